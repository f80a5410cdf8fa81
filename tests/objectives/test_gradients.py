"""Gradients of every objective: autograd of ``Objective(...)`` against central finite differences of a float64
brute force written here from the formulas (plain Python loops over slots and vocabulary, no package code),
for every loss × normaliser and every weight that carries or blocks a gradient.

What is differentiated is the value the module optimises, num / den (den is a normaliser without gradient:
the module sums num and den over micro-batches and ranks and divides once). Stop-gradients of the formulas
(LK's λ, D-PACE's weights, the AUF and valid-prefix masks, Z) are held at the base point in the brute force.
"""

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
    AnchorWeight,
    AUFSupport,
    BernoulliKL,
    ExpDecay,
    Geometric,
    LKAlpha,
    Mixture,
    NegProb,
    Objective,
    ReverseKL,
    StepContext,
    TVMinusOne,
    ValidPrefix,
)
from lightning_spec.objectives.objective import NORMALIZE
from lightning_spec.sampling import SamplingConfig

N, A, K, V = 2, 2, 3, 5
# anchor (0, 1) has a hole at slot 2 (it ends every chain there); anchor (1, 1) has no valid slot
VALID = [[[True, True, True], [True, False, True]], [[True, True, False], [False, False, False]]]
ANCHOR_TABLE = [[2.0, 0.5], [1.0, 3.0]]
T1 = SamplingConfig(temperature=1.0)


class TableAnchorWeight(AnchorWeight):
    """a_n from ANCHOR_TABLE: anchor weights must scale every slot of their anchor."""

    def __call__(self, draft, ctx):
        return torch.tensor(ANCHOR_TABLE, dtype=draft.logits.dtype)


def make_draft(seed: int = 3, grad: bool = False) -> tuple[DraftOutput, StepContext]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor(VALID)
    draft = DraftOutput(
        logits=(torch.randn(N, A, K, V, generator=g, dtype=torch.float64) * 1.5).requires_grad_(grad),
        labels=torch.randint(0, V, (N, A, K), generator=g).masked_fill(~valid, 0),
        valid=valid,
        anchors=torch.tensor([[3, 7], [1, 5]]),
    )
    return draft, StepContext(target_logits=torch.randn(N, A, K, V, generator=g, dtype=torch.float64) * 1.5)


def slots():
    return [(n, a, t) for n in range(N) for a in range(A) for t in range(K)]


# ----------------------------------------------------------------------------------- float64 brute force


def warped(row: list[float], sampling: SamplingConfig) -> list[float]:
    """softmax(z / T), then keep the top_k largest, then the smallest head reaching top_p (the top token always
    stays), renormalised: the SamplingConfig docstring, with lists."""
    z = [x / sampling.temperature for x in row]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[: sampling.top_k] if sampling.top_k else order)
    e = [math.exp(z[i]) if i in keep else 0.0 for i in range(len(z))]
    p = [x / sum(e) for x in e]
    if sampling.top_p < 1:
        head, mass = set(), 0.0
        for i in order:
            if i in keep and mass < sampling.top_p:
                head.add(i)
                mass += p[i]
        p = [p[i] if i in head else 0.0 for i in range(len(p))]
        p = [x / sum(p) for x in p]
    return p


def kl(p: list[float], q: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(p, q) if x > 0)


def alpha(p: list[float], q: list[float]) -> float:
    return sum(min(x, y) for x, y in zip(p, q))


class Slot:
    """What a per-slot loss reads: draft logits ``x`` (the variable), target logits, gold label, target argmax."""

    def __init__(self, x: list[float], target: list[float], label: int) -> None:
        self.x, self.target, self.label = x, target, label
        self.argmax = max(range(len(target)), key=lambda i: target[i])

    def pq(self, sampling: SamplingConfig = T1) -> tuple[list[float], list[float]]:
        """p under ``sampling``; q at the same temperature, no filtering (the draft is never filtered)."""
        return warped(self.target, sampling), warped(self.x, SamplingConfig(temperature=sampling.temperature))


def loss_ce(s: Slot, base: Slot) -> float:
    return -math.log(s.pq()[1][s.label])


def loss_kl(sampling: SamplingConfig):
    return lambda s, base: kl(*s.pq(sampling))


def loss_tv(s: Slot, base: Slot) -> float:
    p, q = s.pq()
    return sum(max(x - y, 0.0) for x, y in zip(p, q))


def loss_reverse_kl(s: Slot, base: Slot, floor: float = -20.0) -> float:
    p, q = s.pq()
    return sum(y * (math.log(y) - max(math.log(x) if x > 0 else -math.inf, floor)) for x, y in zip(p, q))


