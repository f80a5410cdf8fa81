"""EDR (Zhao & Cai 2026, arXiv 2610.10411): Theorem 1 (the EOS-aware cost) over every rollout of a toy target,
Theorem 2 (the TD gradient) against autograd through an exact differentiable recursion, and the anchor sampler
(exact under the budget, unbiased below it). The recursions it rests on: tests/test_rounds.py."""

import itertools
import math

import pytest
import torch
from helpers.rounds import generations

from lightning_spec.decoding.rounds import chain, chain_dp, slot_statistics, target_table
from lightning_spec.drafters import Anchors, DraftOutput, DraftVocab
from lightning_spec.objectives import CE, EDR, EDROccupancy, EDRReach, Objective, StepContext, TargetInfo
from lightning_spec.objectives.edr import inclusion_probabilities, systematic_sample
from lightning_spec.sampling import SamplingConfig

# ------------------------------------------------------------------------------ toy target, drafter, rollouts

EOS = 2


def toy_target(s: int, log_p: torch.Tensor, k: int) -> TargetInfo:
    """p_t = softmax(log_p[t - 1]) whatever the context: hidden states are one-hot positions; a drafter of K = k
    slots over the full vocabulary."""
    n = 1
    hidden = torch.eye(s, dtype=torch.float64)[None].expand(n, s, s)
    vocab = DraftVocab()
    vocab.build(log_p.shape[-1])
    return TargetInfo(last_hidden=hidden, logits=lambda h: h.to(log_p.dtype) @ log_p, vocab=vocab, block_size=k,
                      eos_ids=[EOS])


def table_of(target: TargetInfo, ids, mask, sampling):
    return target_table(target.last_hidden, target.logits, ids, mask, sampling, target.vocab, target.eos_ids)


def toy_draft_fn(q_logits: torch.Tensor, ids: torch.Tensor):
    """A drafter whose slot-h logits from anchor n are the free parameters q_logits[n, h] (S, K, V)."""

    def draft_fn(chosen: Anchors):
        anchors, keep = chosen.positions, chosen.keep
        n, a = anchors.shape
        k = q_logits.shape[1]
        logits = q_logits[anchors]  # (N, A, K, V)
        pos = (anchors[..., None] + 1 + torch.arange(k)).clamp(max=ids.shape[1] - 1)
        labels = ids.gather(1, pos.reshape(n, -1)).view(n, a, k)
        return DraftOutput(logits=logits, labels=labels, valid=keep[..., None].expand(n, a, k), anchors=anchors)

    return draft_fn


