"""GRPO on simulated acceptance (Xia et al., arXiv 2609.24150): the pure pieces by hand, the engine's rules, the
gradient, the KL to the reference, the reduction in chunks, a second-stage fit, and the regime recipes."""

from pathlib import Path

import pytest
import torch
import yaml
from helpers.fits import quiet_trainer
from helpers.objectives import instantiate_objective
from helpers.overlays import QUICKSTART, config_files, meant_config, printed_config, printed_of, restated
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_spec.checkpoint import CKPT_KEY, build, describe
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.decoding.verify import rejection_accept
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.drafters.base import DraftOutput
from lightning_spec.module import DraftModule
from lightning_spec.objectives import GRPO, StepContext
from lightning_spec.objectives.grpo import (
    clipped_surrogate,
    group_advantages,
    sample_tokens,
    simulated_accept,
)
from lightning_spec.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parents[2]
REGIMES = sorted((ROOT / "experiments" / "regimes").glob("*_then_grpo.yaml"))


# ------------------------------------------------------------------------------------------ pure functions
def test_group_advantages_by_hand():
    rewards = torch.tensor([[[0.0, 1.0, 2.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 4.0]]])  # (1, 3, 4)
    adv = group_advantages(rewards)
    s = (5 / 3) ** 0.5  # sample std of 0..3: Σ (r - 1.5)² / 3 = 5/3
    want = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (s + 1e-6)
    assert torch.allclose(adv[0, 0], want, atol=1e-6)
    assert torch.allclose(adv[0, 0], torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895]), atol=1e-5)
    assert torch.equal(adv[0, 1], torch.zeros(4))  # one reward value: nothing to prefer
    assert torch.allclose(adv[0, 2], torch.tensor([-0.5, -0.5, -0.5, 1.5]), atol=1e-5)  # std of (0,0,0,4) = 2
    assert torch.allclose(adv.sum(-1), torch.zeros(1, 3), atol=1e-6)


def test_clipped_surrogate_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]))
    ratio = torch.tensor([1.4, 0.7, 1.1, 1.4, 0.7])
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0, 1.0])
    logq = (old + ratio.log()).requires_grad_()
    loss = clipped_surrogate(logq, old, adv, clip=0.2)
    # ρ > 1 + ε, Â > 0: clipped at 1.2; ρ < 1 - ε, Â < 0: clipped at 0.8; inside: ρÂ; ρ > 1 + ε with Â < 0 and
    # ρ < 1 - ε with Â > 0: the unclipped term is the min, kept
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, -2.2, 1.4, -0.7]), atol=1e-6)
    loss.sum().backward()
    # d/dlogq of -ρÂ is -ρÂ where unclipped; 0 where the clip binds
    assert torch.allclose(logq.grad, torch.tensor([0.0, 0.0, -2.2, 1.4, -0.7]), atol=1e-6)


def test_clipped_surrogate_at_ratio_one_is_the_policy_gradient():
    logq = torch.tensor([-0.3, -2.0, -1.1], requires_grad=True)
    adv = torch.tensor([0.5, -1.5, 2.0])
    loss = clipped_surrogate(logq, logq.detach(), adv, clip=0.2)
    assert torch.allclose(loss, -adv)
    loss.sum().backward()
    assert torch.allclose(logq.grad, -adv)


def test_sample_tokens_inverse_cdf_by_hand():
    q = torch.tensor([[0.2, 0.0, 0.8], [0.5, 0.5, 0.0]])  # (K=2, Vd=3)
    u = torch.tensor([[0.1, 0.1], [0.2, 0.5], [0.99, 0.999]])  # (G=3, K=2)
    tokens = sample_tokens(q, u)
    assert tokens.tolist() == [[0, 0], [2, 1], [2, 1]]  # a token of probability 0 is never drawn
    # many draws follow q
    g = torch.Generator().manual_seed(0)
    draws = sample_tokens(q, torch.rand(20000, 2, generator=g))
    freq = torch.stack([torch.bincount(draws[:, k], minlength=3) for k in range(2)]).float() / 20000
    assert torch.allclose(freq, q, atol=0.01)


def test_simulated_accept_greedy_by_hand():
    tokens = torch.tensor([[1, 2, 3], [1, 5, 3], [4, 2, 3], [1, 2, 0]])  # (G=4, K=3)
    argmax = torch.tensor([1, 2, 3])
    assert simulated_accept(tokens, argmax, None, None, greedy=True).tolist() == [3, 1, 0, 2]
    valid = torch.tensor([True, True, False])  # an unsupervised slot ends the run
    assert simulated_accept(tokens, argmax, None, None, greedy=True, valid=valid).tolist() == [2, 1, 0, 2]


