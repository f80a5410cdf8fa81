"""``decoding: auto`` (``evaluation/auto.py``): the setting with the most expected tokens/s from measured costs.

- with the verify cost linear in the query tokens (a draft never pays) it keeps plain decoding; with a flat verify
  cost and free drafts it picks the setting that commits the most tokens per round;
- with costs measured on this machine it never picks a setting its cost model predicts slower than plain, and the
  MAL it expects on its calibration prompts is the MAL the engine then reaches on them (exact calibration);
- under sampling each estimate's rounds are the offline evaluator's on the same outputs;
- the verify interpolation and the report.
"""

import pytest
from helpers.decoding import MAX_NEW, random_prompts
from helpers.families import trained

from lightning_spec.evaluation.auto import PLAIN, Costs, Setting, candidates, choose_decoding


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
    assert choice.setting == PLAIN and choice.drafter is None and choice.tree is None
    assert any(e.mal > 1 for e in choice.estimates)  # some settings were accepted: they just cannot pay


def test_a_flat_verify_cost_picks_the_most_tokens_per_round(diverse_target, drafter, prompts):
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW,
                             costs=flat_or_linear(drafter, per_token=0.0))
    assert choice.setting != PLAIN
    assert choice.expected.mal == max(e.mal for e in choice.estimates) > 1
    assert len(choice.estimates) == len(candidates(drafter))


def test_measured_costs_never_pick_a_setting_predicted_slower_than_plain(diverse_target, drafter, prompts):
    choice = choose_decoding(diverse_target, drafter, prompts, max_new_tokens=MAX_NEW)
    plain = next(e for e in choice.estimates if e.setting == PLAIN)
    assert choice.expected.tokens_per_s >= plain.tokens_per_s
    assert choice.expected_speedup >= 1.0
    assert all(choice.expected.tokens_per_s >= e.tokens_per_s for e in choice.estimates)
    # the calibration is exact: decoding the calibration prompts with the pick commits the expected MAL
    outs = [choice.generate(diverse_target, p, MAX_NEW, seed=i) for i, p in enumerate(prompts)]
    assert sum(len(o.tokens) for o in outs) / sum(o.rounds for o in outs) == pytest.approx(choice.expected.mal)
    assert choice.describe(measured_speedup=1.0).startswith(f"decoding auto: {choice.setting.label}")
    assert "<- picked" in choice.table()


def test_under_sampling_settings_are_calibrated_with_the_exact_rounds(diverse_target, drafter, prompts):
    """Under sampling a chosen setting (n-gram lookup) is replayed and a drawn chain scored by the exact evaluator:
    each estimate's rounds are the offline evaluator's on the same sampled outputs."""
    from lightning_spec import SamplingConfig, generate, offline_rounds
    from lightning_spec.decoding.ngram import NgramDrafter

    t1 = SamplingConfig(temperature=1.0)
    outputs = [generate(diverse_target, p, MAX_NEW, t1, seed=i).tokens for i, p in enumerate(prompts)]
    pairs = list(zip(prompts, outputs))
    settings = [Setting("ngram", None, 4), Setting("drafter")]
    choice = choose_decoding(diverse_target, drafter, prompts, t1, settings=settings, outputs=outputs,
                             costs=flat_or_linear(drafter, per_token=0.0))
    rounds = {e.setting: e.rounds for e in choice.estimates}
    assert rounds[settings[0]] == pytest.approx(float(offline_rounds(diverse_target, NgramDrafter(4), pairs, t1).sum()))
    assert rounds[settings[1]] == pytest.approx(float(offline_rounds(diverse_target, drafter, pairs, t1).sum()))
    assert rounds[settings[1]] < sum(map(len, outputs))  # the drafter's chain was accepted on these outputs


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
                       "data:\n  eval_prompts_per_domain: 2\n")  # one decoded, one held out per domain
    tiny = Path(__file__).resolve().parents[2] / "experiments" / "tiny.yaml"
    main(["fit", "-c", str(tiny), "-c", str(overlay), "--trainer.logger=false", "--trainer.max_steps=3"])
    out = capsys.readouterr().out
    assert "decoding auto: " in out and "x plain on " in out and "; measured " in out and "on the same prompts" in out


def test_decode_validation_refuses_an_unknown_decoding():
    from lightning_spec.callbacks import SpecDecodeValidation

    with pytest.raises(ValueError, match="decoding must be fixed or auto"):
        SpecDecodeValidation(decoding="fastest")


def test_evaluate_online_decodes_each_drafter_with_decoding_autos_pick(tmp_path, monkeypatch, tiny_target, capsys):
    """``lightning-spec evaluate --mode online --trees '[auto, null]'``: the first arm decodes with its pick, which
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
          "--trees", "[auto, null]", "--sources", "[mt-bench]", "--prompts_per_source", "2", "--max_new_tokens", "6",
          "--n_resamples", "20", "--output", "on.json", "--progress", "false"])
    out = capsys.readouterr().out
    arms = json.loads((tmp_path / "on.json").read_text())["arms"]
    assert "decoding auto: " in out and f"auto: {arms['auto']['decoding']['picked']}" in out  # the table says so
    assert arms["auto"]["decoding"]["expected_speedup"] >= 1.0 and arms["auto"]["tokens"] > 0
    assert "decoding" not in arms["chain"] and arms["chain"]["tree"] is None
    with pytest.raises(SystemExit):
        main(["evaluate", "--mode", "offline", "--rollouts", "r", "--drafters", f"[{path}]", "--tree", "auto"])
    assert "use it with --mode online" in capsys.readouterr().err


def test_every_speed_table_can_state_the_dtypes_greedy_guarantee():
    from lightning_spec import load_target

    assert load_target("tiny-random").precision == "float32: greedy identity guaranteed"
    assert "greedy identity NOT guaranteed" in load_target("tiny-random", dtype="bfloat16").precision
