"""The target's training features, computed once: the feature store (``store.py``) and the command that writes
one ahead of training (``command.py``)."""

from lightning_spec.features.store import FeatureStore, StoreSpec

__all__ = ["FeatureStore", "StoreSpec"]
