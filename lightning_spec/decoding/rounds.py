"""The round chain of speculative decoding on a known output: one module for the offline evaluator and EDR.

Condition on an output x = prompt + response (a target rollout). Decoding x speculatively is a Markov chain over
states (n, t): the round anchored at n (the last committed token) is verifying position t (EDR: Zhao & Cai 2026,
arXiv 2610.10411, §3). The draft token of slot t is accepted with the Bayes acceptance of the realised token,

    A_{n,t} = P(accepted | the output at t is x_t) = min(1, q_{n,t}(x_t) / p_t(x_t))

(the engine accepts a draft x ~ q with min(1, p/q); given that the output is x, it came from an accepted draft
with probability min(q, p)/p); the round goes on w.p. A and a new round starts at t w.p. R = 1 - A; the slot after
the last drafted one is the bonus and ends the round. Everything that depends on that chain is here:

- ``chain``: which anchors start rounds and which slots exist, from the loss mask. Every maximal run of
  supervised tokens is one generation (a multi-turn conversation has several); its first round starts from the
  token before the run; its last token ends generation (EOS, or where the data was cut): after it nothing is
  verified and no round starts (EDR Def. 1, "c = 0 at L + 1").
- ``chain_dp``: both recursions (forward occupancies ω, backward values V, EDR Eq. 12) in float64, vectorised
  over batch and positions: each is a linear recurrence of order K + 1 (a banded unit-triangular system),
  solved blockwise (``solve_band``) and chained across blocks by a parallel (Hillis-Steele) scan in
  ⌈log2(S / (K + 1))⌉ batched matrix products: L = 4096, K = 7 takes ~5 ms per sequence on one CPU core, against
  ~0.4 s for the plain loop of the paper's pseudo-code (``chain_dp_reference`` in tests/helpers/rounds.py, the
  parity tests' reference).
- ``target_table``: what the chain needs from the target at every position: p_t(x_t) under the sampling config
  and, for EDR's cost, p_t on the draft vocabulary, its mass outside it and the non-EOS mass.
- ``slot_statistics``: A and the EOS-aware cost c of every slot of a drafter's forward (differentiable).
- ``every_anchor``: the drafter run from every round start of a batch, in chunks of anchors: A (and c) for
  every (n, slot), and how many slots it drafts there (a variable-length drafter submits fewer than K).
- ``tree_accept``: A when every round verifies a best-first tree (``decoding/trees.py``) instead of a chain.
  Its nodes are chosen, not drawn, and verified by sampling the target's token and looking for it among the
  children (``verify.candidate_rule`` with q None), so given the output the round is deterministic: it accepts
  the longest root path the output follows, A = 1 for its L slots and 0 after, under greedy and sampling alike.

Target distribution and the reduced draft vocabulary. p_t is the target's distribution under ``sampling`` over
its *full* vocabulary (top-k/top-p and the normaliser need every logit); the table keeps, per position, p on the
draft vocabulary (EOS columns zeroed), the mass outside it (EOS excluded), the non-EOS mass and p_t(x_t). Then
c = (Σ_{v∉Vd, v≠EOS} p(v) + Σ_{v∈Vd, v≠EOS} [p(v) - q(v)]_+) / (1 - p(EOS)) exactly, since q is 0 outside the
draft vocabulary; and A = 0 where x_t is outside it (the draft can never propose it). Several EOS ids
(``Target.eos_token_ids``) all count as the stop token.

Data that is not a target rollout (e.g. ShareGPT answers): where the warped target gives the data's token
probability 0 (filtered by top-k/top-p, or not the argmax of a greedy target), A = 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding.trees import TreeConfig, best_first_tree, tree_probs
from lightning_spec.drafts import Anchors, DraftOutput, DraftVocab
from lightning_spec.errors import UserError
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


# --------------------------------------------------------------------------------- target and draft statistics
@dataclass
class TargetTable:
    """Per position t (row t; row 0 unused) what the acceptance (and EDR's cost) need from p_t, float32."""

    p_token: Tensor  # (N, S) p_t(x_t), the realised token
    token_draft: Tensor  # (N, S) x_t as a draft id (0 when outside)
    token_inside: Tensor  # (N, S) bool: x_t is in the draft vocabulary
    p_draft: Tensor | None = None  # (N, S, Vd) p_t on the draft vocabulary, EOS columns zeroed (costs only)
    p_outside: Tensor | None = None  # (N, S) Σ p_t(v) over v outside the draft vocabulary, EOS excluded
    p_noneos: Tensor | None = None  # (N, S) 1 - p_t(EOS), summed directly (accurate when small)


@torch.no_grad()
def target_table(
    last_hidden: Tensor,
    logits: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    loss_mask: Tensor,
    sampling: SamplingConfig,
    vocab: DraftVocab,
    eos_ids: list[int],
    costs: bool = True,
    max_elems: int = 1 << 24,
) -> TargetTable:
    """p_t under ``sampling`` over the full target vocabulary at the supervised positions t ≥ 1 (the only ones a
    slot verifies), from the target's final hidden states (N, S, H) at t - 1 and its head ``logits`` (..., H) ->
    (..., V). ``costs`` also keeps what EDR's cost needs (p on the draft vocabulary: N x S x Vd floats). At most
    ``max_elems`` logits exist at a time."""
    n, s = input_ids.shape
    dev = last_hidden.device
    ids = input_ids.to(dev)
    sel = loss_mask.to(dev).bool().clone()
    sel[:, 0] = False
    rows, cols = sel.nonzero(as_tuple=True)  # (M,) positions t whose p_t is needed
    token_draft, token_inside = vocab.to_draft(ids)
    table = TargetTable(p_token=torch.zeros(n, s, device=dev), token_draft=token_draft, token_inside=token_inside)
    v = vocab.vocab_size
    if costs:
        vocab_ids = vocab.ids.to(dev)
        is_eos = torch.zeros(v, dtype=torch.bool, device=dev)
        eos = [e for e in eos_ids if 0 <= e < v]
        if eos:
            is_eos[torch.tensor(eos, device=dev)] = True
        keep_cols = (~is_eos[vocab_ids]).float()  # (Vd,)
        outside_cols = (~vocab.t2d.to(dev) & ~is_eos).float()  # (V,)
        table.p_draft = torch.zeros(n, s, vocab_ids.numel(), device=dev)
        table.p_outside = torch.zeros(n, s, device=dev)
        table.p_noneos = torch.ones(n, s, device=dev)
    chunk = max(1, max_elems // v)
    for lo in range(0, rows.numel(), chunk):
        r, t = rows[lo : lo + chunk], cols[lo : lo + chunk]
        p = sampling.logprobs(logits(last_hidden[r, t - 1])).exp()  # (M', V): p_t from the hidden at t - 1
        table.p_token[r, t] = p.gather(-1, ids[r, t, None])[..., 0]
        if costs:
            table.p_draft[r, t] = p.index_select(-1, vocab_ids) * keep_cols
            table.p_outside[r, t] = p @ outside_cols
            table.p_noneos[r, t] = p @ (~is_eos).float()
    return table


def _warped_logprobs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """The draft's distribution as the engine draws from it (``SamplingConfig``); float64 stays float64."""
    if sampling.greedy or sampling.top_k or sampling.top_p < 1:
        return sampling.logprobs(logits)
    x = logits if logits.dtype == torch.float64 else logits.float()
    return (x / sampling.temperature).log_softmax(-1)


def bayes_acceptance(q_x: Tensor, p_x: Tensor) -> Tensor:
    """A = P(draft slot accepted | the output token is x) = min(1, q(x) / p(x)) (EDR §3.2), 0 where p(x) = 0.

    The engine accepts a draft x ~ q with min(1, p(x)/q(x)) (``verify.acceptance_probability``); given that the
    output is x (probability p(x)), it came from an accepted draft with probability min(q(x), p(x)) / p(x)."""
    return torch.where(p_x > 0, (q_x / p_x.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q_x))


def slot_statistics(
    logits: Tensor, table: TargetTable, anchors: Tensor, draft_sampling: SamplingConfig, costs: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Acceptance A and EOS-aware cost c (EDR Def. 1) of every slot: logits (N, A, K, Vd) of the drafter run from
    ``anchors`` (N, A) -> A, c (N, A, K), differentiable in the logits (not under greedy drafting). ``costs``
    False returns c as None (the table then need not hold the cost columns)."""
    n, na, k, vd = logits.shape
    s = table.p_token.shape[1]
    t = (anchors[..., None] + 1 + torch.arange(k, device=anchors.device)).clamp(max=s - 1)  # (N, A, K)
    flat = t.reshape(n, -1)

    def at(x: Tensor) -> Tensor:
        return x.gather(1, flat).view(n, na, k)

    q = _warped_logprobs(logits, draft_sampling).exp()  # (N, A, K, Vd)
    q_tok = q.gather(-1, at(table.token_draft)[..., None])[..., 0] * at(table.token_inside)
    accept = bayes_acceptance(q_tok, at(table.p_token))
    if not costs:
        return accept, None
    p = table.p_draft.gather(1, flat[..., None].expand(-1, -1, vd)).view(n, na, k, vd)
    cost = (at(table.p_outside) + (p - q).clamp_min(0).sum(-1)) / at(table.p_noneos).clamp_min(_NONEOS_EPS)
    return accept, cost


# ----------------------------------------------------------------------------------- the drafter from every start
@dataclass
class EveryAnchor:
    """A drafter's slot statistics from every round start of a batch (zero where no round can start)."""

    accept: Tensor  # (N, S, K) float64 A_{n, n+h}: 0 for slots the drafter does not submit from n
    cost: Tensor | None  # (N, S, K) float64 EDR's c_{n, n+h} (None when costs were not asked for)
    drafted: Tensor  # (N, S, K) bool: slot h is submitted from anchor n (variable-length drafters cut blocks)


@torch.no_grad()
def every_anchor(
    draft_fn: Callable[[Anchors], DraftOutput],
    loss_mask: Tensor,
    table: TargetTable,
    block_size: int,
    draft_sampling: SamplingConfig,
    chunk: int,
    costs: bool = True,
    tree: TreeConfig | None = None,
) -> EveryAnchor:
    """Run ``draft_fn`` (the drafter's training forward) from every position n whose next token is supervised,
    ``chunk`` anchors (per row) at a time, and collect A, c and the submitted slots per (n, slot). With ``tree``
    every round verifies a best-first tree (``tree_accept``; no costs)."""
    lm = loss_mask.bool()
    n, s = lm.shape
    k = block_size
    start_ok = torch.zeros_like(lm)
    start_ok[:, :-1] = lm[:, 1:]
    # row i's j-th round start is starts[i, j]; padding sorts last
    pos = torch.arange(s, device=lm.device).expand(n, s)
    starts = torch.where(start_ok, pos, pos + s).sort(-1).values  # (N, S)
    width = int(start_ok.sum(-1).max()) if n else 0
    accept = torch.zeros(n, s, k, dtype=torch.float64, device=lm.device)
    cost = torch.zeros_like(accept) if costs else None
    drafted = torch.zeros(n, s, k, dtype=torch.bool, device=lm.device)
    slot = torch.arange(1, k + 1, device=lm.device)
    rows = torch.arange(n, device=lm.device)[:, None]
    for lo in range(0, width, max(1, chunk)):
        positions = starts[:, lo : lo + chunk]  # (N, C)
        keep = positions < s
        anchors = Anchors(torch.where(keep, positions, torch.zeros_like(positions)), keep)
        out = draft_fn(anchors)
        if tuple(out.labels.shape[1:]) != (positions.shape[1], k):
            raise UserError(
                f"the drafter's forward gave slots of shape {tuple(out.labels.shape[1:])} for {positions.shape[1]} "
                f"anchors, not one chain of block_size={k} per anchor, which EDR and the offline evaluator read (a "
                "SpecBlockDrafter with blocks > 1 trains one row per block); train it with an objective without EDR."
            )
        if tree is not None:
            a, c = tree_accept(out, draft_sampling, tree).to(accept.device), None  # (N, C, K)
        else:
            a, c = slot_statistics(out.logits, table, anchors.positions, draft_sampling, costs)  # (N, C, K)
        submitted = torch.ones_like(a, dtype=torch.bool)
        if out.drafted is not None and tree is None:  # a chain's slots after the drafted prefix are never proposed
            # (a tree is grown from every slot's distribution: a length head or prefix scheduler cuts chains only)
            submitted = slot <= out.drafted[..., None]
        r, p = rows.expand_as(positions)[keep], anchors.positions[keep]
        accept[r, p] = (a * submitted)[keep].double()
        drafted[r, p] = submitted[keep]
        if costs:
            cost[r, p] = c[keep].double()
    return EveryAnchor(accept, cost, drafted)


@torch.no_grad()
def tree_accept(out: DraftOutput, sampling: SamplingConfig, tree: TreeConfig) -> Tensor:
    """A (N, C, K) float64 for rounds that verify the best-first tree over each anchor's slot distributions: 1 for
    the first L slots, L = the depth of the longest root path whose tokens are the output's (the gold labels), 0
    after. Exact under greedy and sampling (module docstring)."""
    logits = out.logits  # (N, C, K, Vd)
    q = tree_probs(logits.float(), sampling)  # (N, C, K, Vd) what the engine's builder chose from
    labels = torch.where(out.valid, out.labels, -1).tolist()  # (N, C, K); -1: no token the tree can hold
    accept = torch.zeros(logits.shape[:3], dtype=torch.float64)
    for i, row in enumerate(labels):
        for j, gold in enumerate(row):
            if gold[0] < 0:
                continue
            tokens, parents = best_first_tree(q[i, j], tree)
            children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node, the best-first sibling
            for node, (tok, parent) in enumerate(zip(tokens.tolist(), parents.tolist()), start=1):
                children.setdefault((parent, tok), node)
            node = depth = 0
            while depth < len(gold) and (node, gold[depth]) in children:
                node = children[(node, gold[depth])]
                depth += 1
            accept[i, j, :depth] = 1.0
    return accept