def test_simulated_accept_rejection_by_hand():
    p = torch.tensor([[0.5, 0.5], [0.2, 0.8]])  # (K=2, Vd=2)
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    # draft [0, 1]: ratios min(1, .5/.25) = 1 and min(1, .8/.5) = 1: always accepted
    # draft [1, 0]: ratios .5/.75 = 2/3 and .2/.5 = 0.4
    tokens = torch.tensor([[0, 1], [1, 0], [1, 0], [1, 0], [1, 0]])  # (G=5, K=2)
    u = torch.tensor([[0.99, 0.99], [0.6, 0.3], [0.7, 0.1], [0.6, 0.5], [0.66, 0.39]])
    got = simulated_accept(tokens, p, q, u, greedy=False)
    assert got.tolist() == [2, 2, 0, 1, 2]


def test_simulated_accept_is_the_engines_rejection_rule():
    """Same uniforms, same accepted length as decoding/verify.py's ``rejection_accept``."""
    g = torch.Generator().manual_seed(3)
    for trial in range(50):
        k, v = 4, 6
        p = torch.rand(k + 1, v, generator=g).pow(3).softmax(-1)
        q = torch.rand(k, v, generator=g).pow(3).softmax(-1)
        tokens = torch.multinomial(q, 1, generator=g)[:, 0]  # (K,)
        want, _ = rejection_accept(tokens, q, p, torch.Generator().manual_seed(trial))
        u = torch.rand(k, generator=torch.Generator().manual_seed(trial))  # the engine's first K draws
        got = simulated_accept(tokens[None], p[:k], q, u[None], greedy=False)
        assert int(got[0]) == want


# ------------------------------------------------------------------------------------------ the objective
def make_draft(n=2, a=3, k=3, vd=5, seed=0, dtype=torch.float64, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, a, k, vd, generator=g, dtype=dtype).requires_grad_()
    target = sharp * torch.randn(n, a, k, vd, generator=g, dtype=dtype)
    valid = torch.ones(n, a, k, dtype=torch.bool)
    if n > 1 and a > 2:
        valid[0, 1, 2] = False  # a block cut by the end of the answer
        valid[1, 2] = False  # a padding anchor
    anchors = torch.arange(a).repeat(n, 1) * 4 + 1
    labels = torch.zeros(n, a, k, dtype=torch.long)
    draft = DraftOutput(logits, labels, valid, anchors)
    return draft, StepContext(target_logits=target, reference_logits=logits.detach().clone()), logits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gradient_is_minus_the_advantage_times_the_score(temperature):
    """With ρ = 1 and the reference equal to the drafter, ∇ logits = -Σ Â_g (onehot(x̃) - q) / den over valid slots."""
    obj = GRPO(SamplingConfig(temperature=temperature), group_size=6, kl_weight=0.05)
    draft, ctx, logits = make_draft()
    terms = obj(draft, ctx)
    (terms.num / terms.den).backward()

    with torch.no_grad():
        q = logits.softmax(-1)  # T = 1 in both modes (draft_temperature 1 when greedy)
        u = obj.uniforms(draft, ctx)
        tokens = sample_tokens(q, u[:, :, 0])  # (N, A, G, K)
        p = ctx.target_logits.argmax(-1) if temperature == 0 else ctx.target_logits.softmax(-1)
        rewards = simulated_accept(tokens, p, q, u[:, :, 1], temperature == 0, valid=draft.valid)
        adv = group_advantages(rewards.double())  # (N, A, G)
        onehot = torch.nn.functional.one_hot(tokens, q.shape[-1]).double()  # (N, A, G, K, Vd)
        score = onehot - q[:, :, None]
        mask = draft.valid[:, :, None, :, None]
        den = 6 * draft.valid.sum()
        want = -(adv[..., None, None] * score * mask).sum(2) / den  # (N, A, K, Vd)
    assert float(terms.den) == float(den)
    assert torch.allclose(logits.grad, want, atol=1e-7)  # sampling.logprobs works in float32
    assert rewards.float().std() > 0  # the example is not degenerate: advantages are not all 0
    assert float(terms.metrics["grpo_kl"]) == 0.0
    anchors = draft.valid.any(-1)
    assert torch.isclose(terms.metrics["grpo_reward_mean"], rewards[anchors].double().mean())


