"""``decoding: auto`` (``decoding/auto/``): the setting whose speedup over plain decoding has the highest lower
confidence bound over the calibration prompts, when that bound beats plain by the margin; else plain.

- with the verify cost linear in the query tokens (a draft never pays) it keeps plain decoding; with a flat verify
  cost and free drafts it picks the setting whose tokens per round have the highest lower bound;
- a calibration set whose answers partly repeat themselves, where the point estimate favours n-gram lookup, does
  not make it pick a setting slower than plain on answers that do not repeat (issue 33); the margin; one
  calibration prompt keeps plain decoding;
- with costs measured on this machine the pick's bound clears the margin, the loop's bookkeeping per round is
  measured, and the MAL it expects on its calibration prompts is the MAL the engine then reaches on them;
- under sampling each estimate's rounds are the offline evaluator's on the same outputs;
- calibration prompts: per domain, held out from the decoded ones, with the target's chat-template arguments (the
  callback's and ``lightning-spec evaluate``'s);
- the t quantile, the verify interpolation and the report.
"""

import dataclasses
import math
import random
import statistics
from types import SimpleNamespace

import pytest
import torch
from helpers.decoding import MAX_NEW, random_prompts
from helpers.families import trained

from lightning_spec.decoding.auto import (
    MARGIN,
    PLAIN,
    Choice,
    Costs,
    Estimate,
    candidates,
    choose_decoding,
    decide,
    estimate,
    on_prompts,
    pick,
    speedup_bound,
    with_bounds,
)
from lightning_spec.decoding.plans import Auto, Chain, Ngram
from lightning_spec.paired import family_confidence, t_quantile
from lightning_spec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def prompts(diverse_target):
    return random_prompts(diverse_target.vocab_size, lengths=(3, 7, 12), seed=1)


@pytest.fixture(scope="module")
def drafter(diverse_target, prompts):
    return trained("dflash", diverse_target, random_prompts(diverse_target.vocab_size), k=3, steps=10)


def flat_or_linear(drafter, per_token: float) -> Costs:
    """1 ms for the anchor, ``per_token`` ms for each further query token; drafts are free."""
    verify = {t: 1e-3 + per_token * 1e-3 * (t - 1) for t in (1, 2, 5, 9, 33)}
    return Costs(verify=verify, tree_verify=dict(verify), draft=dict.fromkeys(candidates(drafter), 0.0))


def test_a_verify_cost_linear_in_tokens_keeps_plain_decoding(diverse_target, drafter, prompts):
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=1.0))
    assert choice.plan == PLAIN and choice.plan.resolve(drafter).proposer is None
    assert any(e.mal > 1 for e in choice.estimates)  # some settings were accepted: they just cannot pay


def test_a_flat_verify_cost_picks_the_highest_lower_bound_on_tokens_per_round(diverse_target, drafter):
    """Every round costs the same: a plan's speedup on a prompt is its MAL there. The candidate is the plan whose
    per-prompt MALs on every other prompt have the highest lower bound there (not necessarily the highest pooled
    MAL), picked because its bound on the other prompts clears the margin."""
    prompts = random_prompts(diverse_target.vocab_size, lengths=(1, 6, 13, 4, 9, 3, 11, 7, 5, 12, 2, 8))
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=0.0))
    verdict = choice.verdict
    assert choice.plan != PLAIN and choice.expected.mal > 1 and verdict.candidate == choice.plan
    assert verdict.confirm_prompts == 6 and verdict.confirmed > 1 + MARGIN
    chosen_on = with_bounds([on_prompts(e, list(range(0, 12, 2))) for e in choice.estimates], joint=False)
    assert choice.plan == max((e for e in chosen_on if e.lcb), key=lambda e: e.lcb).plan
    assert len(choice.estimates) == len(candidates(drafter))
    plain = next(e for e in choice.estimates if e.plan == PLAIN)
    for e in choice.estimates:  # a lower bound of the pooled speedup: below it
        assert e.lcb <= plain.seconds / e.seconds + 1e-12


def test_measured_costs_pick_only_a_setting_whose_bound_clears_the_margin(diverse_target, drafter, prompts):
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW)
    assert choice.plan == PLAIN or choice.expected.lcb > 1 + choice.margin
    # the loop's own seconds per round beyond the timed verify, from the timed calibration decodes
    assert choice.costs.overhead[PLAIN] >= -choice.costs.verify_seconds(1, tree=False)
    assert choice.plan == PLAIN or choice.plan in choice.costs.overhead  # the pick's own, from a timed decode
    # the calibration is exact: decoding the calibration prompts with the pick commits the expected MAL
    outs = [choice.generate(diverse_target, p, MAX_NEW, seed=i) for i, p in expected_on(choice, prompts)]
    assert sum(len(o.tokens) for o in outs) / sum(o.rounds for o in outs) == pytest.approx(choice.expected.mal)
    assert choice.describe(measured_speedup=1.0).startswith(f"decoding auto: {choice.plan.label}")
    assert "<- picked" in choice.table() and "LCB" in choice.table()


