"""``choose_decoding``: decoding auto's pick for a target, a drafter and this machine, and the ``Choice`` it returns."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_spec.decoding.auto.candidates import PLAIN, candidates
from lightning_spec.decoding.auto.costs import Costs, machine_name, measure_costs, round_overhead
from lightning_spec.decoding.auto.estimate import Estimate, Rounds, _with_overheads, count_rounds, output_features
from lightning_spec.decoding.auto.judge import CONFIDENCE, MARGIN, Verdict, baseline, decide, on_prompts, with_bounds
from lightning_spec.decoding.engine import Generation, _as_ids, generate
from lightning_spec.decoding.plans import Auto, Plan, check_dtypes
from lightning_spec.errors import UserError
from lightning_spec.paired import family_confidence
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import dtype_name
from lightning_spec.target_loading import native_bf16

if TYPE_CHECKING:
    from lightning_spec.decoding.proposer import Proposer
    from lightning_spec.target import Target

PROBES = 2  # decodes of one calibration prompt that measure a leading speculative plan's bookkeeping per round


@dataclass
class Choice:
    """The plan ``choose_decoding`` picked, the target's dtype to decode it in, what ``generate`` takes for it,
    every plan's estimate (with its lower bound), and the margin and confidence it was judged at."""

    plan: Plan  # generate(plan=...)
    drafter: Proposer | None  # generate(drafter=...): the drafter the plan drafts with (None: none)
    estimates: list[Estimate]
    machine: str
    dtype: str  # the target's dtype the pick decodes in
    margin: float = MARGIN
    confidence: float = CONFIDENCE
    costs: Costs | None = None  # the pick's dtype's (timed here, or passed in)
    verdict: Verdict | None = None  # how the pick was judged (``decide``); None: the joint rule

    @property
    def key(self) -> tuple[Plan, str | None]:
        return self.plan, (self.verdict.dtype if self.verdict is not None else None)

    @property
    def dtypes(self) -> list[str | None]:
        """The dtypes searched ([None]: the target's own alone)."""
        return list(dict.fromkeys(e.dtype for e in self.estimates))

    def decoding_target(self, target: Target) -> Target:
        """The target the pick decodes with: ``target`` in the pick's dtype (``Target.cast``)."""
        return target.cast(self.dtype)

    @property
    def expected(self) -> Estimate:
        """The pick's figures on the calibration prompts that did not choose it (the split rule), else on all of
        them. The prompts that chose a plan favour it by the choice itself (the winner's curse): counting them
        would expect more than held-out prompts give."""
        return self._held_out(next(e for e in self.estimates if e.key == self.key))

    @property
    def plain(self) -> Estimate:
        """The baseline's figures (the fastest plain decoding searched) on the prompts ``expected`` is taken on."""
        return self._held_out(self._plain_everywhere)

    @property
    def plain_dtype(self) -> str | None:
        """The baseline's dtype when several were searched (None: the target's own alone)."""
        return self._plain_everywhere.dtype

    @property
    def kept_plain(self) -> bool:
        """Whether the pick is the baseline: no plan was sure enough to beat the fastest plain decoding."""
        return self.key == self._plain_everywhere.key

    @property
    def _plain_everywhere(self) -> Estimate:
        return baseline(self.estimates)

    def _held_out(self, estimate: Estimate) -> Estimate:
        v = self.verdict
        if v is None or not v.confirm or self.kept_plain:
            return estimate
        base = estimate.key == self._plain_everywhere.key
        return dataclasses.replace(on_prompts(estimate, list(v.confirm)), lcb=1.0 if base else v.confirmed)

    @property
    def expected_speedup(self) -> float:
        return self.expected.tokens_per_s / self.plain.tokens_per_s

    @property
    def compared(self) -> int:
        """Plans judged against plain: the bounds hold together over this many (``family_confidence``)."""
        return len(self.estimates) - 1

    @property
    def prompts(self) -> int:
        """Calibration prompts that count in the bounds (an answer of no token counts in none)."""
        return sum(t > 0 for t in self._plain_everywhere.prompt_tokens)

    def generate(self, target: Target, input_ids: Any, max_new_tokens: int, sampling: Any = None,
                 seed: int | None = None) -> Any:
        return generate(self.decoding_target(target), input_ids, max_new_tokens, sampling, drafter=self.drafter,
                        seed=seed, plan=self.plan)

    def describe(self, measured_speedup: float | None = None, measured_tokens_per_s: float | None = None) -> str:
        """One line: what was picked, its expected MAL, tokens/s and speedup over plain with the lower bound (or why
        plain was kept), and the measured speedup and tokens/s when given; when plain was kept, the measured figure
        is plain decoding against itself, so it is given as the run-to-run spread, not as a speed result."""
        e, pct = self.expected, f"{self.confidence:.0%}"
        v = self.verdict
        split = v is not None and v.confirm_prompts > 0
        plain = self._plain_label
        if not self.kept_plain and split:
            why = (f"{self.expected_speedup:.2f}x {plain}, {pct} lower bound {v.confirmed:.2f}x on the "
                   f"{v.confirm_prompts} calibration prompts it was not chosen on (of {self.compared} plans)")
        elif not self.kept_plain:
            why = (f"{self.expected_speedup:.2f}x {plain}, {pct} joint lower bound {e.lcb:.2f}x of {self.compared} "
                   f"plans over {self.prompts} calibration prompts")
        elif self.prompts < 2:
            why = (f"{self.prompts} calibration prompt with tokens gives no lower bound (it takes 2), so no plan "
                   "is picked over plain")
        elif split and v.candidate is not None:
            bound = "no bound" if v.confirmed is None else f"a {pct} lower bound of {v.confirmed:.2f}x"
            why = (f"the best of {self.compared} plans on half the calibration prompts, {self._candidate_label}, has "
                   f"{bound} on the {v.confirm_prompts} others, not above {1 + self.margin:.2f}x")
        elif split:
            why = f"no plan was faster than {plain} on the half of the calibration prompts a candidate is chosen on"
        else:
            base = self._plain_everywhere.key
            best = max((x for x in self.estimates if x.lcb is not None and x.key != base),
                       key=lambda x: x.lcb, default=None)
            why = (f"no plan's {pct} joint lower bound ({self.compared} plans) over {self.prompts} calibration "
                   f"prompts beat {plain} by {self.margin:.0%}"
                   + (f"; best {best.label} at {best.lcb:.2f}x, expected "
                      f"{best.tokens_per_s / self.plain.tokens_per_s:.2f}x" if best else ""))
        line = (f"decoding auto: {self.plan.label} (expected MAL {e.mal:.2f}, {e.tokens_per_s:.1f} tokens/s, "
                f"{why}; {self.machine}, {self.dtype})")
        if measured_speedup is not None and self.kept_plain:  # plain against plain: no speed result, noise
            line += f"; kept plain decoding: plain against itself measured {measured_speedup:.2f}x (run-to-run spread)"
        elif measured_speedup is not None:
            line += f"; measured {measured_speedup:.2f}x"
            if measured_tokens_per_s is not None:
                line += f", {measured_tokens_per_s:.1f} tokens/s"
        return line

    @property
    def _plain_label(self) -> str:
        """The baseline, named with its dtype when several were searched ("plain bfloat16")."""
        return "plain" if self.plain_dtype is None else f"plain {self.plain_dtype}"

    @property
    def _candidate_label(self) -> str:
        v = self.verdict
        label = v.candidate.label
        return label if v.candidate_dtype is None else f"{label}, {v.candidate_dtype}"

    def table(self) -> str:
        """Every plan's estimate, fastest first, with its lower bound."""
        rows = sorted(self.estimates, key=lambda e: -e.tokens_per_s)
        plain = self._plain_everywhere.tokens_per_s
        lines = [f"  {'plan':<46}{'MAL':>6}{'tokens/s':>10}{'/ plain':>9}{'LCB':>8}"]
        lines += [f"  {e.label:<46}{e.mal:>6.2f}{e.tokens_per_s:>10.2f}{e.tokens_per_s / plain:>8.2f}x"
                  + (f"{e.lcb:>7.2f}x" if e.lcb is not None else f"{'-':>8}")
                  + ("  <- picked" if e.key == self.key else "") for e in rows]
        each = family_confidence(self.confidence, self.compared)
        lines.append(f"  LCB: the lower bound of the speedup over {self._plain_label}, {self.confidence:.0%} for all "
                     f"{self.compared} plans together (each at {each:.2%}), over {self.prompts} calibration prompts")
        v = self.verdict
        if v is not None and v.confirm_prompts:
            confirmed = "none" if v.candidate is None else (
                f"{self._candidate_label}, " + ("no bound" if v.confirmed is None else f"{v.confirmed:.2f}x"))
            lines.append(f"  picked: the plan with the highest {self.confidence:.0%} bound on every other calibration "
                         f"prompt, confirmed on the other {v.confirm_prompts} above {1 + self.margin:.2f}x "
                         f"(candidate: {confirmed})")
        else:
            lines.append(f"  picked over {self._plain_label} only above {1 + self.margin:.2f}x")
        return "\n".join(lines)