def test_kl_term_is_zero_at_the_reference_and_kl_otherwise():
    draft, ctx, logits = make_draft()
    zero = GRPO(kl_weight=0.0)(draft, ctx)
    with_kl = GRPO(kl_weight=0.5)(draft, ctx)
    assert float(with_kl.metrics["grpo_kl"]) == 0.0
    assert torch.allclose(with_kl.num, zero.num)  # KL(q ‖ q) = 0
    (g_kl,) = torch.autograd.grad(with_kl.num, logits)
    (g0,) = torch.autograd.grad(zero.num, logits)
    assert torch.allclose(g_kl, g0)  # and its gradient vanishes there

    draft, ctx, logits = make_draft()
    ctx = StepContext(target_logits=ctx.target_logits, reference_logits=torch.zeros_like(logits))  # uniform reference
    terms = GRPO(kl_weight=0.5)(draft, ctx)
    logq = logits.detach().log_softmax(-1)
    kl = (logq.exp() * (logq + torch.log(torch.tensor(5.0, dtype=logq.dtype)))).sum(-1)  # KL(q ‖ uniform)
    assert torch.isclose(terms.metrics["grpo_kl"], kl[draft.valid].mean())
    base = GRPO(kl_weight=0.0)(draft, ctx)
    assert torch.isclose(terms.value - base.value, 0.5 * kl[draft.valid].mean())
    with pytest.raises(ValueError, match="reference_logits"):
        GRPO(kl_weight=0.5)(draft, StepContext(target_logits=ctx.target_logits))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grpo_steps_raise_the_expected_accepted_length(temperature):
    """A few GRPO steps on free logits raise the exact expected accepted length of the drafter: greedy,
    Σ_k Π_{j≤k} q_j(argmax p_j) (EAL's quantity, drafts drawn at T = 1); under sampling Σ_k Π_{j≤k} α_j."""
    draft, ctx, logits = make_draft(n=1, a=2, k=3, vd=5, sharp=3.0)
    draft.valid[:] = True
    p = ctx.target_logits.softmax(-1)

    def expected_length(z):
        q = z.softmax(-1)
        if temperature == 0:
            acc = q.gather(-1, p.argmax(-1, keepdim=True))[..., 0]
        else:
            acc = torch.minimum(p, q).sum(-1)
        return float(acc.cumprod(-1).sum())

    start = expected_length(logits.detach())
    opt = torch.optim.SGD([logits], lr=2.0)
    for step in range(30):
        obj = GRPO(SamplingConfig(temperature=temperature), group_size=8, kl_weight=0.0, seed_salt=step)
        ctx = StepContext(target_logits=ctx.target_logits, reference_logits=logits.detach().clone())
        opt.zero_grad()
        terms = obj(draft, ctx)
        (terms.num / terms.den).backward()
        opt.step()
    assert expected_length(logits.detach()) > start + 0.8  # measured +1.5 and +1.05; shuffled rewards: ±0.01


def test_chunks_give_the_same_value_metrics_and_gradient():
    for temperature in (0.0, 1.0):
        obj = GRPO(SamplingConfig(temperature=temperature), group_size=4, kl_weight=0.1)
        draft, ctx, logits = make_draft()
        ctx = StepContext(target_logits=ctx.target_logits,
                          reference_logits=ctx.reference_logits + 0.3 * torch.randn_like(logits))
        whole = obj(draft, ctx)
        (g_whole,) = torch.autograd.grad(whole.num, logits)
        chunked = obj(draft, ctx, chunk=1)
        (g_chunk,) = torch.autograd.grad(chunked.num, logits)
        assert torch.allclose(whole.num, chunked.num) and torch.equal(whole.den, chunked.den)
        for name in ("grpo_reward_mean", "grpo_kl"):
            assert torch.allclose(whole.metrics[name], chunked.metrics[name])
        assert torch.allclose(g_whole, g_chunk)


def test_draws_follow_the_examples_anchor_seed_not_the_batch():
    """The module gives the batch's anchor_seed in the step's context (``ctx.seeds``); a row's draws are the same
    alone or next to another row, and another seed draws others."""
    obj = GRPO(group_size=4)
    draft, _, _ = make_draft()
    ctx = StepContext(seeds=torch.tensor([11, 22]))
    both = obj.uniforms(draft, ctx)
    row, _, _ = make_draft(n=1)
    alone = DraftOutput(row.logits, row.labels, row.valid, draft.anchors[1:])
    assert torch.equal(obj.uniforms(alone, StepContext(seeds=torch.tensor([22])))[0], both[1])
    assert not torch.equal(obj.uniforms(alone, StepContext(seeds=torch.tensor([23])))[0], both[1])
    assert not torch.equal(both[0, 0], both[0, 1])  # anchors of one row draw apart
    assert torch.equal(ctx.chunk(torch.tensor([0])).seeds, ctx.seeds)  # per example: whole in every chunk