def test_a_pick_from_timed_costs_has_its_own_bookkeeping_measured(make_random_llama):
    """A target whose greedy answers loop (initialised at 0.05): n-gram lookup is accepted in long runs, and on this
    tiny model a wider verify costs about a 1-token one, so a lookup setting is picked from costs timed here, after
    a decode of a calibration prompt with it measured its bookkeeping per round (as the calibration decodes did
    plain decoding's). The costs are timed: alone the chain of 10 is expected at ~2.2x plain (bound ~1.8x), but a
    suite's other worker on the second core once squeezed it to 1.26x; up to three calibrations, as a user would
    rerun on a busy machine."""
    target = make_random_llama(init=0.05)
    prompts = random_prompts(target.vocab_size, lengths=(4, 6, 9, 12, 15), seed=3)  # lookup MAL 2.3-3.8 each
    for _ in range(3):
        choice = choose_decoding(target, None, prompts, max_new_tokens=96)
        if isinstance(choice.plan, Ngram):
            break
    assert isinstance(choice.plan, Ngram) and choice.expected.lcb > 1 + choice.margin, choice.table()
    assert set(choice.costs.overhead) >= {PLAIN, choice.plan}
    outs = [choice.generate(target, p, 96, seed=i) for i, p in expected_on(choice, prompts)]
    assert sum(len(o.tokens) for o in outs) / sum(o.rounds for o in outs) == pytest.approx(choice.expected.mal)