def loss_jsd(s: Slot, base: Slot, beta: float = 0.5) -> float:
    p, q = s.pq()
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def loss_lk(kappa: float, scale: float):
    def loss(s: Slot, base: Slot) -> float:
        p, q = s.pq()
        lam = scale * math.exp(-kappa * alpha(*base.pq()))  # λ = scale·exp(-κ·sg(α)): frozen at the base point
        return lam * kl(p, q) + (1 - lam) * (1 - alpha(p, q))

    return loss


def loss_lk_alpha(s: Slot, base: Slot, eps: float = 1e-6) -> float:
    return -math.log(max(alpha(*s.pq()), eps))


def loss_bernoulli_kl(s: Slot, base: Slot, floor: float = -10.0, clip: float = 10.0) -> float:
    p, q = s.pq()

    def logs(x: float) -> tuple[float, float]:
        lx = max(math.log(x), floor)
        return lx, max(math.log(1 - math.exp(lx)), floor)

    lp, l1p = logs(p[s.label])
    lq, l1q = logs(q[s.label])
    return max(-clip, min(clip, math.exp(lp) * (lp - lq) + math.exp(l1p) * (l1p - l1q)))


def loss_tv_minus_one(sampling: SamplingConfig):
    return lambda s, base: -alpha(*s.pq(sampling))


def loss_neg_prob(token: str):
    return lambda s, base: -s.pq()[1][s.label if token == "gold" else s.argmax]


# block-position weights b (K,) for one anchor: (slots, base slots, valid) -> list


def chain(factors: list[float], valid: list[bool]) -> list[float]:
    """Π_{s<t} factor_s, an invalid slot ending the chain."""
    out, prod = [], 1.0
    for f, ok in zip(factors, valid):
        out.append(prod)
        prod *= f if ok else 0.0
    return out


def weight_exp_decay(gamma: float):
    return lambda slots_, base, valid: [math.exp(-t / gamma) for t in range(K)]


def weight_geometric(rho: float):
    return lambda slots_, base, valid: [rho**t for t in range(K)]


def weight_cumulative_alpha(sampling: SamplingConfig):  # E2E-TV and WTV: Π_{s<t} α_s, with gradient
    return lambda slots_, base, valid: chain([alpha(*s.pq(sampling)) for s in slots_], valid)


def weight_eal(token: str):  # Π_{s<t} q_s(y*_s), with gradient
    return lambda slots_, base, valid: chain([-loss_neg_prob(token)(s, None) for s in slots_], valid)


def weight_dpace(smooth: float):  # sg(Σ_{m≥t} Π_{s≤m} q̃_s), q̃ = (1 - α) q(x) + α: at the base point
    def weight(slots_, base, valid):
        survive = chain([(1 - smooth) * s.pq()[1][s.label] + smooth for s in base] + [0.0], valid + [True])[1:]
        return [sum(survive[m] for m in range(t, K)) for t in range(K)]

    return weight


def weight_prefix_support(reference: str):  # AUF (gold) / valid prefix (target argmax): sg, at the base point
    def weight(slots_, base, valid):
        ok = []
        for s, v in zip(base, valid):
            top = max(range(V), key=lambda i: s.x[i])
            ok.append(float(v and top == (s.label if reference == "gold" else s.argmax)))
        return [w * float(v) for w, v in zip(chain(ok, [True] * K), valid)]

    return weight


def brute_force_value(
    x: list, base: list, d: DraftOutput, ctx: StepContext, loss, weight, anchor_table, normalize: str
) -> float:
    """Σ_n a_n Σ_t b_{n,t} ℓ_{n,t} / Z over valid slots; Z (no gradient) from the base point."""
    target, labels = ctx.target_logits.tolist(), d.labels.tolist()
    num = 0.0
    z_weight = 0.0
    for n in range(N):
        for a in range(A):
            slot_list = [Slot(x[n][a][t], target[n][a][t], labels[n][a][t]) for t in range(K)]
            base_list = [Slot(base[n][a][t], target[n][a][t], labels[n][a][t]) for t in range(K)]
            b = weight(slot_list, base_list, VALID[n][a])
            b_base = weight(base_list, base_list, VALID[n][a])
            for t in range(K):
                if VALID[n][a][t]:
                    num += anchor_table[n][a] * b[t] * loss(slot_list[t], base_list[t])
                    z_weight += anchor_table[n][a] * b_base[t]
    z = {
        "weight": z_weight,
        "anchors": sum(any(VALID[n][a]) for n in range(N) for a in range(A)),
        "slots": sum(v for n in range(N) for a in range(A) for v in VALID[n][a]),
        "sequences": sum(any(any(r) for r in VALID[n]) for n in range(N)),
    }[normalize]
    return num / z


