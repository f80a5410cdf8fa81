"""What a ``fit`` checkpoint holds beside Lightning's own state, written and read back in one place.

Checkpoints hold the drafter only: the frozen target's weights are stripped on save and put back from the live
module on load (``load_drafter`` rebinds a drafter to its target from the record). Beside the weights:

    CKPT_KEY          the drafter's record (class, init arguments, target and its weights fingerprint) and its
                      ``parent`` (``model.init_from``), what ``read.py`` rebuilds it from
    PROVENANCE_KEY    the fit's command and resolved config (``provenance.run_record``)
    anchor_seed       the run seed of the per-example anchors: a resumed run draws the anchors the original would
    training_clock    the LR schedule's clock (``schedule.TrainingClock``): a resumed run keeps a switch to time
    the MLflow run    ``tracking.checkpoint_record``: ``fit --ckpt_path`` continues the same run (rank 0 only)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_spec.checkpoint.read import CKPT_KEY
from lightning_spec.drafters.base import Drafter, drafter_record
from lightning_spec.provenance import PROVENANCE_KEY, run_record

TARGET_PREFIX = "target."  # the frozen target's keys in the module's state dict


@dataclass(frozen=True)
class FitState:
    """What a resumed fit takes back from its checkpoint (None: the checkpoint did not record it)."""

    anchor_seed: int | None
    clock: dict[str, Any] | None


def write_fit_state(checkpoint: dict[str, Any], drafter: Drafter, target_spec: str, parent: dict[str, Any] | None,
                    provenance: dict[str, Any] | None, anchor_seed: int | None, clock: dict[str, Any] | None,
                    run: dict[str, str] | None) -> None:
    """Fill Lightning's ``checkpoint`` dict in place: the target's weights out, our entries in (module docstring)."""
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(TARGET_PREFIX)}
    checkpoint[CKPT_KEY] = {**drafter_record(drafter, target_spec), "parent": parent}
    checkpoint[PROVENANCE_KEY] = provenance or run_record()  # a fit from Python: its command, no config
    checkpoint["anchor_seed"] = anchor_seed
    if clock is not None:
        checkpoint["training_clock"] = clock
    checkpoint.update(run or {})


def read_fit_state(checkpoint: dict[str, Any], own_state: dict[str, Any]) -> FitState:
    """Put the live target's weights (from the module's ``own_state``) back into ``checkpoint`` for Lightning to load,
    and return what the fit resumes with."""
    checkpoint["state_dict"].update({k: v for k, v in own_state.items() if k.startswith(TARGET_PREFIX)})
    seed = checkpoint.get("anchor_seed")
    return FitState(None if seed is None else int(seed), checkpoint.get("training_clock"))
