"""Objectives: every part of L = Σ_n a_n Σ_t b_{n,t} ℓ_{n,t} / Z against a float64 brute force written here."""

import math

import pytest
import torch

from lightning_spec.drafters import DraftOutput
from lightning_spec.objectives import (
    CE,
    KL,
    TV,
    AnchorUniform,
    AnchorWeight,
    ExpDecay,
    Objective,
    StepContext,
    Uniform,
)
from lightning_spec.objectives.objective import NORMALIZE
from lightning_spec.sampling import SamplingConfig

N, A, K, VD = 2, 2, 3, 4
# slot validity: anchor (0, 1) has no valid slot at all (it must not count for normalize="anchors")
VALID = [[[True, True, False], [False, False, False]], [[True, True, True], [True, False, False]]]


def make_draft(seed: int = 0) -> tuple[DraftOutput, StepContext]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.tensor(VALID)
    labels = torch.randint(0, VD, (N, A, K), generator=g).masked_fill(~valid, 0)
    draft = DraftOutput(
        logits=(torch.randn(N, A, K, VD, generator=g) * 2).requires_grad_(True),
        labels=labels,
        valid=valid,
        anchors=torch.tensor([[3, 0], [1, 5]]),
    )
    return draft, StepContext(target_logits=torch.randn(N, A, K, VD, generator=g) * 2)


def slots():
    return [(n, a, t) for n in range(N) for a in range(A) for t in range(K)]


# ----------------------------------------------------------------------------------- float64 brute force


def softmax64(row, temperature: float = 1.0, top_k: int = 0) -> list[float]:
    xs = [float(x) / temperature for x in row]
    keep = sorted(range(len(xs)), key=lambda i: -xs[i])[:top_k] if top_k else range(len(xs))
    e = [math.exp(xs[i]) if i in keep else 0.0 for i in range(len(xs))]
    return [x / sum(e) for x in e]


def bf_ce(d, ctx, n, a, t) -> float:
    return -math.log(softmax64(d.logits[n, a, t].tolist())[int(d.labels[n, a, t])])


def bf_kl(d, ctx, n, a, t, temperature=1.0, top_k=0) -> float:
    p = softmax64(ctx.target_logits[n, a, t].tolist(), temperature, top_k)
    q = softmax64(d.logits[n, a, t].tolist(), temperature)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def bf_tv(d, ctx, n, a, t, temperature=1.0) -> float:
    p = softmax64(ctx.target_logits[n, a, t].tolist(), temperature)
    q = softmax64(d.logits[n, a, t].tolist(), temperature)
    return 1 - sum(min(pi, qi) for pi, qi in zip(p, q))  # TV = 1 - α, a different formula from the package's


def per_slot(fn, d, ctx, **kw) -> torch.Tensor:
    out = torch.zeros(N, A, K, dtype=torch.float64)
    for n, a, t in slots():
        out[n, a, t] = fn(d, ctx, n, a, t, **kw)
    return out


# ------------------------------------------------------------------------------------------------ losses


def test_ce_matches_brute_force():
    d, ctx = make_draft()
    torch.testing.assert_close(CE()(d, ctx).double(), per_slot(bf_ce, d, ctx), rtol=1e-5, atol=1e-6)
    assert not CE.needs_target


def test_kl_matches_brute_force():
    d, ctx = make_draft()
    torch.testing.assert_close(KL()(d, ctx).double(), per_slot(bf_kl, d, ctx), rtol=1e-5, atol=1e-6)
    hot = KL(SamplingConfig(temperature=0.5))(d, ctx).double()
    torch.testing.assert_close(hot, per_slot(bf_kl, d, ctx, temperature=0.5), rtol=1e-5, atol=1e-6)
    assert KL.needs_target and (KL()(d, ctx) >= -1e-6).all()