def expected_on(choice: Choice, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """The calibration prompts (index, ids) a pick's expected figures are taken on: those that confirmed it under
    the split rule, else all."""
    split = choice.plan != PLAIN and choice.verdict is not None and choice.verdict.confirm
    held_out = choice.verdict.confirm if split else range(len(prompts))
    return [(i, prompts[i]) for i in held_out]


# ------------------------------------------------------------------------------ the judge (issue 33, item 3)
def distinct_tokens(n: int, gen: torch.Generator) -> list[int]:
    """``n`` different tokens (5..94 of ``diverse_target``'s 96): an answer that never repeats itself."""
    return (torch.randperm(90, generator=gen)[:n] + 5).tolist()


def test_a_calibration_set_that_repeats_itself_does_not_pick_a_setting_slower_on_one_that_does_not(diverse_target):
    """The quickstart's failure (issue 33): two calibration answers repeated themselves, n-gram lookup accepted
    long runs on them, the point estimate said 1.42x and prompts that did not repeat measured 0.69x. Here half the
    calibration answers loop (a 4-token pattern ten times) and half never repeat; the evaluation answers never
    repeat. Verify costs 0.5 ms per further query token over 1 ms, and a lookup costs 0.2 ms a round, so n-gram
    lookup pays only where it is accepted in long runs."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    looping = [distinct_tokens(4, gen) * 10 for _ in range(3)]
    calibration = [answer for pair in zip(looping, [distinct_tokens(40, gen) for _ in range(3)]) for answer in pair]
    evaluation = list(zip(prompts, [distinct_tokens(40, gen) for _ in range(6)]))
    ngram = [Ngram(length=10), Ngram(length=10, nodes=8, top_k=3)]
    verify = {t: 1e-3 + 0.5e-3 * (t - 1) for t in (1, 2, 5, 9, 17)}
    costs = Costs(verify=verify, tree_verify=dict(verify), draft={PLAIN: 0.0, **dict.fromkeys(ngram, 0.2e-3)})
    choice = choose_decoding(diverse_target, None, prompts, plans=[PLAIN, *ngram], costs=costs,
                             outputs=calibration)
    by = {e.plan: e for e in choice.estimates}
    # the old rule (the highest point estimate, if above plain's) would have picked the n-gram chain
    assert max(by.values(), key=lambda e: e.tokens_per_s).plan == ngram[0]
    assert by[ngram[0]].tokens_per_s > by[PLAIN].tokens_per_s
    ratios = [p / s for p, s in zip(by[PLAIN].prompt_seconds, by[ngram[0]].prompt_seconds)]
    assert max(ratios[0::2]) > 1.4 and max(ratios[1::2]) < 1  # fast where answers loop, slow where they do not
    # which is slower on answers that do not repeat
    greedy = SamplingConfig()
    plain_tps = estimate(diverse_target, None, PLAIN, evaluation, greedy, costs).tokens_per_s
    assert estimate(diverse_target, None, ngram[0], evaluation, greedy, costs).tokens_per_s < 0.9 * plain_tps
    # the bound sees the spread over prompts: nothing is picked that is slower there
    picked = estimate(diverse_target, None, choice.plan, evaluation, greedy, costs)
    assert choice.plan == PLAIN and picked.tokens_per_s >= plain_tps
    assert by[ngram[0]].lcb < 1
    assert ("the best of 2 plans on half the calibration prompts, n-gram (K=10) chain, has a 95% lower bound of "
            "0.83x on the 3 others, not above 1.05x") in choice.describe()


def speedups(factor: float, prompts: int = 4) -> list[Estimate]:
    """Plain and one other setting that is ``factor`` times faster on every one of ``prompts`` prompts."""
    tokens = tuple(10 * (i + 1) for i in range(prompts))
    plain = Estimate(PLAIN, tokens, tuple(map(float, tokens)), tuple(t * 1e-3 for t in tokens))
    chain = Estimate(Ngram(length=4), tokens, tuple(t / 2 for t in tokens),
                     tuple(t * 1e-3 / factor for t in tokens))
    return with_bounds([plain, chain])


def test_a_setting_must_beat_plain_by_the_margin():
    """1.02x on every prompt: no spread, so the bound is 1.02x; not enough at the default 5% margin, enough at 0."""
    estimates = speedups(1.02)
    assert estimates[1].lcb == pytest.approx(1.02) and estimates[0].lcb == 1.0
    assert pick(estimates, margin=0.05).plan == PLAIN
    assert pick(estimates, margin=0.0).plan == Ngram(length=4)
    assert pick(speedups(1.2), margin=0.05).plan == Ngram(length=4)
    with pytest.raises(ValueError, match="decoding.margin must be a number >= 0"):
        choose_decoding(None, None, [[1]], auto=Auto(margin=-0.1))


def test_the_bound_is_on_the_pooled_speedup_not_a_mean_of_per_prompt_speedups():
    """Twice as fast on 8 short prompts and half as fast on 2 long ones: the per-prompt speedups' geometric mean is
    1.52x, but overall the setting decodes at 0.57x plain (48 s against 84 s), so its bound must be below 1 and it is
    not picked. On prompts alike, the bound is the speedup itself."""
    tokens = (48,) * 10
    plain = Estimate(PLAIN, tokens, (48.0,) * 10, (1.0,) * 8 + (20.0,) * 2)
    mixed = Estimate(Ngram(length=4), tokens, (24.0,) * 10, (0.5,) * 8 + (40.0,) * 2)
    estimates = with_bounds([plain, mixed])
    assert mixed.tokens_per_s / plain.tokens_per_s == pytest.approx(48 / 84)
    assert estimates[1].lcb < 48 / 84 and pick(estimates, margin=0.0).plan == PLAIN
    assert speedups(1.3)[1].lcb == pytest.approx(1.3)


def test_the_highest_bound_wins_and_ties_go_to_the_setting_listed_first():
    """A setting fast on average but spread over prompts loses to a steadier one (its bound is lower)."""
    tokens = (20, 20, 20, 20)
    plain = Estimate(PLAIN, tokens, (20.0,) * 4, (0.02,) * 4)
    steady = Estimate(Ngram(length=4), tokens, (10.0,) * 4, (0.015,) * 4)  # 1.33x on every prompt
    lucky = Estimate(Ngram(length=10), tokens, (10.0,) * 4, (0.005, 0.02, 0.006, 0.019))  # 1.6x pooled
    twin = Estimate(Ngram(length=10, nodes=8, top_k=3), tokens, (10.0,) * 4, (0.015,) * 4)
    estimates = with_bounds([plain, steady, lucky, twin])
    assert lucky.tokens_per_s > steady.tokens_per_s and estimates[2].lcb < estimates[1].lcb
    assert pick(estimates).plan == steady.plan  # the twin ties with it and comes later


def test_a_kept_plain_decoding_reports_the_spread_of_plain_against_itself_not_a_speedup(diverse_target, drafter,
                                                                                        prompts):
    """When auto keeps plain, what the callback measures is plain against plain: the line says so instead of
    reporting it as a speed result (the quickstart on a Xeon without AMX printed "measured 0.94x")."""
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=1.0))
    assert choice.plan == PLAIN
    line = choice.describe(measured_speedup=0.94, measured_tokens_per_s=20.0)
    assert line.endswith("; kept plain decoding: plain against itself measured 0.94x (run-to-run spread)")
    assert "; measured" not in line


def test_one_calibration_prompt_never_picks_over_plain(diverse_target, drafter, prompts):
    """With one prompt the bound is undefined: even where the drafter's rounds are free (flat verify cost), plain
    decoding is kept, and the line says why."""
    choice = choose_decoding(diverse_target, drafter, prompts[-1:], max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=0.0))
    assert choice.plan == PLAIN and any(e.mal > 1 for e in choice.estimates)
    assert all(e.lcb is None for e in choice.estimates if e.plan != PLAIN)
    assert "1 calibration prompt with tokens gives no lower bound" in choice.describe()


def false_pick_rate(rule, settings: int = 20, prompts: int = 4, trials: int = 1000) -> float:
    """How often ``rule`` (estimates -> the plan picked) takes one of ``settings`` plans that are exactly as fast as
    plain, each timed with its own noise (log-normal, 10% per prompt) on ``prompts`` prompts of different lengths."""
    rng = random.Random(0)
    picked = 0
    for _ in range(trials):
        plain_s = tuple(rng.uniform(0.5, 2.0) for _ in range(prompts))
        tokens = (48,) * prompts
        plain = Estimate(PLAIN, tokens, (48.0,) * prompts, plain_s)
        others = [Estimate(Ngram(length=4 + i), tokens, (24.0,) * prompts,
                           tuple(p * math.exp(rng.gauss(0, 0.1)) for p in plain_s)) for i in range(settings)]
        picked += rule([plain, *others]) != PLAIN
    return picked / trials


def test_the_pick_over_many_plans_holds_its_error_at_5_percent():
    """20 plans no faster than plain: the best of 20 bounds each at 95% clears plain's 5% margin in about one run in
    six; the joint bounds (Šidák, 4 prompts) and the split rule (chosen on half the prompts, confirmed on the other
    half: 8 prompts) in at most 5% of runs. One plan alone is not corrected."""
    def uncorrected(estimates):
        return pick(with_bounds(estimates, joint=False)).plan

    def joint(estimates):
        return pick(with_bounds(estimates)).plan

    def split(estimates):
        return decide(estimates).plan

    assert false_pick_rate(uncorrected) > 0.10
    assert false_pick_rate(joint) <= 0.05
    assert false_pick_rate(split, prompts=8) <= 0.05
    assert family_confidence(0.95, 20) == pytest.approx(0.95 ** (1 / 20)) and family_confidence(0.95, 1) == 0.95


def test_the_split_rule_picks_a_plan_that_is_faster_on_the_prompts_it_was_not_chosen_on():
    """A plan 1.5x faster on every prompt (10% noise) among 19 as fast as plain is chosen on 3 of 6 prompts and
    confirmed on the other 3: one bound at 95% (t_{0.95, 2} / √3 = 1.69 standard errors of log R), where the joint
    bounds of 20 plans over all 6 take t_{0.9974, 5} / √6 = 2.0."""
    rng = random.Random(1)
    tokens, plain_s = (48,) * 6, tuple(rng.uniform(0.5, 2.0) for _ in range(6))
    plain = Estimate(PLAIN, tokens, (48.0,) * 6, plain_s)
    others = [Estimate(Ngram(length=4 + i), tokens, (24.0,) * 6,
                       tuple(p * math.exp(rng.gauss(0, 0.1)) for p in plain_s)) for i in range(19)]
    fast = Estimate(Chain(), tokens, (24.0,) * 6, tuple(p / 1.5 * math.exp(rng.gauss(0, 0.1)) for p in plain_s))
    verdict = decide(with_bounds([plain, *others, fast]))
    assert verdict.plan == Chain() and verdict.candidate == Chain() and verdict.confirm_prompts == 3
    assert verdict.confirmed > 1 + MARGIN
    assert t_quantile(0.95, 2) / math.sqrt(3) < t_quantile(family_confidence(0.95, 20), 5) / math.sqrt(6)


def test_the_expected_speed_of_a_pick_is_taken_on_the_prompts_that_did_not_choose_it():
    """The winner's curse: a plan chosen on half the calibration prompts looks best there partly by luck, so its
    expected tokens/s and speedup are those of the other half (the prompts its bound is confirmed on). Here the plan
    is 3x faster than plain on the prompts that choose it and 1.25x on the others: the pick expects 1.25x, the table
    still shows every plan over all six prompts."""
    tokens = (48,) * 6
    plain = Estimate(PLAIN, tokens, (48.0,) * 6, (1.0,) * 6)
    pick_s = (1 / 3, 0.8, 1 / 3, 0.8, 1 / 3, 0.8)  # prompts 0, 2, 4 choose, 1, 3, 5 confirm
    picked = Estimate(Chain(), tokens, (24.0, 16.0) * 3, pick_s)
    slow = Estimate(Ngram(length=4), tokens, (40.0,) * 6, (1.1,) * 6)
    verdict = decide([plain, picked, slow])
    assert verdict.plan == Chain() and verdict.confirm == (1, 3, 5)
    choice = Choice(Chain(), None, with_bounds([plain, picked, slow]), "cpu", "float32", verdict=verdict)
    assert choice.expected_speedup == pytest.approx(1.25) and choice.expected.mal == pytest.approx(3.0)
    assert choice.expected.lcb == verdict.confirmed and choice.prompts == 6
    everywhere = sum(tokens) / sum(pick_s) / (sum(tokens) / 6.0)
    assert f"{everywhere:.2f}x" in choice.table() and everywhere > 1.7  # all six prompts: the lucky ones counted


def test_the_bound_takes_students_quantile_for_the_number_of_calibration_prompts():
    """Six prompts whose speedups spread: the bound is R exp(-t sd/√6) with t = 2.015 (Student's t, 5 degrees of
    freedom), not the normal 1.645, which would give a bound 1.5% higher."""
    tokens = (30,) * 6
    plain = Estimate(PLAIN, tokens, (30.0,) * 6, (1.0,) * 6)
    other = Estimate(Ngram(length=4), tokens, (15.0,) * 6, (0.5, 0.7, 0.6, 0.8, 0.55, 0.75))
    z = [1.0 - o / statistics.fmean(other.prompt_seconds) for o in other.prompt_seconds]
    spread = statistics.stdev(z) / math.sqrt(6)
    pooled = 6 / sum(other.prompt_seconds)
    assert speedup_bound(plain, other) == pytest.approx(pooled * math.exp(-2.015 * spread), rel=1e-3)
    assert speedup_bound(plain, other) < pooled * math.exp(-1.645 * spread) / 1.01
    assert with_bounds([plain, other])[1].lcb == speedup_bound(plain, other)  # one setting: no correction


def test_t_quantiles_are_students():
    """One-sided 95% and 99% points of Student's t (the tables' values)."""
    for dof, t95, t99 in ((1, 6.314, 31.821), (2, 2.920, 6.965), (5, 2.015, 3.365), (10, 1.812, 2.764)):
        assert t_quantile(0.95, dof) == pytest.approx(t95, abs=1e-3)
        assert t_quantile(0.99, dof) == pytest.approx(t99, abs=1e-3)


def test_under_sampling_settings_are_calibrated_with_the_exact_rounds(diverse_target, drafter, prompts):
    """Under sampling a chosen setting (n-gram lookup) is replayed and a drawn chain scored by the exact evaluator:
    each estimate's rounds are the offline evaluator's on the same sampled outputs."""
    from lightning_spec import SamplingConfig, generate, offline_rounds
    from lightning_spec.decoding.ngram import NgramDrafter

    t1 = SamplingConfig(temperature=1.0)
    outputs = [generate(diverse_target, p, MAX_NEW, t1, seed=i).tokens for i, p in enumerate(prompts)]
    pairs = list(zip(prompts, outputs))
    settings = [Ngram(length=4), Chain()]
    choice = choose_decoding(diverse_target, drafter, prompts, t1, plans=settings, outputs=outputs,
                             costs=flat_or_linear(drafter, per_token=0.0))
    rounds = {e.plan: e.rounds for e in choice.estimates}
    assert rounds[settings[0]] == pytest.approx(float(offline_rounds(diverse_target, NgramDrafter(4), pairs, t1).sum()))
    assert rounds[settings[1]] == pytest.approx(float(offline_rounds(diverse_target, drafter, pairs, t1).sum()))
    assert rounds[settings[1]] < sum(map(len, outputs))  # the drafter's chain was accepted on these outputs


def test_the_bookkeeping_per_round_is_what_a_decode_spent_beyond_the_model():
    """``round_overhead``: a decode's seconds less its prefill and its rounds' modelled draft + verify, per round;
    settings not measured take the largest measured; a round never costs less than nothing."""
    from lightning_spec.decoding.auto import round_overhead
    from lightning_spec.decoding.engine import Generation

    chain = Ngram(length=4)
    costs = Costs(verify={1: 1.0, 5: 3.0}, tree_verify={1: 1.0, 5: 3.0}, draft={PLAIN: 0.0, chain: 0.5})
    gen = Generation(tokens=[1] * 6, accept_lengths=[3, 0], rounds=2, seconds=10.0, prefill_seconds=2.0,
                     draft_lengths=[4, 0])
    assert round_overhead(gen, chain, costs) == pytest.approx((8.0 - (0.5 + 3.0) - (0.5 + 1.0)) / 2)
    assert round_overhead(dataclasses.replace(gen, seconds=2.5), chain, costs) == -1.5  # floored: -(0.5 + 1)
    assert costs.overhead_seconds(chain) == 0.0  # nothing measured (costs passed in): none
    costs.overhead.update({PLAIN: 0.25, chain: 1.5})
    assert costs.overhead_seconds(Ngram(length=10)) == 1.5 and costs.overhead_seconds(PLAIN) == 0.25


def test_verify_seconds_interpolate_between_measured_lengths():
    costs = Costs(verify={1: 1.0, 5: 3.0, 9: 4.0}, tree_verify={2: 10.0, 9: 17.0})
    assert costs.verify_seconds(1, tree=False) == 1.0
    assert costs.verify_seconds(3, tree=False) == 2.0
    assert costs.verify_seconds(13, tree=False) == 5.0  # past the last point: its slope
    assert costs.verify_seconds(1, tree=True) == 1.0  # a tree with no draft nodes is the anchor alone
    assert costs.verify_seconds(5, tree=True) == 13.0


def test_calibration_prompts_are_required(diverse_target, drafter):
    with pytest.raises(ValueError, match="needs calibration prompts"):
        choose_decoding(diverse_target, drafter, [])


def test_decode_validation_reports_decoding_autos_pick_after_a_fit(tmp_path, monkeypatch, capsys):
    """``SpecDecodeValidation(decoding=auto)`` from a YAML overlay: after training it calibrates on held-out prompts,
    decodes the validation prompts with its pick and prints the pick with expected and measured speed."""
    import sys
    from pathlib import Path

    from lightning_spec.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    overlay = tmp_path / "auto.yaml"
    overlay.write_text("trainer:\n  callbacks:\n    - init_args:\n        decoding: auto\n"
                       "data:\n  eval_prompts_per_domain: 3\n")  # one decoded, two held out per domain
    tiny = Path(__file__).resolve().parents[2] / "experiments" / "tiny.yaml"
    main(["fit", "-c", str(tiny), "-c", str(overlay), "--trainer.logger=false", "--trainer.max_steps=3"])
    out = capsys.readouterr().out
    assert "decoding auto: " in out and "calibration prompt" in out
    assert "; measured " in out or "; kept plain decoding: plain against itself measured " in out
    assert ", MAL " in out and "on the same prompts" in out


def test_decode_validation_refuses_an_unknown_decoding():
    from lightning_spec.callbacks import SpecDecodeValidation

    with pytest.raises(ValueError, match="decoding.kind must be one of plain, chain, tree, ngram, auto, adapt, got 'f"):
        SpecDecodeValidation(decoding="fastest")
    with pytest.raises(ValueError, match="calibration_prompts_per_domain=0 must be >= 1"):
        SpecDecodeValidation(decoding="auto", calibration_prompts_per_domain=0)


@pytest.fixture(scope="module")
def calm_tok():
    """tiny-random's tokenizer with a chat template that writes its ``mood`` argument after the generation header."""
    from transformers import AutoTokenizer

    from lightning_spec import assets

    tok = AutoTokenizer.from_pretrained(assets.tiny_folder())
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{{ mood | default('') }}{% endif %}")
    return tok


