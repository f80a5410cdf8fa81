"""The catalogue of objectives beyond CE/KL/TV (reverse KL, JSD, LK, Bernoulli KL, E2E-TV, WTV, EAL, AUF,
valid prefix, D-PACE, mixtures): every ℓ, b and a against hand numbers or a float64 brute force written here,
the normalisers and mixtures. Their gradients: test_gradients.py; their YAMLs, end to end: test_yamls.py."""

import math

import pytest
import torch

from lightning_spec.drafters import DraftOutput
from lightning_spec.objectives import (
    CE,
    DPACE,
    E2E,
    EAL,
    JSD,
    KL,
    LK,
    TV,
    WTV,
    AUFSupport,
    BernoulliKL,
    E2EWeight,
    EALWeight,
    ExpDecay,
    Geometric,
    LKAlpha,
    Mixture,
    NegProb,
    Objective,
    PositionProduct,
    ReverseKL,
    StepContext,
    TVMinusOne,
    Uniform,
    ValidPrefix,
    WTVWeight,
)
from lightning_spec.sampling import SamplingConfig

N, A, K, VD = 2, 2, 3, 5
# anchor (0, 1) has a hole at slot 2 (ends every chain there); anchor (1, 1) has no valid slot
VALID = [[[True, True, True], [True, False, True]], [[True, True, False], [False, False, False]]]


def make_draft(seed: int = 0, dtype=torch.float32, scale: float = 1.5) -> tuple[DraftOutput, StepContext]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor(VALID)
    labels = torch.randint(0, VD, (N, A, K), generator=g).masked_fill(~valid, 0)
    draft = DraftOutput(
        logits=(torch.randn(N, A, K, VD, generator=g, dtype=dtype) * scale).requires_grad_(True),
        labels=labels,
        valid=valid,
        anchors=torch.tensor([[3, 7], [1, 5]]),
    )
    return draft, StepContext(target_logits=torch.randn(N, A, K, VD, generator=g, dtype=dtype) * scale)


def slots():
    return [(n, a, t) for n in range(N) for a in range(A) for t in range(K)]


# ----------------------------------------------------------------------------------- float64 brute force


def softmax64(row, temperature=1.0, top_k=0):
    xs = [float(x) / temperature for x in row]
    keep = set(sorted(range(len(xs)), key=lambda i: -xs[i])[:top_k]) if top_k else set(range(len(xs)))
    e = [math.exp(xs[i]) if i in keep else 0.0 for i in range(len(xs))]
    return [x / sum(e) for x in e]


def pq(d, ctx, n, a, t, temperature=1.0, top_k=0):
    p = softmax64(ctx.target_logits[n, a, t].tolist(), temperature, top_k)
    q = softmax64(d.logits[n, a, t].tolist(), temperature)
    return p, q


def bf_alpha(d, ctx, n, a, t, **kw):
    p, q = pq(d, ctx, n, a, t, **kw)
    return sum(min(x, y) for x, y in zip(p, q))


def bf_kl(p, q):
    return sum(x * math.log(x / y) for x, y in zip(p, q) if x > 0)


def bf_rkl(d, ctx, n, a, t, top_k=0, floor=-20.0):
    p, q = pq(d, ctx, n, a, t, top_k=top_k)
    return sum(y * (math.log(y) - max(math.log(x) if x > 0 else -math.inf, floor)) for x, y in zip(p, q))


def bf_jsd(d, ctx, n, a, t, beta=0.5):
    p, q = pq(d, ctx, n, a, t)
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * bf_kl(p, m) + (1 - beta) * bf_kl(q, m)


def bf_lk(d, ctx, n, a, t, kappa=1.0, scale=1.0):
    p, q = pq(d, ctx, n, a, t)
    alpha = sum(min(x, y) for x, y in zip(p, q))
    lam = scale * math.exp(-kappa * alpha)
    return lam * bf_kl(p, q) + (1 - lam) * (1 - alpha)


