"""The judge: a lower confidence bound of each plan's speedup over plain decoding, and the pick over many plans held
to a 5% error as a whole (``decide``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_spec.decoding.auto.candidates import PLAIN
from lightning_spec.decoding.auto.estimate import Estimate
from lightning_spec.decoding.plans import Plan
from lightning_spec.paired import family_confidence, ratio_bound

CONFIDENCE = 0.95  # one-sided: a plan is picked when its speedup's lower bound at this confidence clears the margin
MARGIN = 0.05  # what the bound must beat plain by: machine noise between calibration and decoding (plain decoding
# measured against itself spread 0.94x-1.00x on the 2-core CPU), the cache growth the verify model leaves out, and
# prompts less like the calibration ones than they are like each other; 5% keeps a pick >= ~0.98x plain elsewhere


def baseline(estimates: list[Estimate]) -> Estimate:
    """What every plan is judged against: the fastest plain decoding among the dtypes searched (one plain estimate
    when auto searches the target's dtype alone)."""
    return min((e for e in estimates if e.plan == PLAIN), key=lambda e: e.seconds)


def speedup_bound(plain: Estimate, other: Estimate, confidence: float = CONFIDENCE) -> float | None:
    """The one-sided lower confidence bound of ``other``'s speedup over plain decoding: the pooled speedup its
    ``tokens_per_s`` reports, R = Σ plain seconds / Σ other seconds (both decode the same outputs, so the tokens
    cancel), not a mean of per-prompt speedups (a plan fast on short prompts and slow on long ones is slower
    overall). The bound is ``paired.ratio_bound`` over the prompts with tokens (a t bound on log R by the delta
    method, paired over prompts). None from fewer than 2 such prompts: one says nothing of how the speedup varies
    from prompt to prompt."""
    pairs = [(p, o) for p, o, t in zip(plain.prompt_seconds, other.prompt_seconds, plain.prompt_tokens) if t > 0]
    return ratio_bound([p for p, _ in pairs], [o for _, o in pairs], confidence)


def with_bounds(estimates: list[Estimate], confidence: float = CONFIDENCE, joint: bool = True) -> list[Estimate]:
    """``estimates`` (plain's among them), each with its ``lcb`` over the ``baseline`` (the baseline's own: 1), every
    bound at the ``family_confidence`` of the others, so that they hold together at ``confidence`` (``joint``), or
    each at ``confidence`` alone."""
    base = baseline(estimates)
    each = family_confidence(confidence, len(estimates) - 1) if joint else confidence
    return [dataclasses.replace(e, lcb=1.0 if e.key == base.key else speedup_bound(base, e, each))
            for e in estimates]


def pick(estimates: list[Estimate], margin: float = MARGIN) -> Estimate:
    """The baseline (the fastest plain decoding), unless some other's ``lcb`` exceeds 1 + ``margin``; of those, the
    one with the highest bound.
    Not the highest estimate: of many plans scored on a few prompts, the one estimated fastest is the likeliest
    to have been lucky on them (the winner's curse), and the bound discounts a plan by how much its speedup
    varied from prompt to prompt. Ties go to the simpler plan, listed first."""
    base, best = baseline(estimates), None
    for e in estimates:
        if e.key != base.key and e.lcb is not None and e.lcb > 1 + margin and (best is None or e.lcb > best.lcb):
            best = e
    return base if best is None else best


def on_prompts(estimate: Estimate, prompts: list[int]) -> Estimate:
    """``estimate`` restricted to the calibration prompts ``prompts`` (indices), its bound left to be taken."""
    def keep(values: tuple) -> tuple:
        return tuple(values[i] for i in prompts)

    return Estimate(estimate.plan, keep(estimate.prompt_tokens), keep(estimate.prompt_rounds),
                    keep(estimate.prompt_seconds), dtype=estimate.dtype)


@dataclass(frozen=True)
class Verdict:
    """What the judge decided: the pick (its plan and the target's dtype for it), and under the split rule the
    candidate chosen on half the calibration prompts and its bound on the other half (None under the joint rule)."""

    plan: Plan
    candidate: Plan | None = None
    confirmed: float | None = None  # the candidate's lower bound on the prompts it was not chosen on
    confirm_prompts: int = 0
    confirm: tuple[int, ...] = ()  # those prompts' indices among the calibration prompts
    dtype: str | None = None  # the pick's (None: the target's own)
    candidate_dtype: str | None = None

    @property
    def key(self) -> tuple[Plan, str | None]:
        return self.plan, self.dtype

    @property
    def candidate_key(self) -> tuple[Plan, str | None] | None:
        return None if self.candidate is None else (self.candidate, self.candidate_dtype)


def decide(estimates: list[Estimate], margin: float = MARGIN, confidence: float = CONFIDENCE) -> Verdict:
    """Pick over many plans with the family-wise error held at 1 - ``confidence``. From 4 calibration prompts with
    tokens: the candidate is the plan with the highest lower bound on every other prompt (no threshold there: the
    choice is not the test), confirmed on the others by one bound at ``confidence``; picked when that bound beats
    the baseline (the fastest plain decoding, ``baseline``) by ``margin``. Choosing and confirming on different
    prompts is one test whatever the number of plans, which keeps more power than holding m bounds together (Šidák
    at m = 22 asks t_{0.9977} instead of t_{0.95}). With fewer prompts: the joint bounds over all of them
    (``with_bounds``, ``pick``)."""
    base = baseline(estimates)
    usable = [i for i, t in enumerate(base.prompt_tokens) if t > 0]
    if len(usable) < 4 or len(estimates) < 3:
        picked = pick(with_bounds(estimates, confidence), margin)
        return Verdict(picked.plan, dtype=picked.dtype)
    choose, confirm = usable[0::2], usable[1::2]
    base_seconds = on_prompts(base, choose).seconds
    ranked = [e for e in with_bounds([on_prompts(e, choose) for e in estimates], confidence, joint=False)
              if e.key != base.key and e.lcb is not None and e.seconds < base_seconds]
    if not ranked:  # no plan was faster than the baseline on the prompts it would be chosen on
        return Verdict(base.plan, None, None, len(confirm), tuple(confirm), dtype=base.dtype)
    candidate = max(ranked, key=lambda e: e.lcb).key  # the first listed among equals
    chosen = next(e for e in estimates if e.key == candidate)
    bound = speedup_bound(on_prompts(base, confirm), on_prompts(chosen, confirm), confidence)
    picked = chosen if bound is not None and bound > 1 + margin else base
    return Verdict(picked.plan, candidate[0], bound, len(confirm), tuple(confirm), picked.dtype, candidate[1])