@pytest.mark.parametrize("vocab,draft_size", [(3, None), (4, 3)], ids=["full", "reduced"])
def test_theorem1_eos_aware_cost_is_unbiased_over_all_rollouts(vocab, draft_size):
    """E_X[1 + Σ ω c] = E_X[τ(X)] with c of Def. 1, over every rollout of a toy target (EOS forced at the last
    position). A cost that ignores EOS (plain TV) is visibly biased: the negative control. ``reduced``: the draft
    vocabulary lacks token 3, which the target emits; the drafter can never propose it, so its mass p_outside is
    part of every slot's cost (a cost that drops that term is biased too, checked below)."""
    prompt, gen_max, k = 2, 5, 2
    s = prompt + gen_max
    g = torch.Generator().manual_seed(0)
    log_p = torch.randn(s, vocab, generator=g, dtype=torch.float64)
    log_p[:, EOS] -= 1.0
    log_p[s - 2] = torch.full((vocab,), -1e9, dtype=torch.float64)
    log_p[s - 2, EOS] = 0.0  # the last position is EOS for sure
    target = toy_target(s, log_p, k)
    if draft_size is not None:  # the draft vocabulary: the most frequent tokens, here all but the last
        target.vocab = DraftVocab(draft_size)
        target.vocab.build(vocab)
        target.vocab.set_from_counts(torch.arange(vocab, 0, -1, dtype=torch.float))
        assert not bool(target.vocab.t2d[vocab - 1]) and bool(target.vocab.t2d[EOS])
    q_logits = torch.randn(s, k, draft_size or vocab, generator=g, dtype=torch.float64)
    sampling = SamplingConfig(temperature=1.0)
    p = log_p.softmax(-1)
    rollouts, probs = [], []
    others = [t for t in range(vocab) if t != EOS]
    for length in range(1, gen_max + 1):
        for body in itertools.product(others, repeat=length - 1):
            tokens = list(body) + [EOS]
            pr = math.prod(float(p[prompt + i - 1, x]) for i, x in enumerate(tokens))
            if pr > 0:
                rollouts.append([0] * prompt + tokens + [0] * (gen_max - length))
                probs.append(pr)
    assert sum(probs) == pytest.approx(1.0, rel=1e-9)
    ids = torch.tensor(rollouts)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rollouts):
        mask[i, prompt : prompt + r[prompt:].index(EOS) + 1] = True
    n = ids.shape[0]
    target.last_hidden = target.last_hidden.expand(n, s, s)
    table = table_of(target, ids, mask, sampling)
    anchors = torch.arange(s).expand(n, s)
    accept, cost = slot_statistics(q_logits[anchors], table, anchors, sampling)
    ch = chain(mask, k)
    w = torch.tensor(probs, dtype=torch.float64)
    surrogate = float((w * chain_dp(accept, cost, ch).rounds).sum())
    true_rounds = float((w * chain_dp(accept, 1 - accept, ch).rounds).sum())
    assert surrogate == pytest.approx(true_rounds, rel=1e-6)
    q = q_logits[anchors].softmax(-1)
    pt = torch.stack([p[(anchors + 1 + h).clamp(max=s - 1) - 1] for h in range(k)], 2)  # (N, S, K, V)
    q_full = torch.zeros_like(pt)
    q_full[..., target.vocab.ids] = q  # q over the target vocabulary: 0 outside the draft vocabulary
    plain_tv = (pt - q_full).clamp_min(0).sum(-1)
    naive = float((w * chain_dp(accept, plain_tv, ch).rounds).sum())
    assert abs(naive - true_rounds) > 1e-2
    if draft_size is not None:  # the same cost without the mass outside the draft vocabulary: biased
        table.p_outside = torch.zeros_like(table.p_outside)
        _, dropped = slot_statistics(q_logits[anchors], table, anchors, sampling)
        assert abs(float((w * chain_dp(accept, dropped, ch).rounds).sum()) - true_rounds) > 1e-2


# ----------------------------------------------------------------------------- (b) Theorem 2's gradient


def exact_rounds(accept, cost, mask, k):
    """1 + V at every first anchor, summed: the plain backward recursion (Eq. 12), differentiable."""
    s = len(mask)
    total = accept.new_zeros(())
    values = [accept.new_zeros(())] * (s + k + 2)
    for first, end in generations(mask):
        for n in reversed(range(first, end)):
            b = n + k + 1
            cont = 1 + values[b] if b < end else accept.new_zeros(())
            for h in reversed(range(k)):
                t = n + 1 + h
                if t >= end:  # the last token or beyond: nothing more to pay
                    cont = accept.new_zeros(())
                    continue
                a = accept[n, h]
                cont = cost[n, h] + a * cont + (1 - a) * values[t]
            values[n] = cont
        total = total + 1 + values[first]
    return total


def rollout_case(seed, s=14, k=3, vocab=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, s), generator=g)
    ids[0, 7] = EOS  # first answer ends with EOS, the second is truncated
    mask = torch.zeros(1, s, dtype=torch.bool)
    mask[0, 3:8] = True
    mask[0, 9:] = True
    log_p = torch.randn(s, vocab, generator=g, dtype=torch.float64) * 1.5
    q_logits = (torch.randn(s, k, vocab, generator=g, dtype=torch.float64) * 1.5).requires_grad_(True)
    return ids, mask, log_p, q_logits