def bf_bernoulli(d, ctx, n, a, t, floor=-10.0, clip=10.0):
    p, q = pq(d, ctx, n, a, t)
    y = int(d.labels[n, a, t])

    def logs(x):
        lx = max(math.log(x), floor)
        l1x = max(math.log(1 - math.exp(lx)), floor) if math.exp(lx) < 1 else floor
        return lx, l1x

    lp, l1p = logs(p[y])
    lq, l1q = logs(q[y])
    loss = math.exp(lp) * (lp - lq) + math.exp(l1p) * (l1p - l1q)
    return max(-clip, min(clip, loss))


def per_slot(fn, d, ctx, **kw) -> torch.Tensor:
    out = torch.zeros(N, A, K, dtype=torch.float64)
    for n, a, t in slots():
        out[n, a, t] = fn(d, ctx, n, a, t, **kw)
    return out


def chain_products(d, factor) -> torch.Tensor:
    """Π_{j<t} factor(n, a, j) over valid slots; an invalid slot ends the chain."""
    out = torch.zeros(N, A, K, dtype=torch.float64)
    for n in range(N):
        for a in range(A):
            prod = 1.0
            for t in range(K):
                out[n, a, t] = prod
                prod *= factor(n, a, t) if VALID[n][a][t] else 0.0
    return out


def close(got, want, tol=1e-5):
    torch.testing.assert_close(got.detach().double(), want, rtol=tol, atol=tol * 1e-1)


# ------------------------------------------------------------------------------------------------ losses


def test_reverse_kl():
    d, ctx = make_draft()
    close(ReverseKL()(d, ctx), per_slot(bf_rkl, d, ctx))
    # a top-2 target puts p = 0 where q has mass: finite through the log-floor
    got = ReverseKL(SamplingConfig(temperature=1.0, top_k=2))(d, ctx)
    close(got, per_slot(bf_rkl, d, ctx, top_k=2))
    got.sum().backward()
    assert torch.isfinite(d.logits.grad).all()


def test_jsd():
    d, ctx = make_draft()
    close(JSD()(d, ctx), per_slot(bf_jsd, d, ctx))
    close(JSD(beta=0.2)(d, ctx), per_slot(bf_jsd, d, ctx, beta=0.2))
    assert (JSD()(d, ctx) <= math.log(2) + 1e-6).all()
    with pytest.raises(ValueError, match="beta"):
        JSD(beta=1.0)


def test_lk_lambda():
    d, ctx = make_draft()
    close(LK()(d, ctx), per_slot(bf_lk, d, ctx))
    close(LK(kappa=3.0, scale=0.5)(d, ctx), per_slot(bf_lk, d, ctx, kappa=3.0, scale=0.5))


def test_lk_alpha_and_tv_minus_one():
    d, ctx = make_draft()
    close(LKAlpha()(d, ctx), per_slot(lambda *s: -math.log(bf_alpha(*s)), d, ctx))
    close(TVMinusOne()(d, ctx), per_slot(lambda *s: -bf_alpha(*s), d, ctx))
    close(TVMinusOne()(d, ctx), TV()(d, ctx).double() - 1)
    close(TVMinusOne(SamplingConfig(temperature=0.5))(d, ctx),
          per_slot(lambda *s: -bf_alpha(*s, temperature=0.5), d, ctx))


