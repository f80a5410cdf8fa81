"""OfflineEvaluation: the exact offline evaluator (EDR §3.4) on a fixed rollout set at every validation.

``SpecDecodeValidation`` decodes for real, which is slow and noisy; this callback scores the live drafter on
the same target rollouts every time (``evaluation.offline``): exact expected rounds, no decoding loop, so two
validations differ only because the drafter changed. Logs ``val/offline_mal``, ``val/offline_mal/<domain>``
and ``val/offline_accept_rate/t<k>``. Rollouts are split across DDP ranks and the sums (tokens, expected
rounds per domain; slot visits and acceptances) are added across ranks before any ratio is taken.
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_spec.callbacks.base import EvaluationCallback, full_parameters
from lightning_spec.data.rollouts import RolloutSet
from lightning_spec.errors import UserError
from lightning_spec.evaluation.inputs import open_rollouts
from lightning_spec.evaluation.offline import offline_report
from lightning_spec.metrics import acceptance_metrics, acceptance_sums, reduce_sums
from lightning_spec.sampling import SamplingConfig


class OfflineEvaluation(EvaluationCallback):
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

    name = "offline-evaluation"

    def __init__(
        self,
        rollouts: str,
        max_rollouts: int | None = 64,
        sampling: SamplingConfig | None = None,
        batch_size: int = 4,
        before_training: bool = False,
    ) -> None:
        if max_rollouts is not None and max_rollouts < 1:
            raise UserError(f"OfflineEvaluation.max_rollouts must be >= 1 or null, got {max_rollouts}.")
        super().__init__(before_training)
        self.rollouts = rollouts
        self.max_rollouts = max_rollouts
        self.sampling = sampling
        self.batch_size = batch_size
        self._data: RolloutSet | None = None
        self._domains: list[str] = []

    def mal_prefixes(self) -> set[str]:
        return {"val/offline_mal"}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage not in ("fit", "validate") or self._data is not None:
            return
        # checked against the run's target before any training step
        self._data, self.sampling = open_rollouts(self.rollouts, pl_module.target, self.sampling, self.max_rollouts,
                                                  sampling_name="OfflineEvaluation.sampling")
        self._domains = sorted(set(self._data.domains))

    def evaluate(
        self, trainer: L.Trainer, module: L.LightningModule, before_training: bool = False
    ) -> dict[str, float]:
        """This rank's share of the rollouts, then sums added across ranks, then the ratios."""
        data = self._data
        assert data is not None, "OfflineEvaluation.setup did not run"
        mine = list(range(trainer.global_rank, len(data), trainer.world_size))
        with full_parameters(trainer):  # FSDP: every rank gathers the whole drafter, even one with no rollouts
            report = None if not mine else offline_report(module.target, module.drafter, data.subset(mine),
                                                          self.sampling, batch_size=self.batch_size)
        if report is None:  # more ranks than rollouts: this rank adds zeros
            none = torch.zeros(module.drafter.block_size, dtype=torch.float64)
            sums = acceptance_sums({}, none, none, self._domains)
        else:
            sums = acceptance_sums(report.domain_sums(), report.slot_accepted, report.slot_reached, self._domains)
        return acceptance_metrics(reduce_sums(trainer, sums), self._domains, mal="val/offline_mal",
                                  accept_rate="val/offline_accept_rate")

    def headline(self, metrics: dict[str, float], seconds: float) -> str:
        return f"val/offline_mal={metrics['val/offline_mal']:.3f}"
