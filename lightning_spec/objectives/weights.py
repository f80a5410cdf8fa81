"""Block-position weights b_{n,t} and anchor weights a_n of the objective template (``objective.py``)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import _TOKENS, _draft_logprobs, _gold_or_argmax, _target_and_draft, acceptance
from lightning_spec.objectives.part import Part
from lightning_spec.sampling import SamplingConfig


class PositionWeight(Part):
    """b_{n,t}: returns (N, A, K); the template multiplies it by the valid mask. ``needs_target`` asks the
    module for target logits (``ctx.target_logits``), as for losses (``Part``)."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        raise NotImplementedError


class Uniform(PositionWeight):
    """b_t = 1 for every slot (plain CE, KL, TV and LK; EDR, arXiv 2610.10411, Table 1)."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return torch.ones_like(draft.valid, dtype=torch.float32)  # (N, A, K)


class ExpDecay(PositionWeight):
    """b_t = exp(-(t - 1) / gamma), the DFlash block-position decay (Chen, Liang, Liu 2026, arXiv 2602.06036,
    Eq. 4).

    Slot convention: t = 1..K counts *predictions* (the anchor is the input, DFlash style), so the first
    prediction gets weight 1. DSpark, whose anchor slot is itself a prediction, writes the same weights as
    exp(-k / gamma) with k = t - 1. gamma = 7 for DFlash B = 16; 4 for blocks of 7-8 (DeepSpec, ModelOpt).
    """

    def __init__(self, gamma: float = 7.0) -> None:
        if gamma <= 0:
            raise UserError(f"position_weight.gamma must be > 0, got {gamma}.")
        self.gamma = gamma  # larger gamma: later slots matter more

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        t = torch.arange(1, draft.block_size + 1, device=draft.logits.device, dtype=torch.float32)
        return torch.exp(-(t - 1) / self.gamma).expand(draft.valid.shape)  # (N, A, K)


def exclusive_cumprod(x: Tensor) -> Tensor:
    """out[..., k] = Π_{j<k} x[..., j] along the slot dimension (out[..., 0] = 1); differentiable."""
    return torch.cat([torch.ones_like(x[..., :1]), x[..., :-1]], dim=-1).cumprod(-1)


def _chain(factor: Tensor, valid: Tensor) -> Tensor:
    """Π_{j<k} factor_j over the slots before k, where an invalid slot ends the chain (its factor is 0).

    Why an invalid slot ends the chain: a label outside the draft vocabulary can never be proposed, so the
    round stops there; past the end of the sequence nothing is drafted; and an unsupervised (prompt) token
    inside a block is not a state decoding visits. The same rule as AUF's "an invalid position ends the prefix".
    """
    return exclusive_cumprod(factor * valid.to(factor.dtype))  # (N, A, K)


class Geometric(PositionWeight):
    """b_t = rho^(t - 1): the geometric decay of EAGLE-3's training-time test (0.8^i over its unrolled steps,
    as SpecForge trains it), Medusa's heads (0.8^k; Cai et al. 2024, arXiv 2401.10774), SpecBlock's draft loss
    (decay^k; Shi et al. 2026, arXiv 2605.07243) and Draft-OPD's rejected-draft stream (0.8^(offset-1); Lei et
    al. 2026, arXiv 2605.29343).

    Slot convention: t = 1 is the first prediction and gets weight 1 (exponent t - 1 = 0), as EAGLE-3's first
    TTT step (i = 0) and Draft-OPD's offset 1. Medusa's 0.8^k, k = 1.., is the same up to a factor rho, which
    ``normalize="weight"`` cancels; under ``anchors``/``slots`` the loss is rho times smaller.

    Args:
        rho: the ratio between consecutive slots, in (0, 1] (1 = uniform).
    """

    def __init__(self, rho: float = 0.8) -> None:
        if not 0 < rho <= 1:
            raise UserError(f"position_weight.rho must be in (0, 1], got {rho}.")
        self.rho = rho

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        t = torch.arange(1, draft.block_size + 1, device=draft.logits.device, dtype=torch.float32)
        return (self.rho ** (t - 1)).expand(draft.valid.shape)  # (N, A, K)


def _prefix_support(matched: Tensor, valid: Tensor) -> Tensor:
    """1 for valid slots k whose earlier slots are all valid and matched (so the first miss is included)."""
    ok = (matched & valid).float()
    return exclusive_cumprod(ok) * valid.float()  # (N, A, K)


class AUFSupport(PositionWeight):
    """AUF, Accept-Until-Fail (Yang & Li 2026, arXiv 2607.01893): b_k = 1 for valid slots
    up to and *including* the first slot whose draft argmax differs from the gold token, 0 after; all valid
    slots when nothing fails. An invalid slot ends the prefix. Computed without gradient (a mask).

    Use with ``CE`` and ``normalize="weight"``: Σ m_k CE_k / Σ m_k, the paper's loss (decay is "empirically
    inert" under AUF, so b carries no decay; multiply by another weight through a mixture if wanted).
    """

    @torch.no_grad()
    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return _prefix_support(draft.logits.argmax(-1) == draft.labels, draft.valid)  # (N, A, K)


class ValidPrefix(PositionWeight):
    """SpecBlock's valid-prefix ("chain") mask (Shi et al. 2026, arXiv 2605.07243): slot k
    counts only where every slot < k predicted top-1 == the target's argmax. The first mismatching slot itself
    counts (its predecessors matched). Computed without gradient; needs the target logits.

    Difference from ``AUFSupport``: the reference is the target's greedy token, not the data's token.
    """

    needs_target = True

    @torch.no_grad()
    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if ctx.target_logits is None:
            raise ValueError("ValidPrefix needs target logits; the module provides them when needs_target.")
        matched = draft.logits.argmax(-1) == ctx.target_logits.argmax(-1)
        return _prefix_support(matched, draft.valid)  # (N, A, K)


class DPACE(PositionWeight):
    """D-PACE (Wu 2026, arXiv 2605.18810; as vLLM speculators implements it, ``losses/utils.py``):

        b_k = sg( Σ_{m=k}^{K} Π_{s=1}^{m} q̃_s ),   q̃_s = (1 - α)·q_s(x_s) + α,

    the α-smoothed probability that the draft survives to slot m, summed over every m ≥ k whose accepted
    length slot k's loss affects. q_s(x_s) = exp(-CE_s) on the gold token. Detached. An invalid slot ends the
    chain (its q̃ counts as 0), so slots after it get weight 0.

    Args:
        alpha: the smoothing α in [0, 1] (vLLM speculators: 0.5); 1 gives b_k = number of slots from k on.
    """

    def __init__(self, alpha: float = 0.5) -> None:
        if not 0 <= alpha <= 1:
            raise UserError(f"position_weight.alpha must be in [0, 1], got {alpha}.")
        self.alpha = alpha

    @torch.no_grad()
    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        q = _draft_logprobs(draft).exp().gather(-1, draft.labels[..., None])[..., 0]  # (N, A, K)
        smooth = ((1 - self.alpha) * q + self.alpha) * draft.valid
        survive = smooth.cumprod(-1)  # Π_{s≤m} q̃_s, 0 from the first invalid slot on
        return survive.flip(-1).cumsum(-1).flip(-1)  # (N, A, K) suffix sums Σ_{m≥k}


class E2EWeight(PositionWeight):
    """The E2E-TV cumulative acceptance (Li et al. 2026c "Bebop", arXiv 2606.12370):
    b_t = Π_{s<t} (1 - TV(p_s, q_s)) = Π_{s<t} α_s, **with** gradient (no stop-gradient), the probability that
    the round reaches slot t. Pair with ``TVMinusOne`` (or use ``E2E``): Σ_t b_t (TV_t - 1) = -E[accepted].

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        _, p, _, q = _target_and_draft(draft, ctx, self.sampling)
        return _chain(acceptance(p, q), draft.valid)  # (N, A, K)