def test_bernoulli_kl_by_hand_and_brute_force():
    # p = (0.5, 0.5), q = (0.25, 0.75), gold 0: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.1438410362
    d = DraftOutput(
        logits=torch.tensor([[[[0.0, math.log(3.0)]]]]),
        labels=torch.zeros(1, 1, 1, dtype=torch.long),
        valid=torch.ones(1, 1, 1, dtype=torch.bool),
        anchors=torch.zeros(1, 1, dtype=torch.long),
    )
    assert float(BernoulliKL()(d, StepContext(target_logits=torch.zeros(1, 1, 1, 2)))) == pytest.approx(
        0.1438410362, rel=1e-6
    )
    d, ctx = make_draft()
    close(BernoulliKL()(d, ctx), per_slot(bf_bernoulli, d, ctx))
    # extreme logits: the log-probability clamps (≥ -10) and the ±10 clip keep it finite, gradient too
    x, x_ctx = make_draft(scale=40.0)
    got = BernoulliKL()(x, x_ctx)
    close(got, per_slot(bf_bernoulli, x, x_ctx), tol=1e-4)
    assert got.abs().max() <= 10
    got.sum().backward()
    assert torch.isfinite(x.logits.grad).all()


def test_neg_prob_gold_and_target_argmax():
    d, ctx = make_draft()
    q = d.logits.detach().double().softmax(-1)
    close(NegProb("gold")(d, ctx), -q.gather(-1, d.labels[..., None])[..., 0])
    close(NegProb()(d, ctx), -q.gather(-1, ctx.target_logits.argmax(-1)[..., None])[..., 0])
    assert NegProb().needs_target and not NegProb("gold").needs_target


# ----------------------------------------------------------------------------------------------- weights


def test_geometric_slot_convention():
    w = Geometric(0.8)(*make_draft())
    torch.testing.assert_close(w, torch.tensor([1.0, 0.8, 0.64]).expand(N, A, K))  # first prediction: 0.8^0
    with pytest.raises(ValueError, match="rho"):
        Geometric(0.0)


def one_hot_draft(draft_argmax, gold, target_argmax, valid, probs=None):
    """A (1, B, K) draft whose argmaxes are given, and its target; ``probs`` sets q(gold) exactly (two-token
    vocabulary)."""
    b, k = len(draft_argmax), len(draft_argmax[0])
    v = 2 if probs is not None else 6
    if probs is not None:
        p = torch.tensor(probs, dtype=torch.float64)
        logits = torch.stack([p.log(), (1 - p).log()], -1)[None]  # q(0) = probs
    else:
        logits = torch.full((1, b, k, v), -3.0).scatter(-1, torch.tensor(draft_argmax)[None, ..., None], 3.0)
    draft = DraftOutput(
        logits=logits.requires_grad_(True),
        labels=torch.tensor(gold)[None],
        valid=torch.tensor(valid)[None],
        anchors=torch.zeros(1, b, dtype=torch.long),
    )
    target = torch.full((1, b, k, v), -3.0).scatter(-1, torch.tensor(target_argmax)[None, ..., None], 3.0)
    return draft, StepContext(target_logits=target)


def test_auf_support_by_hand():
    d = one_hot_draft(
        draft_argmax=[[1, 2, 3, 4], [1, 3, 3, 4], [5, 2, 3, 4], [1, 2, 3, 4]],
        gold=[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 0, 4]],
        target_argmax=[[0, 0, 0, 0]] * 4,  # irrelevant for AUF
        valid=[[True] * 4, [True] * 4, [True] * 4, [True, True, False, True]],
    )
    w = AUFSupport()(*d)
    want = [
        [1, 1, 1, 1],  # no failure: every valid slot
        [1, 1, 0, 0],  # the second slot fails: it counts, the later ones do not
        [1, 0, 0, 0],  # the first slot fails
        [1, 1, 0, 0],  # an invalid slot ends the prefix
    ]
    torch.testing.assert_close(w, torch.tensor(want, dtype=torch.float32)[None])
    assert not w.requires_grad and not AUFSupport.needs_target


