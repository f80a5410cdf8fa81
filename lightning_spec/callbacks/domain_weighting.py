"""DomainReweighting: sample more of the training domains the drafter accepts worst on, from validation MAL.

After every validation it reads the per-domain MAL that ``SpecDecodeValidation`` (``val/mal/<domain>``) or
``OfflineEvaluation`` (``val/offline_mal/<domain>``) just logged and sets the training sampler's domain weights
(``SpecDataModule.set_domain_weights``): weight ∝ (1 / MAL_d)^beta, a floor on every domain's share, then an
exponential moving average with the previous weights. ``DomainSampler`` then draws examples with replacement,
epoch size = dataset size. The weights are sample shares (mixture proportions): a domain of weight 0.3 gives 30%
of the examples drawn whatever its size, so the data module is handed per-example weights weight_d / size_d.

When the weights take effect: the sampler reads them once per epoch, when the epoch's first batch is fetched.
Weights set at a validation therefore steer the *next* epoch; validating several times per epoch
(``val_check_interval``) only smooths several times before any of them is used. Validate at epoch ends
(``check_val_every_n_epoch``). The evaluation ``SpecDecodeValidation`` runs before training (``before_training``, in
its ``on_fit_start``) sets the first epoch's weights: they are applied at the first ``on_train_epoch_start``, which
precedes the first batch.

Under DDP the MALs it reads were already all-reduced by the validation callback, so every rank computes the same
weights; they are still broadcast from rank 0 so that every rank's sampler is guaranteed to draw the same order.
Its state (the smoothed weights) is in the checkpoint, beside the data module's ``domain_weights``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from lightning_spec.callbacks.base import MetricsCallback
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.errors import UserError

LOG_PREFIX = "train/domain_weight"


class DomainReweighting(MetricsCallback):
    """Re-weight the training domains after every validation: weight ∝ (1 / MAL_d)^beta, floored, smoothed.

    The rule, over the domains of the training data (validation domains without training data are ignored):

    1. target_d ∝ MAL_d^(-beta), normalised to sum 1. A training domain with no MAL this time keeps its
       previous weight (the measured domains share the rest); before any weights exist it gets the mean
       score of the measured domains.
    2. floor: every share is raised to at least ``floor`` and the others scaled down together, keeping their
       ratios (so the result sums to 1 and no domain is starved).
    3. smoothing: weights = smoothing · previous + (1 - smoothing) · target (the first update has no previous).

    The weights are shares of the examples drawn (so beta = 0 mixes the domains equally, whatever their sizes)
    and are logged as ``train/domain_weight/<domain>`` at the current step. With a single training domain there
    is nothing to re-weight and the sampler keeps its plain shuffle.

    Args:
        metric: prefix of the per-domain MAL to read: ``val/mal`` (``SpecDecodeValidation``, first sampling
            config), ``val/temp<T>/mal`` (its other sampling configs) or ``val/offline_mal``
            (``OfflineEvaluation``); a callback in ``trainer.callbacks`` must declare that it logs it
            (``MetricsCallback.mal_prefixes``).
        beta: sharpness of the rule; 0 = uniform over domains, 1 = ∝ 1/MAL, larger favours the worst domain more.
        floor: minimum share of every training domain, in [0, 1); ``floor × number of training domains``
            must be at most 1.
        smoothing: weight of the previous weights in the moving average, in [0, 1); 0 = use the latest MAL only.
    """

    def __init__(self, metric: str = "val/mal", beta: float = 1.0, floor: float = 0.05, smoothing: float = 0.5) -> None:
        if not isinstance(metric, str) or not metric.strip("/") or metric != metric.strip("/"):
            raise UserError(
                f"DomainReweighting.metric={metric!r} must be a metric prefix without a trailing slash, such as "
                "'val/mal' or 'val/offline_mal'."
            )
        if not (math.isfinite(beta) and beta >= 0):
            raise UserError(f"DomainReweighting.beta={beta} must be >= 0 (0 = uniform, 1 = ∝ 1/MAL); use e.g. 1.0.")
        if not 0.0 <= floor < 1.0:
            raise UserError(
                f"DomainReweighting.floor={floor} must be in [0, 1) (the minimum share of a domain); use e.g. 0.05."
            )
        if not 0.0 <= smoothing < 1.0:
            raise UserError(
                f"DomainReweighting.smoothing={smoothing} must be in [0, 1) (0 = no memory); use e.g. 0.5."
            )
        super().__init__()  # self.history: (step, weights) of every update
        self.metric = metric
        self.beta = float(beta)
        self.floor = float(floor)
        self.smoothing = float(smoothing)
        self.weights: dict[str, float] | None = None  # the smoothed weights the sampler was last given
        self._domains: list[str] = []
        self._sizes: dict[str, int] = {}  # training examples per domain
        self._initial_pending = False

    # ------------------------------------------------------------------------------------------ the rule
    def next_weights(
        self, mals: Mapping[str, float], domains: Sequence[str], previous: Mapping[str, float] | None = None
    ) -> dict[str, float] | None:
        """The weights after one validation (pure: no state changes); None when no training domain has a MAL.

        ``mals`` maps domain -> MAL (other domains than ``domains`` are ignored, as are MALs that are not
        finite and positive); ``previous`` is the last weights, or None before the first update.
        """
        domains = sorted(set(domains))
        measured = {}
        for d in domains:
            mal = float(mals[d]) if d in mals else math.nan
            if math.isfinite(mal) and mal > 0:
                measured[d] = mal
        if not measured:
            return None
        self._check_floor(len(domains))
        previous = _restrict(previous, domains)
        lowest = min(measured.values())  # scores relative to the lowest-MAL domain's (1): no underflow
        score = {d: (lowest / mal) ** self.beta for d, mal in measured.items()}
        missing = [d for d in domains if d not in measured]
        if previous is None:  # no earlier weight to keep: an unmeasured domain scores like an average one
            mean = sum(score.values()) / len(score)
            raw = {d: score.get(d, mean) for d in domains}
            target = {d: w / sum(raw.values()) for d, w in raw.items()}
        else:  # unmeasured domains keep their share; measured ones split the rest by score
            free = max(0.0, 1.0 - sum(previous[d] for d in missing))
            total = sum(score.values())
            target = {d: free * score[d] / total if d in measured else previous[d] for d in domains}
        target = _apply_floor(target, self.floor)
        if previous is None:
            return target
        s = self.smoothing
        return {d: s * previous[d] + (1.0 - s) * target[d] for d in domains}

    def read_mals(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """``<metric>/<domain>`` entries of ``trainer.callback_metrics`` as {domain: MAL}."""
        prefix = self.metric + "/"
        out = {}
        for key, value in metrics.items():
            domain = key[len(prefix) :]
            if key.startswith(prefix) and domain and "/" not in domain:
                out[domain] = float(value)
        return out

    def _check_floor(self, n: int) -> None:
        if self.floor * n > 1.0 + 1e-9:
            raise UserError(
                f"DomainReweighting.floor={self.floor} times {n} training domains exceeds 1; lower floor to at most "
                f"{1.0 / n:.4g}."
            )

    # --------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dm = trainer.datamodule
        if not isinstance(dm, SpecDataModule):  # plain dataloaders or another data module: no domains to weight
            raise UserError(
                "DomainReweighting needs a SpecDataModule (it sets its domain weights); fit with data: / datamodule=."
            )
        self._sizes = dict(Counter(dm.train_domains()))
        self._domains = sorted(self._sizes)
        n = len(self._domains)
        self._check_floor(n)
        # the producers declare what they log: any MetricsCallback, ours or a user's, may feed the weights
        produced = {p for cb in trainer.callbacks if isinstance(cb, MetricsCallback) for p in cb.mal_prefixes()}
        if self.metric not in produced:
            raise UserError(
                f"DomainReweighting.metric='{self.metric}' is not logged by any callback of this run (they log "
                f"{sorted(produced) or 'nothing per domain'}); add SpecDecodeValidation (val/mal) or "
                "OfflineEvaluation (val/offline_mal) to trainer.callbacks, or set metric to one they log."
            )
        if n < 2:
            rank_zero_warn(
                f"DomainReweighting: the training data has a single domain {self._domains}; there is nothing to "
                "re-weight and the sampler keeps its plain shuffle."
            )
        if isinstance(trainer.val_check_interval, int) or trainer.val_check_interval != 1.0:
            rank_zero_warn(
                "DomainReweighting: validation runs within epochs (trainer.val_check_interval), but the sampler "
                "reads the domain weights only when an epoch starts; prefer trainer.check_val_every_n_epoch."
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a fresh fit: apply the weights of the evaluation before training (SpecDecodeValidation's on_fit_start) at
        # the first epoch start, when the sampler is about to draw
        self._initial_pending = trainer.global_step == 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._initial_pending:
            self._initial_pending = False
            self._update(trainer, initial=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # on_validation_end runs after the on_validation_epoch_end of every callback and of the module (where
        # SpecDecodeValidation and OfflineEvaluation log), whatever the order of trainer.callbacks; and before
        # ModelCheckpoint saves (Lightning moves checkpoint callbacks last), so the checkpoint holds these weights.
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._update(trainer)

    def _update(self, trainer: L.Trainer, initial: bool = False) -> None:
        if len(self._domains) < 2:
            return
        weights = self.next_weights(self.read_mals(trainer.callback_metrics), self._domains, self.weights)
        # the metrics were all-reduced by the validation callback, so every rank computes the same weights;
        # broadcasting rank 0's makes that a guarantee (float noise, a rank that missed a metric)
        weights = trainer.strategy.broadcast(weights, src=0)
        if weights is None:
            if not initial:  # before training, a missing evaluation is a choice (before_training: false)
                rank_zero_warn(
                    f"DomainReweighting: no '{self.metric}/<domain>' MAL for any training domain {self._domains} "
                    "after this validation; the domain weights stay as they were."
                )
            return
        self.weights = weights
        # the sampler draws an example ∝ its domain's weight: divide by the domain's size so shares are the weights
        trainer.datamodule.set_domain_weights({d: w / self._sizes[d] for d, w in weights.items()})
        step = trainer.global_step
        self.history.append((step, dict(weights)))
        self.publish(trainer, {f"{LOG_PREFIX}/{d}": w for d, w in weights.items()}, step)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, **super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.weights = state_dict.get("weights")


def _restrict(weights: Mapping[str, float] | None, domains: list[str]) -> dict[str, float] | None:
    """``weights`` over exactly ``domains``, renormalised; None if it misses one of them (start afresh)."""
    if weights is None or any(d not in weights for d in domains):
        return None
    total = sum(float(weights[d]) for d in domains)
    if not total > 0:
        return None
    return {d: float(weights[d]) / total for d in domains}


def _apply_floor(weights: dict[str, float], floor: float) -> dict[str, float]:
    """Raise every share below ``floor`` to ``floor`` and scale the others down by one common factor.

    Clipping one domain lowers the factor, which may push another below the floor, so repeat until none is;
    the clipped set only grows, so this ends within len(weights) passes. Needs floor × len(weights) <= 1.
    """
    if floor <= 0:
        return dict(weights)
    clipped: set[str] = set()
    while True:
        rest = sum(w for d, w in weights.items() if d not in clipped)
        scale = (1.0 - floor * len(clipped)) / rest if rest > 0 else 0.0
        low = {d for d, w in weights.items() if d not in clipped and w * scale < floor}
        if not low:
            break
        clipped |= low
    out = {d: floor if d in clipped else w * scale for d, w in weights.items()}
    total = sum(out.values())
    return {d: w / total for d, w in out.items()}
