"""EDR, Expected Decoding Rounds (Zhao & Cai 2026, arXiv 2610.10411, §3).

Condition on a target rollout x. Round states are (n, t): the round started after the committed prefix x_{≤n}
(anchor n) and is verifying position t. With A_{n,t} = min(1, q_{n,t}(x_t) / p_t(x_t)) the Bayes acceptance of
the realised token and R = 1 - A, the chain moves (n, t) -> (n, t + 1) w.p. A and (n, t) -> (t, t + 1) w.p. R;
the bonus slot t = n + K + 1 always ends the round. Expected rounds = 1 + Σ_{n,t} ω_{n,t} c_{n,t} (Thm 1) with
occupancies ω (forward recursion) and the EOS-aware local cost c (Def. 1); its gradient is Theorem 2's
temporal-difference form Σ ω [∇c + ∇A (V_{n,t+1} - V_{t,t+1})] with V from the backward recursion (Eq. 12).

Here, in this file:
- ``chain``: which anchors start rounds and which slots exist, from the loss mask. Every maximal run of
  supervised tokens is one generation (a multi-turn conversation has several); its first round starts from the
  token before the run; its last token ends generation (the EOS, or where the data was truncated): after
  it nothing is verified and no round starts, so its cost is 0 (Def. 1, "c = 0 at L + 1").
- ``chain_dp``: both recursions in float64, vectorised over batch and positions: each is a linear recurrence
  of order K + 1 (a banded unit-triangular system), solved blockwise (``solve_band``) and chained across
  blocks by a parallel (Hillis-Steele) scan in ⌈log2(S / (K + 1))⌉ batched matrix products: L = 4096, K = 7
  takes ~5 ms per sequence on one CPU core, against ~0.4 s for ``chain_dp_reference``, the plain loop of the
  paper's pseudo-code kept for the parity tests.
- ``inclusion_probabilities`` + ``systematic_sample``: at most ``max_anchors`` anchors per sequence, π_n =
  min(1, λ ω_{n,n+1}) with Σ π = budget (water-filling), drawn by random-start systematic sampling (each
  anchor is drawn with probability exactly π_n), weights sg(ω / π): an unbiased estimate of the full sum.
- The parts: ``EDROccupancy`` (a_n = sg(ω_{n,n+1} / π_n); it also chooses the anchors), ``EDRReach``
  (b = sg(Π_{s<t} A)), ``EDRCost`` (ℓ = c + A·sg(V_{n,t+1} - V_{t,t+1})), assembled by ``EDR``.

Target distribution and the reduced draft vocabulary. p_t is the target's distribution under ``sampling``
over its *full* vocabulary (top-k/top-p and the normaliser need every logit); we keep, per position, p on the
draft vocabulary (EOS columns zeroed), the mass outside it (EOS excluded), the non-EOS mass and p_t(x_t). Then
c = (Σ_{v∉Vd, v≠EOS} p(v) + Σ_{v∈Vd, v≠EOS} [p(v) - q(v)]_+) / (1 - p(EOS)) exactly, since q is 0 outside
the draft vocabulary; and A = 0 where x_t is outside it (the draft can never propose it). So EOS need not be
in the draft vocabulary for the statistics to be exact; if it is not, the drafter can never propose the end
and pays for that through c. Several EOS ids (``Target.eos_token_ids``) all count as the stop token.

Conventions for data that is not a target rollout (e.g. ShareGPT answers): where the warped target gives the
data's token probability 0 (filtered by top-k/top-p, or not the argmax of a greedy target), A = 0. Train on
target rollouts (``lightning-spec rollouts``, README "Rollouts") for the estimate to be the expected rounds of
real decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput, seeded_rand
from lightning_spec.objectives.losses import Loss
from lightning_spec.objectives.objective import DraftFn, Objective, TargetInfo
from lightning_spec.objectives.weights import AnchorWeight, PositionWeight
from lightning_spec.sampling import SamplingConfig

_NONEOS_EPS = 1e-6  # floor of 1 - p(EOS): c ≤ 1 always (its numerator is at most the non-EOS mass)


# ---------------------------------------------------------------------------------------- chain structure
@dataclass
class Chain:
    """Where rounds start and which slots exist, for every anchor n of a padded batch (K slots)."""

    start_ok: Tensor  # (N, S) bool: a round may start at anchor n (position n + 1 is supervised)
    first: Tensor  # (N, S) bool: the first anchor of a generation
    exists: Tensor  # (N, S, K) bool: slot h of anchor n verifies position n + 1 + h of the same generation
    terminal: Tensor  # (N, S, K) bool: ... and that position is the generation's last token
    bonus: Tensor  # (N, S) bool: the bonus position n + K + 1 exists and is not the last token (a new round)
    length: Tensor  # (N, S) tokens from anchor n to the end of its generation (committed tokens of a generation)


def chain(loss_mask: Tensor, block_size: int) -> Chain:
    """The chain's structure from the loss mask (N, S): every maximal supervised run is one generation."""
    lm = loss_mask.bool()
    n, s = lm.shape
    k = block_size
    pos = torch.arange(s, device=lm.device)
    # nxt[t] = first j ≥ t with lm[j] False (s if none): the generation containing t ends at nxt[t] - 1
    nxt = torch.where(~lm, pos, torch.full_like(pos, s)).flip(-1).cummin(-1).values.flip(-1)  # (N, S)
    start_ok = torch.zeros_like(lm)
    start_ok[:, :-1] = lm[:, 1:]
    end = torch.full_like(nxt, -1)
    end[:, :-1] = nxt[:, 1:] - 1  # last position of the generation that anchor n's next token belongs to
    prompt = ~lm
    prompt[:, 0] = True  # position 0 cannot be predicted: it is context even when supervised
    first = start_ok & prompt
    t = pos[:, None] + 1 + torch.arange(k, device=lm.device)  # (S, K)
    exists = start_ok[..., None] & (t <= end[..., None])
    terminal = exists & (t == end[..., None])
    bonus = start_ok & (pos + k + 1 < end)
    length = torch.where(start_ok, end - pos, torch.zeros_like(end))
    return Chain(start_ok, first, exists, terminal, bonus, length)