def test_valid_prefix_uses_the_target_argmax():
    d = one_hot_draft(
        draft_argmax=[[1, 2, 3], [1, 2, 3]],
        gold=[[0, 0, 0], [1, 2, 3]],  # gold disagrees: irrelevant for the valid prefix
        target_argmax=[[1, 2, 3], [1, 5, 3]],
        valid=[[True] * 3, [True] * 3],
    )
    w = ValidPrefix()(*d)
    torch.testing.assert_close(w, torch.tensor([[[1.0, 1, 1], [1, 1, 0]]]))
    assert not w.requires_grad and ValidPrefix.needs_target
    torch.testing.assert_close(AUFSupport()(*d), torch.tensor([[[1.0, 0, 0], [1, 1, 1]]]))


def test_dpace_by_hand():
    # q(gold) = 0.6, 0.5, 0.4, α = 0.5: q̃ = 0.8, 0.75, 0.7; survival 0.8, 0.6, 0.42; suffix sums 1.82, 1.02, 0.42
    d = one_hot_draft([[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[0, 0, 0]] * 2,
                      [[True] * 3, [True, False, True]], probs=[[0.6, 0.5, 0.4], [0.6, 0.5, 0.4]])
    w = DPACE(0.5)(*d)
    torch.testing.assert_close(w[0], torch.tensor([[1.82, 1.02, 0.42], [0.8, 0.0, 0.0]], dtype=torch.float64))
    assert not w.requires_grad
    torch.testing.assert_close(DPACE(1.0)(*d)[0, 0], torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))


def test_cumulative_weights_match_brute_force_products():
    d, ctx = make_draft()
    close(E2EWeight()(d, ctx), chain_products(d, lambda *s: bf_alpha(d, ctx, *s)))
    close(WTVWeight(0.7)(d, ctx), chain_products(d, lambda *s: bf_alpha(d, ctx, *s, temperature=0.7)))
    q = d.logits.detach().double().softmax(-1)
    y = ctx.target_logits.argmax(-1)
    close(EALWeight()(d, ctx), chain_products(d, lambda n, a, t: float(q[n, a, t, y[n, a, t]])))
    assert E2EWeight()(d, ctx).requires_grad and EALWeight()(d, ctx).requires_grad  # no stop-gradient


def test_position_product():
    got = PositionProduct([ExpDecay(2.0), Geometric(0.5)])(*make_draft())
    want = torch.tensor([math.exp(-t / 2) * 0.5**t for t in range(K)])
    torch.testing.assert_close(got, want.expand(N, A, K))
    assert PositionProduct([Uniform(), ValidPrefix()]).needs_target


# ------------------------------------------------------------------------------- ready-made objectives


def expected_length_objective(d, factor):
    """-Σ_blocks Σ_k Π_{j≤k} factor_j, over the anchors with a valid slot (normalize="anchors")."""
    total, anchors = 0.0, 0
    for n in range(N):
        for a in range(A):
            if not any(VALID[n][a]):
                continue
            anchors += 1
            prod = 1.0
            for t in range(K):
                if not VALID[n][a][t]:
                    break
                prod *= factor(n, a, t)
                total -= prod
    return total / anchors


def test_e2e_wtv_eal_are_minus_expected_accepted_length():
    d, ctx = make_draft()
    assert float(E2E()(d, ctx).value) == pytest.approx(
        expected_length_objective(d, lambda *s: bf_alpha(d, ctx, *s)), rel=1e-5
    )
    assert float(WTV(0.5)(d, ctx).value) == pytest.approx(
        expected_length_objective(d, lambda *s: bf_alpha(d, ctx, *s, temperature=0.5)), rel=1e-5
    )
    q = d.logits.detach().double().softmax(-1)
    y = ctx.target_logits.argmax(-1)
    assert float(EAL()(d, ctx).value) == pytest.approx(
        expected_length_objective(d, lambda n, a, t: float(q[n, a, t, y[n, a, t]])), rel=1e-5
    )
    assert E2E().needs_target and WTV().needs_target and EAL().needs_target and not EAL("gold").needs_target


# ------------------------------------------------------------------------------------- normalisers, OR


