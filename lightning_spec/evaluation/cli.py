"""``lightning-spec evaluate``: score drafters offline on target rollouts, or online by real speculative decoding.

    lightning-spec evaluate --mode offline --rollouts rollouts/t1 --drafters '[a.ckpt, b.ckpt]'
    lightning-spec evaluate --mode online --target smollm2-135m-instruct --drafters '[a.ckpt]' \\
        --sources '[mt-bench, humaneval, mmath]' --prompts_per_source 8 --max_new_tokens 128 --temperature 0 \\
        --decoding '{kind: tree, nodes: 16, top_k: 4}'

Offline: exact expected rounds per rollout (``offline.py``), pooled MAL per domain, AR_k, and with several
drafters ΔMAL against the baseline with a bootstrap CI over prompts (``lightning_spec/paired.py``). Online: real
decoding with every drafter and plain decoding of the same prompts, interleaved prompt by prompt in one process
(MAL, tokens/s, speedup). How each drafter decodes is one plan (``--decoding``, or ``--decodings`` per drafter;
``decoding/plans.py``). Both print a per-domain table and write a JSON file; ``--mlflow true`` logs one MLflow run
per drafter. Checkpoints given the same ``--names`` entry are seeds of one arm: their rounds are averaged per
rollout before the bootstrap.

This file is the edge: it parses the flags, loads the inputs (``inputs.py``), runs the evaluator (``offline.py``,
``online.py``) and shows the result (``report.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_spec.decoding.ngram import from_name
from lightning_spec.decoding.plans import Adapt, Auto, Chain, Plain, Plan, parse_plan
from lightning_spec.errors import UserError
from lightning_spec.evaluation.inputs import (
    TargetLoad,
    calibration_prompts,
    open_drafter,
    open_prompts,
    open_rollouts,
    open_target,
    trained_checkpoint,
)
from lightning_spec.evaluation.offline import OfflineReport, offline_report
from lightning_spec.evaluation.online import OnlineRun, choose_decodings, decoding_of, online_result, plain_baseline
from lightning_spec.evaluation.report import common_plan, log_mlflow, print_results, write_json
from lightning_spec.paired import Bootstrap, Comparison, compare_reports
from lightning_spec.provenance import input_checksums, run_record
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import TargetOptions
from lightning_spec.tracking import EVALUATE_EXPERIMENT


def arm_names(drafters: list[str], names: list[str] | None, plans: list[Plan]) -> list[str]:
    """One name per checkpoint; equal names form one arm. Default: the file or folder name, or the whole path
    where two checkpoints share it (``last.ckpt`` of two runs), and the plan's label where one checkpoint decodes
    with several plans (``last (chain)``, ``last (adapt (chain))``)."""
    if names is not None:
        if len(names) != len(drafters):
            raise UserError(f"--names has {len(names)} entries for {len(drafters)} --drafters; give one per drafter.")
        return list(names)
    stems = {d: Path(d).stem if Path(d).suffix == ".ckpt" else Path(d).name for d in drafters}
    base = [stems[d] if list(stems.values()).count(stems[d]) == 1 else str(d) for d in drafters]
    return [f"{b} ({p.label})" if len({q for c, q in zip(base, plans) if c == b}) > 1 else b
            for b, p in zip(base, plans)]


def sampling_config(temperature: float | None, top_p: float | None, top_k: int | None) -> SamplingConfig | None:
    """The sampling flags as a config; None when none is given (offline: the rollouts' own; online: greedy)."""
    if temperature is None and top_p is None and top_k is None:
        return None
    return SamplingConfig(
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
    )


@dataclass(frozen=True)
class Entry:
    """One ``--drafters`` entry: the arm it belongs to, its checkpoint, and how it decodes."""

    name: str
    checkpoint: str
    plan: Plan = Chain()


@dataclass(frozen=True)
class OfflineOptions:
    """How ``--mode offline`` scores: the rollouts' sampling config (None: their own), how many, batch size."""

    sampling: SamplingConfig | None = None
    max_rollouts: int | None = None
    batch_size: int = 4
    progress: bool = True


@dataclass(frozen=True)
class OnlineOptions:
    """What ``--mode online`` decodes: the prompt sources, prompts per source, budget, sampling, seed."""

    sampling: SamplingConfig
    sources: list[str]
    prompts_per_source: int = 8
    max_new_tokens: int = 128
    seed: int = 0
    progress: bool = True


# -------------------------------------------------------------------------------------------------- offline
def run_offline(rollouts: str, entries: list[Entry], target: str | None, how: TargetLoad, options: OfflineOptions,
                bootstrap: Bootstrap) -> tuple[dict[str, Any], Comparison]:
    """Exact offline rounds of every checkpoint on the rollouts folder (``offline.py``), arms compared on them.
    The target is ``target``, else the one the rollouts record; checkpoints are loaded one at a time."""
    from lightning_spec.data.rollouts import load_rollout_set

    data = load_rollout_set(rollouts)
    spec = target or (data.meta or {}).get("target")
    if spec is None:
        raise UserError("--target is needed: the rollouts record none.")
    _, model = open_target(spec, trained_checkpoint([e.checkpoint for e in entries]), how)
    data, sampling = open_rollouts(data, model, options.sampling, options.max_rollouts,
                                   sampling_name="--temperature (--top_p, --top_k)")
    reports: dict[str, list[OfflineReport]] = {}
    for entry in entries:
        run = entry.plan.resolve(open_drafter(entry.checkpoint, model))
        if run.length is not None and run.length < run.proposer.block_size:
            raise UserError(f"--mode offline scores a drafter's whole chain; decoding {entry.plan.label!r} of "
                            f"{entry.checkpoint} drafts {run.length} of its {run.proposer.block_size}: drop "
                            "decoding.length or decode it with --mode online.")
        reports.setdefault(entry.name, []).append(offline_report(
            model, run.proposer, data, sampling, batch_size=options.batch_size, progress=options.progress,
            tree=run.tree,
        ))
        del run  # one drafter in memory at a time
    comparison = compare_reports(reports, bootstrap.baseline, bootstrap.n_resamples, bootstrap.confidence,
                                 bootstrap.seed)
    first = next(iter(reports.values()))[0]
    return {
        "mode": "offline",
        "target": spec,
        "target_fingerprint": model.fingerprint,
        "sampling": sampling.to_dict(),
        "decoding": common_plan([e.plan for e in entries]),
        "rollouts": rollouts,
        "rows": {
            "prompt_id": first.prompt_keys,
            "domain": first.domains,
            "tokens": first.tokens.tolist(),
            "finished": first.finished,
        },
        "arms": {name: _offline_arm(reps, [e for e in entries if e.name == name], comparison)
                 for name, reps in reports.items()},
        "comparison": comparison.to_dict(),
    }, comparison


def _offline_arm(reports: list[OfflineReport], entries: list[Entry], comparison: Comparison) -> dict[str, Any]:
    """One arm's JSON: its MAL overall and per domain, acceptance per slot and rounds per rollout, pooled over its
    checkpoints (seeds)."""
    name = entries[0].name
    reached = torch.stack([r.slot_reached for r in reports]).sum(0)
    accepted = torch.stack([r.slot_accepted for r in reports]).sum(0)
    return {
        "checkpoints": [e.checkpoint for e in entries],
        "mal": comparison.arm(name).mal,
        "mal_by_domain": {d: comparison.arm(name, d).mal for d in comparison.by_domain},
        "accept_rate": (accepted / reached.clamp_min(1e-12)).tolist(),
        "seconds": sum(r.seconds.get("total", 0.0) for r in reports),
        "rounds": torch.stack([r.rounds for r in reports]).mean(0).tolist(),
        "decoding": entries[0].plan.to_dict(),
    }


# --------------------------------------------------------------------------------------------------- online
def run_online(entries: list[Entry], target: str | None, how: TargetLoad, options: OnlineOptions,
               bootstrap: Bootstrap) -> tuple[dict[str, Any], Comparison]:
    """Real decoding of the prompts by plain decoding and every checkpoint with its plan, interleaved prompt by
    prompt (``online.py``). Every entry loads its own drafter, so an ``adapt`` plan adapts a copy no other arm
    decodes with; ``auto`` plans are resolved on held-out calibration prompts first."""
    # default: the first checkpoint's target
    spec, model = open_target(target, trained_checkpoint([e.checkpoint for e in entries]), how)
    prompts = open_prompts(model, spec, options.sources, options.prompts_per_source, options.seed)
    decodings = [decoding_of(e.name, e.checkpoint, open_drafter(e.checkpoint, model), e.plan, model, options.seed)
                 for e in entries]
    if any(isinstance(e.plan, Auto) for e in entries):
        calibration = calibration_prompts(model, options.sources, options.prompts_per_source, options.seed, prompts)
        decodings = choose_decodings(decodings, model, calibration, options.sampling, options.max_new_tokens,
                                     options.progress)
    run = OnlineRun(model, decodings, prompts, options.sampling, options.max_new_tokens, options.seed,
                    options.progress, plain_baseline(decodings))
    return online_result(run, run.run(), bootstrap, spec, options.sources)


# -------------------------------------------------------------------------------------------------- command
@dataclass
class Evaluate:
    """Score drafters offline on target rollouts (exact expected rounds) or online by real decoding.

    Args:
        drafters: fit checkpoints (.ckpt) or exported drafter folders, e.g. '[runs/a/last.ckpt, runs/b/last.ckpt]';
            ``ngram`` or ``ngram:K`` is n-gram lookup (prompt and output, chains of up to K tokens; 10 by default),
            the untrained baseline: '[runs/a/last.ckpt, ngram]'. It records no target: alone it needs --target.
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
        experiment_name: MLflow experiment; ``{target}`` is the evaluated target (one experiment per target).
        target_dtype: float32 (CPU default), bfloat16 (GPUs), or auto: bf16 where the device multiplies it natively.
        device: where the target and drafters run.
        progress: show progress bars.
        decoding: how every drafter decodes, one plan (``decoding/plans.py``): ``chain`` (the default), a mapping
            such as '{kind: tree, nodes: 16, top_k: 4, ngram: 2}' or '{kind: chain, stop_below: 0.2}', or, online
            only, ``auto`` (each drafter's fastest plan from measured costs, ``decoding/auto/``: plain, n-gram lookup,
            its chains and trees, calibrated on 2 held-out prompts of every source and picked over plain only when
            its speedup's 95% lower bound beats plain by the plan's margin; the arm reports the speed it expected
            beside what it measured), ``plain``, ``ngram`` and ``adapt`` (the drafter adapting while it decodes:
            after each prompt it may update itself on the verified tokens when the expected time saved beats the
            update's measured cost, a UCB bandit over update scopes, SpecBlock arXiv 2605.07243; its seconds
            include the updates; '{kind: adapt, decoding: {kind: tree, nodes: 8}, lr: 1e-3}'). Offline, chains and
            trees are scored exactly: best-first trees (DFlash, Medusa) under any sampling, the others (EAGLE-3,
            MTP, D²SD, SpecBlock) on greedy rollouts.
        decodings: one plan per drafter instead of ``decoding``, e.g. one checkpoint as a chain, as a tree and
            adapting, a paired comparison of the three: --drafters '[a.ckpt, a.ckpt, a.ckpt]'
            --decodings '[chain, {kind: tree, nodes: 16, top_k: 4}, adapt]' (null: a chain).
    """

    drafters: list[str]
    mode: Literal["offline", "online"] = "offline"
    names: list[str] | None = None
    baseline: int | str = 0
    rollouts: str | None = None
    max_rollouts: int | None = None
    target: str | None = None
    target_options: TargetOptions | None = None
    sources: list[str] = field(default_factory=lambda: ["mt-bench", "humaneval", "mmath"])
    prompts_per_source: int = 8
    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    batch_size: int = 4
    n_resamples: int = 2000
    confidence: float = 0.95
    output: str | None = "evaluation.json"
    mlflow: bool = False
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment_name: str = EVALUATE_EXPERIMENT
    target_dtype: str = "float32"
    device: str = "cpu"
    progress: bool = True
    decoding: dict | str | None = None
    decodings: list[dict | str | None] | None = None

    # The fields above are the command's flags and YAML keys (``lightning-spec evaluate``, ``cli.run_command``);
    # the methods below group them into the objects the evaluators take.
    def run(self) -> dict[str, Any]:
        """Check the options, score the arms offline or online, print the tables, log to MLflow and write the JSON.
        Returns the JSON's dict."""
        entries, sampling = self.arms()
        how = TargetLoad(dtype=self.target_dtype, device=self.device, options=self.target_options)
        if self.mode == "offline":
            result, comparison = run_offline(self.rollouts, entries, self.target, how, self.offline(sampling),
                                             self.bootstrap())
        elif self.mode == "online":
            result, comparison = run_online(entries, self.target, how, self.online(sampling), self.bootstrap())
        else:
            raise UserError(f"--mode must be offline or online, got {self.mode!r}.")
        # the command and the inputs' checksums: what reproduces this report (``provenance.py``)
        result["provenance"] = {**run_record(), "inputs": input_checksums(
            [*self.drafters, *([self.rollouts] if self.mode == "offline" and self.rollouts else [])])}
        print_results(result, comparison)
        if self.mlflow:
            result["mlflow_run_ids"] = log_mlflow(result, comparison, self.tracking_uri, self.experiment_name)
        if self.output:
            write_json(result, self.output)
        return result

    def arms(self) -> tuple[list[Entry], SamplingConfig | None]:
        """Every check of the options that needs no file, in one place: the checkpoints as arm entries (name, path,
        plan) and the sampling flags' config (None: none given)."""
        drafters = self.drafters
        if not drafters:
            raise UserError("--drafters is empty; pass one or more checkpoints, e.g. --drafters '[runs/a/last.ckpt]'.")
        if self.n_resamples < 1 or not 0 < self.confidence < 1:
            raise UserError(f"--n_resamples ({self.n_resamples}) must be >= 1 and --confidence ({self.confidence}) "
                            "in (0, 1).")
        plans = self.plans()
        for drafter, plan in zip(drafters, plans):
            if self.mode == "offline" and isinstance(plan, (Plain, Auto, Adapt)):
                raise UserError(f"decoding {plan.kind!r} is measured by real decoding; score chains and trees with "
                                "--mode offline, or use --mode online.")
            if from_name(drafter) is not None and isinstance(plan, (Auto, Adapt)):
                why = "has no weights to adapt" if isinstance(plan, Adapt) else "is among what decoding auto weighs"
                raise UserError(f"--drafters {drafter!r} is n-gram lookup, which {why}; give it a chain or a tree.")
        return ([Entry(n, d, p) for n, d, p in zip(arm_names(drafters, self.names, plans), drafters, plans)],
                sampling_config(self.temperature, self.top_p, self.top_k))

    def plans(self) -> list[Plan]:
        """Each drafter's plan: ``decodings``' entry, or ``decoding`` for all (default: the chain)."""
        if self.decodings is None:
            return [parse_plan(self.decoding)] * len(self.drafters)
        if self.decoding is not None:
            raise UserError("pass --decoding (one plan for every drafter) or --decodings (one per drafter), not both.")
        if len(self.decodings) != len(self.drafters):
            raise UserError(f"--decodings has {len(self.decodings)} plans for {len(self.drafters)} drafters; give one "
                            "per drafter (null for a chain).")
        return [parse_plan(p) for p in self.decodings]

    def bootstrap(self) -> Bootstrap:
        """How the arms are compared: the baseline and the bootstrap over prompts."""
        return Bootstrap(self.baseline, self.n_resamples, self.confidence, self.seed)

    def offline(self, sampling: SamplingConfig | None) -> OfflineOptions:
        """How ``--mode offline`` scores (``sampling``: the flags', None for the rollouts' own)."""
        if self.rollouts is None:
            raise UserError("--mode offline needs --rollouts: a folder made by `lightning-spec rollouts`.")
        return OfflineOptions(sampling, self.max_rollouts, self.batch_size, self.progress)

    def online(self, sampling: SamplingConfig | None) -> OnlineOptions:
        """What ``--mode online`` decodes (``sampling``: the flags', None for greedy decoding)."""
        if self.prompts_per_source < 1 or self.max_new_tokens < 1:
            raise UserError("--prompts_per_source and --max_new_tokens must be >= 1.")
        return OnlineOptions(sampling or SamplingConfig(), self.sources, self.prompts_per_source, self.max_new_tokens,
                             self.seed, self.progress)