def test_decode_validation_calibrates_on_held_out_prompts_of_every_domain(calm_tok):
    """``decoding: auto`` in the callback: the next ``calibration_prompts_per_domain`` prompts of every domain, none
    of the decoded ones, templated with the target's chat-template arguments; data holding out fewer is refused
    before training starts, in one sentence naming the fields."""
    from lightning_spec.callbacks import SpecDecodeValidation
    from lightning_spec.datamodule import SpecDataModule

    def trainer(per_domain):
        dm = SpecDataModule(tokenizer=calm_tok, eval_sources=["mt-bench", "humaneval"], seed=0,
                            eval_prompts_per_domain=per_domain,
                            target_options={"chat_template_kwargs": {"mood": "[calm]"}})
        return SimpleNamespace(datamodule=dm)

    callback = SpecDecodeValidation(prompts_per_domain=1, decoding="auto", calibration_prompts_per_domain=2)
    decoded, held_out = callback._prompts(trainer(3)), callback._prompts(trainer(3), calibration=True)
    assert [p["domain"] for p in held_out] == ["chat", "chat", "code", "code"]
    assert not {p["id"] for p in decoded} & {p["id"] for p in held_out}
    assert all(calm_tok.decode(p["prompt_ids"]).endswith("assistant\n[calm]") for p in held_out)
    short = trainer(2)
    with pytest.raises(ValueError, match=r"raise data.eval_prompts_per_domain to 3 or lower those two"):
        callback._prompts(short, calibration=True)
    with pytest.raises(ValueError, match=r"calibration_prompts_per_domain=2 others; raise data.eval_prompts_per_"):
        callback.on_fit_start(short, None)