# ------------------------------------------------------------------------------------------ the recursions
@dataclass
class ChainValues:
    """Both recursions of one batch, float64. Zero wherever no round can start or no slot exists."""

    value: Tensor  # (N, S) V_{n,n+1}: expected rounds after the one that starts at anchor n (Eq. 12)
    start: Tensor  # (N, S) ω_{n,n+1}: probability that a round starts at anchor n
    reach: Tensor  # (N, S, K) Π_{s<h} A_{n,s}: probability that round n verifies slot h, given it started
    occupancy: Tensor  # (N, S, K) ω_{n,n+1+h} = start · reach
    advantage: Tensor  # (N, S, K) V_{n,t+1} - V_{t,t+1}, t = n + 1 + h (Theorem 2)
    rounds: Tensor  # (N,) Σ over the sequence's generations of 1 + V at its first anchor
    generations: Tensor  # (N,) number of generations
    tokens: Tensor  # (N,) committed tokens of those generations (their last token included)


def _suffix_affine(m: Tensor, b: Tensor) -> Tensor:
    """x_i = m_i x_{i+1} + b_i for i = S-1..0 with x_S = 0; m (N, S, W, W), b (N, S, W) -> x (N, S, W).

    Hillis-Steele doubling: after the step with offset o, (m_i, b_i) is the composition of the maps i..i+2o-1,
    so ⌈log2 S⌉ batched products replace the loop over positions.
    """
    s = m.shape[1]
    step = 1
    while step < s:
        head = s - step
        b = torch.cat([b[:, :head] + (m[:, :head] @ b[:, step:, :, None])[..., 0], b[:, head:]], dim=1)
        if 2 * step < s:
            m = torch.cat([m[:, :head] @ m[:, step:], m[:, head:]], dim=1)
        step *= 2
    return b


def _companion(first_row: Tensor) -> Tensor:
    """(N, S, W) -> (N, S, W, W): the given first row over a sub-diagonal of ones (a shift register)."""
    w = first_row.shape[-1]
    shift = torch.diag(torch.ones(w - 1, dtype=first_row.dtype, device=first_row.device), -1)
    m = shift.expand(*first_row.shape[:-1], w, w).clone()
    m[..., 0, :] = first_row
    return m


