"""AdaFlash's objective parts (Qian et al. 2026, arXiv 2607.19223): its on-policy draft loss and the loss of its
adaptive length head.

- ``AdaFlashLoss``: ℓ = α·CE(q, argmax p) + (1 - α)·T²·KL(q^T ‖ p^T) per slot, used with the DFlash decay
  (``ExpDecay(7)``, ``normalize="weight"``) on trajectories the target produced under the live drafter.
- ``LengthMSE``: the length head's regression (``DFlashDrafter(length_head=True)``, ``draft.aux["length"]``) towards
  clamp((ℓ + lookahead) / K, 0, 1), ℓ the greedy accepted length of the block on the trajectory. It lives per anchor:
  use it in its own ``Objective(LengthMSE(), normalize="anchors")`` (a mean over blocks), alone to fit the head of a
  trained drafter (experiments/regimes/length_head_init.yaml) or in a ``Mixture`` with the draft loss (AdaFlash adds
  the two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import Loss, _gold_or_argmax, _target_and_draft, _upcast
from lightning_spec.sampling import SamplingConfig


class AdaFlashLoss(Loss):
    """ℓ = α·CE(q, argmax p) + (1 - α)·T²·KL(q^T ‖ p^T), AdaFlash's draft loss (Qian et al. 2026, arXiv
    2607.19223): cross-entropy on the target's greedy token plus the reverse KL at temperature T, with q^T =
    softmax(z_q / T) and p^T = softmax(z_p / T) from the target's logits at the slot (the CE term is at T = 1).

    ``rkl_clip`` clips the reverse-KL term per slot: (1 - α)·min(T²·KL, rkl_clip). AdaFlash instead clips each
    slot's T²·KL after dividing it by the batch's total decay weight W = Σ w (its token count), at τ = 0.01, i.e. at
    τ·W in these unnormalised units, a bound that moves with the batch; a per-slot loss does not see W, so here the
    bound is fixed: ``rkl_clip = 0.01 * W`` for a typical W reproduces AdaFlash's. As there, a clipped slot passes
    no gradient through its reverse-KL term.

    Args:
        alpha: α in [0, 1], the weight of the CE term (AdaFlash: 0.8).
        temperature: T > 0 of the reverse-KL term (AdaFlash: 1).
        rkl_clip: upper bound of T²·KL per slot, > 0; None: no clip (AdaFlash's default).
    """

    needs_target = True

    def __init__(self, alpha: float = 0.8, temperature: float = 1.0, rkl_clip: float | None = None) -> None:
        if not 0 <= alpha <= 1:
            raise UserError(f"loss.alpha must be in [0, 1] (the CE term's weight, AdaFlash: 0.8), got {alpha}.")
        if not temperature > 0:
            raise UserError(f"loss.temperature must be > 0 (AdaFlash: 1.0), got {temperature}.")
        if rkl_clip is not None and not rkl_clip > 0:
            raise UserError(f"loss.rkl_clip must be > 0 or null (no clip), got {rkl_clip}.")
        self.alpha = alpha
        self.temperature = temperature
        self.rkl_clip = rkl_clip

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        greedy = _gold_or_argmax(draft, ctx, "target_argmax")  # (N, A, K) argmax p
        ce = -_upcast(draft.logits).log_softmax(-1).gather(-1, greedy[..., None])[..., 0]  # (N, A, K)
        logp, _, logq, q = _target_and_draft(draft, ctx, SamplingConfig(temperature=self.temperature))  # (N, A, K, Vd)
        rkl = self.temperature**2 * (q * (logq - logp)).sum(-1)  # (N, A, K)
        if self.rkl_clip is not None:
            rkl = rkl.clamp(max=self.rkl_clip)
        return self.alpha * ce + (1 - self.alpha) * rkl  # (N, A, K)


def greedy_accepted_length(matched: Tensor, valid: Tensor) -> Tensor:
    """ℓ = Σ_{k=1..K} Π_{j≤k} 1[matched_j and valid_j]: how many leading slots the greedy draft gets right, an
    invalid slot ending the run (matched, valid (..., K) bool -> (...,) long)."""
    return (matched & valid).long().cumprod(-1).sum(-1)


class LengthMSE(Loss):
    """The adaptive length head's loss (AdaFlash, Qian et al. 2026, arXiv 2607.19223): per anchor,
    (pred - y)² with pred = ``draft.aux[key]`` (N, A) in [0, 1] and

        y = clamp((ℓ + lookahead) / K, 0, 1),   ℓ = Σ_{k=1..K} Π_{j≤k} 1[argmax q_j = x_{n+j}] over valid slots,

    the greedy accepted length of the block on the trajectory (on target rollouts, what greedy verification
    accepts), computed without gradient. The drafter feeds the head detached states, so this trains the head only.

    The loss lives per anchor: it is returned at the anchor's first valid slot, zeros elsewhere (N, A, K), so
    ``Objective(LengthMSE(), normalize="anchors")`` (with the default ``Uniform`` weight) is the mean over the blocks
    with a valid slot. An anchor whose first slots are outside the draft vocabulary still counts, with ℓ = 0. Near the
    end of a sequence the run is cut by the data, not by a miss, so ℓ there is a lower bound; AdaFlash avoids such
    blocks by sampling anchors at least K tokens before the end, here they count as they are.

    Args:
        lookahead: added to ℓ before dividing by K (AdaFlash: 1, so the cut drafts one past the expected run).
        key: the ``aux`` entry holding the head's prediction.
    """

    def __init__(self, lookahead: int = 1, key: str = "length") -> None:
        self.lookahead = lookahead
        self.key = key

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if self.key not in draft.aux:
            raise UserError(
                f"loss LengthMSE reads draft.aux[{self.key!r}], which this drafter does not give; use it with "
                "lightning_spec.drafters.DFlashDrafter(length_head=true) or drop it."
            )
        valid = draft.valid
        k = valid.shape[-1]
        with torch.no_grad():
            run = greedy_accepted_length(draft.logits.argmax(-1) == draft.labels, valid)  # (N, A) ℓ
            y = ((run + self.lookahead).float() / k).clamp(0, 1)  # (N, A)
            first = torch.nn.functional.one_hot(valid.long().argmax(-1), k).bool() & valid  # (N, A, K)
        pred = _upcast(draft.aux[self.key])  # (N, A)
        per_anchor = (pred - y.to(pred.dtype)) ** 2  # (N, A)
        return torch.where(first, per_anchor[..., None], torch.zeros_like(per_anchor[..., None]))  # (N, A, K)
