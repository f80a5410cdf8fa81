"""What the callbacks that produce metrics outside Lightning's ``self.log`` share.

``SpecDecodeValidation`` (real decoding), ``OfflineEvaluation`` (exact offline rounds) and ``DomainReweighting``
(domain weights from their MAL) measure or derive values in their own hooks, not in a ``*_step``, so Lightning's
logging does not carry them. ``MetricsCallback`` gives them one way to

- keep a history of (step, values), saved in the checkpoint (``state_dict``) so that a resumed run knows what was
  measured and when (``last_step``);
- publish values that are already reduced over the ranks: into ``trainer.callback_metrics`` on every rank (what
  checkpoints, other callbacks and a sweep's reporter read) and into every logger on rank 0, at their step;
- declare the per-domain MAL they log (``mal_prefixes``), which is how ``DomainReweighting`` finds its producer.

``EvaluationCallback`` adds when an evaluation runs: once before training (``before_training``, outside the
``max_time`` budget), after every validation (never the sanity check), and when training ends if its last steps were
not evaluated.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy

from lightning_spec.errors import UserError


class MetricsCallback(Callback):
    """A callback that logs values it measured itself: their history, their publishing and its state."""

    def __init__(self) -> None:
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, values) of every measurement

    def mal_prefixes(self) -> set[str]:
        """The prefixes ``P`` of the per-domain mean accepted lengths this callback logs as ``P/<domain>`` (what
        ``DomainReweighting.metric`` may name); none unless a subclass measures MAL."""
        return set()

    @property
    def last_step(self) -> int | None:
        """The step of the last measurement (None before the first)."""
        return self.history[-1][0] if self.history else None

    def publish(self, trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
        """``metrics`` (already reduced over ranks) into ``trainer.callback_metrics`` on every rank and into every
        logger at ``step`` on rank 0."""
        for key, value in metrics.items():
            trainer.callback_metrics[key] = torch.tensor(value)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


class EvaluationCallback(MetricsCallback):
    """Evaluate the live drafter before training, after every validation and at the end of training.

    A subclass says what one evaluation measures (``evaluate``) and what its one line on stderr shows
    (``headline``); every rank evaluates (its share) and gets the same reduced values.
    """

    name = "evaluation"  # the tag of the line printed after every evaluation: "[<name>] step 3: ..."

    def __init__(self, before_training: bool) -> None:
        super().__init__()
        self.before_training = before_training

    def evaluate(
        self, trainer: L.Trainer, module: L.LightningModule, before_training: bool = False
    ) -> dict[str, float]:
        """Measure the drafter now; the values must be reduced over ranks (every rank returns the same)."""
        raise NotImplementedError

    def headline(self, metrics: dict[str, float], seconds: float) -> str:
        """The summary printed after an evaluation that took ``seconds``."""
        return ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.count("/") == 1)

    def measure(self, trainer: L.Trainer, module: L.LightningModule, step: int, before_training: bool = False) -> None:
        """Evaluate, keep and publish the values at ``step``, and print the headline on rank 0."""
        start = time.perf_counter()
        metrics = self.evaluate(trainer, module, before_training=before_training)
        seconds = time.perf_counter() - start
        self.history.append((step, metrics))
        self.publish(trainer, metrics, step)
        if trainer.is_global_zero:
            print(f"[{self.name}] step {step}: {self.headline(metrics, seconds)}", file=sys.stderr)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The evaluation before training runs here, before Lightning's ``Timer`` starts the ``max_time`` clock at
        ``on_train_start``: decoding with an untrained drafter takes none of the training budget, so runs compare at
        the steps their budget buys. A resumed fit (its history restored from the checkpoint) does not repeat it."""
        refuse_sharded_target(pl_module, type(self).__name__)
        if self.before_training and not self.history and trainer.ckpt_path is None:
            self.measure_before_training(trainer, pl_module)

    def measure_before_training(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """The evaluation at step 0; a subclass may defer it (``SpecDecodeValidation.offline_before``)."""
        self.measure(trainer, module, step=0, before_training=True)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.measure(trainer, pl_module, step=trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.last_step != trainer.global_step:  # the last steps were never evaluated
            self.measure(trainer, pl_module, step=trainer.global_step)


def refuse_sharded_target(module: L.LightningModule, callback: str) -> None:
    """A sharded target runs a forward only when every rank runs it (``Target.shard_layers``); a callback that
    decodes each rank's own prompts would wait forever on the others, so it stops here in one sentence."""
    if module.target.sharded:
        raise UserError(f"{callback} decodes on each rank's own prompts, which a sharded target cannot (every rank "
                        "must run each forward together); drop it from trainer.callbacks with model.shard_target, "
                        "and evaluate the checkpoint with `lightning-spec evaluate`.")


def full_parameters(trainer: L.Trainer) -> contextlib.AbstractContextManager:
    """Decoding needs whole weights: under FSDP each rank holds a shard of the drafter between steps, so gather
    them for the duration (every rank enters together; decoding then runs on plain modules, never inside an FSDP
    forward, which is why the FSDP example wraps no drafter layer on its own). Elsewhere: nothing to do."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False)
