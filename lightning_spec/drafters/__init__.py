"""Drafters: small trainable models that propose tokens. One file per family; all share ``base.Drafter``."""

from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab
from lightning_spec.drafters.block import BlockDrafter
from lightning_spec.drafters.d2sd import VPDrafter
from lightning_spec.drafters.domino import DFlyDrafter, DominoDrafter
from lightning_spec.drafters.dspark import DSparkDrafter
from lightning_spec.drafters.eagle3 import Eagle3Drafter
from lightning_spec.drafters.heads import MedusaDrafter, MTPDrafter
from lightning_spec.drafters.specblock import SpecBlockDrafter

__all__ = [
    "Anchors", "BlockDrafter", "DFlyDrafter", "DominoDrafter", "DSparkDrafter", "DraftOutput", "DraftVocab", "Drafter",
    "Eagle3Drafter", "MTPDrafter", "MedusaDrafter", "SpecBlockDrafter",
    "VPDrafter",
]
