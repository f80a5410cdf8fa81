"""SpecBlock's rank loss (Shi et al. 2026, arXiv 2605.07243): the ordinal loss of the rank head.

The rank head (``SpecBlockDrafter``, ``draft.aux["rank"]``) predicts, per slot, the bucket of the rank of the target's
argmax in the draft distribution: class 0 = rank 1, 1 = ranks 2-4, 2 = ranks 5-10, 3 = beyond 10. At decode time the
class sets the slot's tree width (1, 4, 10 children, or stop), so under-predicting the rank (a narrow tree that
misses the target's token) costs more than over-predicting it (a few wasted nodes): both the smoothing and the
weight are asymmetric.

SpecBlock's whole loss is a ``Mixture`` of the draft loss (``KL`` with ``PositionProduct([Geometric(0.8),
ValidPrefix()])``) and ``Objective(RankOrdinal())``: experiments/drafters/specblock.yaml.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.drafters.specblock_rank import rank_labels  # the drafter owns the bucket boundaries
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import Loss
from lightning_spec.objectives.weights import _prefix_support


def ordinal_targets(label: Tensor, classes: int) -> Tensor:
    """Soft targets y_c ∝ 1 / (1 + |c - t| + max(t - c, 0))^2 over classes c for labels t (...,) -> (..., C): a
    class below the label (a narrower tree than needed) is penalised twice as far as one above it."""
    c = torch.arange(classes, device=label.device, dtype=torch.float32)
    t = label[..., None].float()
    kernel = 1.0 / (1 + (c - t).abs() + (t - c).clamp(min=0)) ** 2  # (..., C)
    return kernel / kernel.sum(-1, keepdim=True)


class RankOrdinal(Loss):
    """ℓ = d · f · m · CE(y, softmax(z)) per slot, with z the rank head's logits ``draft.aux[key]`` (N, A, K, C), t the
    rank class of the target's argmax in q (no gradient), p = argmax z the predicted class, and

    - y = ``ordinal_targets(t)``, the asymmetric ordinal smoothing 1 / (1 + |c - t| + max(t - c, 0))^2, normalised;
    - d = 1 + |t - p| + max(t - p, 0), the distance weight (under-prediction costs double);
    - f = min(1, cap / count_t), count_t = how many of the counted slots in this call have label t (the batch, or the
      module's chunk of anchors when it chunks), so that the frequent class 0 does not drown the others. These
      counts depend on how a batch is split (accumulation, DDP ranks, chunks): only ``cap`` >= the counts (f = 1)
      makes the loss invariant to the split;
    - m = 1 for valid slots up to and including the first whose predicted class differs from its label, 0 after
      (an invalid slot ends the prefix), "computed only up to the first rank mistake".

    Trains the rank head only (its input is detached in the drafter). With ``Uniform`` and ``normalize="weight"`` the
    objective divides by the valid slots.

    Args:
        cap: the frequency cap (the paper: 10).
        key: the ``aux`` entry holding the rank logits.
    """

    needs_target = True

    def __init__(self, cap: float = 10.0, key: str = "rank") -> None:
        if not cap > 0:
            raise UserError(f"loss.cap must be > 0 (the frequency reweighting min(1, cap / count)), got {cap!r}.")
        self.cap = cap
        self.key = key

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if self.key not in draft.aux:
            raise UserError(
                f"loss RankOrdinal reads draft.aux[{self.key!r}], which this drafter does not give; use it with a "
                "drafter that has a rank head (lightning_spec.drafters.SpecBlockDrafter) or drop it."
            )
        if ctx.target_logits is None:
            raise ValueError("RankOrdinal needs target logits; the module provides them when needs_target.")
        z = draft.aux[self.key]
        z = z if z.dtype == torch.float64 else z.float()  # (N, A, K, C)
        with torch.no_grad():
            t = rank_labels(draft.logits, ctx.target_logits)  # (N, A, K)
            p = z.argmax(-1)  # (N, A, K)
            m = _prefix_support(p == t, draft.valid)  # (N, A, K) up to the first rank mistake
            counted = m > 0
            counts = torch.bincount(t[counted], minlength=z.shape[-1]).to(z.dtype)  # (C,)
            f = (self.cap / counts.clamp(min=1)).clamp(max=1)[t]  # (N, A, K)
            d = 1 + (t - p).abs() + (t - p).clamp(min=0)  # (N, A, K)
            y = ordinal_targets(t, z.shape[-1]).to(z.dtype)  # (N, A, K, C)
        ce = -(y * z.log_softmax(-1)).sum(-1)  # (N, A, K)
        return d.to(z.dtype) * f * m.to(z.dtype) * ce
