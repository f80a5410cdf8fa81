"""Drafters: small trainable models that propose tokens. One file per family; all share ``base.Drafter``."""

from lightning_spec.drafters.base import Drafter, DraftOutput, Proposal
from lightning_spec.drafters.block import BlockDrafter

__all__ = ["BlockDrafter", "DraftOutput", "Drafter", "Proposal"]