@pytest.mark.parametrize("draft_size", [None, 4], ids=["full", "reduced"])
@pytest.mark.parametrize(
    "sampling,draft_sampling",
    [
        (SamplingConfig(temperature=1.0), None),
        (SamplingConfig(temperature=0.7, top_k=4), SamplingConfig(temperature=0.7)),  # the EDR paper's set-up
    ],
)
def test_td_surrogate_gradient_is_the_gradient_of_expected_rounds(sampling, draft_sampling, draft_size):
    """``reduced``: a draft vocabulary of 4 of the 6 tokens (the rollout emits the other two), so the costs carry
    the target's mass outside it."""
    ids, mask, log_p, q_logits = rollout_case(0)
    s, k = ids.shape[1], q_logits.shape[1]
    target = toy_target(s, log_p, k)
    if draft_size is not None:
        target.vocab = DraftVocab(draft_size)
        target.vocab.build(log_p.shape[-1])
        target.vocab.set_from_counts(torch.tensor([5.0, 4, 6, 3, 2, 1]))  # EOS (2) kept; tokens 4, 5 outside
        assert bool((~target.vocab.t2d[ids[0][mask[0]]]).any())  # the rollout holds tokens it cannot draft
        q_logits = q_logits[..., :draft_size].detach().requires_grad_(True)
    draft_fn = toy_draft_fn(q_logits, ids)
    objective = EDR(sampling=sampling, draft_sampling=draft_sampling, max_anchors=64, chunk_size=5)
    chosen, extra = objective.select_anchors({"input_ids": ids, "loss_mask": mask}, draft_fn, target)
    draft = draft_fn(chosen)
    terms = objective(draft, StepContext(extra=extra))
    (grad_td,) = torch.autograd.grad(terms.num, q_logits)

    # exact expected rounds through a differentiable recursion, A and c from the same distributions
    table = table_of(target, ids, mask, sampling)
    every = torch.arange(s)[None]
    accept, cost = slot_statistics(q_logits[every], table, every, draft_sampling or sampling)
    rounds = exact_rounds(accept[0], cost[0], mask[0].tolist(), k)
    (grad_exact,) = torch.autograd.grad(rounds, q_logits)
    assert grad_exact.abs().max() > 1e-3
    torch.testing.assert_close(grad_td, grad_exact, rtol=1e-5, atol=1e-7)
    # the logged metric is the round count itself (per generation), not the surrogate's value
    assert float(terms.metrics["edr_expected_rounds"]) == pytest.approx(float(rounds.detach()) / 2, rel=1e-5)
    assert float(terms.den) == 1  # normalize="sequences"


def test_greedy_drafting_statistics_and_no_gradient():
    """T = 0 drafting: A = 1[argmax q = x_t], c = 1 - p(y)/(1 - p(EOS)) (1 if y is EOS); EDR refuses to
    train on it, while EDROccupancy still weights CE by the greedy occupancies."""
    ids, mask, log_p, q_logits = rollout_case(1)
    s, k = ids.shape[1], q_logits.shape[1]
    target = toy_target(s, log_p, k)
    table = table_of(target, ids, mask, SamplingConfig(temperature=1.0))
    every = torch.arange(s)[None]
    accept, cost = slot_statistics(q_logits[every], table, every, SamplingConfig(temperature=0.0))
    p = log_p.softmax(-1)
    y = q_logits.argmax(-1)  # (S, K)
    for n in range(s - k - 1):
        for h in range(k):
            t = n + 1 + h
            if not mask[0, t]:  # the table holds supervised positions only
                continue
            assert float(accept[0, n, h]) == float(y[n, h] == ids[0, t])
            want = 1.0 if y[n, h] == EOS else 1 - float(p[t - 1, y[n, h]]) / (1 - float(p[t - 1, EOS]))
            assert float(cost[0, n, h]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not accept.requires_grad and not cost.requires_grad
    with pytest.raises(ValueError, match="greedy drafting"):
        EDR(sampling=SamplingConfig(temperature=0.0))
    weighted = Objective(CE(), EDRReach(), EDROccupancy(SamplingConfig(temperature=0.0)))
    draft_fn = toy_draft_fn(q_logits, ids)
    chosen, extra = weighted.select_anchors({"input_ids": ids, "loss_mask": mask}, draft_fn, target)
    draft = draft_fn(chosen)
    terms = weighted(draft, StepContext(extra=extra))
    assert torch.isfinite(terms.num) and terms.num.requires_grad
    occ = extra["edr"].anchor_weight[..., None] * extra["edr"].reach
    assert set(occ.unique().tolist()) <= {0.0, 1.0}  # greedy: every slot is visited or not


# -------------------------------------------------------------------------------------- (c) anchor sampling


def test_inclusion_probabilities_by_hand():
    pi = inclusion_probabilities(torch.tensor([[4.0, 1, 1, 1, 1], [10.0, 1, 1, 1, 0]]), budget=2)
    torch.testing.assert_close(pi[0], torch.tensor([1.0, 0.25, 0.25, 0.25, 0.25], dtype=torch.float64))
    torch.testing.assert_close(pi[1], torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))
    # at most `budget` positive masses: all of them, exactly
    pi = inclusion_probabilities(torch.tensor([[0.5, 0.0, 1e-9, 3.0]]), budget=3)
    torch.testing.assert_close(pi[0], torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64))