def test_normalisers_by_hand():
    """The four Z on VALID: Σ a·b, anchors with a valid slot, valid slots, sequences with a valid slot."""
    d, _ = make_draft()
    e = math.exp
    weight = (1 + e(-1) + e(-2)) + (1 + e(-2)) + (1 + e(-1))  # ExpDecay(1): valid slots of (0,0), (0,1), (1,0)
    assert float(Objective(CE(), ExpDecay(1.0), normalize="weight")(d).den) == pytest.approx(weight)
    assert float(Objective(CE(), ExpDecay(1.0), normalize="anchors")(d).den) == 3
    assert float(Objective(CE(), ExpDecay(1.0), normalize="slots")(d).den) == 7
    assert float(Objective(CE(), ExpDecay(1.0), normalize="sequences")(d).den) == 2
    # the numerator never depends on Z
    nums = {float(Objective(CE(), ExpDecay(1.0), normalize=z)(d).num.detach()) for z in ("weight", "anchors", "slots")}
    assert len(nums) == 1
    with pytest.raises(ValueError, match="normalize"):
        Objective(normalize="tokens")


def test_needs_target_is_the_or_over_parts():
    assert not Objective(CE(), AUFSupport()).needs_target
    assert Objective(CE(), ValidPrefix()).needs_target
    assert Objective(CE(), E2EWeight()).needs_target
    assert Objective(KL()).needs_target
    assert not Objective(CE(), EALWeight("gold")).needs_target
    assert Mixture([Objective(CE()), Objective(TV())], [1.0, 1.0]).needs_target
    assert not Mixture([Objective(CE()), Objective(CE(), Geometric())], [1.0, 1.0]).needs_target


# --------------------------------------------------------------------------------------------- mixtures


def test_mixture_with_a_common_normaliser_is_exact():
    d, ctx = make_draft()
    ce, tv = Objective(CE(), ExpDecay(4.0)), Objective(TV(), ExpDecay(4.0))
    mix = Mixture([ce, tv], [0.1, 1.8])(d, ctx)
    a, b = ce(d, ctx), tv(d, ctx)
    assert float(mix.den) == float(a.den) == float(b.den)
    assert float(mix.num.detach()) == pytest.approx(0.1 * float(a.num.detach()) + 1.8 * float(b.num.detach()), rel=1e-6)
    assert float(mix.value) == pytest.approx(0.1 * float(a.value) + 1.8 * float(b.value), rel=1e-6)
    assert set(mix.metrics) == {"mixture/0", "mixture/1"}


def test_mixture_with_different_normalisers_is_the_weighted_sum_of_values():
    d, ctx = make_draft()
    a, b = Objective(CE(), normalize="slots"), E2E()
    mix = Mixture([a, b], [0.5, 2.0])(d, ctx)
    ta, tb = a(d, ctx), b(d, ctx)
    assert float(mix.den) == float(ta.den)
    assert float(mix.value) == pytest.approx(0.5 * float(ta.value) + 2.0 * float(tb.value), rel=1e-6)
    (g,) = torch.autograd.grad(mix.num, d.logits)
    d2, ctx2 = make_draft()
    want = 0.5 * a(d2, ctx2).num + 2.0 * float(ta.den / tb.den) * b(d2, ctx2).num
    (g2,) = torch.autograd.grad(want, d2.logits)
    torch.testing.assert_close(g, g2)
    with pytest.raises(ValueError, match="same length"):
        Mixture([a, b], [1.0])


def test_mixture_lets_one_component_choose_anchors():
    class Chooser(Objective):
        def select_anchors(self, batch, draft_fn, target):
            return torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), {}

    assert Mixture([Chooser(), Objective()], [1.0, 1.0]).select_anchors({}, None, None) is not None
    assert Mixture([Objective(), Objective()], [1.0, 1.0]).select_anchors({}, None, None) is None
    with pytest.raises(ValueError, match="At most one"):
        Mixture([Chooser(), Chooser()], [1.0, 1.0]).select_anchors({}, None, None)
