"""The online runner's parts alone: the timed loop (``OnlineRun.run``) records what each decoding reports, in
interleaved order, and the statistics (``online_statistics``) are a pure function of that record: a fixed record
gives the figures worked out by hand. The real runner end to end is ``evaluate --mode online`` (test_offline.py,
test_adaptation.py, decoding/test_trees.py, evaluation/test_auto.py)."""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from lightning_spec.decoding.timed import DecodeReport
from lightning_spec.evaluation.online import OnlineRun, OnlineTimings, online_statistics
from lightning_spec.paired import Bootstrap
from lightning_spec.sampling import SamplingConfig

PROMPTS = [{"id": f"p{i}", "domain": "xy"[i // 2], "prompt_ids": [1, 2, 3]} for i in range(4)]


def fixed_record() -> OnlineTimings:
    """Plain decoding and two arms over 4 prompts (2 per domain), every prompt alike within a row:
    plain 10 tokens in 10 rounds and 1 s; arm a 10 tokens in 5 rounds and 0.5 s (0.1 s drafting);
    arm b 12 tokens in 4 rounds and 0.25 s."""
    ones = np.ones(4)
    timings = OnlineTimings.zeros([2, 2], 4)
    timings.tokens[:] = np.stack([10 * ones, 10 * ones, 12 * ones])
    timings.rounds[:] = np.stack([10 * ones, 5 * ones, 4 * ones])
    timings.seconds[:] = np.stack([ones, 0.5 * ones, 0.25 * ones])
    timings.draft_seconds[:] = np.stack([0 * ones, 0.1 * ones, 0 * ones])
    timings.slots[0][:] = [[6, 2], [8, 4]]  # accepted, reached per slot
    timings.slots[1][:] = [[0, 0], [4, 0]]
    return timings


def test_statistics_of_a_fixed_record_are_the_hand_computed_figures():
    stats = online_statistics(fixed_record(), ["a", "b"], [p["id"] for p in PROMPTS], [p["domain"] for p in PROMPTS],
                              Bootstrap(baseline="a", n_resamples=50, confidence=0.9, seed=0))
    a, b = stats.arms["a"], stats.arms["b"]
    assert stats.plain == {"tokens": 40, "seconds": 4.0, "tokens_per_s": 10.0}
    assert a["mal"] == 2.0 and b["mal"] == 3.0 and a["mal_by_domain"] == {"x": 2.0, "y": 2.0}
    assert a["accept_rate"] == [0.75, 0.5] and b["accept_rate"] == [0.0, 0.0]  # 0 / max(reached, 1)
    assert (a["tokens"], a["seconds"], a["tokens_per_s"]) == (40, 2.0, 20.0)
    assert a["speedup"] == 2.0 and b["speedup"] == pytest.approx(4.8)  # 48 tokens/s over plain's 10
    # every prompt alike: each resample gives the same ratios, so the intervals are points
    assert a["speedup_ci"] == pytest.approx([2.0, 2.0]) and b["speedup_ci"] == pytest.approx([4.8, 4.8])
    assert a["draft_ms_per_round"] == pytest.approx(1000 * 0.4 / 20)
    cmp = stats.comparison
    assert cmp.baseline == "a" and cmp.arm("b").delta == 1.0 and cmp.arm("b").delta_ci == pytest.approx((1.0, 1.0))
    assert cmp.prompts == 4 and cmp.n_resamples == 50 and cmp.confidence == 0.9


def test_the_speedup_interval_resamples_all_prompts_together_as_mal_does():
    """One prompt per domain, the arm twice as fast as plain on one and as fast on the other: the speedup's interval
    resamples the prompts together (as the MAL intervals do), so it spans the two; stratified by domain every
    resample would redraw each domain's one prompt and the interval would collapse to a point."""
    timings = OnlineTimings.zeros([2], 2)
    timings.tokens[:] = 10
    timings.rounds[:] = [[10, 10], [5, 5]]
    timings.seconds[:] = [[1.0, 1.0], [0.5, 1.0]]  # 2x on x, 1x on y; overall 20 tokens in 1.5 s against 2 s
    stats = online_statistics(timings, ["a"], ["p0", "p1"], ["x", "y"], Bootstrap(n_resamples=200, seed=0))
    arm = stats.arms["a"]
    assert arm["speedup"] == pytest.approx(4 / 3)
    assert arm["speedup_ci"] == pytest.approx([1.0, 2.0])  # both prompts drawn twice happens in 1 of 4 resamples


def test_seeds_of_one_arm_are_averaged_per_prompt():
    """Two checkpoints named alike are one arm: tokens and rounds averaged per prompt, each checkpoint's MAL kept."""
    stats = online_statistics(fixed_record(), ["a", "a"], [p["id"] for p in PROMPTS], [p["domain"] for p in PROMPTS],
                              Bootstrap(n_resamples=20))
    arm = stats.arms["a"]
    assert list(stats.arms) == ["a"] and arm["tokens"] == 88 and arm["seconds"] == 3.0
    assert arm["mal"] == pytest.approx(11 / 4.5)  # (10 + 12) / 2 tokens over (5 + 4) / 2 rounds per prompt
    assert stats.comparison.arm("a").checkpoint_mal == [2.0, 3.0]
    assert arm["accept_rate"] == [6 / 12, 2 / 4]  # slot counts added over the checkpoints


def test_seeds_that_draft_different_lengths_add_their_slot_counts():
    """Decoding auto may pick a 2-slot chain for one seed and a 3-slot one for the other: slot 3's rate is over the
    rounds that reached it, which only the second seed's did."""
    timings = OnlineTimings.zeros([2, 3], 1)
    timings.tokens[:], timings.rounds[:], timings.seconds[:] = 10, 5, 1.0
    timings.slots[0][:] = [[4, 1], [5, 4]]  # accepted, reached per slot
    timings.slots[1][:] = [[3, 2, 1], [5, 3, 2]]
    stats = online_statistics(timings, ["a", "a"], ["p0"], ["x"], Bootstrap(n_resamples=10))
    assert stats.arms["a"]["accept_rate"] == pytest.approx([7 / 10, 3 / 7, 1 / 2])


@dataclass
class Scripted:
    """A decoding that reports fixed figures and logs its calls (no target, no drafter)."""

    name: str
    tokens: int
    calls: list = field(default_factory=list)
    checkpoint: str = ""
    tree: None = None
    slots: int = 2
    parameters: int = 0

    def warm_up(self, target, prompts, sampling, max_new_tokens, seed):
        self.calls.append(("warm", self.name, [p["id"] for p in prompts], max_new_tokens, seed))

    def decode(self, target, prompts, sampling, max_new_tokens, seed):
        self.calls.append(("decode", self.name, prompts[0]["id"], seed))
        report = DecodeReport(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([2.0, 1.0]).double())
        report.tokens, report.rounds, report.seconds, report.draft_seconds = self.tokens, 2, 0.5, 0.125
        return report

    def arm_details(self, seeds):
        return {}


def test_the_timed_loop_warms_up_then_interleaves_prompts_and_records_every_report():
    calls: list = []
    plain, a, b = (Scripted(n, t, calls) for n, t in [("plain", 3, ), ("a", 5), ("b", 7)])
    run = OnlineRun(None, [a, b], PROMPTS[:3], SamplingConfig(), max_new_tokens=32, seed=10, progress=False,
                    plain=plain)
    timings = run.run()
    warm = [("warm", n, ["p0"], 8, 10) for n in ("plain", "a", "b")]  # each once, 8 tokens of the first prompt
    loop = [("decode", n, f"p{i}", 10 + i) for i in range(3) for n in ("plain", "a", "b")]  # prompt by prompt
    assert calls == warm + loop
    assert timings.tokens.tolist() == [[3] * 3, [5] * 3, [7] * 3] and timings.rounds.sum() == 18
    assert timings.seconds.sum() == 4.5 and timings.draft_seconds[1].sum() == 0.375
    assert [s.tolist() for s in timings.slots] == [[[3, 0], [6, 3]]] * 2  # plain's row keeps no slot counts