def test_user_errors_name_the_field():
    with pytest.raises(ValueError, match="objective.group_size"):
        GRPO(group_size=1)
    with pytest.raises(ValueError, match="objective.draft_temperature"):
        GRPO(draft_temperature=0.0)
    with pytest.raises(ValueError, match="objective.clip"):
        GRPO(clip=1.5)
    with pytest.raises(ValueError, match="objective.kl_weight"):
        GRPO(kl_weight=-1.0)


def test_describe_rebuilds_grpo():
    obj = GRPO(SamplingConfig(temperature=0.7, top_k=20), group_size=3, draft_temperature=0.5, clip=0.1,
               kl_weight=0.2, bonus=True, seed_salt=7)
    again = build(describe(obj))
    assert type(again) is GRPO and describe(again) == describe(obj)
    assert again.sampling == SamplingConfig(temperature=0.7, top_k=20) and again.bonus and again.seed_salt == 7


# --------------------------------------------------------------------------------------------- a second stage
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grpo_stage_trains_from_a_first_stage_checkpoint(trained_fit, data_files, tmp_path, temperature):
    _, path, _ = trained_fit
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=8, draft_vocab_size=100)
    objective = GRPO(SamplingConfig(temperature=temperature), group_size=4, kl_weight=0.05)
    module = DraftModule(drafter, objective, target="tiny-random", lr=1e-3, init_from=str(path))
    assert module._reference is not None  # the frozen start the KL pulls towards
    start = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    trainer = quiet_trainer(max_steps=3, enable_checkpointing=True, default_root_dir=tmp_path, log_every_n_steps=1,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "grpo", save_last=True)])
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert 0 <= float(metrics["train/grpo_reward_mean"]) <= 3
    assert float(metrics["train/grpo_kl"]) >= 0
    moved = module.drafter.state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in start.items() if v.is_floating_point())
    ckpt = torch.load(tmp_path / "grpo" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt[CKPT_KEY]["parent"]["path"] == str(path)
    assert ckpt["hyper_parameters"]["objective"]["class_path"] == "lightning_spec.objectives.grpo.GRPO"


# ------------------------------------------------------------------------------------------------ recipes
def test_both_regime_recipes_exist():
    assert {p.stem for p in REGIMES} == {"eal_then_grpo", "wtv_then_grpo"}


@pytest.mark.parametrize("path", REGIMES, ids=[p.stem for p in REGIMES])
def test_regime_recipe_is_an_overlay_with_its_two_commands(path):
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    stage1 = "experiments/objectives/" + path.stem.split("_then_")[0] + ".yaml"
    assert f"lightning-spec fit -c experiments/quickstart.yaml -c {stage1}" in header
    assert (ROOT / stage1).is_file()
    assert f"-c experiments/regimes/{path.name} --model.init_from RUN/checkpoints/last.ckpt" in header
    files = config_files(path)
    assert files == [QUICKSTART, path]
    assert restated(yaml.safe_load(path.read_text()), yaml.safe_load(QUICKSTART.read_text())) == []
    printed = printed_config(*files)
    assert printed == printed_of(meant_config(files))
    assert printed["model"]["objective"]["class_path"] == "lightning_spec.objectives.GRPO"
    assert printed["model"]["lr"] < yaml.safe_load(QUICKSTART.read_text())["model"]["lr"]


@pytest.mark.parametrize("path", REGIMES, ids=[p.stem for p in REGIMES])
def test_regime_recipe_serves_as_its_first_stage(path):
    """EAL's GRPO stage verifies greedily, WTV's at T = 1, the temperature WTV trained at."""
    objective = instantiate_objective(path)
    assert isinstance(objective, GRPO)
    if path.stem.startswith("eal"):
        assert objective.sampling.greedy and objective.draft_temperature > 0
    else:
        wtv = instantiate_objective(ROOT / "experiments" / "objectives" / "wtv.yaml")
        assert objective.sampling == SamplingConfig(temperature=wtv.temperature)