def finite_differences(f, x0: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    """Central differences of the scalar f(list) at x0 (N, A, K, V), one coordinate at a time."""
    grad = torch.zeros_like(x0)
    flat = grad.view(-1)
    for i in range(x0.numel()):
        up, down = x0.clone(), x0.clone()
        up.view(-1)[i] += h
        down.view(-1)[i] -= h
        flat[i] = (f(up.tolist()) - f(down.tolist())) / (2 * h)
    return grad


def compare(objective, d: DraftOutput, ctx: StepContext, value) -> None:
    """The objective's num / den against ``value`` (the brute force of the same draft): value, and gradient
    against the brute force's finite differences."""
    x = d.logits.clone().requires_grad_(True)
    terms = objective(DraftOutput(x, d.labels, d.valid, d.anchors), ctx)
    assert not terms.den.requires_grad
    got = terms.num / terms.den
    # 1e-7, not 1e-12: the fixed position weights (ExpDecay, Geometric) are float32 tensors in the package
    assert float(got.detach()) == pytest.approx(value(x.detach().tolist()), rel=1e-7, abs=1e-9)
    (grad,) = torch.autograd.grad(got, x)
    want = finite_differences(value, x.detach())
    assert want.abs().max() > 1e-3  # the objective does depend on the draft logits
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-8)


def check(objective, bf_loss, bf_weight, anchor_table, normalize: str) -> None:
    d, ctx = make_draft()
    base = d.logits.tolist()
    compare(objective, d, ctx,
            lambda x: brute_force_value(x, base, d, ctx, bf_loss, bf_weight, anchor_table, normalize))


# ------------------------------------------------------------------------------------ the checks

UNIFORM = [[1.0] * A for _ in range(N)]
HOT_TOP_K = SamplingConfig(temperature=0.5, top_k=3)
TOP_P = SamplingConfig(temperature=1.0, top_p=0.8)

# name: (the package's loss, its brute force)
LOSSES = {
    "CE": (CE(), loss_ce),
    "KL": (KL(), loss_kl(T1)),
    "KL_T0.5_top_k3": (KL(HOT_TOP_K), loss_kl(HOT_TOP_K)),
    "KL_top_p0.8": (KL(TOP_P), loss_kl(TOP_P)),
    "TV": (TV(), loss_tv),
    "ReverseKL": (ReverseKL(), loss_reverse_kl),
    "JSD": (JSD(), loss_jsd),
    "LK": (LK(kappa=3.0, scale=0.8), loss_lk(3.0, 0.8)),
    "LKAlpha": (LKAlpha(), loss_lk_alpha),
    "BernoulliKL": (BernoulliKL(), loss_bernoulli_kl),
    "TVMinusOne": (TVMinusOne(), loss_tv_minus_one(T1)),
    "NegProb": (NegProb(), loss_neg_prob("target_argmax")),
    "NegProb_gold": (NegProb("gold"), loss_neg_prob("gold")),
}


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_gradient_matches_the_brute_force(name, normalize):
    """Every loss, with a decaying b and a non-uniform a, under every normaliser: the value to 1e-7 and the
    autograd gradient to the brute force's finite differences.

    Catches, each checked on a mutated copy of the package (losses.py): KL(q ‖ p) computed instead of KL(p ‖ q);
    LK's λ left undetached (exp(-κ α) instead of exp(-κ sg(α))); TV with q detached. The last two leave every
    value unchanged."""
    loss, bf_loss = LOSSES[name]
    objective = Objective(loss, ExpDecay(2.0), TableAnchorWeight(), normalize=normalize)
    check(objective, bf_loss, weight_exp_decay(2.0), ANCHOR_TABLE, normalize)


