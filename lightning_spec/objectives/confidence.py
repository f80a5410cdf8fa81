"""Objective parts for a drafter's confidence head (DSpark, Cheng et al. 2026, arXiv 2607.05147, §3.2.1 and §3.3).

DSpark's loss is 0.1·CE + 0.9·L1 + 1.0·BCE, each weighted by the block-position decay: CE and TV exist
(``losses.py``; L1 = ‖p - q‖₁ = 2·TV), ``Mixture`` sums them, and ``ConfidenceBCE`` here is the third term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import Loss, _target_and_draft, acceptance
from lightning_spec.sampling import SamplingConfig


class ConfidenceBCE(Loss):
    """ℓ = BCE(c_k, sg(c*_k)) with c*_k = 1 - ½‖p_k - q_k‖₁ = Σ_v min(p_k, q_k), the probability that lossless
    verification accepts slot k's draft (DSpark Eq. 8 and 11). c_k = σ(z_k) is the drafter's confidence head, read
    as logits z (N, A, K) from ``draft.aux[key]``; the target c* carries no gradient, so this part trains the
    confidence head (and what feeds it) only, never the draft distribution.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature (DSpark: T = 1).
        key: the ``aux`` entry holding the confidence logits.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), key: str = "confidence") -> None:
        self.sampling = sampling
        self.key = key

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if self.key not in draft.aux:
            raise UserError(
                f"loss ConfidenceBCE reads draft.aux[{self.key!r}], which this drafter does not give; use it with a "
                "drafter that has a confidence head (lightning_spec.drafters.DSparkDrafter) or drop it."
            )
        with torch.no_grad():
            _, p, _, q = _target_and_draft(draft, ctx, self.sampling)
            target = acceptance(p, q).clamp(0, 1)  # (N, A, K) c*
        z = draft.aux[self.key]
        z = z if z.dtype == torch.float64 else z.float()
        return F.binary_cross_entropy_with_logits(z, target.to(z.dtype), reduction="none")  # (N, A, K)
