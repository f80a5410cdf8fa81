"""Pure chain-verification rules (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

Both take the K draft tokens and the target's K + 1 verified distributions (positions anchor .. anchor + K)
and return ``(accepted, next_token)``: how many draft tokens are kept and the token the target commits after
them (the correction at the first rejection, or the bonus when all K are accepted). One host sync each.
"""

from __future__ import annotations

import torch
from torch import Tensor

RESIDUAL_EPS = 1e-8  # DeepSpec's guard: a residual with less mass than this is replaced by p


def greedy_accept(draft: Tensor, target_argmax: Tensor) -> tuple[int, int]:
    """Greedy: accept the leading run of draft tokens equal to the target argmax.

    draft (K,), target_argmax (K + 1,) -> (accepted, argmax at the first mismatch or the bonus position).
    """
    k = draft.shape[0]
    match = (draft == target_argmax[:k]).to(torch.int64)
    accepted = int(match.cumprod(0).sum()) if k else 0
    return accepted, int(target_argmax[accepted])


def acceptance_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x) / q(x)) for draft tokens x ~ q: the rule that keeps the output distributed as p."""
    return (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0)


def rejection_accept(
    draft: Tensor,  # (K,) draft tokens, x_t ~ q_t
    q: Tensor,  # (K, V) draft distributions the tokens were drawn from
    p: Tensor,  # (K + 1, V) target distributions under the same SamplingConfig
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless rejection sampling: accept x_t with min(1, p_t(x_t)/q_t(x_t)); at the first rejection draw
    from norm(max(0, p_t - q_t)); if all K are accepted draw the bonus from p_{K+1}."""
    k = draft.shape[0]
    if k:
        idx = draft[:, None]
        ratio = acceptance_probability(p[:k].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0])  # (K,)
        u = torch.rand(k, generator=generator, device="cpu" if generator is not None else p.device).to(p.device)
        accepted = int((u < ratio).to(torch.int64).cumprod(0).sum())
    else:
        accepted = 0
    if accepted < k:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        mass = residual.sum()
        dist = residual / mass if mass > RESIDUAL_EPS else p[accepted]
    else:
        dist = p[k]
    token = torch.multinomial(dist.float().cpu() if generator is not None else dist.float(), 1, generator=generator)
    return accepted, int(token)