def test_evaluate_calibrates_on_held_out_prompts_of_every_source(calm_tok):
    """``lightning-spec evaluate --decoding auto``: 2 prompts of every source after the evaluated ones, with the
    target's chat-template arguments (they used to be built without them)."""
    from lightning_spec.evaluation.inputs import calibration_prompts, open_prompts

    target = SimpleNamespace(tokenizer=calm_tok, chat_template_kwargs={"mood": "[calm]"})
    used = open_prompts(target, "calm", ["mt-bench", "humaneval"], 2, seed=0)
    calibration = calibration_prompts(target, ["mt-bench", "humaneval"], 2, 0, used)
    assert len(calibration) == 4 and not {tuple(p) for p in calibration} & {tuple(p["prompt_ids"]) for p in used}
    assert all(calm_tok.decode(p).endswith("assistant\n[calm]") for p in calibration)
    assert len(calibration_prompts(target, ["mt-bench", "humaneval"], 2, 0, used, per_domain=3)) == 6


def test_evaluate_online_decodes_each_drafter_with_decoding_autos_pick(tmp_path, monkeypatch, tiny_target, capsys):
    """``lightning-spec evaluate --mode online --decodings '[auto, null]'``: the first arm decodes with its pick, which
    the JSON and the output name with the speedup it expected; the second keeps its chain. Offline, auto is one
    sentence."""
    import json
    import sys

    from helpers.offline import saved_drafters

    from lightning_spec.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    (path,) = saved_drafters(tiny_target, tmp_path, seeds=(0,))
    main(["evaluate", "--mode", "online", "--drafters", f"[{path}, {path}]", "--names", "[auto, chain]",
          "--decodings", "[auto, null]", "--sources", "[mt-bench]", "--prompts_per_source", "2",
          "--max_new_tokens", "6", "--n_resamples", "20", "--output", "on.json", "--progress", "false"])
    out = capsys.readouterr().out
    arms = json.loads((tmp_path / "on.json").read_text())["arms"]
    assert "decoding auto: " in out and f"auto: {arms['auto']['auto']['picked']}" in out  # the table says so
    picked = arms["auto"]["auto"]
    assert picked["expected_speedup"] >= 1.0 and arms["auto"]["tokens"] > 0 and picked["calibration_prompts"] == 2
    # expected (on the calibration prompts) against measured, in the printout
    assert f"auto: decoding auto picked {picked['picked']}: expected {picked['expected_tokens_per_s']:.1f}" in out
    assert f"measured {arms['auto']['tokens_per_s']:.1f} tokens/s, {arms['auto']['speedup']:.2f}x plain" in out
    assert "auto" not in arms["chain"] and arms["chain"]["decoding"] == {"kind": "chain"}
    assert arms["auto"]["decoding"] == {"kind": "auto"}
    with pytest.raises(SystemExit):
        main(["evaluate", "--mode", "offline", "--rollouts", "r", "--drafters", f"[{path}]", "--decoding", "auto"])
    assert "use --mode online" in capsys.readouterr().err


