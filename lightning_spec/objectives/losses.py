"""Per-position losses ℓ_{n,t} of the objective template (``objective.py``; EDR, arXiv 2610.10411, Table 1).

Each returns a (N, A, K) tensor; the template applies weights and normalises. Target distributions p come
from the same ``SamplingConfig`` code the decoding engine uses, so training and evaluation agree on p.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.part import Part
from lightning_spec.sampling import SamplingConfig


class Loss(Part):
    """A per-slot loss. ``needs_target`` asks the module for target logits at every slot (``Part``).
    ``reads_candidates``: the loss is defined on logits that are -inf outside a candidate set (``DraftOutput.sparse``,
    DFlash2's selector); ``Objective`` refuses a sparse draft to any other loss."""

    reads_candidates: bool = False

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:  # (N, A, K)
        raise NotImplementedError


def _upcast(x: Tensor) -> Tensor:
    """At least float32; float64 stays float64 (the gradient checks run in float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _draft_logprobs(draft: DraftOutput, temperature: float = 1.0) -> Tensor:
    return (_upcast(draft.logits) / (temperature or 1.0)).log_softmax(-1)  # (N, A, K, Vd)


def _target_logprobs(ctx: StepContext, sampling: SamplingConfig) -> Tensor:
    if ctx.target_logits is None:
        raise ValueError("This loss needs target logits; the module provides them when objective.needs_target.")
    return sampling.logprobs(ctx.target_logits)  # (N, A, K, Vd); -inf where filtered


class CE(Loss):
    """Cross-entropy on the gold token, ℓ = -log q_{n,t}(x_t) (DFlash, Chen, Liang, Liu 2026, arXiv 2602.06036)."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logq = _draft_logprobs(draft)
        return -logq.gather(-1, draft.labels[..., None])[..., 0]  # (N, A, K)


class KL(Loss):
    """Forward KL(p_t ‖ q_{n,t}) = Σ_v p log(p / q), p the target under ``sampling``.

    Args:
        sampling: how p is formed from the target logits (default temperature 1, no filtering). With a
            temperature T > 0 the draft distribution uses the same T. Temperature 0 makes p one-hot on the
            target argmax, i.e. CE against the target's greedy token.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logp = _target_logprobs(ctx, self.sampling)
        logq = _draft_logprobs(draft, self.sampling.temperature)
        p = logp.exp()
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)  # (N, A, K)


class TV(Loss):
    """Total variation TV(p, q) = Σ_v [p(v) - q(v)]_+ = 1 - α, α = Σ_v min(p, q) the probability that lossless
    verification accepts a draft token drawn from q (Leviathan et al. 2023)."""

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        p = _target_logprobs(ctx, self.sampling).exp()
        q = _draft_logprobs(draft, self.sampling.temperature).exp()
        return (p - q).clamp_min(0).sum(-1)  # (N, A, K)


# ----------------------------------------------------------------------------------------------- helpers
def _target_and_draft(
    draft: DraftOutput, ctx: StepContext, sampling: SamplingConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """log p, p (the target under ``sampling``) and log q, q (the draft at the same temperature): (N, A, K, Vd)."""
    logp = _target_logprobs(ctx, sampling)
    logq = _draft_logprobs(draft, sampling.temperature)
    return logp, logp.exp(), logq, logq.exp()


def acceptance(p: Tensor, q: Tensor) -> Tensor:
    """α = Σ_v min(p(v), q(v)) = 1 - TV(p, q): the probability that a token drawn from q is accepted (§1.1)."""
    return torch.minimum(p, q).sum(-1)


def _gold_or_argmax(draft: DraftOutput, ctx: StepContext, token: str) -> Tensor:
    if token == "gold":
        return draft.labels
    if ctx.target_logits is None:
        raise ValueError("token='target_argmax' needs target logits; the module provides them when needs_target.")
    return ctx.target_logits.argmax(-1)  # (N, A, K) y* = argmax p (the target's greedy token)


_TOKENS = ("target_argmax", "gold")


# ------------------------------------------------------------------------------------------------ losses
class ReverseKL(Loss):
    """Reverse KL(q_{n,t} ‖ p_t) = Σ_v q log(q / p), the mode-seeking distillation loss (AdaFlash's
    reverse-KL drafter training, Qian et al. 2026, arXiv 2607.19223; Draft-OPD's sampled k3
    estimator of the same divergence, Lei et al. 2026, arXiv 2605.29343).

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
        log_floor: log p is floored here. Top-k/top-p (or greedy) targets give p = 0 to tokens the draft may
            still propose, where the reverse KL is infinite; the floor keeps the loss finite and its gradient,
            which pushes q's mass off those tokens, bounded.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), log_floor: float = -20.0) -> None:
        self.sampling = sampling
        self.log_floor = log_floor

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logp, _, logq, q = _target_and_draft(draft, ctx, self.sampling)
        return (q * (logq - logp.clamp_min(self.log_floor))).sum(-1)  # (N, A, K)


class JSD(Loss):
    """Generalised Jensen-Shannon divergence β·KL(p ‖ m) + (1 - β)·KL(q ‖ m), m = β p + (1 - β) q
    (the generalised JSD of GKD, Agarwal et al. 2024, "On-policy distillation of language models"). β = 0.5
    is the symmetric JSD, bounded by log 2 nats, finite even where top-k/top-p gives p = 0.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
        beta: the mixing weight β in (0, 1).
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), beta: float = 0.5) -> None:
        if not 0 < beta < 1:
            raise UserError(f"loss.beta must be in (0, 1), got {beta}.")
        self.sampling = sampling
        self.beta = beta

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logp, p, logq, q = _target_and_draft(draft, ctx, self.sampling)
        logm = torch.logaddexp(logp + math.log(self.beta), logq + math.log(1 - self.beta))
        kl_pm = torch.where(p > 0, p * (logp - logm), torch.zeros_like(p)).sum(-1)
        kl_qm = (q * (logq - logm)).sum(-1)
        return self.beta * kl_pm + (1 - self.beta) * kl_qm  # (N, A, K)


class LK(Loss):
    """LK-λ (Samarin 2026, arXiv 2602.23881; as SpecForge implements it, ``core/lk_loss.py``):
    ℓ = λ·KL(p ‖ q) + (1 - λ)·TV(p, q) with λ = scale·exp(-κ·sg(α)), α = Σ min(p, q).

    KL dominates while the draft is far from the target (α small) and TV, whose complement is the acceptance
    rate, takes over as α grows. λ is detached, as in both public implementations.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
        kappa: κ, the decay of λ in α (SpecForge ``kl_decay`` default 1; vLLM speculators use 3).
        scale: the value of λ at α = 0 (SpecForge ``kl_scale``, default 1). Above 1, λ can exceed 1 and the
            TV term gets a negative weight; keep it ≤ 1 unless you mean that.
    """

    needs_target = True

    def __init__(
        self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), kappa: float = 1.0, scale: float = 1.0
    ) -> None:
        self.sampling = sampling
        self.kappa = kappa
        self.scale = scale

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logp, p, logq, q = _target_and_draft(draft, ctx, self.sampling)
        alpha = acceptance(p, q)  # (N, A, K)
        lam = self.scale * torch.exp(-self.kappa * alpha.detach())
        kl = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
        return lam * kl + (1 - lam) * (1 - alpha)  # (N, A, K)


class LKAlpha(Loss):
    """LK^α (Samarin 2026, arXiv 2602.23881; SpecForge's ``alpha`` variant): ℓ = -log α,
    α = Σ_v min(p, q). Its gradient is TV's scaled by 1/α: slots the draft gets badly wrong weigh more.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
        eps: α is clamped to at least ``eps`` so a slot with no overlap gives a finite loss.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), eps: float = 1e-6) -> None:
        self.sampling = sampling
        self.eps = eps

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        _, p, _, q = _target_and_draft(draft, ctx, self.sampling)
        return -acceptance(p, q).clamp_min(self.eps).log()  # (N, A, K)


