"""``lightning-spec evaluate``: score drafters offline on target rollouts, or online by real speculative decoding.

    lightning-spec evaluate --mode offline --rollouts rollouts/t1 --drafters '[a.ckpt, b.ckpt]'
    lightning-spec evaluate --mode online --target smollm2-135m-instruct --drafters '[a.ckpt]' \\
        --sources '[mt-bench, humaneval, mmath]' --prompts_per_source 8 --max_new_tokens 128 --temperature 0

Offline: exact expected rounds per rollout (``offline.py``), pooled MAL per domain, AR_k, and with several
drafters ΔMAL against the baseline with a bootstrap CI over prompts (``paired.py``). Online: real decoding with
every drafter and plain decoding of the same prompts, interleaved prompt by prompt in one process (MAL,
tokens/s, speedup). Both print a per-domain table and write a JSON file; ``--mlflow true`` logs one MLflow run
per drafter. Checkpoints given the same ``--names`` entry are seeds of one arm: their rounds are averaged per
rollout before the bootstrap.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightning_spec.data.rollouts import check_rollouts, load_rollout_set, rollout_sampling, spread
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.evaluation.offline import OfflineReport, offline_report
from lightning_spec.evaluation.paired import Comparison, bootstrap_mal, compare, compare_reports, percentile_interval
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import TargetOptions


def arm_names(drafters: list[str], names: list[str] | None) -> list[str]:
    """One name per checkpoint; equal names form one arm. Default: the file or folder name, or the whole path
    where two checkpoints share it (``last.ckpt`` of two runs)."""
    if names is not None:
        if len(names) != len(drafters):
            raise ValueError(f"--names has {len(names)} entries for {len(drafters)} --drafters; give one per drafter.")
        return list(names)
    stems = [Path(d).stem if Path(d).suffix == ".ckpt" else Path(d).name for d in drafters]
    return [s if stems.count(s) == 1 else str(d) for s, d in zip(stems, drafters)]


def _recorded_target(path: str) -> tuple[str, TargetOptions]:
    """The target a checkpoint or exported drafter folder was trained for, and its options (read as data:
    checkpoint.py)."""
    from lightning_spec.checkpoint import recorded_target

    return recorded_target(path, what="--drafters entry")


def _sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> SamplingConfig | None:
    if temperature is None and top_p is None and top_k is None:
        return None
    return SamplingConfig(
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
    )


# -------------------------------------------------------------------------------------------------- offline
def run_offline(
    rollouts: str,
    drafters: list[str],
    names: list[str],
    baseline: int | str,
    target: str | None,
    sampling: SamplingConfig | None,
    max_rollouts: int | None,
    batch_size: int,
    n_resamples: int,
    confidence: float,
    seed: int,
    target_dtype: str,
    device: str,
    progress: bool,
    trees: list[TreeConfig | None],
    options: TargetOptions | None = None,
) -> tuple[dict[str, Any], Comparison]:
    from lightning_spec.checkpoint import load_drafter
    from lightning_spec.target import load_target

    data = load_rollout_set(rollouts)
    meta = data.meta or {}
    spec = target or meta.get("target")
    if spec is None:
        raise ValueError("--target is needed: the rollouts record none.")
    options = options or _recorded_target(drafters[0])[1]  # the options the first drafter's target was loaded with
    model = load_target(spec, dtype=target_dtype, device=device, options=options)
    sampling = sampling or rollout_sampling(data.meta)
    check_rollouts(data.meta, model, sampling, data.source)
    data = spread(data, max_rollouts)
    reports: dict[str, list[OfflineReport]] = {}
    for path, name, tree in zip(drafters, names, trees):
        drafter = load_drafter(path, target=model)
        reports.setdefault(name, []).append(
            offline_report(model, drafter, data, sampling, batch_size=batch_size, progress=progress, tree=tree)
        )
        del drafter
    comparison = compare_reports(reports, baseline, n_resamples, confidence, seed)
    first = next(iter(reports.values()))[0]
    arms = {}
    for name, reps in reports.items():
        mean_rounds = torch.stack([r.rounds for r in reps]).mean(0)
        reached = torch.stack([r.slot_reached for r in reps]).sum(0)
        accepted = torch.stack([r.slot_accepted for r in reps]).sum(0)
        arms[name] = {
            "checkpoints": [p for p, n in zip(drafters, names) if n == name],
            "mal": comparison.arm(name).mal,
            "mal_by_domain": {d: comparison.arm(name, d).mal for d in comparison.by_domain},
            "accept_rate": (accepted / reached.clamp_min(1e-12)).tolist(),
            "seconds": sum(r.seconds.get("total", 0.0) for r in reps),
            "rounds": mean_rounds.tolist(),
            "tree": _arm_tree(trees, names, name),
        }
    return {
        "mode": "offline",
        "target": spec,
        "target_fingerprint": model.fingerprint,
        "sampling": sampling.to_dict(),
        "tree": _common_tree(trees),
        "rollouts": rollouts,
        "rows": {
            "prompt_id": first.prompt_keys,
            "domain": first.domains,
            "tokens": first.tokens.tolist(),
            "finished": first.finished,
        },
        "arms": arms,
        "comparison": comparison.to_dict(),
    }, comparison


# --------------------------------------------------------------------------------------------------- online
def run_online(
    target: str | None,
    drafters: list[str],
    names: list[str],
    baseline: int | str,
    sampling: SamplingConfig,
    sources: list[str],
    prompts_per_source: int,
    max_new_tokens: int,
    n_resamples: int,
    confidence: float,
    seed: int,
    target_dtype: str,
    device: str,
    progress: bool,
    trees: list[TreeConfig | None],
    adapt: dict[str, Any] | None = None,
    options: TargetOptions | None = None,
) -> tuple[dict[str, Any], Comparison]:
    """Real decoding of the prompts by plain decoding and every drafter, interleaved prompt by prompt. ``adapt``
    (``CostAwareAdapter`` settings) adds an arm ``<name>+adapt`` per drafter: its own copy, adapted while it
    decodes the prompts in order (``adaptation.py``), its update time counted in its seconds."""
    from lightning_spec.checkpoint import load_drafter
    from lightning_spec.data.prompts import select_prompts
    from lightning_spec.data.sources import as_source
    from lightning_spec.evaluation.adaptation import CostAwareAdapter, decode_adapting
    from lightning_spec.evaluation.benchmark import decode_prompts
    from lightning_spec.target import load_target

    recorded, recorded_options = _recorded_target(drafters[0])
    spec, options = target or recorded, options or recorded_options
    model = load_target(spec, dtype=target_dtype, device=device, options=options)
    if model.tokenizer is None:
        raise ValueError(f"--target {spec} has no tokenizer; online evaluation builds chat prompts with it.")
    prompts = select_prompts(model.tokenizer, [as_source(s) for s in sources], prompts_per_source, seed,
                             chat_template_kwargs=model.chat_template_kwargs)
    loaded = [load_drafter(p, target=model) for p in drafters]
    for d, tree in zip(loaded, trees):
        if tree is not None and tree != "auto":
            d.check_tree()
    decoders, trees, picks = _decode_auto(model, loaded, trees, prompts, sampling, sources, prompts_per_source,
                                          max_new_tokens, seed, progress)
    plan = [(None, None), *zip(decoders, trees)]  # plain decoding, then every drafter with its tree (None: a chain)
    for d, tree in plan:  # warm-up: first calls pay one-off costs that are not decoding speed
        decode_prompts(model, d, prompts[:1], sampling, min(8, max_new_tokens), seed=seed, tree=tree)
    if adapt is not None:  # a second, adapting copy of every drafter (warmed up without adapting)
        adapters = [CostAwareAdapter(load_drafter(p, target=model), model, tree=tree, seed=seed, **adapt)
                    for p, tree in zip(drafters, trees)]
        for a in adapters:
            decode_prompts(model, a.drafter, prompts[:1], sampling, min(8, max_new_tokens), seed=seed, tree=a.tree)
        loaded, trees = loaded + adapters, trees + [a.tree for a in adapters]
        names, drafters = names + [f"{n}+adapt" for n in names], drafters + drafters
        decoders = loaded
        plan = [(None, None), *zip(loaded, trees)]

    # per prompt: plain, then every drafter (interleaved, so a load change on the machine hits all alike)
    n = len(prompts)
    tok = np.zeros((len(loaded) + 1, n))
    rnd = np.zeros((len(loaded) + 1, n))
    sec = np.zeros((len(loaded) + 1, n))
    draft_sec = np.zeros((len(loaded) + 1, n))  # time inside drafter.propose
    slots = [np.zeros((2, d.block_size if d is not None else 1)) for d in decoders]
    with progress_bar(f"online decoding ({len(loaded)} drafters + plain)", n, progress) as bar:
        for i, prompt in enumerate(prompts):
            for j, (d, tree) in enumerate(plan):
                if isinstance(d, CostAwareAdapter):  # an adapting drafter: this prompt is its next window
                    rep = decode_adapting(d, [prompt], sampling, max_new_tokens, seed=seed + i)
                else:
                    rep = decode_prompts(model, d, [prompt], sampling, max_new_tokens, seed=seed + i, tree=tree)
                tok[j, i], rnd[j, i], sec[j, i] = rep.tokens, rep.rounds, rep.seconds
                draft_sec[j, i] = rep.draft_seconds
                if d is not None:
                    slots[j - 1] += np.stack([rep.slot_accepted.numpy(), rep.slot_reached.numpy()])
            bar.advance(1)

    keys = [p["id"] for p in prompts]
    domains = [p["domain"] for p in prompts]
    arm_list = list(dict.fromkeys(names))
    idx = {name: [j + 1 for j, n_ in enumerate(names) if n_ == name] for name in arm_list}
    # an arm's checkpoints (seeds) decode their own tokens: average tokens and rounds per prompt
    comparison = compare(
        {name: rnd[idx[name]].mean(0) for name in arm_list},
        {name: tok[idx[name]].mean(0) for name in arm_list},
        keys, domains, baseline, n_resamples, confidence, seed,
    )
    for a in comparison.arms:
        a.checkpoint_mal = [float(tok[j].sum() / max(rnd[j].sum(), 1e-12)) for j in idx[a.name]]
    plain_tps = tok[0].sum() / max(sec[0].sum(), 1e-9)
    # tokens/s of every arm and of plain decoding per bootstrap resample of the prompts (the MAL bootstrap's ratio of
    # sums, with seconds for rounds): the speedup's interval is paired, a load change hits both sides of a prompt
    per_arm_tok = np.stack([tok[0]] + [tok[idx[name]].mean(0) for name in arm_list])  # (1 + A, R)
    per_arm_sec = np.stack([sec[0]] + [sec[idx[name]].mean(0) for name in arm_list])
    tps_boot = bootstrap_mal(per_arm_tok, per_arm_sec, keys, domains, n_resamples, seed)  # (B, 1 + A)
    speedup_boot = tps_boot[:, 1:] / tps_boot[:, :1]  # (B, A)
    arms = {}
    for name in arm_list:
        j = idx[name]
        tps = tok[j].sum() / max(sec[j].sum(), 1e-9)
        acc = sum(slots[i - 1] for i in j)
        arms[name] = {
            "checkpoints": [drafters[i - 1] for i in j],
            "mal": comparison.arm(name).mal,
            "mal_by_domain": {d: comparison.arm(name, d).mal for d in comparison.by_domain},
            "accept_rate": (acc[0] / np.maximum(acc[1], 1)).tolist(),
            "tokens": int(tok[j].sum()),
            "seconds": float(sec[j].sum()),
            "tokens_per_s": float(tps),
            "speedup": float(tps / plain_tps),
            "speedup_ci": list(percentile_interval(speedup_boot[:, arm_list.index(name)], confidence)),
            "draft_ms_per_round": float(1000 * draft_sec[j].sum() / max(rnd[j].sum(), 1)),
            "parameters": int(sum(p.numel() for p in _module(loaded[j[0] - 1]).parameters())),
            "tree": _arm_tree(trees, names, name),
        }
        if picks.get(j[0] - 1) is not None:  # decoding auto: what it picked and the speed it expected
            choice = picks[j[0] - 1]
            arms[name]["decoding"] = {"picked": choice.setting.label, "expected_mal": choice.expected.mal,
                                      "expected_speedup": choice.expected_speedup, "machine": choice.machine}
        adapters = [loaded[i - 1] for i in j if isinstance(loaded[i - 1], CostAwareAdapter)]
        if adapters:
            arms[name]["adaptation"] = [a.summary() for a in adapters]
    return {
        "mode": "online",
        "target": spec,
        "target_fingerprint": model.fingerprint,
        "precision": model.precision,
        "sampling": sampling.to_dict(),
        "tree": _common_tree(trees),
        "sources": [str(s) for s in sources],
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "plain": {"tokens": int(tok[0].sum()), "seconds": float(sec[0].sum()), "tokens_per_s": float(plain_tps)},
        "rows": {"prompt_id": keys, "domain": domains, "plain_tokens": tok[0].tolist()},
        "arms": arms,
        "comparison": comparison.to_dict(),
    }, comparison


def _decode_auto(model: Any, loaded: list[Any], trees: list[Any], prompts: list[dict[str, Any]],
                 sampling: SamplingConfig, sources: list[str], prompts_per_source: int, max_new_tokens: int,
                 seed: int, progress: bool) -> tuple[list[Any], list[TreeConfig | None], dict[int, Any]]:
    """For every drafter whose tree is ``auto``, ``choose_decoding`` on held-out prompts (the next prompt of every
    source, not among ``prompts``): what each arm decodes with (the drafter, None for plain, an n-gram lookup),
    its tree, and the picks by drafter index."""
    if "auto" not in trees:
        return loaded, trees, {}
    from lightning_spec.data.prompts import select_prompts
    from lightning_spec.data.sources import as_source
    from lightning_spec.decoding.auto import choose_decoding

    used = {p["id"] for p in prompts}
    more = select_prompts(model.tokenizer, [as_source(s) for s in sources], prompts_per_source + 1, seed)
    calibration = [p["prompt_ids"] for p in more if p["id"] not in used][:4]
    if not calibration:
        raise ValueError("--tree auto calibrates on prompts beyond --prompts_per_source and the sources have none "
                         "left; lower --prompts_per_source.")
    picks = {j: choose_decoding(model, d, calibration, sampling, max_new_tokens, progress=progress)
             for j, (d, tree) in enumerate(zip(loaded, trees)) if tree == "auto"}
    for choice in picks.values():
        print(choice.describe())
    decoders = [picks[j].drafter if j in picks else d for j, d in enumerate(loaded)]
    return decoders, [picks[j].tree if j in picks else t for j, t in enumerate(trees)], picks


def _module(decoder: Any) -> Any:
    """The drafter module of an arm: the drafter itself, or an adapter's drafter."""
    from lightning_spec.evaluation.adaptation import CostAwareAdapter

    return decoder.drafter if isinstance(decoder, CostAwareAdapter) else decoder