class WTVWeight(E2EWeight):
    """WTV (Xia et al., arXiv 2609.24150; derived here, not from the paper): b_k = Π_{j<k} α^T_j with
    α^T = Σ min(softmax(z_p / T), softmax(z_q / T)), with gradient: E2E's weight at temperature T with no
    top-k/top-p. Pair with ``TVMinusOne(sampling={temperature: T})`` or use ``WTV``.

    Args:
        temperature: T > 0 applied to both target and draft logits.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        if temperature <= 0:
            raise UserError(f"position_weight.temperature must be > 0, got {temperature}.")
        super().__init__(SamplingConfig(temperature=temperature))
        self.temperature = temperature


class EALWeight(PositionWeight):
    """EAL (Xia et al., arXiv 2609.24150; derived here, not from the paper): b_k = Π_{j<k} q_j(y*_j), with
    gradient, the differentiable stand-in for "the greedy draft matched every earlier slot". Pair with ``NegProb`` (or
    use ``EAL``): Σ_k b_k·(-q_k(y*_k)) = -Σ_k Π_{j≤k} q_j(y*_j) = -EAL.

    Args:
        token: ``target_argmax`` (y* = argmax p, what greedy verification compares against)
            or ``gold`` (the data's token).
    """

    def __init__(self, token: Literal["target_argmax", "gold"] = "target_argmax") -> None:
        if token not in _TOKENS:
            raise UserError(f"position_weight.token must be one of {_TOKENS}, got {token!r}.")
        self.token = token

    @property
    def needs_target(self) -> bool:
        return self.token == "target_argmax"

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        q = _draft_logprobs(draft).exp().gather(-1, _gold_or_argmax(draft, ctx, self.token)[..., None])[..., 0]
        return _chain(q, draft.valid)  # (N, A, K)


class PositionProduct(PositionWeight):
    """b = Π_i b_i: several block-position weights at once, e.g. SpecBlock's valid-prefix mask times its
    0.8^t decay (Shi et al. 2026, arXiv 2605.07243), or AUF's support times the DFlash decay.

    Args:
        weights: the factors.
    """

    def __init__(self, weights: list[PositionWeight]) -> None:
        if not weights:
            raise UserError("position_weight.weights must name at least one weight.")
        self.weights = list(weights)

    @property
    def needs_target(self) -> bool:
        return any(w.needs_target for w in self.weights)

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        out = self.weights[0](draft, ctx)
        for w in self.weights[1:]:
            out = out * w(draft, ctx)
        return out  # (N, A, K)


class AnchorWeight(Part):
    """a_n: returns (N, A). ``needs_target`` and ``select_anchors`` as for the other parts (``Part``)."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        raise NotImplementedError


class AnchorUniform(AnchorWeight):
    """a_n = 1 for every sampled anchor (every objective but EDR, whose a_n is ``EDROccupancy``)."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return torch.ones(draft.valid.shape[:2], device=draft.logits.device)  # (N, A)
