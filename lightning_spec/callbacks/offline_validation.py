"""OfflineEvaluation: the exact offline evaluator (EDR §3.4) on a fixed rollout set at every validation.

``SpecDecodeValidation`` decodes for real, which is slow and noisy; this callback scores the live drafter on
the same target rollouts every time (``evaluation.offline``): exact expected rounds, no decoding loop, so two
validations differ only because the drafter changed. Logs ``val/offline_mal``, ``val/offline_mal/<domain>``
and ``val/offline_accept_rate/t<k>``. Rollouts are split across DDP ranks and the sums (tokens, expected
rounds per domain; slot visits and acceptances) are all-reduced before any ratio is taken.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_spec.callbacks.spec_validation import full_parameters, last_step, publish
from lightning_spec.evaluation.offline import (
    RolloutSet,
    check_rollouts,
    load_rollout_set,
    offline_report,
    rollout_sampling,
    spread,
)
from lightning_spec.sampling import SamplingConfig


class OfflineEvaluation(Callback):
    """Score the drafter offline on a fixed rollout set at the end of every validation (not the sanity check),
    and once more when training ends if the last steps were not scored (as ``SpecDecodeValidation``).

    Args:
        rollouts: a rollouts folder made by ``lightning-spec rollouts`` with this run's target.
        max_rollouts: evaluate at most this many (round-robin over domains, first samples of prompts first);
            null = all of them.
        sampling: the config the rollouts were drawn under; null = the one the folder records (a different
            one is refused: offline rounds are exact only under the rollouts' own config).
        batch_size: rollouts per target forward.
        before_training: also evaluate once before the first optimizer step (logged at step 0).
    """

    def __init__(
        self,
        rollouts: str,
        max_rollouts: int | None = 64,
        sampling: SamplingConfig | None = None,
        batch_size: int = 4,
        before_training: bool = False,
    ) -> None:
        if max_rollouts is not None and max_rollouts < 1:
            raise ValueError(f"OfflineEvaluation.max_rollouts must be >= 1 or null, got {max_rollouts}.")
        self.rollouts = rollouts
        self.max_rollouts = max_rollouts
        self.sampling = sampling
        self.batch_size = batch_size
        self.before_training = before_training
        self.history: list[tuple[int, dict[str, float]]] = []
        self._data: RolloutSet | None = None
        self._domains: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate") or self._data is not None:
            return
        data = load_rollout_set(self.rollouts)
        sampling = self.sampling or rollout_sampling(data.meta)
        if sampling is None:
            raise ValueError(f"OfflineEvaluation.sampling is needed: {self.rollouts} records no sampling config.")
        check_rollouts(data.meta, pl_module.target, sampling, self.rollouts)  # before any training step
        self.sampling = sampling
        self._data = spread(data, self.max_rollouts)
        self._domains = sorted(set(self._data.domains))

    def evaluate(self, trainer: L.Trainer, module: L.LightningModule) -> dict[str, float]:
        """This rank's share of the rollouts, then sums all-reduced across ranks, then the ratios."""
        data = self._data
        assert data is not None, "OfflineEvaluation.setup did not run"
        k = module.drafter.block_size
        mine = list(range(trainer.global_rank, len(data), trainer.world_size))
        d = len(self._domains)
        sums = torch.zeros(2 * d + 2 * k, dtype=torch.float64, device=module.device)  # tokens, rounds, slots
        with full_parameters(trainer):  # FSDP: every rank gathers the whole drafter, even one with no rollouts
            report = None if not mine else offline_report(module.target, module.drafter, data.subset(mine),
                                                          self.sampling, batch_size=self.batch_size)
        if report is not None:
            for i, domain in enumerate(self._domains):
                tokens, rounds = report.domain_sums().get(domain, (0.0, 0.0))
                sums[i], sums[d + i] = tokens, rounds
            sums[2 * d : 2 * d + k] = report.slot_accepted.to(sums.device)
            sums[2 * d + k :] = report.slot_reached.to(sums.device)
        if trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums, reduce_op="sum")
        sums = sums.cpu()
        tokens, rounds = sums[:d], sums[d : 2 * d]
        out = {"val/offline_mal": float(tokens.sum() / rounds.sum().clamp_min(1e-12))}
        for i, domain in enumerate(self._domains):
            out[f"val/offline_mal/{domain}"] = float(tokens[i] / rounds[i].clamp_min(1e-12))
        accepted, reached = sums[2 * d : 2 * d + k], sums[2 * d + k :]
        for j in range(k):
            out[f"val/offline_accept_rate/t{j + 1}"] = float(accepted[j] / reached[j].clamp_min(1e-12))
        return out

    def _log(self, trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
        self.history.append((step, metrics))
        publish(trainer, metrics, step)
        if trainer.is_global_zero:
            print(f"[offline-evaluation] step {step}: val/offline_mal={metrics['val/offline_mal']:.3f}",
                  file=sys.stderr)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.before_training and trainer.global_step == 0:
            self._log(trainer, self.evaluate(trainer, pl_module), step=0)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._data is None:
            return
        self._log(trainer, self.evaluate(trainer, pl_module), step=trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the last steps were never scored
        if self._data is not None and last_step(self.history) != trainer.global_step:
            self._log(trainer, self.evaluate(trainer, pl_module), step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
