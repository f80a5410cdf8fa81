"""Paired statistics, one module for evaluation and decoding auto: ΔMAL with bootstrap confidence intervals that
resample PROMPTS, and a t bound on a ratio of sums for the few prompts decoding auto calibrates on.

Every drafter ("arm") is scored on the same rollouts (offline) or the same prompts (online), so differences
are paired: a hard prompt is hard for every arm, and resampling prompts jointly cancels that shared noise.

- MAL is the pooled ratio Σ tokens / Σ rounds (a ratio of totals, as EDR's MAL = E[L + 1] / E[#rounds]: Zhao &
  Cai 2026, arXiv 2610.10411, eq. 1), never a mean of per-rollout ratios; the bootstrap recomputes that ratio on
  every resample.
- The resampling unit is the prompt (a cluster: all samples of a prompt go in or out together), not the
  rollout or the token: samples of one prompt are correlated, so resampling them separately would understate
  the uncertainty. The overall interval resamples all prompts together (``bootstrap_mal`` can also stratify
  by domain, which is degenerate for domains of one or two prompts); per-domain intervals resample the
  domain's own prompts.
- Several checkpoints per arm (seeds): each rollout's rounds are averaged over the arm's checkpoints first,
  then prompts are bootstrapped; the interval covers rollout sampling for the seed-averaged arm (seed-to-seed
  spread is reported beside it, ``checkpoint_mal``).
- Percentile intervals from ``n_resamples`` multinomial resamples, drawn once, vectorised with numpy and
  seeded; every arm and the deltas use the same resamples (paired).
- A handful of prompts (decoding auto's calibration) is too few for a bootstrap: ``ratio_bound`` bounds the
  pooled ratio by the delta method with Student's t (``t_quantile``), and ``family_confidence`` holds m such
  bounds together (Šidák).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_spec.errors import UserError


def _clusters(keys: Sequence[str], strata: Sequence[str] | None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cluster index per row (R,), and per stratum the cluster indices it holds."""
    index: dict[str, int] = {}
    stratum_of: list[str] = []
    ids = np.empty(len(keys), dtype=np.int64)
    for i, key in enumerate(keys):
        if key not in index:
            index[key] = len(index)
            stratum_of.append(strata[i] if strata is not None else "")
        elif strata is not None and stratum_of[index[key]] != strata[i]:
            raise ValueError(f"prompt {key!r} appears in two domains ({stratum_of[index[key]]!r}, {strata[i]!r}).")
        ids[i] = index[key]
    groups: dict[str, list[int]] = {}
    for c, s in enumerate(stratum_of):
        groups.setdefault(s, []).append(c)
    return ids, [np.asarray(groups[s]) for s in sorted(groups)]


def _draw(groups: list[np.ndarray], c: int, b: int, rng: np.random.Generator) -> np.ndarray:
    counts = np.zeros((b, c), dtype=np.float64)
    for group in groups:
        m = len(group)
        counts[:, group] = rng.multinomial(m, np.full(m, 1.0 / m), size=b)
    return counts


