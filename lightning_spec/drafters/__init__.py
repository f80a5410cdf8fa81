"""Drafters: small trainable models that propose tokens. One file per family; all share ``base.Drafter``."""

from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab
from lightning_spec.drafters.block import BlockDrafter

__all__ = ["Anchors", "BlockDrafter", "DraftOutput", "DraftVocab", "Drafter"]
