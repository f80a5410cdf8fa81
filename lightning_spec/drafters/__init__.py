"""Drafters: small trainable models that propose tokens. One file per family, named after it; all share
``base.Drafter`` (the contract), ``layers.py`` (what families share) and the bodies descendants share: ``block.py``
(DFlash's) and ``eagle.py`` (EAGLE-3's and P-EAGLE's).

``FAMILIES`` is the registry: each family's name (its class's ``family``) -> its class. The family tests, the
YAML overlays under experiments/drafters/ and the export codecs read it instead of keeping their own lists.
"""

from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab
from lightning_spec.drafters.d2sd import D2SDDrafter
from lightning_spec.drafters.dflash import DFlashDrafter
from lightning_spec.drafters.dflash2 import DFlash2Drafter
from lightning_spec.drafters.dfly import DFlyDrafter
from lightning_spec.drafters.domino import DominoDrafter
from lightning_spec.drafters.dspark import DSparkDrafter
from lightning_spec.drafters.eagle3 import Eagle3Drafter
from lightning_spec.drafters.medusa import MedusaDrafter
from lightning_spec.drafters.mtp import MTPDrafter
from lightning_spec.drafters.peagle import PEagleDrafter
from lightning_spec.drafters.specblock import SpecBlockDrafter

FAMILIES: dict[str, type[Drafter]] = {
    cls.family: cls
    for cls in (
        DFlashDrafter, DFlash2Drafter, DSparkDrafter, D2SDDrafter, DFlyDrafter, DominoDrafter, Eagle3Drafter,
        MedusaDrafter, MTPDrafter, PEagleDrafter, SpecBlockDrafter,
    )
}

# Names that files saved before the one-file-per-family layout still name, and nothing else: configs (Lightning's
# config.yaml of a run, a user's YAML) name the package's ``BlockDrafter`` and ``VPDrafter``; checkpoints and exported
# folders record the defining module's path (``drafter_class``), which ``RENAMED`` maps to the class's path now.
BlockDrafter = DFlashDrafter
VPDrafter = D2SDDrafter
RENAMED = {
    "lightning_spec.drafters.block.BlockDrafter": "lightning_spec.drafters.dflash.DFlashDrafter",
    "lightning_spec.drafters.d2sd.VPDrafter": "lightning_spec.drafters.d2sd.D2SDDrafter",
    "lightning_spec.drafters.domino.DFlyDrafter": "lightning_spec.drafters.dfly.DFlyDrafter",
    "lightning_spec.drafters.heads.MedusaDrafter": "lightning_spec.drafters.medusa.MedusaDrafter",
    "lightning_spec.drafters.heads.MTPDrafter": "lightning_spec.drafters.mtp.MTPDrafter",
}


def class_path_now(path: str) -> str:
    """A saved ``drafter_class`` as this version names it (``RENAMED``); any other path unchanged."""
    return RENAMED.get(path, path)


def family_class(drafter: Drafter) -> type[Drafter] | None:
    """The registered family class ``drafter`` is exactly (None: a shared body, or a subclass the registry lacks,
    which no codec may write as its parent family)."""
    cls = FAMILIES.get(drafter.family) if drafter.family else None
    return cls if type(drafter) is cls else None

__all__ = [
    "FAMILIES", "RENAMED", "Anchors", "BlockDrafter", "D2SDDrafter", "DFlash2Drafter", "DFlashDrafter", "DFlyDrafter",
    "DominoDrafter", "DSparkDrafter", "DraftOutput", "DraftVocab", "Drafter", "Eagle3Drafter", "MTPDrafter",
    "MedusaDrafter", "PEagleDrafter", "SpecBlockDrafter", "VPDrafter", "class_path_now", "family_class",
]