def test_systematic_sampling_hits_each_unit_with_probability_pi():
    g = torch.Generator().manual_seed(0)
    mass = torch.rand(2, 12, generator=g, dtype=torch.float64) ** 3
    mass[:, 3] = 0
    budget = 4
    pi = inclusion_probabilities(mass, budget)
    assert torch.allclose(pi.sum(-1), torch.full((2,), float(budget), dtype=torch.float64))
    draws = 4000
    counts = torch.zeros_like(pi)
    for _ in range(draws):
        index, keep = systematic_sample(pi, budget, generator=g)
        assert keep.sum(-1).tolist() == [budget, budget]
        counts.scatter_add_(1, index, keep.double())
    freq = counts / draws
    se = (pi * (1 - pi) / draws).sqrt()
    assert ((freq - pi).abs() <= 5 * se + 1e-9).all()
    assert (counts[:, 3] == 0).all()


def edr_terms(objective, ids, mask, target, q_logits):
    draft_fn = toy_draft_fn(q_logits, ids)
    chosen, extra = objective.select_anchors({"input_ids": ids, "loss_mask": mask}, draft_fn, target)
    anchors, keep = chosen.positions, chosen.keep
    draft = draft_fn(chosen)
    terms = objective(draft, StepContext(extra=extra))
    (grad,) = torch.autograd.grad(terms.num, q_logits)
    return anchors, keep, terms, grad


def extra_weight(objective, ids, mask, target, q_logits):
    chosen, extra = objective.select_anchors(
        {"input_ids": ids, "loss_mask": mask}, toy_draft_fn(q_logits, ids), target
    )
    return extra["edr"].anchor_weight[chosen.keep]


def test_budget_at_least_the_starts_is_exact_and_below_it_unbiased():
    ids, mask, log_p, q_logits = rollout_case(2, s=16)
    target = toy_target(ids.shape[1], log_p, q_logits.shape[1])
    starts = int(mask[0, 1:].sum())
    exact_anchors, keep, exact, exact_grad = edr_terms(EDR(max_anchors=starts), ids, mask, target, q_logits)
    draft_fn = toy_draft_fn(q_logits, ids)
    _, _, values = EDROccupancy().statistics({"input_ids": ids, "loss_mask": mask}, draft_fn, target)
    reachable = (values.start[0] > 0).nonzero()[:, 0].tolist()  # starts a round can reach (A = 1 cuts some)
    assert exact_anchors[keep].tolist() == reachable and len(reachable) > 3  # every one of them, π = 1
    torch.testing.assert_close(extra_weight(EDR(max_anchors=starts), ids, mask, target, q_logits),
                               values.start[0, reachable])
    _, _, again, again_grad = edr_terms(EDR(max_anchors=10 * starts), ids, mask, target, q_logits)
    assert float(again.num.detach()) == float(exact.num.detach()) and torch.equal(again_grad, exact_grad)

    torch.manual_seed(0)
    small = EDR(max_anchors=3)
    draws = 600
    nums, grads = [], []
    for _ in range(draws):
        anchors, keep, terms, grad = edr_terms(small, ids, mask, target, q_logits)
        assert int(keep.sum()) == 3
        nums.append(float(terms.num.detach()))
        grads.append(grad)
    nums_t = torch.tensor(nums, dtype=torch.float64)
    assert abs(float(nums_t.mean()) - float(exact.num.detach())) <= 4 * float(nums_t.std()) / math.sqrt(draws)
    g = torch.stack(grads)  # (draws, S, K, V)
    err = (g.mean(0) - exact_grad).norm()
    noise = (g.var(0).sum() / draws).sqrt()
    assert err <= 3 * noise
    assert float(nums_t.std()) > 0  # it really was sampling


def test_seeded_systematic_sampling_is_per_row():
    g = torch.Generator().manual_seed(1)
    pi = inclusion_probabilities(torch.rand(5, 30, generator=g, dtype=torch.float64), 6)
    seeds = torch.tensor([11, 12, 13, 14, 15])
    index, keep = systematic_sample(pi, 6, seeds=seeds)
    for rows in ([3, 0], [4], [2, 1, 0]):  # a row draws the same anchors next to any neighbours
        sub_index, sub_keep = systematic_sample(pi[rows], 6, seeds=seeds[rows])
        for j, row in enumerate(rows):
            assert sub_index[j][sub_keep[j]].tolist() == index[row][keep[row]].tolist()
    other, other_keep = systematic_sample(pi, 6, seeds=seeds + 100)
    assert any(other[r][other_keep[r]].tolist() != index[r][keep[r]].tolist() for r in range(5))