# ---------------------------------------------------------------------------------------------- reporting
def _arm_tree(trees: list[TreeConfig | None], names: list[str], name: str) -> dict[str, Any] | None:
    """The tree setting of an arm (its first checkpoint's), as a dict; None for a chain."""
    tree = trees[names.index(name)]
    return dataclasses.asdict(tree) if tree else None


def _common_tree(trees: list[TreeConfig | None]) -> dict[str, Any] | None:
    """The one tree setting every drafter decodes with, or None (chains, or per-arm settings: see each arm)."""
    return dataclasses.asdict(trees[0]) if trees[0] is not None and len(set(trees)) == 1 else None


def _arm_label(arm: dict[str, Any]) -> str:
    """How an arm decoded: decoding auto's pick, or its tree setting."""
    if arm.get("decoding"):
        return f"auto: {arm['decoding']['picked']}"
    return _tree_label(arm.get("tree"))


def _tree_label(tree: dict[str, Any] | None) -> str:
    if tree is None:
        return "chain"
    return "tree {nodes}/{top_k}".format(**tree) + (f" + {tree['ngram']} n-gram" if tree.get("ngram") else "")


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
    if result.get("tree"):
        how += ", tree of {nodes} nodes (top {top_k})".format(**result["tree"])
        if result["tree"].get("ngram"):
            how += f", up to {result['tree']['ngram']} of them n-gram candidates"
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
    per_arm = result.get("tree") is None and any(arm.get("tree") or arm.get("decoding")
                                                 for arm in result["arms"].values())
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
            row.append(_arm_label(arm))
        if mode == "online":
            row += [f"{arm['tokens_per_s']:.1f}", f"{arm['speedup']:.2f}x", _ci(arm["speedup_ci"])]
        summary.add_row(*row)
    console.print(summary)
    if mode == "online":
        console.print(f"plain decoding: {result['plain']['tokens_per_s']:.1f} tokens/s (same prompts, same process)")
        for name, arm in result["arms"].items():
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
    from lightning_spec.tracking import log_runs

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
            "decoding": _arm_label(arm),
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
    return log_runs(tracking_uri, experiment_name, runs)


