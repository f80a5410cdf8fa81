"""Per-position losses ℓ_{n,t} of the objective template (METHODS.md §3.1, Table 1).

Each returns a (N, A, K) tensor; the template applies weights and normalises. Target distributions p come
from the same ``SamplingConfig`` code the decoding engine uses, so training and evaluation agree on p.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.sampling import SamplingConfig


class Loss:
    """A per-slot loss. ``needs_target`` asks the module for target logits at every slot."""

    needs_target: bool = False

    def __call__(self, draft: DraftOutput) -> Tensor:  # (N, A, K)
        raise NotImplementedError


def _draft_logprobs(draft: DraftOutput, temperature: float = 1.0) -> Tensor:
    return (draft.logits.float() / (temperature or 1.0)).log_softmax(-1)  # (N, A, K, Vd)


def _target_logprobs(draft: DraftOutput, sampling: SamplingConfig) -> Tensor:
    if draft.target_logits is None:
        raise ValueError("This loss needs target logits; the module provides them when objective.needs_target.")
    return sampling.logprobs(draft.target_logits)  # (N, A, K, Vd); -inf where filtered


class CE(Loss):
    """Cross-entropy on the gold token, ℓ = -log q_{n,t}(x_t) (DFlash, METHODS.md §2.2)."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        logq = _draft_logprobs(draft)
        return -logq.gather(-1, draft.labels[..., None])[..., 0]  # (N, A, K)


class KL(Loss):
    """Forward KL(p_t ‖ q_{n,t}) = Σ_v p log(p / q), p the target under ``sampling`` (METHODS.md §3.1).

    Args:
        sampling: how p is formed from the target logits (default temperature 1, no filtering). With a
            temperature T > 0 the draft distribution uses the same T. Temperature 0 makes p one-hot on the
            target argmax, i.e. CE against the target's greedy token.
    """

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput) -> Tensor:
        logp = _target_logprobs(draft, self.sampling)
        logq = _draft_logprobs(draft, self.sampling.temperature)
        p = logp.exp()
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)  # (N, A, K)


class TV(Loss):
    """Total variation TV(p, q) = Σ_v [p(v) - q(v)]_+ = 1 - α, α the acceptance probability (METHODS.md §1.3)."""

    needs_target = True

    def __init__(self, sampling: SamplingConfig = SamplingConfig(temperature=1.0)) -> None:
        self.sampling = sampling

    def __call__(self, draft: DraftOutput) -> Tensor:
        p = _target_logprobs(draft, self.sampling).exp()
        q = _draft_logprobs(draft, self.sampling.temperature).exp()
        return (p - q).clamp_min(0).sum(-1)  # (N, A, K)
