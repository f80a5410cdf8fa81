"""What ``lightning-spec evaluate`` shows of a result: the per-domain and per-arm tables, the JSON file, and one
MLflow run per arm. Every function reads the result dict (``online_result``, the offline one of ``cli.py``) and
its ``Comparison``; none computes a figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lightning_spec.decoding.plans import Plan, parse_plan
from lightning_spec.paired import Comparison


def common_plan(plans: list[Plan]) -> dict[str, Any] | None:
    """The one plan every arm decodes with, as the JSON records it, or None (per-arm plans: see each arm)."""
    return plans[0].to_dict() if len(set(plans)) == 1 else None


def plan_label(plan: dict[str, Any]) -> str:
    """A recorded plan's short name (``Plan.label``): ``chain``, ``tree 16/top 4 + 2 n-gram``, ..."""
    return parse_plan(plan).label


def arm_label(arm: dict[str, Any]) -> str:
    """How an arm decoded: decoding auto's pick, or its plan."""
    if arm.get("auto"):
        return f"auto: {arm['auto']['picked']}"
    return plan_label(arm["decoding"])


def auto_line(name: str, arm: dict[str, Any]) -> str:
    """One line for an arm decoding auto picked for: expected (on its calibration prompts) against measured."""
    d = arm["auto"]
    bound = f", {d['confidence']:.0%} lower bound {d['lcb']:.2f}x" if d["picked"] != "plain" else ""
    return (f"{name}: decoding auto picked {d['picked']}: expected {d['expected_tokens_per_s']:.1f} tokens/s, "
            f"{d['expected_speedup']:.2f}x plain{bound} (on {d['calibration_prompts']} calibration prompts); "
            f"measured {arm['tokens_per_s']:.1f} tokens/s, {arm['speedup']:.2f}x plain")


def _ci(ci: tuple[float, float] | list[float]) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _p(p: float, n_resamples: int) -> str:
    return f"<{2 / n_resamples:.0e}" if p == 0 else f"{p:.3f}"  # no resample crossed 0


def print_results(result: dict[str, Any], comparison: Comparison, file: Any = None) -> None:
    """Per-domain MAL of every arm, then per arm: MAL with CI, ΔMAL vs the baseline with CI (and speed)."""
    from rich.console import Console
    from rich.table import Table

    out = file or sys.stdout
    tty = getattr(out, "isatty", lambda: False)()
    console = Console(file=out, width=None if tty else 160)  # a log file gets whole rows, not 80 columns
    mode = result["mode"]
    s = result["sampling"]
    how = "greedy" if s["temperature"] == 0 else f"T={s['temperature']:g} top_p={s['top_p']:g} top_k={s['top_k']}"
    if result.get("decoding"):
        how += f", decoding {plan_label(result['decoding'])}"
    what = (f"{comparison.rows} rollouts of {comparison.prompts} prompts" if mode == "offline"
            else f"{comparison.prompts} prompts, real decoding, {result.get('precision', '')}")
    console.print(f"{mode} MAL (tokens per target forward, bonus included), {how}, {what}")
    table = Table()
    table.add_column("domain")
    names = [a.name for a in comparison.arms]
    for name in names:
        table.add_column(name, justify="right", min_width=len(name))
    for d, arms in comparison.by_domain.items():
        table.add_row(d, *[f"{a.mal:.3f}" for a in arms])
    table.add_row("all", *[f"{a.mal:.3f}" for a in comparison.arms])
    console.print(table)

    pct = f"{comparison.confidence:.0%}"
    console.print(f"vs baseline {comparison.baseline!r}: bootstrap over prompts, {comparison.n_resamples} resamples, "
                  f"{pct} intervals" + (f" (only {comparison.prompts} prompts: read the intervals loosely)"
                                        if comparison.prompts < 20 else ""))
    summary = Table()
    for col in ["drafter", "MAL", f"{pct} CI", "ΔMAL", f"{pct} CI of Δ", "p"]:
        width = max(map(len, names)) if col == "drafter" else None  # names in full, the figures wrap instead
        summary.add_column(col, justify="left" if col == "drafter" else "right", min_width=width)
    per_arm = result.get("decoding") is None
    if per_arm:
        summary.add_column("decoding", justify="right")
    if mode == "online":
        summary.add_column("tokens/s", justify="right")
        summary.add_column("speedup", justify="right")
        summary.add_column(f"{pct} CI", justify="right")
    for a in comparison.arms:
        base = a.name == comparison.baseline
        row = [a.name, f"{a.mal:.3f}", _ci(a.mal_ci), "-" if base else f"{a.delta:+.3f}",
               "-" if base else _ci(a.delta_ci), "-" if base else _p(a.p_value, comparison.n_resamples)]
        arm = result["arms"][a.name]
        if per_arm:
            row.append(arm_label(arm))
        if mode == "online":
            row += [f"{arm['tokens_per_s']:.1f}", f"{arm['speedup']:.2f}x", _ci(arm["speedup_ci"])]
        summary.add_row(*row)
    console.print(summary)
    if mode == "online":
        console.print(f"plain decoding: {result['plain']['tokens_per_s']:.1f} tokens/s (same prompts, same process)")
        for name, arm in result["arms"].items():
            if arm.get("auto"):  # decoding auto's pick: what it expected on its calibration prompts, and got
                console.print(auto_line(name, arm))
            for a in arm.get("adaptation", []):  # an adapting arm: what it spent its update time on
                applied = ", ".join(f"{s} {v['updates']}" for s, v in a["arms"].items())
                console.print(f"{name}: updates over {a['windows']} prompts: {applied or 'no scope'}; "
                              f"{a['adapter_seconds']:.2f} s adapting (inside its tokens/s)")
    seeds = [a for a in comparison.arms if len(a.checkpoint_mal) > 1]
    for a in seeds:
        console.print(f"{a.name}: MAL per checkpoint {', '.join(f'{m:.3f}' for m in a.checkpoint_mal)}")