def bootstrap_mal(
    tokens: np.ndarray,
    rounds: np.ndarray,
    keys: Sequence[str],
    strata: Sequence[str] | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
    max_elems: int = 1 << 24,
) -> np.ndarray:
    """Bootstrap replicates of the pooled MAL of every arm: (B, A).

    tokens: (R,) shared by the arms (offline: the same rollouts) or (A, R) per arm (online decoding);
    rounds: (A, R); keys: the prompt of each row (clusters); strata: the domain of each row (or None).
    Resamples are drawn ``max_elems // clusters`` at a time (memory only; the same stream of draws)."""
    rounds = np.atleast_2d(np.asarray(rounds, dtype=np.float64))
    tokens = np.broadcast_to(np.asarray(tokens, dtype=np.float64), rounds.shape)
    if rounds.shape[1] != len(keys) or not len(keys):
        raise ValueError(f"bootstrap: {rounds.shape[1]} rows of rounds but {len(keys)} prompt keys.")
    ids, groups = _clusters(keys, strata)
    c = int(ids.max()) + 1
    tok_c = np.stack([np.bincount(ids, weights=t, minlength=c) for t in tokens])  # (A, C) sums per cluster
    rnd_c = np.stack([np.bincount(ids, weights=r, minlength=c) for r in rounds])
    rng = np.random.default_rng(seed)
    step = max(1, max_elems // c)
    out = []
    for lo in range(0, n_resamples, step):
        counts = _draw(groups, c, min(step, n_resamples - lo), rng)  # (b, C)
        out.append((counts @ tok_c.T) / np.maximum(counts @ rnd_c.T, 1e-12))  # (b, A)
    return np.concatenate(out)


def percentile_interval(samples: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(samples, [alpha, 1 - alpha])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Bootstrap:
    """How arms are compared (``compare``): the baseline arm (its index among the arms or its name) and the
    bootstrap over prompts."""

    baseline: int | str = 0
    n_resamples: int = 2000
    confidence: float = 0.95
    seed: int = 0


@dataclass
class ArmResult:
    """One arm's pooled MAL with its interval, and its difference to the baseline arm."""

    name: str
    mal: float
    mal_ci: tuple[float, float]
    delta: float  # MAL - baseline MAL (0 for the baseline)
    delta_ci: tuple[float, float]
    p_value: float  # two-sided bootstrap p of Δ = 0 (1 for the baseline)
    checkpoint_mal: list[float] = field(default_factory=list)  # MAL of each checkpoint (seed) of the arm


@dataclass
class Comparison:
    """Every arm against ``baseline`` on the same rows, overall and per domain."""

    baseline: str
    arms: list[ArmResult]
    by_domain: dict[str, list[ArmResult]]
    rows: int
    prompts: int
    n_resamples: int
    confidence: float
    seed: int

    def arm(self, name: str, domain: str | None = None) -> ArmResult:
        arms = self.arms if domain is None else self.by_domain[domain]
        return next(a for a in arms if a.name == name)

    def to_dict(self) -> dict[str, Any]:
        def one(a: ArmResult) -> dict[str, Any]:
            return {
                "mal": a.mal, "mal_ci": list(a.mal_ci), "delta_mal": a.delta, "delta_mal_ci": list(a.delta_ci),
                "p_value": a.p_value, "checkpoint_mal": a.checkpoint_mal,
            }

        return {
            "baseline": self.baseline,
            "arms": {a.name: one(a) for a in self.arms},
            "by_domain": {d: {a.name: one(a) for a in arms} for d, arms in self.by_domain.items()},
            "rows": self.rows,
            "prompts": self.prompts,
            "n_resamples": self.n_resamples,
            "confidence": self.confidence,
            "seed": self.seed,
        }


def _arms(tokens: np.ndarray, rounds: np.ndarray, names: list[str], base: int, keys, n_resamples: int,
          seed: int, confidence: float, checkpoint_mal: list[list[float]]) -> list[ArmResult]:
    samples = bootstrap_mal(tokens, rounds, keys, None, n_resamples, seed)  # (B, A): the same resamples for all
    tok = np.broadcast_to(tokens, rounds.shape).sum(-1)
    point = tok / np.maximum(rounds.sum(-1), 1e-12)  # (A,)
    out = []
    for a, name in enumerate(names):
        diff = samples[:, a] - samples[:, base]
        p = 1.0 if a == base else float(min(1.0, 2 * min((diff <= 0).mean(), (diff >= 0).mean())))
        out.append(ArmResult(
            name=name,
            mal=float(point[a]),
            mal_ci=percentile_interval(samples[:, a], confidence),
            delta=float(point[a] - point[base]),
            delta_ci=(0.0, 0.0) if a == base else percentile_interval(diff, confidence),
            p_value=p,
            checkpoint_mal=checkpoint_mal[a],
        ))
    return out


def compare(
    rounds: dict[str, list[np.ndarray] | np.ndarray],
    tokens: np.ndarray | dict[str, np.ndarray],
    keys: Sequence[str],
    domains: Sequence[str] | None = None,
    baseline: int | str = 0,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Comparison:
    """Compare arms scored on the same rows.

    Args:
        rounds: {arm name: rounds per row (R,), or a list of such arrays, one per checkpoint (seed) of the arm}.
        tokens: committed tokens per row (R,), shared by all arms (offline), or {arm: (R,)} (online decoding,
            where each arm decodes its own tokens from the same prompts).
        keys: the prompt of each row: rows of one prompt are resampled together.
        domains: the domain of each row, for per-domain comparisons (each resamples its own prompts).
        baseline: the arm every other is compared with (index into ``rounds`` or its name).
        n_resamples, confidence, seed: the bootstrap.
    """
    names = list(rounds)
    if not names:
        raise UserError("compare needs at least one arm.")
    base = names.index(baseline) if isinstance(baseline, str) and baseline in names else baseline
    if isinstance(base, str) or not 0 <= base < len(names):
        raise UserError(f"baseline {baseline!r} is not one of the arms {names}.")
    r = len(keys)
    per_arm, ckpt_mal = [], []
    if isinstance(tokens, dict):
        tok = np.stack([np.asarray(tokens[n], dtype=np.float64) for n in names])  # (A, R)
    else:
        tok = np.asarray(tokens, dtype=np.float64)
    for i, name in enumerate(names):
        runs = rounds[name]
        runs = [np.asarray(x, dtype=np.float64) for x in (runs if isinstance(runs, (list, tuple)) else [runs])]
        if any(x.shape != (r,) for x in runs):
            raise UserError(
                f"arm {name!r} was scored on {[len(x) for x in runs]} rows, not the {r} rows of the comparison; "
                "score every drafter on the same rollouts."
            )
        t = tok[i] if tok.ndim == 2 else tok
        ckpt_mal.append([float(t.sum() / max(x.sum(), 1e-12)) for x in runs])
        per_arm.append(np.mean(runs, axis=0))  # average over the arm's checkpoints, per row
    rnd = np.stack(per_arm)  # (A, R)
    arms = _arms(tok, rnd, names, base, keys, n_resamples, seed, confidence, ckpt_mal)
    by_domain: dict[str, list[ArmResult]] = {}
    if domains is not None:
        dom = np.asarray(domains)
        for d in sorted(set(domains)):
            sel = np.flatnonzero(dom == d)
            sub_tok = tok[:, sel] if tok.ndim == 2 else tok[sel]
            sub_keys = [keys[i] for i in sel]
            by_domain[d] = _arms(sub_tok, rnd[:, sel], names, base, sub_keys, n_resamples, seed, confidence,
                                 [[] for _ in names])
    return Comparison(
        baseline=names[base],
        arms=arms,
        by_domain=by_domain,
        rows=r,
        prompts=len(set(keys)),
        n_resamples=n_resamples,
        confidence=confidence,
        seed=seed,
    )


def compare_reports(
    reports: dict[str, list[Any] | Any],
    baseline: int | str = 0,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Comparison:
    """``compare`` for ``OfflineReport``s: {arm name: report, or a list of reports (one per seed)}; every
    report must come from the same rollouts (checked: same prompts, domains and token counts)."""
    flat = {name: (list(r) if isinstance(r, (list, tuple)) else [r]) for name, r in reports.items()}
    first = next(iter(flat.values()))[0]
    for name, runs in flat.items():
        for rep in runs:
            if rep.prompt_keys != first.prompt_keys or not bool((rep.tokens == first.tokens).all()):
                raise UserError(
                    f"arm {name!r} was scored on other rollouts than the first arm; score every drafter on the same "
                    "rollouts (same folder, same max_rollouts)."
                )
    return compare(
        {name: [rep.rounds.numpy() for rep in runs] for name, runs in flat.items()},
        first.tokens.numpy(),
        first.prompt_keys,
        first.domains,
        baseline,
        n_resamples,
        confidence,
        seed,
    )


# ------------------------------------------------------------------------------ small samples: a t bound
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


def ratio_bound(base: Sequence[float], other: Sequence[float], confidence: float = 0.95) -> float | None:
    """The one-sided lower confidence bound of the pooled ratio R = Σ base / Σ other of paired measurements (unit i
    measured both ways: plain and speculative seconds of one prompt), by the delta method on log R: unit i moves
    log R by z_i = b_i / mean(b) - o_i / mean(o), so its standard error is sd(z) / √n and the bound is
    R · exp(-t_{confidence, n-1} · sd(z) / √n), Student's t for the few units a calibration has (2.015 at six,
    not the normal 1.645). Units with a non-positive value are left out; None from fewer than 2 units."""
    pairs = [(b, o) for b, o in zip(base, other) if b > 0 and o > 0]
    if len(pairs) < 2:
        return None
    mean_b, mean_o = statistics.fmean(b for b, _ in pairs), statistics.fmean(o for _, o in pairs)
    spread = statistics.stdev(b / mean_b - o / mean_o for b, o in pairs) / math.sqrt(len(pairs))
    return mean_b / mean_o * math.exp(-t_quantile(confidence, len(pairs) - 1) * spread)


def family_confidence(confidence: float, plans: int) -> float:
    """The confidence each of ``plans`` bounds is taken at so that all of them hold together at ``confidence``
    (Šidák: confidence ** (1 / m)). ``pick`` takes the best of m bounds: at 95% each, a plan no faster than plain
    clears one of 20 by chance far more often than 5% of the time (13.6% in the simulation of
    tests/decoding/test_auto.py); at the corrected level, at most 5%."""
    return confidence ** (1 / max(plans, 1))