class BernoulliKL(Loss):
    """Bernoulli forward KL on the realised (gold) token x_t, Draft-OPD's response-stream loss (Lei et al.
    2026, arXiv 2605.29343): with p = p_t(x_t) and q = q_{n,t}(x_t),

        ℓ = p log(p / q) + (1 - p) log((1 - p) / (1 - q)),

    the KL between "the target emits x_t" and "the draft emits x_t" as coin flips. As in Draft-OPD,
    log-probabilities (log p, log q, log(1 - p), log(1 - q)) are clamped to ≥ ``log_floor`` and the loss to
    ±``clip``.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
        log_floor: lower clamp of every log-probability (Draft-OPD: -10).
        clip: the loss is clamped to [-clip, clip] (Draft-OPD: 10).
    """

    needs_target = True

    def __init__(
        self, sampling: SamplingConfig = SamplingConfig(temperature=1.0), log_floor: float = -10.0, clip: float = 10.0
    ) -> None:
        self.sampling = sampling
        self.log_floor = log_floor
        self.clip = clip

    def _logs(self, logprob: Tensor) -> tuple[Tensor, Tensor]:
        """log x and log(1 - x) of a probability given as a log, both clamped to ≥ log_floor, NaN-free."""
        one = 1 - torch.finfo(logprob.dtype).eps
        log_x = logprob.clamp_min(self.log_floor)
        log_1mx = torch.log1p(-logprob.exp().clamp(max=one)).clamp_min(self.log_floor)
        return log_x, log_1mx

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        logp, _, logq, _ = _target_and_draft(draft, ctx, self.sampling)
        gold = draft.labels[..., None]
        lp, l1p = self._logs(logp.gather(-1, gold)[..., 0])  # (N, A, K)
        lq, l1q = self._logs(logq.gather(-1, gold)[..., 0])
        loss = lp.exp() * (lp - lq) + l1p.exp() * (l1p - l1q)
        return loss.clamp(-self.clip, self.clip)  # (N, A, K)