def choose_decoding(
    target: Target,
    drafter: Proposer | None,
    prompts: list[list[int]],
    sampling: SamplingConfig | dict | None = None,
    max_new_tokens: int = 48,
    plans: list[Plan] | None = None,
    costs: Costs | dict[str, Costs] | None = None,
    outputs: list[list[int]] | None = None,
    auto: Auto | None = None,
    progress: bool = False,
) -> Choice:
    """``decoding: auto``: the fastest plan for this target, drafter and machine, in the fastest of the dtypes
    searched, that is sure enough to beat the fastest plain decoding (``decide``), else that plain decoding.

    Args:
        target: a loaded ``Target``.
        drafter: the trained drafter (bound to ``target``), or None (plain and n-gram plans only).
        prompts: calibration prompts (each as ``generate`` takes it: token ids or a tokenizer's output), prompts the
            decoding will not be judged on, a few of every kind it will decode (one gives no lower bound: plain).
        sampling: the decoding's sampling config (None: greedy).
        max_new_tokens: tokens the target answers each calibration prompt with.
        plans: the plans to compare (default ``candidates(drafter)``); plain is always among them.
        costs: measured ``Costs`` to use instead of timing them (``measure_costs``), one per dtype name when several
            are searched; given, nothing is timed, and bookkeeping and prefill count only as far as
            ``costs.overhead`` says.
        outputs: the target's answers to ``prompts`` under ``sampling`` if already decoded (else decoded here, timed
            for plain decoding's bookkeeping per round and each prompt's prefill when ``costs`` is None).
        auto: the ``auto`` plan's options (default ``Auto()``): ``margin``, how much faster than the baseline a
            plan's lower bound must be (``MARGIN``: why 5%), and ``dtypes``, the target's dtypes searched
            (``search_dtypes``). Searching several, every plan is costed in each (its rounds are counted once, on
            the target's own answers) and the baseline is the fastest plain decoding among them: on an AMX CPU a
            1-token bf16 forward can be slower than fp32 while its 9-token verify is nearly free. Greedy identity
            with plain decoding holds in float32 only (``Target.precision``): a pick in bfloat16 decodes what bf16
            plain decoding would.
        progress: show a progress bar over the plans.
    """
    sampling, auto = SamplingConfig.coerce(sampling), auto or Auto()
    if not prompts:
        raise UserError("choose_decoding needs calibration prompts: a few prompts like those it will decode.")
    own, names = dtype_name(target.dtype), search_dtypes(target, auto.dtypes)
    costs_of = _costs_per_dtype(costs, names, own)
    prompts = [_as_ids(p, target.vocab_size, target.device)[0].tolist() for p in prompts]  # what generate takes
    plans = list(plans or candidates(drafter))
    if PLAIN not in plans:
        plans.insert(0, PLAIN)
    calibration = _Calibration(target, drafter, prompts, sampling, max_new_tokens, names, costs_of)
    if costs is None:  # nothing passed in: time it here (passed in: deterministic)
        calibration.measure(plans, outputs)
    if outputs is None:
        outputs = calibration.answers()
    pairs = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
    # one target forward per output for every drafter plan (n-gram lookup reads no features)
    features = output_features(target, list(drafter.target_layers) if drafter is not None else [], pairs)
    counted = []
    with progress_bar("decoding auto: scoring plans", len(plans), progress) as bar:
        for plan in plans:
            c = count_rounds(target, drafter, plan, pairs, sampling, features)
            if c is not None:
                counted.append(c)
            bar.advance(1)
    estimates, verdict = calibration.judge(counted, auto.margin, probe=max(range(len(pairs)),
                                                                           key=lambda i: len(pairs[i][1])))
    picked = verdict.dtype or own
    return Choice(verdict.plan, drafter, estimates, costs_of[picked].machine or machine_name(target.device), picked,
                  auto.margin, CONFIDENCE, costs_of[picked], verdict)


