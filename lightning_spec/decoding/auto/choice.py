"""``choose_decoding``: decoding auto's pick for a target, a drafter and this machine, and the ``Choice`` it returns."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_spec.decoding.auto.candidates import PLAIN, candidates
from lightning_spec.decoding.auto.costs import Costs, machine_name, measure_costs, round_overhead
from lightning_spec.decoding.auto.estimate import Estimate, _count, _with_overheads, output_features
from lightning_spec.decoding.auto.judge import CONFIDENCE, MARGIN, Verdict, decide, on_prompts, with_bounds
from lightning_spec.decoding.engine import _as_ids, generate
from lightning_spec.decoding.plans import Plan
from lightning_spec.errors import UserError
from lightning_spec.paired import family_confidence
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.proposer import Proposer
    from lightning_spec.target import Target

PROBES = 2  # decodes of one calibration prompt that measure a leading speculative plan's bookkeeping per round


@dataclass
class Choice:
    """The plan ``choose_decoding`` picked, what ``generate`` takes for it, every plan's estimate (with its
    lower bound), and the margin and confidence it was judged at."""

    plan: Plan  # generate(plan=...)
    drafter: Proposer | None  # generate(drafter=...): the drafter the plan drafts with (None: none)
    estimates: list[Estimate]
    machine: str
    dtype: str
    margin: float = MARGIN
    confidence: float = CONFIDENCE
    costs: Costs | None = None  # what the estimates were computed from (timed here, or passed in)
    verdict: Verdict | None = None  # how the pick was judged (``decide``); None: the joint rule

    @property
    def expected(self) -> Estimate:
        """The pick's figures on the calibration prompts that did not choose it (the split rule), else on all of
        them. The prompts that chose a plan favour it by the choice itself (the winner's curse): counting them
        would expect more than held-out prompts give."""
        return self._held_out(next(e for e in self.estimates if e.plan == self.plan))

    @property
    def plain(self) -> Estimate:
        """Plain decoding's figures on the prompts ``expected`` is taken on."""
        return self._held_out(self._plain_everywhere)

    @property
    def _plain_everywhere(self) -> Estimate:
        return next(e for e in self.estimates if e.plan == PLAIN)

    def _held_out(self, estimate: Estimate) -> Estimate:
        v = self.verdict
        if v is None or not v.confirm or self.plan == PLAIN:
            return estimate
        return dataclasses.replace(on_prompts(estimate, list(v.confirm)),
                                   lcb=1.0 if estimate.plan == PLAIN else v.confirmed)

    @property
    def expected_speedup(self) -> float:
        return self.expected.tokens_per_s / self.plain.tokens_per_s

    @property
    def compared(self) -> int:
        """Plans judged against plain: the bounds hold together over this many (``family_confidence``)."""
        return sum(e.plan != PLAIN for e in self.estimates)

    @property
    def prompts(self) -> int:
        """Calibration prompts that count in the bounds (an answer of no token counts in none)."""
        return sum(t > 0 for t in self._plain_everywhere.prompt_tokens)

    def generate(self, target: Target, input_ids: Any, max_new_tokens: int, sampling: Any = None,
                 seed: int | None = None) -> Any:
        return generate(target, input_ids, max_new_tokens, sampling, drafter=self.drafter, seed=seed, plan=self.plan)

    def describe(self, measured_speedup: float | None = None, measured_tokens_per_s: float | None = None) -> str:
        """One line: what was picked, its expected MAL, tokens/s and speedup over plain with the lower bound (or why
        plain was kept), and the measured speedup and tokens/s when given; when plain was kept, the measured figure
        is plain decoding against itself, so it is given as the run-to-run spread, not as a speed result."""
        e, pct = self.expected, f"{self.confidence:.0%}"
        v = self.verdict
        split = v is not None and v.confirm_prompts > 0
        if self.plan != PLAIN and split:
            why = (f"{self.expected_speedup:.2f}x plain, {pct} lower bound {v.confirmed:.2f}x on the "
                   f"{v.confirm_prompts} calibration prompts it was not chosen on (of {self.compared} plans)")
        elif self.plan != PLAIN:
            why = (f"{self.expected_speedup:.2f}x plain, {pct} joint lower bound {e.lcb:.2f}x of {self.compared} "
                   f"plans over {self.prompts} calibration prompts")
        elif self.prompts < 2:
            why = (f"{self.prompts} calibration prompt with tokens gives no lower bound (it takes 2), so no plan "
                   "is picked over plain")
        elif split and v.candidate is not None:
            bound = "no bound" if v.confirmed is None else f"a {pct} lower bound of {v.confirmed:.2f}x"
            why = (f"the best of {self.compared} plans on half the calibration prompts, {v.candidate.label}, has "
                   f"{bound} on the {v.confirm_prompts} others, not above {1 + self.margin:.2f}x")
        elif split:
            why = "no plan was faster than plain on the half of the calibration prompts a candidate is chosen on"
        else:
            best = max((x for x in self.estimates if x.lcb is not None and x.plan != PLAIN),
                       key=lambda x: x.lcb, default=None)
            why = (f"no plan's {pct} joint lower bound ({self.compared} plans) over {self.prompts} calibration "
                   f"prompts beat plain by {self.margin:.0%}"
                   + (f"; best {best.plan.label} at {best.lcb:.2f}x, expected "
                      f"{best.tokens_per_s / self.plain.tokens_per_s:.2f}x" if best else ""))
        line = (f"decoding auto: {self.plan.label} (expected MAL {e.mal:.2f}, {e.tokens_per_s:.1f} tokens/s, "
                f"{why}; {self.machine}, {self.dtype})")
        if measured_speedup is not None and self.plan == PLAIN:  # plain against plain: no speed result, noise
            line += f"; kept plain decoding: plain against itself measured {measured_speedup:.2f}x (run-to-run spread)"
        elif measured_speedup is not None:
            line += f"; measured {measured_speedup:.2f}x"
            if measured_tokens_per_s is not None:
                line += f", {measured_tokens_per_s:.1f} tokens/s"
        return line

    def table(self) -> str:
        """Every plan's estimate, fastest first, with its lower bound."""
        rows = sorted(self.estimates, key=lambda e: -e.tokens_per_s)
        plain = self._plain_everywhere.tokens_per_s
        lines = [f"  {'plan':<36}{'MAL':>6}{'tokens/s':>10}{'/ plain':>9}{'LCB':>8}"]
        lines += [f"  {e.plan.label:<36}{e.mal:>6.2f}{e.tokens_per_s:>10.2f}{e.tokens_per_s / plain:>8.2f}x"
                  + (f"{e.lcb:>7.2f}x" if e.lcb is not None else f"{'-':>8}")
                  + ("  <- picked" if e.plan == self.plan else "") for e in rows]
        lines.append(f"  LCB: the lower bound of the speedup over plain, {self.confidence:.0%} for all {self.compared} "
                     f"plans together (each at {family_confidence(self.confidence, self.compared):.2%}), over the "
                     f"{self.prompts} calibration prompts")
        v = self.verdict
        if v is not None and v.confirm_prompts:
            confirmed = "none" if v.candidate is None else (
                f"{v.candidate.label}, " + ("no bound" if v.confirmed is None else f"{v.confirmed:.2f}x"))
            lines.append(f"  picked: the plan with the highest {self.confidence:.0%} bound on every other calibration "
                         f"prompt, confirmed on the other {v.confirm_prompts} above {1 + self.margin:.2f}x "
                         f"(candidate: {confirmed})")
        else:
            lines.append(f"  picked over plain only above {1 + self.margin:.2f}x")
        return "\n".join(lines)


def choose_decoding(
    target: Target,
    drafter: Proposer | None,
    prompts: list[list[int]],
    sampling: SamplingConfig | dict | None = None,
    max_new_tokens: int = 48,
    plans: list[Plan] | None = None,
    costs: Costs | None = None,
    outputs: list[list[int]] | None = None,
    margin: float = MARGIN,
    progress: bool = False,
) -> Choice:
    """``decoding: auto``: the fastest plan for this target, drafter and machine that is sure enough to beat plain
    decoding (``pick``), else plain decoding.

    Args:
        target: a loaded ``Target``.
        drafter: the trained drafter (bound to ``target``), or None (plain and n-gram plans only).
        prompts: calibration prompts (each as ``generate`` takes it: token ids or a tokenizer's output), prompts the
            decoding will not be judged on, a few of every kind it will decode (one gives no lower bound: plain).
        sampling: the decoding's sampling config (None: greedy).
        max_new_tokens: tokens the target answers each calibration prompt with.
        plans: the plans to compare (default ``candidates(drafter)``); plain is always among them.
        costs: measured ``Costs`` to use instead of timing them (``measure_costs``); given, nothing is timed, and
            bookkeeping and prefill count only as far as ``costs.overhead`` says.
        outputs: the target's answers to ``prompts`` under ``sampling`` if already decoded (else decoded here, timed
            for plain decoding's bookkeeping per round and each prompt's prefill when ``costs`` is None).
        margin: how much faster than plain a plan's lower bound must be (``MARGIN``: why 5%).
        progress: show a progress bar over the plans.
    """
    sampling = SamplingConfig.coerce(sampling)
    if not prompts:
        raise UserError("choose_decoding needs calibration prompts: a few prompts like those it will decode.")
    if margin < 0:
        raise UserError(f"choose_decoding margin={margin} must be >= 0: it is how far a plan's lower bound must "
                        "beat plain decoding (0.05: by 5%).")
    prompts = [_as_ids(p, target.vocab_size, target.device)[0].tolist() for p in prompts]  # what generate takes
    plans = list(plans or candidates(drafter))
    if PLAIN not in plans:
        plans.insert(0, PLAIN)
    decodes = None
    if outputs is None:
        decodes = [generate(target, p, max_new_tokens, sampling, seed=i) for i, p in enumerate(prompts)]
        outputs = [g.tokens for g in decodes]
    pairs = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
    timed = costs is None and decodes is not None  # costs passed in: nothing is timed (deterministic)
    if costs is None:
        longest = max(pairs, key=lambda pr: len(pr[0]) + len(pr[1]))
        costs = measure_costs(target, drafter, plans, longest[0] + longest[1][: len(longest[1]) // 2])
    if timed:  # the median over the decodes: the first pays one-off costs
        costs.overhead[PLAIN] = statistics.median(round_overhead(g, PLAIN, costs) for g in decodes)
    # one target forward per output for every drafter plan (n-gram lookup reads no features)
    features = output_features(target, list(drafter.target_layers) if drafter is not None else [], pairs)
    counted = []
    with progress_bar("decoding auto: scoring plans", len(plans), progress) as bar:
        for plan in plans:
            c = _count(target, drafter, plan, pairs, sampling, costs, features)
            if c is not None:
                counted.append(c)
            bar.advance(1)
    prefill = [g.prefill_seconds for g in decodes] if timed else None
    probe = max(range(len(pairs)), key=lambda i: len(pairs[i][1]))  # the longest answer: the most rounds timed
    for probes in range(PROBES + 1):  # measure the leader's bookkeeping, then judge again
        estimates = with_bounds([_with_overheads(c, costs, prefill) for c in counted])
        verdict = decide(estimates, margin)
        lead = verdict.candidate or verdict.plan
        if not timed or lead == PLAIN or lead in costs.overhead or probes == PROBES:
            break
        gen = generate(target, prompts[probe], max_new_tokens, sampling, drafter=drafter, seed=probe, plan=lead)
        costs.overhead[lead] = round_overhead(gen, lead, costs)
    return Choice(verdict.plan, drafter, estimates, costs.machine or machine_name(target.device),
                  str(target.dtype).replace("torch.", ""), margin, CONFIDENCE, costs, verdict)
