"""The comparison plots on a study's MLflow parent run (PNG artifacts under ``plots/``).

``metric_vs_block_size.png``: the metric against block size K, one line per objective (its best trial per K);
``per_domain.png``: per-domain values of each objective's best trial; ``optimization_history.png``: every
finished trial and the best so far. Only trials that completed are compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState


def _domain_keys(metrics: dict[str, float], metric: str) -> dict[str, str]:
    """Per-domain keys of the metric (``val/mal/<domain>``), else of ``val/mal``."""
    for prefix in (metric, "val/mal"):
        n = len(prefix) + 1
        keys = {k[n:]: k for k in metrics if k.startswith(prefix + "/") and "/" not in k[n:]}
        if keys:
            return keys
    return {}


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def comparison_plots(trials: list[FrozenTrial], metric: str, direction: Any, out: Path) -> list[Path]:
    """PNG files: the metric vs block size per objective, per-domain values of each objective's best trial,
    and the optimisation history. Only trials that completed are compared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maximize = direction == optuna.study.StudyDirection.MAXIMIZE
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    paths = []
    if done:
        paths.append(_block_size_plot(plt, done, metric, maximize, out))
        per_domain = _per_domain_plot(plt, done, metric, maximize, out)
        if per_domain is not None:
            paths.append(per_domain)
    finished = sorted((t for t in trials if t.state.is_finished()), key=lambda t: t.number)
    if finished:
        paths.append(_history_plot(plt, finished, metric, maximize, out))
    return paths


def _block_size_plot(plt: Any, done: list[FrozenTrial], metric: str, maximize: bool, out: Path) -> Path:
    """``metric_vs_block_size.png``: per objective, the best completed trial per block size K (a line) over all
    of its trials (dots)."""
    objectives = sorted({str(t.user_attrs.get("objective")) for t in done})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in objectives:
        mine = [t for t in done if str(t.user_attrs.get("objective")) == name and t.user_attrs.get("block_size")]
        if not mine:
            continue
        ks = sorted({t.user_attrs["block_size"] for t in mine})
        pick = max if maximize else min
        best = [pick(t.value for t in mine if t.user_attrs["block_size"] == k) for k in ks]
        line = ax.plot(ks, best, marker="o", label=name)[0]
        ax.scatter([t.user_attrs["block_size"] for t in mine], [t.value for t in mine], s=12, alpha=0.4,
                   color=line.get_color())
    sizes = sorted({t.user_attrs["block_size"] for t in done if t.user_attrs.get("block_size")})
    if sizes and sizes[0] > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(k) for k in sizes])
        ax.minorticks_off()
    ax.set_xlabel("block size K")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs block size (line: best trial per K)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "metric_vs_block_size.png")


def _per_domain_plot(plt: Any, done: list[FrozenTrial], metric: str, maximize: bool, out: Path) -> Path | None:
    """``per_domain.png``: the per-domain values of each objective's best completed trial (None: the trials
    logged no per-domain values)."""
    best_per_objective = {}
    for t in done:
        name = str(t.user_attrs.get("objective"))
        other = best_per_objective.get(name)
        if other is None or (t.value > other.value if maximize else t.value < other.value):
            best_per_objective[name] = t
    keys = _domain_keys(next(iter(best_per_objective.values())).user_attrs.get("metrics") or {}, metric)
    if not keys:
        return None
    domains = sorted(keys)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(best_per_objective) + 2), 4.2))
    width = 0.8 / len(domains)
    names = sorted(best_per_objective)
    shown = []
    for j, domain in enumerate(domains):
        ys = [(best_per_objective[n].user_attrs.get("metrics") or {}).get(keys[domain], math.nan) for n in names]
        ax.bar([i + j * width for i in range(len(names))], ys, width, label=domain)
        shown += [y for y in ys if math.isfinite(y)]
    if shown:  # MAL lives above 1: zoom on the values, not on the bars' zero
        lo, hi = min(shown), max(shown)
        pad = 0.15 * (hi - lo) or 0.05 * max(abs(hi), 1e-3)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(next(iter(keys.values())).rsplit("/", 1)[0] + "/<domain>")
    ax.set_title("per domain, best trial of each objective")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, out / "per_domain.png")


def _history_plot(plt: Any, finished: list[FrozenTrial], metric: str, maximize: bool, out: Path) -> Path:
    """``optimization_history.png``: every finished trial by number, the best so far as a step line, failed
    trials as red lines."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {TrialState.COMPLETE: ("o", "complete"), TrialState.PRUNED: ("x", "pruned")}
    for state, (marker, label) in styles.items():
        mine = [t for t in finished if t.state == state and t.value is not None]
        if mine:
            ax.scatter([t.number for t in mine], [t.value for t in mine], marker=marker, label=label)
    xs, ys, best = [], [], None
    for t in finished:
        if t.state == TrialState.COMPLETE and t.value is not None:
            best = t.value if best is None else (max(best, t.value) if maximize else min(best, t.value))
        if best is not None:
            xs.append(t.number)
            ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="black", label="best so far")
    failed = [t.number for t in finished if t.state == TrialState.FAIL]
    for n in failed:
        ax.axvline(n, color="red", alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title("optimisation history" + (" (red: failed)" if failed else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "optimization_history.png")