class TVMinusOne(Loss):
    """ℓ = TV(p_t, q_{n,t}) - 1 = -α: the per-slot loss of E2E-TV (Li et al. 2026c "Bebop", arXiv 2606.12370)
    and, with a temperature-only ``sampling``, of WTV (Xia et al., arXiv 2609.24150). Paired with the
    cumulative-acceptance weight ``E2EWeight`` (no stop-gradient) the block sums to -Σ_k Π_{s≤k} α_s, the
    negative expected accepted length; ``E2E`` / ``WTV`` build that pair.

    Args:
        sampling: how p is formed from the target logits; the draft uses the same temperature.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        _, p, _, q = _target_and_draft(draft, ctx, self.sampling)
        return -acceptance(p, q)  # (N, A, K)


class NegProb(Loss):
    """ℓ = -q_{n,t}(y_t): the per-slot loss of EAL (Xia et al., arXiv 2609.24150; derived here, not from the paper).
    Paired with ``EALWeight`` (Π_{j<t} q_j(y*_j), with gradient) the block sums to -Σ_k Π_{j≤k} q_j(y*_j),
    the differentiable surrogate of the greedy expected accepted length; ``EAL`` builds that pair.

    Args:
        token: ``target_argmax`` (y* = argmax p_t, what greedy verification compares against)
            or ``gold`` (the data's token; the same thing on target-generated data).
    """

    def __init__(self, token: Literal["target_argmax", "gold"] = "target_argmax") -> None:
        if token not in _TOKENS:
            raise UserError(f"loss.token must be one of {_TOKENS}, got {token!r}.")
        self.token = token

    @property
    def needs_target(self) -> bool:
        return self.token == "target_argmax"

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        q = _draft_logprobs(draft).exp()
        return -q.gather(-1, _gold_or_argmax(draft, ctx, self.token)[..., None])[..., 0]  # (N, A, K)
