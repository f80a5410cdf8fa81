"""Paired comparisons: the prompt-cluster bootstrap of pooled MAL covers the truth at its nominal rate, resamples
whole prompts within domains, averages an arm's seeds per rollout, and refuses unpaired inputs."""

import numpy as np
import pytest
import torch
from helpers.paired import resample_weights

from lightning_spec.evaluation.offline import OfflineReport
from lightning_spec.paired import bootstrap_mal, compare, compare_reports


def synthetic(rng, prompts=40, samples=3, mal=(2.0, 2.3)):
    """Rollouts whose population MAL per arm is known exactly: tokens L (independent of everything else),
    a prompt difficulty d (mean 1) shared by both arms and by the prompt's samples, per-rollout noise e (mean 1)
    partly shared by the arms. rounds_a = L d e_a / mal_a, so E[Σ L] / E[Σ rounds_a] = mal_a."""
    d = rng.gamma(4.0, 0.25, size=prompts)  # prompt difficulty, mean 1
    keys = [f"p{c}" for c in range(prompts) for _ in range(samples)]
    domains = ["chat" if c % 2 else "code" for c in range(prompts) for _ in range(samples)]
    n = prompts * samples
    tokens = rng.poisson(40, size=n) + 5
    shared = rng.gamma(8.0, 1 / 8.0, size=n)
    rounds = {}
    for a, m in enumerate(mal):
        own = rng.gamma(16.0, 1 / 16.0, size=n)
        rounds[f"arm{a}"] = tokens * np.repeat(d, samples) * (0.5 * shared + 0.5 * own) / m
    return tokens, rounds, keys, domains


def test_bootstrap_interval_covers_the_true_delta_at_the_nominal_rate():
    rng = np.random.default_rng(0)
    reps, truth = 200, 2.3 - 2.0
    covered_delta = covered_mal = 0
    for rep in range(reps):
        tokens, rounds, keys, domains = synthetic(rng)
        cmp = compare(rounds, tokens, keys, domains, baseline="arm0", n_resamples=1000, seed=rep)
        lo, hi = cmp.arm("arm1").delta_ci
        covered_delta += lo <= truth <= hi
        lo, hi = cmp.arm("arm0").mal_ci
        covered_mal += lo <= 2.0 <= hi
    assert 0.90 <= covered_delta / reps <= 0.99, covered_delta / reps
    assert 0.90 <= covered_mal / reps <= 0.99, covered_mal / reps


def test_resampling_rollouts_instead_of_prompts_understates_the_uncertainty():
    """Samples of one prompt share its difficulty: treating them as independent (one cluster per rollout)
    gives a narrower, over-confident interval for a single arm's MAL."""
    rng = np.random.default_rng(1)
    tokens, rounds, keys, _ = synthetic(rng, prompts=30, samples=6)
    by_prompt = bootstrap_mal(tokens, rounds["arm0"], keys, n_resamples=2000, seed=0)[:, 0]
    by_rollout = bootstrap_mal(tokens, rounds["arm0"], [str(i) for i in range(len(keys))], n_resamples=2000,
                               seed=0)[:, 0]
    assert by_prompt.std() > 1.5 * by_rollout.std()


def test_pairing_narrows_the_delta_interval():
    rng = np.random.default_rng(2)
    tokens, rounds, keys, domains = synthetic(rng)
    paired = compare(rounds, tokens, keys, domains, n_resamples=2000)
    lo, hi = paired.arm("arm1").delta_ci
    a0 = bootstrap_mal(tokens, rounds["arm0"], keys, domains, 2000, seed=0)[:, 0]
    a1 = bootstrap_mal(tokens, rounds["arm1"], keys, domains, 2000, seed=1)[:, 0]  # independent resamples
    unpaired = np.quantile(a1 - a0, [0.025, 0.975])
    assert hi - lo < 0.7 * (unpaired[1] - unpaired[0])


