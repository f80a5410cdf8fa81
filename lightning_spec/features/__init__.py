"""The target's training features, computed once: the feature store (``store.py``), the one door to features that
the module and the command both go through (``source.py``), and the command that writes a store ahead of training
(``command.py``)."""

from lightning_spec.features.source import FeatureSource
from lightning_spec.features.store import FeatureStore, StoreSpec

__all__ = ["FeatureSource", "FeatureStore", "StoreSpec"]