def solve_band(coef: Tensor, rhs: Tensor) -> Tensor:
    """x[i] = rhs[i] + Σ_{j=1}^{W} coef[i, j-1]·x[i+j] for i = S-1..0, x = 0 beyond S: (N, S, W), (N, S) -> (N, S).

    Positions are grouped in blocks of W: inside block b the system is unit upper-triangular,
    (I - L_b) X_b = rhs_b + U_b X_{b+1}, solved for all blocks at once; the blocks are then chained by
    ``_suffix_affine`` on the maps X_b = T_b X_{b+1} + r_b. Work O(S W^2 log(S / W)), no loop over positions.
    """
    n, s, w = coef.shape
    nb = -(-s // w)
    pad = nb * w - s
    coef = torch.nn.functional.pad(coef, (0, 0, 0, pad)).view(n, nb, w, w)  # [b, r, j-1]
    rhs = torch.nn.functional.pad(rhs, (0, pad)).view(n, nb, w)
    r = torch.arange(w, device=coef.device)
    col = (r[:, None] + 1 + r[None, :]).expand(n, nb, w, w)  # column r + j of the (W, 2W) band
    band = coef.new_zeros(n, nb, w, 2 * w).scatter_(-1, col, coef)
    eye = torch.eye(w, dtype=coef.dtype, device=coef.device)
    upper = eye - band[..., :w]  # unit upper-triangular
    sol = torch.linalg.solve_triangular(upper, torch.cat([band[..., w:], rhs[..., None]], -1), upper=True)
    x = _suffix_affine(sol[..., :w], sol[..., w])  # (N, nb, W)
    return x.reshape(n, nb * w)[:, :s]


def _transitions(accept: Tensor, cost: Tensor, ch: Chain) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Masked A and c, reach P (N, S, K + 1), and per anchor the one-round value β (N, S) and the
    probabilities γ (N, S, K + 1) that the next round starts at n + 1 + j (j = K: after the bonus)."""
    live = ch.exists & ~ch.terminal  # slots whose outcome matters: the last token ends generation anyway
    a = accept.double() * live
    c = cost.double() * live
    reach = torch.cat([torch.ones_like(a[..., :1]), a], -1).cumprod(-1) * ch.start_ok[..., None]  # (N, S, K+1)
    bonus = ch.bonus.double()
    gamma = torch.cat([reach[..., :-1] * (1 - a) * live, (reach[..., -1] * bonus)[..., None]], -1)
    beta = (reach[..., :-1] * c).sum(-1) + reach[..., -1] * bonus
    return a, c, reach, gamma, beta


def chain_dp(accept: Tensor, cost: Tensor, ch: Chain) -> ChainValues:
    """Forward occupancies and backward values (EDR §3, values by Eq. 12) in float64, vectorised (a parallel scan).

    accept, cost: (N, S, K) A_{n,n+1+h} and c_{n,n+1+h} (any dtype; masked here by ``ch``).
    """
    a, c, reach, gamma, beta = _transitions(accept, cost, ch)
    n, s, k = a.shape
    w = k + 1
    # backward (Eq. 12 summed over one round): V[n] = β[n] + Σ_j γ[n, j] V[n + 1 + j]
    value = solve_band(gamma, beta)
    # forward: start[m] = first[m] + Σ_j γ[m - 1 - j, j] start[m - 1 - j], the same band solve on the
    # reversed sequence
    into = torch.zeros_like(gamma)  # into[m, j] = γ[m - 1 - j, j]
    for j in range(w):
        into[:, j + 1 :, j] = gamma[:, : s - j - 1, j]
    start = solve_band(into.flip(1), ch.first.double().flip(1)).flip(1)
    # in-round values V_{n,t} from the bonus back to the first slot, and the TD advantages
    pad = torch.cat([value, value.new_zeros(n, w)], -1)
    idx = (torch.arange(s, device=a.device)[:, None] + 1 + torch.arange(w, device=a.device)).expand(n, s, w)
    v_next = pad.gather(1, idx.reshape(n, -1)).view(n, s, w)  # V[n + 1 + h], h = 0..K
    live = ch.exists & ~ch.terminal
    cont = ch.bonus.double() * (1 + v_next[..., k])
    advantage = torch.zeros_like(a)
    for h in reversed(range(k)):
        vt = v_next[..., h] * live[..., h]
        advantage[..., h] = (cont - vt) * ch.exists[..., h]
        cont = c[..., h] + a[..., h] * cont + (1 - a[..., h]) * vt
    reach_k = reach[..., :-1] * ch.exists
    first = ch.first.double()
    return ChainValues(
        value=value,
        start=start * ch.start_ok,
        reach=reach_k,
        occupancy=start[..., None] * reach_k,
        advantage=advantage,
        rounds=(first * (1 + value)).sum(-1),
        generations=first.sum(-1),
        tokens=(first * ch.length.double()).sum(-1),
    )


def chain_dp_reference(accept: Tensor, cost: Tensor, ch: Chain) -> ChainValues:
    """The same quantities by the plain loops of the paper's pseudo-code (EDR Alg. 1 and App. C.2).
    For parity tests and timing only: a Python loop over positions, far too slow for training batches."""
    a_all, c_all = accept.double().tolist(), cost.double().tolist()
    n, s, k = accept.shape
    value, start = torch.zeros(n, s, dtype=torch.float64), torch.zeros(n, s, dtype=torch.float64)
    reach, adv = torch.zeros(n, s, k, dtype=torch.float64), torch.zeros(n, s, k, dtype=torch.float64)
    ok, first, bonus = ch.start_ok.tolist(), ch.first.tolist(), ch.bonus.tolist()
    exists, term = ch.exists.tolist(), ch.terminal.tolist()
    for i in range(n):
        v = [0.0] * (s + k + 2)
        for a0 in reversed(range(s)):  # backward
            if not ok[i][a0]:
                continue
            cont = 1.0 + v[a0 + k + 1] if bonus[i][a0] else 0.0
            for h in reversed(range(k)):
                if not exists[i][a0][h] or term[i][a0][h]:
                    cont = 0.0  # the generation has ended: nothing after it costs anything
                    continue
                t = a0 + 1 + h
                a, c = a_all[i][a0][h], c_all[i][a0][h]
                adv[i, a0, h] = cont - v[t]
                cont = c + a * cont + (1 - a) * v[t]
            v[a0] = cont
        mass_in = [0.0] * (s + k + 2)
        for a0 in range(s):  # forward
            if first[i][a0]:
                mass_in[a0] += 1.0
            if not ok[i][a0]:
                continue
            mass = 1.0
            for h in range(k):
                if not exists[i][a0][h]:
                    mass = 0.0
                    break
                reach[i, a0, h] = mass
                if term[i][a0][h]:
                    mass = 0.0
                    break
                a = a_all[i][a0][h]
                mass_in[a0 + 1 + h] += mass_in[a0] * mass * (1 - a)
                mass *= a
            if bonus[i][a0]:
                mass_in[a0 + k + 1] += mass_in[a0] * mass
        value[i] = torch.tensor(v[:s], dtype=torch.float64)
        start[i] = torch.tensor(mass_in[:s], dtype=torch.float64)
    start = start * ch.start_ok
    first_d = ch.first.double()
    return ChainValues(
        value=value,
        start=start,
        reach=reach,
        occupancy=start[..., None] * reach,
        advantage=adv,
        rounds=(first_d * (1 + value)).sum(-1),
        generations=first_d.sum(-1),
        tokens=(first_d * ch.length.double()).sum(-1),
    )


# --------------------------------------------------------------------------------- target and draft statistics
@dataclass
class TargetTable:
    """Per position t (row t; row 0 unused) what the cost and acceptance need from p_t, float32."""

    p_draft: Tensor  # (N, S, Vd) p_t on the draft vocabulary, EOS columns zeroed
    p_outside: Tensor  # (N, S) Σ p_t(v) over v outside the draft vocabulary, EOS excluded
    p_noneos: Tensor  # (N, S) 1 - p_t(EOS), summed directly (accurate when small)
    p_token: Tensor  # (N, S) p_t(x_t), the realised token
    token_draft: Tensor  # (N, S) x_t as a draft id (0 when outside)
    token_inside: Tensor  # (N, S) bool: x_t is in the draft vocabulary


@torch.no_grad()
def target_table(
    target: TargetInfo, input_ids: Tensor, loss_mask: Tensor, sampling: SamplingConfig, max_elems: int = 1 << 24
) -> TargetTable:
    """p_t under ``sampling`` over the full target vocabulary, reduced to a ``TargetTable``, at the supervised
    positions t ≥ 1 (the only ones a slot verifies); at most ``max_elems`` logits at a time."""
    hidden = target.last_hidden
    n, s = input_ids.shape
    dev = hidden.device
    ids = input_ids.to(dev)
    sel = loss_mask.to(dev).bool().clone()
    sel[:, 0] = False
    rows, cols = sel.nonzero(as_tuple=True)  # (M,) positions t whose p_t is needed
    vocab = target.logits(hidden[:1, :1]).shape[-1]
    vocab_ids = (target.vocab_ids if target.vocab_ids is not None else torch.arange(vocab, device=dev)).to(dev)
    vd = vocab_ids.numel()
    is_eos = torch.zeros(vocab, dtype=torch.bool, device=dev)
    eos = [e for e in target.eos_ids if 0 <= e < vocab]
    if eos:
        is_eos[torch.tensor(eos, device=dev)] = True
    inside = torch.zeros(vocab, dtype=torch.bool, device=dev).index_fill_(0, vocab_ids, True)
    keep_cols = (~is_eos[vocab_ids]).float()  # (Vd,)
    outside_cols = (~inside & ~is_eos).float()  # (V,)
    pos = torch.searchsorted(vocab_ids, ids.clamp(min=0)).clamp(max=vd - 1)
    token_inside = vocab_ids[pos] == ids
    table = TargetTable(
        p_draft=torch.zeros(n, s, vd, device=dev),
        p_outside=torch.zeros(n, s, device=dev),
        p_noneos=torch.ones(n, s, device=dev),
        p_token=torch.zeros(n, s, device=dev),
        token_draft=torch.where(token_inside, pos, torch.zeros_like(pos)),
        token_inside=token_inside,
    )
    chunk = max(1, max_elems // vocab)
    for lo in range(0, rows.numel(), chunk):
        r, t = rows[lo : lo + chunk], cols[lo : lo + chunk]
        p = sampling.logprobs(target.logits(hidden[r, t - 1])).exp()  # (M', V): p_t from the hidden at t - 1
        table.p_draft[r, t] = p.index_select(-1, vocab_ids) * keep_cols
        table.p_outside[r, t] = p @ outside_cols
        table.p_noneos[r, t] = p @ (~is_eos).float()
        table.p_token[r, t] = p.gather(-1, ids[r, t, None])[..., 0]
    return table


def _warped_logprobs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """The draft's distribution as the engine draws from it (``SamplingConfig``); float64 stays float64."""
    if sampling.greedy or sampling.top_k or sampling.top_p < 1:
        return sampling.logprobs(logits)
    x = logits if logits.dtype == torch.float64 else logits.float()
    return (x / sampling.temperature).log_softmax(-1)


def slot_statistics(
    logits: Tensor, table: TargetTable, anchors: Tensor, draft_sampling: SamplingConfig
) -> tuple[Tensor, Tensor]:
    """Acceptance A and EOS-aware cost c (Def. 1) of every slot: logits (N, A, K, Vd) of the drafter run from
    ``anchors`` (N, A) -> A, c (N, A, K), differentiable in the logits (not under greedy drafting)."""
    n, na, k, vd = logits.shape
    s = table.p_token.shape[1]
    t = (anchors[..., None] + 1 + torch.arange(k, device=anchors.device)).clamp(max=s - 1)  # (N, A, K)
    flat = t.reshape(n, -1)

    def at(x: Tensor) -> Tensor:
        return x.gather(1, flat).view(n, na, k)

    p = table.p_draft.gather(1, flat[..., None].expand(-1, -1, vd)).view(n, na, k, vd)
    q = _warped_logprobs(logits, draft_sampling).exp()  # (N, A, K, Vd)
    cost = (at(table.p_outside) + (p - q).clamp_min(0).sum(-1)) / at(table.p_noneos).clamp_min(_NONEOS_EPS)
    q_tok = q.gather(-1, at(table.token_draft)[..., None])[..., 0] * at(table.token_inside)
    p_tok = at(table.p_token)
    accept = torch.where(p_tok > 0, (q_tok / p_tok.clamp_min(1e-30)).clamp(max=1), torch.zeros_like(q_tok))
    return accept, cost


# ------------------------------------------------------------------------------------------- anchor sampling
def inclusion_probabilities(mass: Tensor, budget: int) -> Tensor:
    """π_n = min(1, λ·mass_n) per row, λ chosen so that Σ_n π_n = budget (water-filling); rows with at most
    ``budget`` positive masses get π = 1 on all of them (exact). mass (N, S) ≥ 0 -> π (N, S) float64."""
    mass = mass.double()
    positive = mass > 0
    s = mass.shape[-1]
    srt = mass.sort(-1, descending=True).values
    tail = srt.flip(-1).cumsum(-1).flip(-1)  # Σ_{j ≥ k} of the sorted masses
    k = torch.arange(s, device=mass.device, dtype=torch.float64)
    lam = (budget - k) / tail.clamp_min(1e-300)  # λ if the k largest are capped at 1
    ok = (lam * srt <= 1 + 1e-12) & (k < budget)  # the smallest such k is the water level
    lam_star = lam.gather(-1, ok.float().argmax(-1, keepdim=True))
    pi = (lam_star * mass).clamp(max=1)
    exact = positive.sum(-1, keepdim=True) <= budget
    return torch.where(exact, positive.double(), pi)


def systematic_sample(
    pi: Tensor, budget: int, generator: torch.Generator | None = None, seeds: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Random-start systematic sampling: unit n is drawn iff [C_{n-1}, C_n) (C the running sum of π) contains
    one of u, u + 1, ...; u ~ U[0, 1) per row. Each unit is drawn with probability exactly π_n ≤ 1, Σ π of
    them in all. Returns sorted indices (N, B) and keep (N, B), B ≤ budget.

    ``seeds`` (N,) int: row i draws its u from its own generator seeded with ``seeds[i]`` (the same draw in
    whatever batch or DDP rank the row lands); otherwise u comes from ``generator`` or the global RNG."""
    n, s = pi.shape
    c = pi.double().cumsum(-1)
    if seeds is not None:
        u = seeded_rand(seeds, 1, dtype=torch.float64)  # (N, 1)
    else:
        u = torch.rand(n, 1, dtype=torch.float64, generator=generator, device="cpu" if generator else pi.device)
    u = u.to(pi.device)
    prev = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], -1)
    drawn = (torch.floor(c - u) - torch.floor(prev - u)) > 0  # (N, S)
    width = max(1, min(budget, int(drawn.sum(-1).max())))
    pos = torch.arange(s, device=pi.device).expand(n, s)
    key = torch.where(drawn, pos, pos + s)  # drawn units first, in order
    index = key.sort(-1).values[:, :width]
    keep = index < s
    return torch.where(keep, index, torch.zeros_like(index)), keep


# ------------------------------------------------------------------------------------------------ the parts
@dataclass
class EDRBatch:
    """What ``EDROccupancy.select_anchors`` leaves in ``draft.extra["edr"]`` for the parts (no gradient)."""

    anchor_weight: Tensor  # (N, A) ω_{n,n+1} / π_n (0 for padding anchors)
    reach: Tensor  # (N, A, K) Π_{s<t} A_{n,s}
    advantage: Tensor  # (N, A, K) V_{n,t+1} - V_{t,t+1}
    mask: Tensor  # (N, A, K) bool: slots whose cost and acceptance matter (the generation's last token excluded)
    table: TargetTable
    draft_sampling: SamplingConfig


def _edr_batch(draft: DraftOutput) -> EDRBatch:
    batch = (draft.extra or {}).get("edr")
    if batch is None:
        raise ValueError(
            "This EDR part needs EDROccupancy to choose the anchors: put EDROccupancy as the objective's "
            "anchor_weight (or use lightning_spec.objectives.EDR)."
        )
    return batch


def _like(x: Tensor, draft: DraftOutput) -> Tensor:
    return x.to(torch.float64 if draft.logits.dtype == torch.float64 else torch.float32)


class EDROccupancy(AnchorWeight):
    """EDR's anchor weight a_n = sg(ω_{n,n+1} / π_n) (Zhao & Cai 2026, arXiv 2610.10411, Table 1 "TD form"),
    and the part that chooses the anchors (Alg. 1, App. C.2):

    1. no gradient: the target's p_t at every position; the drafter from *every* supervised start, in chunks
       of ``chunk_size`` anchors; A and c (Def. 1) of every slot;
    2. both recursions (``chain_dp``, float64): occupancies ω, values V, TD advantages;
    3. π_n = min(1, λ ω_{n,n+1}) with Σ π = ``max_anchors`` per sequence (all starts, π = 1, when they fit),
       drawn by random-start systematic sampling;
    4. the module re-runs the drafter with gradient from the drawn anchors only (pass 2).

    Logs ``edr_expected_rounds`` (mean over generations of 1 + V at the first anchor, the estimate of
    E[#rounds], Thm 1) and ``edr_mal`` (Σ committed tokens / Σ expected rounds, bonus included).

    With another loss it gives occupancy-weighted training, e.g. ``Objective(CE, EDRReach, EDROccupancy)``:
    under greedy decoding (``sampling: {temperature: 0}``) that is CE on exactly the slots greedy decoding of
    the data verifies, up to and including each round's first miss.

    Args:
        sampling: the target distribution p the rollouts are decoded with (temperature, top-k, top-p); must
            match evaluation: lossless acceptance compares exactly the distributions tokens are drawn from.
        draft_sampling: the draft distribution q; None = the same config, as the decoding engine's drafter
            uses. The EDR paper drafts at the target's temperature without top-k/top-p: pass
            ``{temperature: T}`` for that. Temperature 0 = greedy drafting (statistics, no gradient).
        max_anchors: ρ, the anchor budget per sequence (EDR: 512).
        chunk_size: anchors per no-gradient drafter call in pass 1 (memory, not results).
    """

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        draft_sampling: SamplingConfig | None = None,
        max_anchors: int = 512,
        chunk_size: int = 64,
    ) -> None:
        if max_anchors < 1 or chunk_size < 1:
            raise ValueError(f"max_anchors ({max_anchors}) and chunk_size ({chunk_size}) must be >= 1.")
        self.sampling = sampling
        self.draft_sampling = draft_sampling if draft_sampling is not None else sampling
        self.max_anchors = max_anchors
        self.chunk_size = chunk_size

    @torch.no_grad()
    def statistics(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[TargetTable, Chain, ChainValues]:
        """Pass 1 and the recursions: the no-gradient statistics from every supervised start."""
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        n, s = ids.shape
        table = target_table(target, ids, loss_mask, self.sampling)
        start_ok = torch.zeros_like(loss_mask)
        start_ok[:, :-1] = loss_mask[:, 1:]
        accept = cost = None
        for lo in range(0, s - 1, self.chunk_size):
            cols = torch.arange(lo, min(s - 1, lo + self.chunk_size), device=ids.device)
            keep = start_ok[:, cols]
            if not keep.any():
                continue
            anchors = cols.expand(n, -1)
            out = draft_fn(anchors, keep)
            a, c = slot_statistics(out.logits, table, anchors, self.draft_sampling)  # (N, C, K)
            if accept is None:
                accept = a.new_zeros(n, s, a.shape[-1], dtype=torch.float64)
                cost = torch.zeros_like(accept)
            accept[:, cols], cost[:, cols] = a.double(), c.double()
        if accept is None:  # nothing supervised: an empty chain
            k = draft_fn(torch.zeros_like(ids[:, :1]), torch.zeros_like(start_ok[:, :1])).block_size
            accept = torch.zeros(n, s, k, dtype=torch.float64, device=ids.device)
            cost = torch.zeros_like(accept)
        ch = chain(loss_mask, accept.shape[-1])
        return table, ch, chain_dp(accept, cost, ch)

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        table, ch, values = self.statistics(batch, draft_fn, target)
        with torch.no_grad():
            pi = inclusion_probabilities(values.start, self.max_anchors)  # (N, S)
            anchors, keep = systematic_sample(pi, self.max_anchors, seeds=batch.get("anchor_seed"))  # (N, A)
            n, na = anchors.shape
            k = values.reach.shape[-1]
            idx = anchors[..., None].expand(n, na, k)

            def at(x: Tensor) -> Tensor:
                return x.gather(1, idx)

            weight = values.start.gather(1, anchors) / pi.gather(1, anchors).clamp_min(1e-300) * keep
            mask = at(ch.exists & ~ch.terminal) & keep[..., None]
            edr = EDRBatch(weight, at(values.reach), at(values.advantage), mask, table, self.draft_sampling)
            rounds, generations = values.rounds.sum(), values.generations.sum()
            metrics = {
                "edr_expected_rounds": (rounds / generations.clamp_min(1)).float(),
                "edr_mal": (values.tokens.sum() / rounds.clamp_min(1e-12)).float(),
            }
        return anchors, keep, {"edr": edr, "metrics": metrics}

    def __call__(self, draft: DraftOutput) -> Tensor:
        return _like(_edr_batch(draft).anchor_weight, draft)  # (N, A)


class EDRReach(PositionWeight):
    """EDR's block-position weight in the TD form, b_{n,t} = sg(Π_{s<t} A_{n,s}) (Zhao & Cai 2026, Table 1):
    with ``EDROccupancy``, a_n b_{n,t} = sg(ω_{n,t} / π_n). Reads the statistics
    ``EDROccupancy`` computed."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        return _like(_edr_batch(draft).reach, draft)  # (N, A, K)


class EDRCost(Loss):
    """EDR's per-slot surrogate in the TD form, ℓ = c_{n,t} + A_{n,t}·sg(V_{n,t+1} - V_{t,t+1}) (Zhao & Cai
    2026, Table 1 and Theorem 2): c the EOS-aware local cost (Def. 1) and A the Bayes
    acceptance of the realised token, both with gradient, recomputed from the drafter's pass-2 logits with the
    distributions ``EDROccupancy`` was configured with. Its value is not the round count."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        edr = _edr_batch(draft)
        accept, cost = slot_statistics(draft.logits, edr.table, draft.anchors, edr.draft_sampling)
        out = cost + accept * _like(edr.advantage, draft)
        return torch.where(edr.mask, out, torch.zeros_like(out))  # (N, A, K)


class EDR(Objective):
    """EDR, Expected Decoding Rounds (Zhao & Cai 2026, arXiv 2610.10411, §3): the TD surrogate

        L = (1 / #sequences) Σ_{n ∈ I} Σ_t sg(ω_{n,t} / π_n) [c_{n,t} + A_{n,t} sg(V_{n,t+1} - V_{t,t+1})],

    whose gradient is Theorem 2's unbiased gradient of the expected number of decoding rounds, with anchors I
    drawn by ``EDROccupancy``. One YAML block: ``EDRCost`` + ``EDRReach`` + ``EDROccupancy``. The bonus
    position's cost 1 is constant and left out of the surrogate; the round count itself is logged as
    ``train/edr_expected_rounds``.

    Args:
        sampling: the target distribution p (must match evaluation).
        draft_sampling: the draft distribution q (None = ``sampling``); greedy drafting has no gradient, use
            ``Objective(CE, EDRReach, EDROccupancy)`` for that.
        max_anchors: anchor budget per sequence (EDR: 512).
        chunk_size: anchors per no-gradient drafter call in pass 1.
        normalize: Z; ``sequences`` (the paper's 1/M over rollouts).
    """

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        draft_sampling: SamplingConfig | None = None,
        max_anchors: int = 512,
        chunk_size: int = 64,
        normalize: Literal["weight", "anchors", "slots", "sequences"] = "sequences",
    ) -> None:
        occupancy = EDROccupancy(sampling, draft_sampling, max_anchors, chunk_size)
        if occupancy.draft_sampling.greedy:
            raise ValueError(
                "EDR's surrogate has no gradient under greedy drafting (draft_sampling.temperature = 0); use "
                "Objective(loss=CE, position_weight=EDRReach, anchor_weight=EDROccupancy) to weight CE by the "
                "greedy occupancies instead."
            )
        super().__init__(EDRCost(), EDRReach(), occupancy, normalize)
        # init arguments kept under their names: checkpoint.describe rebuilds the objective from them
        self.sampling, self.draft_sampling = sampling, draft_sampling
        self.max_anchors, self.chunk_size = max_anchors, chunk_size

    def slot_mask(self, draft: DraftOutput) -> Tensor:
        return _edr_batch(draft).mask  # out-of-vocabulary tokens still cost: not the drafter's ``valid``

