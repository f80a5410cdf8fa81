"""Domino's two-branch loss as one per-slot loss of the objective template (``objective.py``).

Domino (SpecForge #571; NeMo AutoModel ``speculative/dflash/domino_core.py``) supervises both its final logits
(DFlash base + the GRU correction) and its base branch alone, with a curriculum that moves the weight from the
base to the final logits: early steps keep the parallel backbone strong, later ones let the correction take over.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import Loss, _upcast


def _ce(logits: Tensor, labels: Tensor) -> Tensor:
    """-log softmax(logits)[label]: (N, A, K, Vd), (N, A, K) -> (N, A, K)."""
    return -_upcast(logits).log_softmax(-1).gather(-1, labels[..., None])[..., 0]


class TwoBranchCE(Loss):
    """ℓ_t = (1 - λ)·CE(final_t) + λ·CE(base_t), the base-anchor curriculum of Domino: λ decays linearly from
    ``start`` at the start of training to 0 once a share ``decay_ratio`` of training is done, then stays 0:

        λ = start · max(0, 1 - progress / decay_ratio),   progress = ``ctx.progress`` (0..1, the module sets it).

    The final logits are ``draft.logits``; the base ones the drafter's head ``draft.aux[branch]`` (a
    ``DominoDrafter`` gives ``base_logits``). The position weight multiplies both terms, so with ``ExpDecay`` this is
    Domino's loss, both CEs with the DFlash decay, normalised by Σ weights (``normalize="weight"``); with
    ``AUFSupport`` it is AUF on Domino (the support from the final logits' argmax, what decoding proposes).
    Without a known progress (``ctx.progress`` None: an objective called outside the module) λ = ``start``.

    Args:
        start: λ at the start of training, in [0, 1] (1 released).
        decay_ratio: the share of training over which λ reaches 0, > 0 (1 in the released Qwen3-8B config, 0.5 the
            code's default; above 1, λ is still positive at the end).
        branch: the ``draft.aux`` head holding the base branch's logits.
    """

    def __init__(self, start: float = 1.0, decay_ratio: float = 0.5, branch: str = "base_logits") -> None:
        if not 0 <= start <= 1:
            raise UserError(f"loss.start must be in [0, 1], got {start}.")
        if not decay_ratio > 0:
            raise UserError(f"loss.decay_ratio must be > 0 (the share of training λ decays over), got {decay_ratio}.")
        self.start = start
        self.decay_ratio = decay_ratio
        self.branch = branch

    def weight(self, progress: float | None) -> float:
        """λ at ``progress`` (the share 0..1 of training done)."""
        done = 0.0 if progress is None else float(progress)
        return self.start * max(0.0, 1.0 - done / self.decay_ratio)

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if self.branch not in draft.aux:
            raise UserError(
                f"loss TwoBranchCE needs the drafter's second branch draft.aux[{self.branch!r}], which this drafter "
                f"does not give (it has {sorted(draft.aux) or 'none'}); use it with DominoDrafter or set loss.branch."
            )
        lam = self.weight(ctx.progress)
        final = _ce(draft.logits, draft.labels)  # (N, A, K)
        base = draft.aux[self.branch]
        if callable(base):  # a head not yet evaluated (the objective materialises or chunks it first)
            base = base(draft.hidden, torch.arange(draft.num_anchors, device=draft.valid.device))
        base = _ce(base, draft.labels)  # (N, A, K)
        return (1 - lam) * final + lam * base
