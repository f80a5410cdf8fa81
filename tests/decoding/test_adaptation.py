"""Cost-aware adaptation at decode time (SpecBlock, Shi et al. 2026, arXiv 2605.07243; the design is DERIVED): the
target still decides every token (greedy output = plain greedy, token for token) while the drafter's weights move;
the measured gain of an update is exact (it equals the realised MAL change on a repeated window); the decision rule
on hand values; the scopes' parameter names per family; the update's time inside ``Generation.seconds``; and
``evaluate --mode online --decodings '[chain, adapt]'`` end to end."""

import json
import math

import pytest
import torch
from helpers.offline import saved_drafters

from lightning_spec import generate
from lightning_spec.adaptation import (
    ArmStats,
    CostAwareAdapter,
    decide,
    expected_saving,
    scope_parameters,
)
from lightning_spec.decoding.plans import Adapt
from lightning_spec.drafters import Eagle3Drafter, MedusaDrafter, SpecBlockDrafter


def prompts(vocab: int, n: int, length: int = 10) -> list[list[int]]:
    return [torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def eagle3(target, block_size: int = 3) -> Eagle3Drafter:
    torch.manual_seed(0)
    d = Eagle3Drafter(block_size=block_size, draft_vocab_size=48)
    d.bind(target)
    d.vocab.set_from_counts(torch.rand(target.vocab_size))
    return d.eval()


# ------------------------------------------------------------------------------------------------ losslessness
@pytest.mark.parametrize("family, scope", [("block", "all"), ("eagle3", "last")])
def test_greedy_output_is_plain_greedy_while_the_drafter_adapts(diverse_target, make_block_drafter, family, scope):
    drafter = make_block_drafter(diverse_target, block_size=3) if family == "block" else eagle3(diverse_target)
    flags = {n: p.requires_grad for n, p in drafter.named_parameters()}
    before = weights(drafter)
    adapter = CostAwareAdapter(drafter, diverse_target, Adapt(lr=1e-2, steps=2, force=scope))
    for prompt in prompts(diverse_target.vocab_size, 4):
        out = adapter.generate(prompt, 16)
        assert out.tokens == generate(diverse_target, prompt, 16).tokens
    assert [d.arm for d in adapter.history] == [scope] * 4 and all(d.forced for d in adapter.history)
    after = weights(drafter)
    trained = set(scope_parameters(drafter, scope))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trained  # only the scope moved
    assert not drafter.training and {n: p.requires_grad for n, p in drafter.named_parameters()} == flags
    assert all(p.grad is None for p in drafter.parameters())


def test_greedy_output_with_a_tree_is_plain_greedy(diverse_target, make_block_drafter):
    drafter = make_block_drafter(diverse_target, block_size=3)
    adapter = CostAwareAdapter(drafter, diverse_target,
                               Adapt(decoding={"kind": "tree", "nodes": 8, "top_k": 2}, lr=1e-2, force="head"))
    for prompt in prompts(diverse_target.vocab_size, 3):
        assert adapter.generate(prompt, 12).tokens == generate(diverse_target, prompt, 12).tokens
    assert [d.measured_arm for d in adapter.history] == [None, "head", "head"]


# ---------------------------------------------------------------------------------------------- the gain measured
def test_measured_gain_is_the_realised_mal_change_on_a_repeated_window(tiny_target, make_block_drafter):
    """On the same prompt twice, greedy decoding commits the same tokens, so the drafter before the last update
    scored on window w decodes it as window w - 1 was decoded: the exact offline gain must equal MAL_w - MAL_{w-1}
    of real decoding. The drafter memorises the window, so MAL must rise."""
    drafter = make_block_drafter(tiny_target, block_size=3)
    adapter = CostAwareAdapter(drafter, tiny_target, Adapt(lr=1e-2, steps=4, force="all"))
    (prompt,) = prompts(300, 1, length=12)
    for _ in range(6):
        adapter.generate(prompt, 32)
    h = adapter.history
    for prev, cur in zip(h, h[1:]):
        assert cur.measured_arm == "all"
        assert cur.measured_gain == pytest.approx(cur.mal - prev.mal, abs=1e-6)
    assert h[-1].mal > h[0].mal + 0.5
    stats = adapter.arms["all"]
    assert stats.n == 5 and stats.updates == 6


def test_untried_scopes_come_first_then_the_rule(tiny_target, make_block_drafter):
    drafter = make_block_drafter(tiny_target, block_size=3)
    adapter = CostAwareAdapter(drafter, tiny_target, Adapt(lr=1e-2, steps=2))
    (prompt,) = prompts(300, 1, length=12)
    for _ in range(4):
        adapter.generate(prompt, 16)
    assert [d.arm for d in adapter.history[:3]] == ["head", "last", "all"]
    assert [d.measured_arm for d in adapter.history] == [None, "head", "last", "all"]
    assert all(s.n == 1 and s.seconds > 0 for s in adapter.arms.values())
    last = adapter.history[3]
    assert last.scores and all(math.isfinite(v) for v in last.scores.values())
    best = max(last.scores, key=last.scores.get)
    assert last.arm == (best if last.scores[best] > 0 else "none")


# ------------------------------------------------------------------------------------------------- the decision
def test_expected_saving_by_hand():
    assert expected_saving(1000, 0.01, 2.0, 0.5) == pytest.approx(1000 * 0.01 * (1 / 2 - 1 / 2.5))  # 1.0 s
    assert expected_saving(1000, 0.01, 2.0, -0.5) == pytest.approx(1000 * 0.01 * (1 / 2 - 1 / 1.5))  # a loss
    assert expected_saving(1000, 0.01, 2.0, -5.0) == pytest.approx(1000 * 0.01 * (1 / 2 - 1))  # MAL stays >= 1
    assert expected_saving(1000, 0.01, 2.0, 0.0) == 0.0


def test_decision_rule_by_hand():
    common = dict(mal=2.0, seconds_per_round=0.01, horizon_tokens=1000, exploration=0.0, windows=10)
    # saving 1.0 s beats a cost of 0.5 s: applied
    arm, scores, saving = decide({"head": ArmStats(n=4, gain=0.5, cost=0.5)}, **common)
    assert arm == "head" and saving == pytest.approx(1.0) and scores["head"] == pytest.approx(0.5)
    # the same saving against 1.5 s (update 1.2 + measuring 0.3): not worth it
    arm, scores, saving = decide({"head": ArmStats(n=4, gain=0.5, cost=1.2, score_cost=0.3)}, **common)
    assert arm == "none" and saving == 0.0 and scores["head"] == pytest.approx(-0.5)
    # a gain that hurts is never applied, whatever the cost
    assert decide({"all": ArmStats(n=4, gain=-0.2, cost=0.0)}, **common)[0] == "none"
    # an untried arm goes first, even next to a profitable one
    arm, scores, _ = decide({"head": ArmStats(n=4, gain=0.5, cost=0.5), "last": ArmStats()}, **common)
    assert arm == "last" and scores["last"] == math.inf
    # the largest saving minus cost wins: head 1.0 - 0.9, last 1.6667 - 1.0
    arm, scores, _ = decide({"head": ArmStats(n=4, gain=0.5, cost=0.9), "last": ArmStats(n=4, gain=1.0, cost=1.0)},
                            **common)
    assert arm == "last" and scores["last"] == pytest.approx(1000 * 0.01 * (1 / 2 - 1 / 3) - 1.0)


def test_the_ucb_bonus_shrinks_with_the_arms_trials():
    # gain 0, c = 1, ln n = 4: n_a = 4 gives Δ_ucb = 1 (saving 1.667 > cost 1); n_a = 16 gives 0.5 (saving 1.0 = cost)
    common = dict(mal=2.0, seconds_per_round=0.01, horizon_tokens=1000, exploration=1.0, windows=math.exp(4))
    arm, scores, saving = decide({"all": ArmStats(n=4, gain=0.0, cost=1.0)}, **common)
    assert arm == "all" and saving == pytest.approx(10 * (1 / 2 - 1 / 3))
    arm, scores, _ = decide({"all": ArmStats(n=16, gain=0.0, cost=1.0)}, **common)
    assert arm == "none" and scores["all"] == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------------------------------------------- scopes
def test_scopes_of_a_block_drafter(diverse_target, make_block_drafter):
    drafter = make_block_drafter(diverse_target, block_size=3, num_layers=2)
    names = [n for n, _ in drafter.named_parameters()]
    assert scope_parameters(drafter, "head") == ["norm.weight"]
    last = scope_parameters(drafter, "last")
    assert last == [n for n in names if n.startswith("layers.1.")] + ["norm.weight"] and len(last) == 10
    assert scope_parameters(drafter, "all") == names
    with pytest.raises(ValueError, match="scope 'bias' is unknown"):
        scope_parameters(drafter, "bias")


def test_scopes_of_an_eagle3_drafter(diverse_target):
    drafter = eagle3(diverse_target)
    assert scope_parameters(drafter, "head") == ["norm.weight"]
    last = scope_parameters(drafter, "last")
    assert last[-1] == "norm.weight" and all(n.startswith("layer.") for n in last[:-1]) and len(last) == 11
    assert "fc.weight" not in last and "fc.weight" in scope_parameters(drafter, "all")


def test_scopes_of_other_families_and_empty_scopes(diverse_target):
    spec = SpecBlockDrafter(block_size=4, num_layers=2)
    spec.bind(diverse_target)
    head = scope_parameters(spec, "head")
    assert head[0] == "norm.weight" and {n.split(".")[0] for n in head[1:]} == {"rank_head"}
    assert "shifts.0.weight" not in scope_parameters(spec, "last")  # between the layers, not after the last
    medusa = MedusaDrafter(block_size=3)
    medusa.bind(diverse_target)
    adapter = CostAwareAdapter(medusa, diverse_target)
    assert adapter.skipped == ["head", "last"] and list(adapter.scopes) == ["all"]
    with pytest.raises(ValueError, match="not an available scope of MedusaDrafter"):
        CostAwareAdapter(medusa, diverse_target, Adapt(force="last"))
    with pytest.raises(ValueError, match="decoding.scopes of kind 'adapt' must be a non-empty list"):
        Adapt(scopes=["everything"])
    with pytest.raises(ValueError, match="decoding.lr of kind 'adapt' must be a number > 0"):
        Adapt(lr=0.0)
    with pytest.raises(ValueError, match="decoding.decoding of kind 'adapt' must be a full chain"):
        Adapt(decoding={"kind": "chain", "length": 2})


# ------------------------------------------------------------------------------------------------------ timing
def test_update_time_is_inside_the_window_seconds(diverse_target, make_block_drafter, monkeypatch):
    """The adapter's update is paid inside the window's ``seconds``: with the engine's and the adapter's clocks
    injected, every round of decoding takes 0.125 s and the update 0.25 s, exactly."""
    from helpers.clock import FakeClock

    import lightning_spec.adaptation as adaptation
    import lightning_spec.decoding.engine as engine

    clock = FakeClock()
    monkeypatch.setattr(engine, "time", clock)
    monkeypatch.setattr(adaptation, "time", clock)
    drafter = make_block_drafter(diverse_target, block_size=3)
    adapter = CostAwareAdapter(drafter, diverse_target, Adapt(lr=1e-2, force="head"))
    real = adapter._update

    def slow(*args, **kwargs):
        clock.sleep(0.25)
        return real(*args, **kwargs)

    draft = engine.draft

    def timed_draft(*args, **kwargs):  # a round's own time, read by the engine's clock
        clock.advance(0.125)
        return draft(*args, **kwargs)

    monkeypatch.setattr(engine, "draft", timed_draft)
    monkeypatch.setattr(adapter, "_update", slow)
    out = adapter.generate(prompts(diverse_target.vocab_size, 1)[0], 8)
    d = adapter.history[0]
    assert d.arm == "head" and d.update_seconds == 0.25 and d.score_seconds == 0.0
    assert d.rounds > 0 and d.decode_seconds == 0.125 * d.rounds
    assert out.seconds == d.decode_seconds + d.overhead_seconds == 0.125 * d.rounds + 0.25


# --------------------------------------------------------------------------------------------------- evaluate
def test_evaluate_online_with_adaptation(in_tmp, tiny_target, capsys):
    from lightning_spec.cli import main

    (a,) = saved_drafters(tiny_target, in_tmp, seeds=(0,))
    main(["evaluate", "--mode", "online", "--drafters", f"[{a}, {a}]", "--sources", "[mt-bench, humaneval]",
          "--prompts_per_source", "2", "--max_new_tokens", "8", "--temperature", "0", "--n_resamples", "100",
          "--decodings", "[chain, {kind: adapt, lr: 1e-2, horizon_tokens: 100000}]", "--output", "online.json",
          "--progress", "false"])
    out = capsys.readouterr().out
    result = json.loads((in_tmp / "online.json").read_text())
    assert set(result["arms"]) == {"drafter0 (chain)", "drafter0 (adapt (chain))"}  # one checkpoint, two plans
    plain, adapted = result["arms"]["drafter0 (chain)"], result["arms"]["drafter0 (adapt (chain))"]
    assert adapted["tokens"] == plain["tokens"]  # greedy: the target decides the same tokens
    assert adapted["tokens_per_s"] > 0 and adapted["speedup"] > 0 and 1.0 <= adapted["mal"] <= 4.0
    (summary,) = adapted["adaptation"]
    assert summary["windows"] == 4 and sum(s["updates"] for s in summary["arms"].values()) >= 3  # each tried once
    assert "adaptation" not in plain and adapted["checkpoints"] == [a]
    assert adapted["decoding"] == {"kind": "adapt", "decoding": {"kind": "chain"}, "lr": 0.01, "horizon_tokens": 100000}
    assert "drafter0 (adapt (chain))" in out and "s adapting" in out


def test_adapt_needs_online_mode(in_tmp, tiny_target, capsys):
    from lightning_spec.cli import main

    (a,) = saved_drafters(tiny_target, in_tmp, seeds=(0,))
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--drafters", f"[{a}]", "--rollouts", "r", "--decoding", "adapt"])
    assert exit_.value.code == 2 and "--mode online" in capsys.readouterr().err
