"""Pure verification rules: chains (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318)
and one node of a token tree (``candidate_rule``, METHODS §1.2).

The chain rules take the K draft tokens and the target's K + 1 verified distributions (positions anchor .. anchor
+ K) and return ``(accepted, next_token)``: how many draft tokens are kept and the token the target commits after
them (the correction at the first rejection, or the bonus when all K are accepted). One host sync each. A tree's
walk from node to node is ``TreeProposal.accept`` (``proposals.py``).
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


# ------------------------------------------------------------------------------------------------ trees
def candidate_rule(
    p: Tensor,  # (V,) the target's distribution at a tree node
    candidates: Tensor,  # (m,) the node's children's tokens, in the order they were drawn
    q: Tensor | None,  # (V,) the distribution they were drawn from; None: chosen deterministically
    replacement: bool,  # drawn independently (True) or without replacement (False)
) -> tuple[Tensor, Tensor]:
    """The multi-candidate rule at one node of a token tree under sampling (METHODS §1.2, DERIVED there; exact
    enumeration in tests/decoding/test_tree_verify.py): the probability a_i (m,) of accepting child i once every earlier
    child was rejected, and the distribution (V,) the target's token is drawn from when all m are rejected. The
    committed token is then distributed as p.

    - ``q`` given (SpecInfer's multi-candidate rejection, Miao et al. 2024, arXiv 2305.09781): a_i = min(1,
      p_i(c_i)/q_i(c_i)); after a rejection p_{i+1} = norm((p_i - q_i)+), and for candidates drawn without
      replacement also q_{i+1} = q_i with c_i removed, renormalised (the distribution the next one was drawn from).
    - ``q`` None (children chosen deterministically, e.g. the draft's top-k): a_i = p_i(c_i) and p_{i+1} = p_i with
      c_i removed, renormalised: sampling x ~ p and looking for x among the children one at a time."""
    p = original = p.double()
    q = q.double() if q is not None else None
    accept = torch.zeros(len(candidates), dtype=torch.float64, device=p.device)
    for i, c in enumerate(candidates.tolist()):
        if q is None:
            accept[i] = p[c]
            p = p.clone()
            p[c] = 0.0
        else:
            accept[i] = acceptance_probability(p[c], q[c])
            p = (p - q).clamp_min(0)
            if not replacement:
                q = q.clone()
                q[c] = 0.0
                q = q / q.sum().clamp_min(1e-300)
        mass = p.sum()
        if mass <= RESIDUAL_EPS:  # the tried children held all of p's mass (up to float error): as rejection_accept
            return accept, original
        p = p / mass
    return accept, p


def candidate_accept(
    p: Tensor, candidates: Tensor, q: Tensor | None, replacement: bool, generator: torch.Generator | None = None
) -> tuple[int | None, Tensor]:
    """``candidate_rule`` with uniforms: the index of the accepted child, or None and the distribution the target's
    token is drawn from."""
    accept, rest = candidate_rule(p, candidates, q, replacement)
    u = torch.rand(len(candidates), generator=generator, device="cpu" if generator is not None else p.device)
    hits = (u.to(accept.device, accept.dtype) < accept).nonzero()
    return (int(hits[0]), rest) if hits.numel() else (None, rest)


def draw(dist: Tensor, generator: torch.Generator | None = None) -> int:
    """One token from ``dist`` (V,) with the engine's generator (on the CPU when seeded)."""
    dist = dist.float().cpu() if generator is not None else dist.float()
    return int(torch.multinomial(dist, 1, generator=generator))