@dataclass
class _Calibration:
    """What ``choose_decoding`` measures on this machine, per dtype searched: plain decodes of the calibration
    prompts (their answers in the target's own dtype are what plans are scored on), each dtype's ``Costs`` with
    plain decoding's bookkeeping per round, each prompt's prefill, and the leading plan's bookkeeping."""

    target: Target
    drafter: Proposer | None
    prompts: list[list[int]]
    sampling: SamplingConfig
    max_new_tokens: int
    names: list[str]  # the dtypes searched
    costs: dict[str, Costs]  # name -> its costs (passed in, or measured here)
    decodes: dict[str, list[Generation]] = field(default_factory=dict)  # name -> plain decodes
    timed: bool = False  # the decodes were timed by ``measure``: bookkeeping and prefill count

    @property
    def own(self) -> str:
        return dtype_name(self.target.dtype)

    def answers(self) -> list[list[int]]:
        """The target's answers in its own dtype (decoded here if ``measure`` did not)."""
        if self.own not in self.decodes:
            self.decodes[self.own] = self._decode(self.own)
        return [g.tokens for g in self.decodes[self.own]]

    def _decode(self, name: str) -> list[Generation]:
        return [generate(self.target.cast(name), p, self.max_new_tokens, self.sampling, seed=i)
                for i, p in enumerate(self.prompts)]

    def measure(self, plans: list[Plan], outputs: list[list[int]] | None) -> None:
        """Time each dtype's verify forwards and proposals halfway through the longest calibration answer, and,
        without ``outputs`` passed in, its plain decodes, for the bookkeeping per round and the prefill."""
        if outputs is None:
            for name in dict.fromkeys([self.own, *self.names]):
                self.decodes[name] = self._decode(name)
            self.timed, outputs = True, self.answers()
        prompt, answer = max(zip(self.prompts, outputs), key=lambda pr: len(pr[0]) + len(pr[1]))
        context = list(prompt) + list(answer[: len(answer) // 2])
        for name in self.names:
            self.costs[name] = measure_costs(self.target.cast(name), self.drafter, plans, context)
            if self.timed:  # the median over the decodes: the first pays one-off costs
                self.costs[name].overhead[PLAIN] = statistics.median(
                    round_overhead(g, PLAIN, self.costs[name]) for g in self.decodes[name])
        if self.drafter is not None:
            self.drafter.use_target(self.target)  # rounds are counted on the target's own answers

    def judge(self, counted: list[Rounds], margin: float, probe: int) -> tuple[list[Estimate], Verdict]:
        """Every plan's estimate in every dtype, with its bound, and the verdict (``decide``); where the leading
        plan's bookkeeping per round was not measured, one decode of the ``probe`` prompt with it measures it and the
        plans are judged again (at most ``PROBES`` times)."""
        search = self.names != [self.own]  # estimates carry their dtype only when it is searched
        for probes in range(PROBES + 1):
            estimates = with_bounds([
                _with_overheads(c.timed(self.costs[n], n if search else None), self.costs[n], self._prefill(n))
                for n in self.names for c in counted])
            verdict = decide(estimates, margin)
            lead, dtype = verdict.candidate_key or verdict.key
            costs = self.costs[dtype or self.own]
            if not self.timed or lead == PLAIN or lead in costs.overhead or probes == PROBES:
                break
            gen = generate(self.target.cast(dtype or self.own), self.prompts[probe], self.max_new_tokens,
                           self.sampling, drafter=self.drafter, seed=probe, plan=lead)
            costs.overhead[lead] = round_overhead(gen, lead, costs)
        if self.drafter is not None:
            self.drafter.use_target(self.target)
        return estimates, verdict

    def _prefill(self, name: str) -> list[float] | None:
        return [g.prefill_seconds for g in self.decodes[name]] if self.timed else None


def search_dtypes(target: Target, dtypes: Sequence[str] | str | None) -> list[str]:
    """The dtype names ``choose_decoding`` searches: the target's own (None), those ``target``'s device multiplies
    natively (``"native"``: float32, and bfloat16 where ``native_bf16``), or the names given."""
    own = dtype_name(target.dtype)
    if dtypes is None:
        return [own]
    if dtypes == "native":
        return ["float32"] + (["bfloat16"] if native_bf16(target.device) else [])
    check_dtypes(dtypes)
    names = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    return list(dict.fromkeys(names))


def _costs_per_dtype(costs: Costs | dict[str, Costs] | None, names: list[str], own: str) -> dict[str, Costs]:
    """``costs`` passed in, keyed by the dtype names searched (a lone ``Costs``: the target's own dtype's)."""
    if costs is None:
        return {}
    if isinstance(costs, Costs):
        costs = {own: costs}
    missing = [n for n in names if n not in costs]
    if missing:
        raise UserError(f"choose_decoding was given costs for {sorted(costs)} but searches {names}: pass one Costs "
                        f"per dtype searched (missing {missing}), or none to time them here.")
    return dict(costs)
