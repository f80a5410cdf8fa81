"""``TrialReporter``: the callback a sweep adds to each trial's ``fit`` to feed Optuna from inside the run."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import optuna
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_spec.errors import UserError
from lightning_spec.module import DraftModule
from lightning_spec.objectives import Objective


def objective_label(objective: Objective) -> str:
    """The objective's name in the plots: ``KL+ExpDecay`` for the template's loss and position weight."""
    if type(objective) is Objective:  # the template itself; a ready-made pair or a mixture goes by its class name
        return f"{type(objective.loss).__name__}+{type(objective.position_weight).__name__}"
    return type(objective).__name__


class TrialReporter(Callback):
    """Feeds Optuna from inside the trial's ``fit``: the metric at every validation (step = global step) for
    the pruner, and the final ``val/*`` values, block size and objective when fit ends.

    Not ``optuna_integration.PyTorchLightningPruningCallback``: it reports at ``step=current_epoch``, and our
    validations run every ``val_check_interval`` steps inside one epoch, so Optuna would drop every report after
    an epoch's first (``trial.report`` ignores a step already reported) and prune on stale values. A value is
    reported only when this validation wrote it (the tensor in ``callback_metrics`` changed): the decode
    validation also logs before training, and a metric set by a callback that skipped this validation is old.
    """

    def __init__(self, trial: optuna.Trial, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.final: dict[str, float] = {}
        self.block_size: int | None = None
        self.objective: str | None = None
        self.checkpoint: str | None = None
        self._before: Any = None
        self._reported: set[int] = set()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:
            raise UserError(
                "a sweep runs each trial in its own process on one device (trainer.devices: 1); for several "
                "GPUs start one sweep worker per GPU (CUDA_VISIBLE_DEVICES) on the same study."
            )
        if isinstance(pl_module, DraftModule):  # the reporter also serves other modules: no block size, no objective
            self.block_size = int(pl_module.drafter.block_size)
            self.objective = objective_label(pl_module.objective)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = trainer.callback_metrics.get(self.metric)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.metric)
        step = trainer.global_step
        if value is None or value is self._before or step in self._reported:
            return
        self._reported.add(step)
        self.trial.report(float(value), step)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step}: {self.metric}={float(value):.4g}")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and v.numel() == 1
        }
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint):
            self.checkpoint = callback.last_model_path or callback.best_model_path or None

    def value(self) -> float:
        """The trial's objective: the metric's last value (the drafter the trial ends with)."""
        if self.metric not in self.final:
            logged = ", ".join(sorted(k for k in self.final if k.count("/") == 1)) or "nothing"
            raise UserError(
                f"metric {self.metric!r} was not logged by the trial (it logged {logged}); add the callback that "
                "logs it (SpecDecodeValidation: val/mal, val/tokens_per_s; OfflineEvaluation: val/offline_mal)."
            )
        value = self.final[self.metric]
        if not math.isfinite(value):
            raise FloatingPointError(f"metric {self.metric!r} ended at {value}.")
        return value