def test_kl_with_top_k_target_is_finite_with_finite_gradients():
    d, ctx = make_draft()
    got = KL(SamplingConfig(temperature=1.0, top_k=2))(d, ctx)
    torch.testing.assert_close(got.double(), per_slot(bf_kl, d, ctx, top_k=2), rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert torch.isfinite(d.logits.grad).all()


def test_kl_at_temperature_zero_is_ce_on_the_target_argmax():
    d, ctx = make_draft()
    argmax = ctx.target_logits.argmax(-1)
    want = -d.logits.detach().double().log_softmax(-1).gather(-1, argmax[..., None])[..., 0]
    torch.testing.assert_close(KL(SamplingConfig())(d, ctx).double(), want, rtol=1e-5, atol=1e-6)


def test_tv_matches_brute_force():
    d, ctx = make_draft()
    got = TV()(d, ctx).double()
    torch.testing.assert_close(got, per_slot(bf_tv, d, ctx), rtol=1e-5, atol=1e-6)
    assert ((got >= 0) & (got <= 1)).all()
    torch.testing.assert_close(TV(SamplingConfig(temperature=2.0))(d, ctx).double(),
                               per_slot(bf_tv, d, ctx, temperature=2.0))


def test_losses_needing_target_logits_say_so():
    d, _ = make_draft()
    for loss in (KL(), TV()):
        with pytest.raises(ValueError, match="target logits"):
            loss(d, StepContext())


# ----------------------------------------------------------------------------------------------- weights


def test_uniform_and_anchor_uniform():
    d, ctx = make_draft()
    assert Uniform()(d, ctx).shape == (N, A, K) and (Uniform()(d, ctx) == 1).all()
    assert AnchorUniform()(d, ctx).shape == (N, A) and (AnchorUniform()(d, ctx) == 1).all()


@pytest.mark.parametrize("gamma", [1.0, 4.0, 7.0])
def test_exp_decay_slot_convention(gamma):
    w = ExpDecay(gamma)(*make_draft())
    assert w.shape == (N, A, K)
    # slot t = 1 (the first prediction after the anchor) has weight 1, t = 2 exp(-1/γ), t = 3 exp(-2/γ)
    want = torch.tensor([1.0, math.exp(-1 / gamma), math.exp(-2 / gamma)])
    torch.testing.assert_close(w, want.expand(N, A, K))


def test_exp_decay_rejects_nonpositive_gamma():
    with pytest.raises(ValueError, match="gamma"):
        ExpDecay(0.0)


# --------------------------------------------------------------------------------------------- objective


class TableAnchorWeight(AnchorWeight):
    """a_n from a fixed table: checks that anchor weights broadcast over the slots of their anchor."""

    def __call__(self, draft, ctx):
        return torch.tensor([[2.0, 0.5], [1.0, 3.0]])


def brute_force_objective(d, ell, a_w, b_w, normalize):
    num = den_weight = 0.0
    valid_slots = 0
    for n, a, t in slots():
        if VALID[n][a][t]:
            w = a_w[n][a] * b_w[t]
            num += w * float(ell[n, a, t])
            den_weight += w
            valid_slots += 1
    anchors = sum(any(VALID[n][a]) for n in range(N) for a in range(A))
    sequences = sum(any(any(row) for row in VALID[n]) for n in range(N))
    return num, {"weight": den_weight, "anchors": anchors, "slots": valid_slots, "sequences": sequences}[normalize]


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("loss_name", ["CE", "KL", "TV"])
def test_objective_matches_brute_force(normalize, loss_name):
    d, ctx = make_draft()
    loss, bf = {"CE": (CE(), bf_ce), "KL": (KL(), bf_kl), "TV": (TV(), bf_tv)}[loss_name]
    gamma = 2.0
    b_w = [math.exp(-(t - 1) / gamma) for t in (1, 2, 3)]
    table = [[2.0, 0.5], [1.0, 3.0]]
    terms = Objective(loss, ExpDecay(gamma), TableAnchorWeight(), normalize=normalize)(d, ctx)
    num, den = brute_force_objective(d, per_slot(bf, d, ctx), table, b_w, normalize)
    assert float(terms.num.detach()) == pytest.approx(num, rel=1e-5)
    assert float(terms.den) == pytest.approx(den, rel=1e-6)
    assert float(terms.value) == pytest.approx(num / den, rel=1e-5)
    assert not terms.den.requires_grad and terms.num.requires_grad


def test_objective_normalisers_by_hand():
    """The three Z of the docstring on the VALID pattern, counted by hand."""
    d, ctx = make_draft()
    e = math.exp
    gamma = 2.0
    weight = (1 + e(-0.5)) + (1 + e(-0.5) + e(-1)) + 1  # valid slots of anchors (0,0), (1,0), (1,1)
    assert float(Objective(CE(), ExpDecay(gamma), normalize="weight")(d).den) == pytest.approx(weight)
    assert float(Objective(CE(), ExpDecay(gamma), normalize="anchors")(d).den) == 3  # (0,1) has no valid slot
    assert float(Objective(CE(), ExpDecay(gamma), normalize="slots")(d).den) == 6
    # defaults: CE, uniform weights, Z = Σ weights = number of valid slots
    default = Objective()(d)
    assert float(default.den) == 6
    want = sum(bf_ce(d, ctx, n, a, t) for n, a, t in slots() if VALID[n][a][t])
    assert float(default.num.detach()) == pytest.approx(want, rel=1e-5)


def test_invalid_slots_get_no_loss_and_no_gradient():
    d, ctx = make_draft()
    with torch.no_grad():  # a huge loss on every invalid slot: it must not leak into the value or the gradient
        d.logits[~d.valid] = torch.tensor([-50.0, 50.0, -50.0, 50.0])
        d.labels[~d.valid] = 0
    base = Objective(KL())(*make_draft())
    terms = Objective(KL())(d, ctx)
    assert float(terms.num.detach()) == pytest.approx(float(base.num.detach()), rel=1e-6)
    terms.num.backward()
    assert (d.logits.grad[~d.valid] == 0).all()
    assert (d.logits.grad[d.valid].abs().sum(-1) > 0).all()


def test_objective_rejects_unknown_normalize():
    with pytest.raises(ValueError, match="objective.normalize"):
        Objective(normalize="tokens")
    assert Objective(KL()).needs_target and not Objective(CE()).needs_target


def test_parts_declare_their_needs_on_the_base_classes():
    """``needs_target`` and ``select_anchors`` are declared by ``Part`` (False, None) and overridden where true, so
    ``Objective`` reads them from every part without probing."""
    from lightning_spec.objectives import PositionProduct, ValidPrefix
    from lightning_spec.objectives.part import Part

    assert not Part.needs_target and Part().select_anchors({}, None, None) is None
    assert not CE().needs_target and KL().needs_target and not ExpDecay().needs_target
    assert PositionProduct([ExpDecay(), ValidPrefix()]).needs_target
    assert not PositionProduct([ExpDecay(), ExpDecay()]).needs_target
    assert Objective(CE(), PositionProduct([ExpDecay(), ValidPrefix()])).needs_target


def test_a_mixture_declares_what_its_components_need(tiny_target):
    """``needs_rollouts`` and ``needs_reference`` are declared on every objective; a ``Mixture`` has its components'
    needs, so a GRPO inside a mixture still gets the frozen starting drafter from the module."""
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import GRPO, DraftOPD, Mixture

    assert not Objective().needs_rollouts and not Objective().needs_reference
    assert Mixture([Objective(CE()), GRPO()], [0.5, 0.5]).needs_reference
    assert Mixture([Objective(CE()), DraftOPD()], [0.5, 0.5]).needs_rollouts
    assert not Mixture([Objective(CE()), Objective(CE())], [0.5, 0.5]).needs_reference
    # every need, at any depth: the target's logits (GRPO's parts), a reference inside a nested mixture
    assert Mixture([Objective(CE()), GRPO()], [0.5, 0.5]).needs_target
    assert not Mixture([Objective(CE()), Objective(CE())], [0.5, 0.5]).needs_target
    nested = Mixture([Objective(CE()), Mixture([Objective(KL()), GRPO()], [1.0, 1.0])], [0.5, 0.5])
    assert nested.needs_reference and nested.needs_target and not nested.needs_rollouts
    module = DraftModule(DFlashDrafter(block_size=3, num_layers=1), Mixture([Objective(CE()), GRPO()], [0.5, 0.5]),
                         target=tiny_target)
    assert module._reference is not None  # the frozen start, kept because a component asked for it