def test_every_speed_table_can_state_the_dtypes_greedy_guarantee():
    from lightning_spec import load_target

    assert load_target("tiny-random").precision == "float32: greedy identity guaranteed"
    assert "greedy identity NOT guaranteed" in load_target("tiny-random", dtype="bfloat16").precision


# ------------------------------------------------------------------------------------- the target's dtype searched
def dtype_costs(drafter, one: float, per_token: float) -> Costs:
    """``one`` ms for the anchor, ``per_token`` ms for each further query token; drafts are free."""
    verify = {t: (one + per_token * (t - 1)) * 1e-3 for t in (1, 2, 5, 9, 33)}
    return Costs(verify=verify, tree_verify=dict(verify), draft=dict.fromkeys(candidates(drafter), 0.0))


BOTH = Auto(dtypes=("float32", "bfloat16"))


@pytest.fixture(scope="module")
def twelve(diverse_target):
    return random_prompts(diverse_target.vocab_size, lengths=(1, 6, 13, 4, 9, 3, 11, 7, 5, 12, 2, 8))


def test_auto_searches_the_targets_dtype_and_judges_against_the_fastest_plain_decoding(diverse_target, drafter,
                                                                                        twelve):
    """float32 verifies at 1 ms per token (no plan pays); bfloat16's 1-token forward is slower (1.02 ms) but its
    verify is flat, as on an AMX Xeon: the pick is a drafter plan in bfloat16, judged against plain float32, the
    faster plain decoding, not against plain bfloat16. With bfloat16 both faster per token and linear, plain
    bfloat16 is the baseline and kept."""
    prompts = twelve
    costs = {"float32": dtype_costs(drafter, 1.0, 1.0), "bfloat16": dtype_costs(drafter, 1.02, 0.0)}
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW, costs=costs,
                             auto=BOTH)
    assert {e.dtype for e in choice.estimates} == {"float32", "bfloat16"}
    assert len(choice.estimates) == 2 * len(candidates(drafter)) and choice.compared == len(choice.estimates) - 1
    assert choice.plain_dtype == "float32" and choice.dtype == "bfloat16" and choice.plan != PLAIN
    assert choice.plain.dtype == "float32" and choice.plain.plan == PLAIN
    plain_bf16 = next(e for e in choice.estimates if e.key == (PLAIN, "bfloat16"))
    assert plain_bf16.lcb < 1 and choice.expected.lcb > 1 + MARGIN  # plain bf16 is a candidate like any other
    assert choice.expected_speedup == pytest.approx(choice.plain.seconds / choice.expected.seconds)
    line = choice.describe()
    assert f"{choice.plan.label}" in line and "x plain float32" in line and "bfloat16)" in line
    assert f"{choice.plan.label}, bfloat16" in choice.table()

    costs = {"float32": dtype_costs(drafter, 1.0, 1.0), "bfloat16": dtype_costs(drafter, 0.5, 0.5)}
    kept = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW, costs=costs,
                           auto=BOTH)
    assert kept.kept_plain and kept.plan == PLAIN and kept.dtype == "bfloat16" and kept.plain_dtype == "bfloat16"
    assert "beat plain bfloat16" in kept.describe() or "plain bfloat16 on the half" in kept.describe()


