"""The judge: a lower confidence bound of each plan's speedup over plain decoding, and the pick over many plans held
to a 5% error as a whole (``decide``)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from lightning_spec.decoding.plans import Plan
from lightning_spec.evaluation.auto.candidates import PLAIN
from lightning_spec.evaluation.auto.estimate import Estimate

CONFIDENCE = 0.95  # one-sided: a plan is picked when its speedup's lower bound at this confidence clears the margin
MARGIN = 0.05  # what the bound must beat plain by: machine noise between calibration and decoding (plain decoding
# measured against itself spread 0.94x-1.00x on the 2-core CPU), the cache growth the verify model leaves out, and
# prompts less like the calibration ones than they are like each other; 5% keeps a pick >= ~0.98x plain elsewhere


def t_quantile(q: float, dof: int) -> float:
    """Student's t quantile (P(T <= t) = q >= 0.5, ``dof`` >= 1 degrees of freedom), by bisection on the closed
    form of P(|T| <= t) for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    lo, hi = 0.0, 1e6
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(mid, dof) < 2 * q - 1 else (lo, mid)
    return (lo + hi) / 2


def _t_within(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` degrees of freedom; θ = atan(t / √dof)."""
    theta = math.atan(t / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    total = 0.0
    if dof % 2:  # odd: (2/π)(θ + sinθ (cosθ + (2/3) cos³θ + (2·4)/(3·5) cos⁵θ + ...)), (dof - 1) / 2 terms
        term = math.sin(theta) * math.cos(theta)
        for j in range((dof - 1) // 2):
            total += term
            term *= c2 * (2 * j + 2) / (2 * j + 3)
        return 2 / math.pi * (theta + total)
    term = 1.0  # even: sinθ (1 + (1/2) cos²θ + (1·3)/(2·4) cos⁴θ + ...), dof / 2 terms
    for j in range(dof // 2):
        total += term
        term *= c2 * (2 * j + 1) / (2 * j + 2)
    return math.sin(theta) * total


def speedup_bound(plain: Estimate, other: Estimate, confidence: float = CONFIDENCE) -> float | None:
    """The one-sided lower confidence bound of ``other``'s speedup over plain decoding: the pooled speedup its
    ``tokens_per_s`` reports, R = Σ plain seconds / Σ other seconds (both decode the same outputs, so the tokens
    cancel), not a mean of per-prompt speedups (a plan fast on short prompts and slow on long ones is slower
    overall). The bound is taken on log R by the delta method, paired over prompts: prompt i moves log R by
    z_i = p_i / mean(p) - o_i / mean(o), so log R's standard error is sd(z) / √n and the bound is
    R · exp(-t_{confidence, n-1} · sd(z) / √n). None from fewer than 2 prompts with tokens: one says nothing of how
    the speedup varies from prompt to prompt."""
    pairs = [(p, o) for p, o, t in zip(plain.prompt_seconds, other.prompt_seconds, plain.prompt_tokens)
             if t > 0 and p > 0 and o > 0]
    if len(pairs) < 2:
        return None
    mean_p, mean_o = statistics.fmean(p for p, _ in pairs), statistics.fmean(o for _, o in pairs)
    spread = statistics.stdev(p / mean_p - o / mean_o for p, o in pairs) / math.sqrt(len(pairs))
    return mean_p / mean_o * math.exp(-t_quantile(confidence, len(pairs) - 1) * spread)


def family_confidence(confidence: float, plans: int) -> float:
    """The confidence each of ``plans`` bounds is taken at so that all of them hold together at ``confidence``
    (Šidák: confidence ** (1 / m)). ``pick`` takes the best of m bounds: at 95% each, a plan no faster than plain
    clears one of 20 by chance far more often than 5% of the time (13.6% in the simulation of
    tests/evaluation/test_auto.py); at the corrected level, at most 5%."""
    return confidence ** (1 / max(plans, 1))


def with_bounds(estimates: list[Estimate], confidence: float = CONFIDENCE, joint: bool = True) -> list[Estimate]:
    """``estimates`` (plain's among them), each with its ``lcb`` over plain's (plain's own: 1), every bound at the
    ``family_confidence`` of the plans compared, so that they hold together at ``confidence`` (``joint``), or each
    at ``confidence`` alone."""
    plain = next(e for e in estimates if e.plan == PLAIN)
    each = family_confidence(confidence, sum(e.plan != PLAIN for e in estimates)) if joint else confidence
    return [dataclasses.replace(e, lcb=1.0 if e.plan == PLAIN else speedup_bound(plain, e, each))
            for e in estimates]


def pick(estimates: list[Estimate], margin: float = MARGIN) -> Plan:
    """Plain decoding, unless some plan's ``lcb`` exceeds 1 + ``margin``; of those, the one with the highest bound.
    Not the highest estimate: of many plans scored on a few prompts, the one estimated fastest is the likeliest
    to have been lucky on them (the winner's curse), and the bound discounts a plan by how much its speedup
    varied from prompt to prompt. Ties go to the simpler plan, listed first."""
    best = None
    for e in estimates:
        if e.plan != PLAIN and e.lcb is not None and e.lcb > 1 + margin and (best is None or e.lcb > best.lcb):
            best = e
    return PLAIN if best is None else best.plan


def on_prompts(estimate: Estimate, prompts: list[int]) -> Estimate:
    """``estimate`` restricted to the calibration prompts ``prompts`` (indices), its bound left to be taken."""
    def keep(values: tuple) -> tuple:
        return tuple(values[i] for i in prompts)

    return Estimate(estimate.plan, keep(estimate.prompt_tokens), keep(estimate.prompt_rounds),
                    keep(estimate.prompt_seconds))


@dataclass(frozen=True)
class Verdict:
    """What the judge decided: the pick, and under the split rule the candidate chosen on half the calibration
    prompts and its bound on the other half (None under the joint rule)."""

    plan: Plan
    candidate: Plan | None = None
    confirmed: float | None = None  # the candidate's lower bound on the prompts it was not chosen on
    confirm_prompts: int = 0


def decide(estimates: list[Estimate], margin: float = MARGIN, confidence: float = CONFIDENCE) -> Verdict:
    """Pick over many plans with the family-wise error held at 1 - ``confidence``. From 4 calibration prompts with
    tokens: the candidate is the plan with the highest lower bound on every other prompt (no threshold there: the
    choice is not the test), confirmed on the others by one bound at ``confidence``; picked when that bound beats
    plain by ``margin``. Choosing and confirming on different prompts is one test whatever the number of plans, which
    keeps more power than holding m bounds together (Šidák at m = 22 asks t_{0.9977} instead of t_{0.95}). With
    fewer prompts: the joint bounds over all of them (``with_bounds``, ``pick``)."""
    plain = next(e for e in estimates if e.plan == PLAIN)
    usable = [i for i, t in enumerate(plain.prompt_tokens) if t > 0]
    if len(usable) < 4 or len(estimates) < 3:
        return Verdict(pick(with_bounds(estimates, confidence), margin))
    choose, confirm = usable[0::2], usable[1::2]
    plain_seconds = on_prompts(plain, choose).seconds
    ranked = [e for e in with_bounds([on_prompts(e, choose) for e in estimates], confidence, joint=False)
              if e.plan != PLAIN and e.lcb is not None and e.seconds < plain_seconds]
    if not ranked:  # no plan was faster than plain on the prompts it would be chosen on
        return Verdict(PLAIN, None, None, len(confirm))
    candidate = max(ranked, key=lambda e: e.lcb).plan  # the first listed among equals
    chosen = next(e for e in estimates if e.plan == candidate)
    bound = speedup_bound(on_prompts(plain, confirm), on_prompts(chosen, confirm), confidence)
    picked = candidate if bound is not None and bound > 1 + margin else PLAIN
    return Verdict(picked, candidate, bound, len(confirm))