def log_mlflow(result: dict[str, Any], comparison: Comparison, tracking_uri: str, experiment_name: str) -> list[str]:
    """One MLflow run per arm: params (mode, target, sampling, checkpoints), metrics ``<mode>/mal``,
    ``<mode>/mal/<domain>``, ``<mode>/accept_rate/t<k>``, ``<mode>/delta_mal`` (+ ``_lo``/``_hi``), online
    also ``online/tokens_per_s`` and ``online/speedup``. Returns the run ids."""
    from lightning_spec import tracking

    mode = result["mode"]
    runs = []
    for a in comparison.arms:
        arm = result["arms"][a.name]
        metrics = {f"{mode}/mal": a.mal, f"{mode}/mal_lo": a.mal_ci[0], f"{mode}/mal_hi": a.mal_ci[1]}
        metrics.update({f"{mode}/mal/{d}": arm["mal_by_domain"][d] for d in arm["mal_by_domain"]})
        metrics.update({f"{mode}/accept_rate/t{k}": v for k, v in enumerate(arm["accept_rate"], 1)})
        if a.name != comparison.baseline:
            metrics.update({f"{mode}/delta_mal": a.delta, f"{mode}/delta_mal_lo": a.delta_ci[0],
                            f"{mode}/delta_mal_hi": a.delta_ci[1], f"{mode}/delta_p": a.p_value})
        if mode == "online":
            metrics.update({"online/tokens_per_s": arm["tokens_per_s"], "online/speedup": arm["speedup"],
                            "online/speedup_lo": arm["speedup_ci"][0], "online/speedup_hi": arm["speedup_ci"][1]})
        params = {
            "mode": mode, "target": result["target"], "target_fingerprint": result["target_fingerprint"],
            "decoding": arm_label(arm),
            **{f"sampling.{k}": v for k, v in result["sampling"].items()},
            "checkpoints": ",".join(arm["checkpoints"])[:500], "rows": comparison.rows,
            "prompts": comparison.prompts, "baseline": comparison.baseline,
        }
        if mode == "offline":
            params["rollouts"] = result["rollouts"]
        else:
            params.update({"sources": ",".join(result["sources"]), "max_new_tokens": result["max_new_tokens"]})
        tags = {"lightning_spec.command": "evaluate", "lightning_spec.mode": mode, "lightning_spec.arm": a.name,
                "lightning_spec.baseline": comparison.baseline,
                "lightning_spec.checkpoints": json.dumps(arm["checkpoints"])}
        runs.append({"name": f"{mode}-{a.name}", "tags": tags, "params": params, "metrics": metrics})
    return tracking.log_runs(tracking_uri, tracking.experiment_name(experiment_name, result["target"]), runs)


def write_json(result: dict[str, Any], output: str) -> None:
    """The result as indented JSON at ``output`` (its folder made), and a line saying so."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")