def test_one_dtype_searched_keeps_the_estimates_unlabelled(diverse_target, drafter, prompts):
    """The default searches the target's own dtype alone: estimates carry no dtype, the pick decodes there."""
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=1.0))
    assert choice.dtypes == [None] and choice.plain_dtype is None and choice.dtype == "float32"
    assert choice.decoding_target(diverse_target) is diverse_target


def test_a_pick_in_another_dtype_decodes_there_and_the_drafter_returns_to_float32(diverse_target, drafter, twelve):
    """Auto's target for a bfloat16 pick is the target cast once (the same weights, which the drafter accepts);
    after decoding there, greedy speculative decoding in float32 is still plain decoding's."""
    prompts = twelve
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs={"float32": dtype_costs(drafter, 1.0, 1.0),
                                    "bfloat16": dtype_costs(drafter, 1.02, 0.0)}, auto=BOTH)
    cast = choice.decoding_target(diverse_target)
    assert choice.dtype == "bfloat16" and cast.dtype == torch.bfloat16 and cast is diverse_target.cast("bfloat16")
    assert cast.same_weights(diverse_target) and diverse_target.same_weights(cast)
    assert cast.fingerprint != diverse_target.fingerprint  # rollouts and feature caches still tell them apart
    out = choice.generate(diverse_target, prompts[1], MAX_NEW, seed=0)
    assert drafter.target is cast and len(out.tokens) > 0
    from lightning_spec import generate

    plain = generate(diverse_target, prompts[1], MAX_NEW)
    assert generate(diverse_target, prompts[1], MAX_NEW, drafter=drafter, plan=choice.plan).tokens == plain.tokens
    assert drafter.target is diverse_target