def test_weights_resample_whole_prompts_within_domains():
    keys = ["a", "a", "b", "c", "c", "c", "d"]
    strata = ["x", "x", "x", "y", "y", "y", "y"]
    ids, counts = resample_weights(keys, strata, n_resamples=500, seed=0)
    assert ids.tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert (counts[:, [0, 1]].sum(1) == 2).all() and (counts[:, [2, 3]].sum(1) == 2).all()  # per domain
    assert counts.std(0).min() > 0  # every prompt is sometimes left out, sometimes drawn twice
    with pytest.raises(ValueError, match="two domains"):
        resample_weights(["a", "a"], ["x", "y"], 10, 0)


def test_point_estimates_are_pooled_ratios_and_seeded():
    tokens = np.array([10.0, 20.0, 30.0, 40.0])
    rounds = {"a": np.array([5.0, 10.0, 10.0, 20.0]), "b": np.array([2.0, 10.0, 15.0, 10.0])}
    keys = ["p", "p", "q", "r"]
    cmp = compare(rounds, tokens, keys, n_resamples=300, seed=7)
    assert cmp.arm("a").mal == pytest.approx(100 / 45)  # Σ tokens / Σ rounds, not the mean of ratios
    assert cmp.arm("b").delta == pytest.approx(100 / 37 - 100 / 45)
    assert cmp.baseline == "a" and cmp.arm("a").delta == 0 and cmp.prompts == 3 and cmp.rows == 4
    again = compare(rounds, tokens, keys, n_resamples=300, seed=7)
    assert again.arm("b").delta_ci == cmp.arm("b").delta_ci
    assert compare(rounds, tokens, keys, baseline="b", n_resamples=300).arm("a").delta < 0


def test_several_checkpoints_per_arm_are_averaged_per_rollout():
    rng = np.random.default_rng(3)
    tokens, rounds, keys, domains = synthetic(rng, prompts=10)
    seeds = [rounds["arm1"] * 0.9, rounds["arm1"] * 1.1]
    cmp = compare({"arm0": rounds["arm0"], "arm1": seeds}, tokens, keys, domains, n_resamples=500)
    same = compare({"arm0": rounds["arm0"], "arm1": rounds["arm1"]}, tokens, keys, domains, n_resamples=500)
    assert cmp.arm("arm1").mal == pytest.approx(same.arm("arm1").mal)
    assert cmp.arm("arm1").delta_ci == pytest.approx(same.arm("arm1").delta_ci)
    assert len(cmp.arm("arm1").checkpoint_mal) == 2
    assert cmp.arm("arm1").checkpoint_mal[0] > cmp.arm("arm1").checkpoint_mal[1]
    assert set(cmp.by_domain) == {"chat", "code"}


def test_online_arms_with_their_own_tokens():
    tokens = {"a": np.array([10.0, 12.0]), "b": np.array([11.0, 9.0])}
    rounds = {"a": np.array([5.0, 6.0]), "b": np.array([4.0, 3.0])}
    cmp = compare(rounds, tokens, ["p", "q"], n_resamples=100)
    assert cmp.arm("b").mal == pytest.approx(20 / 7) and cmp.arm("a").mal == pytest.approx(2.0)


def report(rounds, keys, tokens):
    return OfflineReport(
        rounds=torch.tensor(rounds, dtype=torch.float64), tokens=torch.tensor(tokens), domains=["d"] * len(keys),
        prompt_keys=keys, finished=[True] * len(keys), slot_reached=torch.ones(2), slot_accepted=torch.ones(2),
    )


def test_unpaired_inputs_are_refused():
    with pytest.raises(ValueError, match="same rollouts"):
        compare({"a": np.ones(3), "b": np.ones(2)}, np.ones(3), ["p", "q", "r"])
    a = report([2.0, 3.0], ["p", "q"], [4, 6])
    with pytest.raises(ValueError, match="other rollouts"):
        compare_reports({"a": a, "b": report([2.0, 3.0], ["p", "r"], [4, 6])})
    with pytest.raises(ValueError, match="other rollouts"):
        compare_reports({"a": a, "b": report([2.0, 3.0], ["p", "q"], [4, 7])})
    cmp = compare_reports({"a": a, "b": [report([1.0, 2.0], ["p", "q"], [4, 6])] * 2}, n_resamples=50)
    assert cmp.arm("b").mal == pytest.approx(10 / 3)
    with pytest.raises(ValueError, match="baseline"):
        compare({"a": np.ones(1)}, np.ones(1), ["p"], baseline="z")