# -------------------------------------------------------------------------------------------------- command
def evaluate(
    drafters: list[str],
    mode: Literal["offline", "online"] = "offline",
    names: list[str] | None = None,
    baseline: int | str = 0,
    rollouts: str | None = None,
    max_rollouts: int | None = None,
    target: str | None = None,
    target_options: TargetOptions | None = None,
    sources: list[str] = ["mt-bench", "humaneval", "mmath"],  # noqa: B006 (never mutated; a list shows in --help)
    prompts_per_source: int = 8,
    max_new_tokens: int = 128,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
    batch_size: int = 4,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    output: str | None = "evaluation.json",
    mlflow: bool = False,
    tracking_uri: str = "sqlite:///mlflow.db",
    experiment_name: str = "lightning_spec_evaluate",
    target_dtype: str = "float32",
    device: str = "cpu",
    progress: bool = True,
    tree: TreeConfig | Literal["auto"] | None = None,
    trees: list[TreeConfig | Literal["auto"] | None] | None = None,
    adapt: bool = False,
    adapt_scopes: list[str] = ["head", "last", "all"],  # noqa: B006 (never mutated; a list shows in --help)
    adapt_lr: float = 1e-4,
    adapt_steps: int = 2,
    adapt_horizon: int = 4096,
    adapt_exploration: float = 0.1,
    adapt_force: str | None = None,
) -> dict[str, Any]:
    """Score drafters offline on target rollouts (exact expected rounds) or online by real decoding.

    Args:
        drafters: fit checkpoints (.ckpt) or exported drafter folders, e.g. '[runs/a/last.ckpt, runs/b/last.ckpt]'.
        mode: offline (rollouts + drafter forwards, exact expected rounds) or online (real speculative decoding).
        names: a name per drafter (default: the file names); equal names form one arm whose checkpoints (seeds)
            are averaged per rollout.
        baseline: the arm the others are compared with: its index among the arms or its name.
        rollouts: offline: a rollouts folder (`lightning-spec rollouts`).
        max_rollouts: offline: evaluate at most this many rollouts (round-robin over domains).
        target: the target (default: the rollouts' target offline, the first drafter's target online).
        target_options: how to load and prompt it (revision, trust_remote_code, attn_implementation,
            chat_template_kwargs; ``TargetOptions``); default: the options the first drafter's target was trained with.
        sources: online: prompt sources (packaged names, local files, hub ids), as `lightning-spec rollouts`.
        prompts_per_source: online: prompts per source (the same selection as `lightning-spec rollouts`).
        max_new_tokens: online: generation budget per prompt.
        temperature: sampling temperature (online default 0 = greedy; offline default: the rollouts' own).
        top_p: nucleus filtering (1 = off).
        top_k: top-k filtering (0 = off).
        seed: prompt selection, decoding seeds (prompt i uses seed + i) and the bootstrap.
        batch_size: offline: rollouts per target forward.
        n_resamples: bootstrap resamples of the prompts.
        confidence: level of the bootstrap intervals.
        output: the JSON file to write (null: none).
        mlflow: log one MLflow run per arm.
        tracking_uri: MLflow tracking URI.
        experiment_name: MLflow experiment.
        target_dtype: float32 (CPU default), bfloat16 (GPUs), or auto: bf16 where the device multiplies it natively.
        device: where the target and drafters run.
        progress: show progress bars.
        tree: decode (online) or score (offline, exactly) rounds that verify a token tree instead of a chain, e.g.
            --tree '{nodes: 16, top_k: 4}', built by each family's tree builder; offline, best-first trees (DFlash,
            Medusa) are scored under any sampling, the others (EAGLE-3, MTP, D²SD, SpecBlock) on greedy rollouts.
            Online, ``auto`` picks each drafter's fastest decoding from measured costs (``decoding/auto.py``: plain,
            n-gram lookup, its chain, a tree, a tree with n-gram candidates), calibrated on held-out prompts of the
            same sources; the arm decodes with the pick and reports it with the speedup it expected.
        trees: one tree setting per drafter instead of ``tree`` (null: a chain), e.g. the same checkpoint twice as
            a chain and as a tree: --drafters '[a.ckpt, a.ckpt]' --names '[chain, tree]'
            --trees '[null, {nodes: 16, top_k: 4}]' (a paired comparison of the two).
        adapt: online: also decode with an adapting copy of every drafter, arm '<name>+adapt': after each prompt
            it may update itself on the verified tokens when the expected time saved beats the update's
            measured cost (a UCB bandit over update scopes; SpecBlock, arXiv 2605.07243). Its seconds include
            the updates.
        adapt_scopes: the update scopes the adapter chooses among: head (the drafter's output norm / heads),
            last (last decoder layer + final norm), all.
        adapt_lr: the adapter's learning rate (AdamW).
        adapt_steps: optimizer steps per update.
        adapt_horizon: tokens over which an update's MAL gain is expected to pay (the saving it is weighed by).
        adapt_exploration: the UCB constant, in MAL units.
        adapt_force: apply this scope after every prompt whatever the saving ('none': never update).
    """
    tree = tree if tree == "auto" else TreeConfig.coerce(tree)
    if not drafters:
        raise ValueError("--drafters is empty; pass one or more checkpoints, e.g. --drafters '[runs/a/last.ckpt]'.")
    if n_resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"--n_resamples ({n_resamples}) must be >= 1 and --confidence ({confidence}) in (0, 1).")
    labels = arm_names(drafters, names)
    if trees is not None and tree is not None:
        raise ValueError("pass --tree (one setting for every drafter) or --trees (one per drafter), not both.")
    if trees is not None and len(trees) != len(drafters):
        raise ValueError(f"--trees has {len(trees)} settings for {len(drafters)} drafters; give one per drafter "
                         "(null for a chain).")
    per_drafter = [t if t == "auto" else TreeConfig.coerce(t) for t in trees] if trees is not None else [tree] * len(
        drafters)
    if "auto" in per_drafter and (mode != "online" or adapt):
        raise ValueError("--tree auto picks a decoding by its measured speed: use it with --mode online and without "
                         "--adapt.")
    sampling = _sampling(temperature, top_p, top_k)
    if adapt and mode != "online":
        raise ValueError("--adapt true adapts drafters while they decode; use it with --mode online.")
    if mode == "offline":
        if rollouts is None:
            raise ValueError("--mode offline needs --rollouts: a folder made by `lightning-spec rollouts`.")
        result, comparison = run_offline(
            rollouts, drafters, labels, baseline, target, sampling, max_rollouts, batch_size, n_resamples,
            confidence, seed, target_dtype, device, progress, per_drafter, options=target_options,
        )
    elif mode == "online":
        if prompts_per_source < 1 or max_new_tokens < 1:
            raise ValueError("--prompts_per_source and --max_new_tokens must be >= 1.")
        result, comparison = run_online(
            target, drafters, labels, baseline, sampling or SamplingConfig(), sources, prompts_per_source,
            max_new_tokens, n_resamples, confidence, seed, target_dtype, device, progress, per_drafter,
            adapt=dict(scopes=adapt_scopes, lr=adapt_lr, steps=adapt_steps, horizon_tokens=adapt_horizon,
                       exploration=adapt_exploration, force=adapt_force) if adapt else None,
            options=target_options,
        )
    else:
        raise ValueError(f"--mode must be offline or online, got {mode!r}.")
    print_results(result, comparison)
    if mlflow:
        result["mlflow_run_ids"] = log_mlflow(result, comparison, tracking_uri, experiment_name)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {output}")
    return result