def test_auto_times_each_dtype_searched(diverse_target, drafter, prompts):
    """Timed on this machine over float32 and bfloat16: every plan is estimated in each, the baseline is the plain
    decoding with the fewest expected seconds, and the drafter is bound to the float32 target afterwards."""
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=8, auto=BOTH)
    plains = {e.dtype: e for e in choice.estimates if e.plan == PLAIN}
    assert set(plains) == {"float32", "bfloat16"}
    assert choice.plain_dtype == min(plains, key=lambda d: plains[d].seconds)
    assert all(e.seconds > 0 for e in choice.estimates) and drafter.target is diverse_target


def test_bad_dtypes_are_refused_in_one_sentence(diverse_target, drafter, prompts):
    from lightning_spec.decoding.plans import parse_plan
    from lightning_spec.errors import UserError

    assert parse_plan({"kind": "auto", "dtypes": ["float32", "bfloat16"]}) == Auto(dtypes=("float32", "bfloat16"))
    assert parse_plan({"kind": "auto", "dtypes": "native"}).dtypes == "native"
    for bad in (["int8"], [], 3):
        with pytest.raises(UserError, match=r"decoding\.dtypes must be 'native'"):
            Auto(dtypes=bad)
    with pytest.raises(UserError, match="pass one Costs per dtype searched"):
        choose_decoding(diverse_target, drafter, prompts, costs=flat_or_linear(drafter, 1.0),
                        auto=BOTH)


def test_evaluate_online_times_plain_decoding_in_the_dtype_auto_found_fastest(tmp_path, monkeypatch, tiny_target):
    """``--decodings '[{kind: auto, dtypes: [float32, bfloat16]}]'`` with bfloat16 the faster plain decoding (costs
    fixed): the arm keeps plain decoding in bfloat16, and the run's plain row, which every speedup is over, decodes
    in bfloat16 too; the JSON says so."""
    import json
    import sys

    from helpers.offline import saved_drafters

    import lightning_spec.decoding.auto as auto
    from lightning_spec.cli import main

    real = auto.choose_decoding

    def fixed_costs(target, drafter, prompts, sampling, max_new_tokens, auto, progress):
        assert auto.dtypes == ("float32", "bfloat16")
        return real(target, drafter, prompts, sampling, max_new_tokens, auto=auto,
                    costs={"float32": dtype_costs(drafter, 1.0, 1.0), "bfloat16": dtype_costs(drafter, 0.5, 0.5)})

    monkeypatch.setattr(auto, "choose_decoding", fixed_costs)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    (path,) = saved_drafters(tiny_target, tmp_path, seeds=(0,))
    main(["evaluate", "--mode", "online", "--drafters", f"[{path}]", "--names", "[auto]",
          "--decodings", "[{kind: auto, dtypes: [float32, bfloat16]}]", "--sources", "[mt-bench]",
          "--prompts_per_source", "2", "--max_new_tokens", "6", "--n_resamples", "20", "--output", "on.json",
          "--progress", "false"])
    report = json.loads((tmp_path / "on.json").read_text())
    picked = report["arms"]["auto"]["auto"]
    assert picked["picked"] == "plain" and picked["dtype"] == "bfloat16" and picked["plain_dtype"] == "bfloat16"
    assert report["plain"]["dtype"] == "bfloat16"
    assert report["arms"]["auto"]["decoding"] == {"kind": "auto", "dtypes": ["float32", "bfloat16"]}