# name: (the objective for a normaliser, the brute-force loss, the brute-force b); a = 1
WEIGHTED = {
    "E2E": (lambda z: E2E(normalize=z), loss_tv_minus_one(T1), weight_cumulative_alpha(T1)),
    "E2E_T0.8_top_k3": (
        lambda z: E2E(SamplingConfig(temperature=0.8, top_k=3), normalize=z),
        loss_tv_minus_one(SamplingConfig(temperature=0.8, top_k=3)),
        weight_cumulative_alpha(SamplingConfig(temperature=0.8, top_k=3)),
    ),
    "WTV_T0.7": (
        lambda z: WTV(0.7, normalize=z),
        loss_tv_minus_one(SamplingConfig(temperature=0.7)),
        weight_cumulative_alpha(SamplingConfig(temperature=0.7)),
    ),
    "EAL": (lambda z: EAL(normalize=z), loss_neg_prob("target_argmax"), weight_eal("target_argmax")),
    "EAL_gold": (lambda z: EAL("gold", normalize=z), loss_neg_prob("gold"), weight_eal("gold")),
    "CE_Geometric": (lambda z: Objective(CE(), Geometric(0.7), normalize=z), loss_ce, weight_geometric(0.7)),
    "CE_DPACE": (lambda z: Objective(CE(), DPACE(0.5), normalize=z), loss_ce, weight_dpace(0.5)),
    "CE_AUF": (lambda z: Objective(CE(), AUFSupport(), normalize=z), loss_ce, weight_prefix_support("gold")),
    "KL_ValidPrefix": (
        lambda z: Objective(KL(), ValidPrefix(), normalize=z), loss_kl(T1), weight_prefix_support("argmax")
    ),
}


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("name", list(WEIGHTED))
def test_weighted_objective_gradient_matches_the_brute_force(name, normalize):
    """Weights with a gradient (E2E/WTV's Π α, EAL's Π q) and without one (D-PACE, AUF, valid prefix) under
    every normaliser: the gradient flows through exactly the products the formulas leave undetached.

    Catches a stop-gradient added to E2E's cumulative acceptance Π α in weights.py (checked on a mutated copy
    of the package; the value is unchanged)."""
    make, bf_loss, bf_weight = WEIGHTED[name]
    check(make(normalize), bf_loss, bf_weight, UNIFORM, normalize)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_mixture_gradient_matches_the_brute_force(normalize):
    """DSpark's 0.1·CE + 1.8·TV with the decay on both: the value and gradient of Σ_i w_i value_i."""
    parts = [(CE(), loss_ce, 0.1), (TV(), loss_tv, 1.8)]
    mixture = Mixture([Objective(loss, ExpDecay(4.0), normalize=normalize) for loss, _, _ in parts], [0.1, 1.8])
    d, ctx = make_draft()
    base = d.logits.tolist()

    def value(x):
        return sum(
            w * brute_force_value(x, base, d, ctx, bf, weight_exp_decay(4.0), UNIFORM, normalize)
            for _, bf, w in parts
        )

    compare(mixture, d, ctx, value)


# ------------------------------------------------------------------------------ self-consistency checks
# (autograd against finite differences of the implementation itself; the brute-force checks above subsume them
# but these isolate one property each)


def num_of(objective):
    base, ctx = make_draft()

    def f(logits):
        d = DraftOutput(logits=logits, labels=base.labels, valid=base.valid, anchors=base.anchors)
        return objective(d, ctx).num

    return f, base.logits.detach().clone().requires_grad_(True)


@pytest.mark.parametrize(
    "name", ["e2e", "e2e_topk", "eal", "wtv", "lk_constant_lambda", "lk_alpha", "jsd", "reverse_kl"]
)
def test_gradcheck_float64(name):
    objective = {
        "e2e": E2E(),
        "e2e_topk": E2E(SamplingConfig(temperature=0.8, top_k=3)),
        "eal": EAL(),
        "wtv": WTV(0.7),
        "lk_constant_lambda": Objective(LK(kappa=0.0, scale=0.3)),  # λ constant: the numeric gradient agrees
        "lk_alpha": Objective(LKAlpha()),
        "jsd": Objective(JSD()),
        "reverse_kl": Objective(ReverseKL()),
    }[name]
    f, x = num_of(objective)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_lk_gradient_treats_lambda_as_a_constant():
    """LK's λ = exp(-κ sg(α)) is detached: its gradient is that of λ0·KL + (1 - λ0)·TV with λ0 frozen at the
    current point (finite differences of LK itself would also move λ, so gradcheck it through the frozen form)."""
    kappa = 3.0
    f, x = num_of(Objective(LK(kappa=kappa)))
    base, ctx = make_draft()
    with torch.no_grad():  # LK, KL and TV all default to temperature 1; α = Σ min(p, q) as LK computes it
        p = SamplingConfig(temperature=1.0).probs(ctx.target_logits)
        lam0 = torch.exp(-kappa * torch.minimum(p, x.softmax(-1)).sum(-1))

    def frozen(logits):
        d = DraftOutput(logits, base.labels, base.valid, base.anchors)
        ell = lam0 * KL()(d, ctx) + (1 - lam0) * TV()(d, ctx)
        return (ell * base.valid).sum()

    (g_lk,) = torch.autograd.grad(f(x), x)
    (g_frozen,) = torch.autograd.grad(frozen(x), x)
    torch.testing.assert_close(g_lk, g_frozen, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(frozen, (x,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_mask_weights_carry_no_gradient():
    """AUF, valid-prefix and D-PACE weights are constants: the objective's gradient is CE's gradient times
    the (detached) weights."""
    for weight in (AUFSupport(), ValidPrefix(), DPACE()):
        d, ctx = make_draft(seed=1, grad=True)
        w = weight(d, ctx)
        assert not w.requires_grad
        (g,) = torch.autograd.grad(Objective(CE(), weight)(d, ctx).num, d.logits)
        d2, ctx2 = make_draft(seed=1, grad=True)
        (want,) = torch.autograd.grad((CE()(d2, ctx2) * w * d2.valid).sum(), d2.logits)
        torch.testing.assert_close(g, want)
