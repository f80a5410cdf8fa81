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

This file is the edge: it parses the flags, loads the inputs (``inputs.py``), runs the evaluator (``offline.py``,
``online.py``) and shows the result (``report.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_spec.decoding.adaptation import Adaptation
from lightning_spec.decoding.ngram import from_name
from lightning_spec.decoding.trees import TreeConfig
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
from lightning_spec.evaluation.online import (
    DrafterDecoding,
    OnlineRun,
    adapting_arm,
    choose_decodings,
    online_result,
)
from lightning_spec.evaluation.report import common_tree, log_mlflow, print_results, tree_dict, write_json
from lightning_spec.paired import Bootstrap, Comparison, compare_reports
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import TargetOptions
from lightning_spec.tracking import EVALUATE_EXPERIMENT


def arm_names(drafters: list[str], names: list[str] | None) -> list[str]:
    """One name per checkpoint; equal names form one arm. Default: the file or folder name, or the whole path
    where two checkpoints share it (``last.ckpt`` of two runs)."""
    if names is not None:
        if len(names) != len(drafters):
            raise UserError(f"--names has {len(names)} entries for {len(drafters)} --drafters; give one per drafter.")
        return list(names)
    stems = [Path(d).stem if Path(d).suffix == ".ckpt" else Path(d).name for d in drafters]
    return [s if stems.count(s) == 1 else str(d) for s, d in zip(stems, drafters)]


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
    """One ``--drafters`` entry: the arm it belongs to, its checkpoint, and its tree (None: a chain)."""

    name: str
    checkpoint: str
    tree: TreeConfig | Literal["auto"] | None = None


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
        drafter = open_drafter(entry.checkpoint, model)
        reports.setdefault(entry.name, []).append(offline_report(
            model, drafter, data, sampling, batch_size=options.batch_size, progress=options.progress, tree=entry.tree,
        ))
        del drafter  # one drafter in memory at a time
    comparison = compare_reports(reports, bootstrap.baseline, bootstrap.n_resamples, bootstrap.confidence,
                                 bootstrap.seed)
    first = next(iter(reports.values()))[0]
    return {
        "mode": "offline",
        "target": spec,
        "target_fingerprint": model.fingerprint,
        "sampling": sampling.to_dict(),
        "tree": common_tree([e.tree for e in entries]),
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
        "tree": tree_dict(entries[0].tree),
    }


# --------------------------------------------------------------------------------------------------- online
def run_online(entries: list[Entry], target: str | None, how: TargetLoad, options: OnlineOptions,
               bootstrap: Bootstrap, adaptation: Adaptation | None = None) -> tuple[dict[str, Any], Comparison]:
    """Real decoding of the prompts by plain decoding and every checkpoint, interleaved prompt by prompt
    (``online.py``). ``adaptation`` adds an arm ``<name>+adapt`` per checkpoint: its own copy, adapted while it
    decodes the prompts in order (``adaptation.py``), its update time counted in its seconds."""
    from lightning_spec.checkpoint import load_drafter

    # default: the first checkpoint's target
    spec, model = open_target(target, trained_checkpoint([e.checkpoint for e in entries]), how)
    prompts = open_prompts(model, spec, options.sources, options.prompts_per_source, options.seed)
    decodings = [DrafterDecoding(e.name, e.checkpoint, open_drafter(e.checkpoint, model), e.tree) for e in entries]
    if any(e.tree == "auto" for e in entries):
        calibration = calibration_prompts(model, options.sources, options.prompts_per_source, options.seed, prompts)
        decodings = choose_decodings(decodings, model, calibration, options.sampling, options.max_new_tokens,
                                     options.progress)
    arms = list(decodings)
    if adaptation is not None:  # a second, adapting copy of every drafter
        arms += [adapting_arm(adaptation, d, load_drafter(d.checkpoint, target=model), model, options.seed)
                 for d in decodings]
    run = OnlineRun(model, arms, prompts, options.sampling, options.max_new_tokens, options.seed, options.progress)
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
        tree: decode (online) or score (offline, exactly) rounds that verify a token tree instead of a chain, e.g.
            --tree '{nodes: 16, top_k: 4}', built by each family's tree builder; offline, best-first trees (DFlash,
            Medusa) are scored under any sampling, the others (EAGLE-3, MTP, D²SD, SpecBlock) on greedy rollouts.
            Online, ``auto`` picks each drafter's fastest decoding from measured costs (``decoding/auto/``: plain,
            n-gram lookup, its chain, a tree, a tree with n-gram candidates), calibrated on 2 held-out prompts of
            every source and picked over plain only when its speedup's 95% lower bound beats plain by 5%; the arm
            decodes with the pick and reports the tokens/s and speedup it expected beside those it measured.
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
    tree: TreeConfig | Literal["auto"] | None = None
    trees: list[TreeConfig | Literal["auto"] | None] | None = None
    adapt: bool = False
    adapt_scopes: list[str] = field(default_factory=lambda: ["head", "last", "all"])
    adapt_lr: float = 1e-4
    adapt_steps: int = 2
    adapt_horizon: int = 4096
    adapt_exploration: float = 0.1
    adapt_force: str | None = None

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
            result, comparison = run_online(entries, self.target, how, self.online(sampling), self.bootstrap(),
                                            self.adaptation())
        else:
            raise UserError(f"--mode must be offline or online, got {self.mode!r}.")
        print_results(result, comparison)
        if self.mlflow:
            result["mlflow_run_ids"] = log_mlflow(result, comparison, self.tracking_uri, self.experiment_name)
        if self.output:
            write_json(result, self.output)
        return result

    def arms(self) -> tuple[list[Entry], SamplingConfig | None]:
        """Every check of the options that needs no file, in one place: the checkpoints as arm entries (name, path,
        tree) and the sampling flags' config (None: none given)."""
        tree = self.tree if self.tree == "auto" else TreeConfig.coerce(self.tree)
        drafters, trees = self.drafters, self.trees
        if not drafters:
            raise UserError("--drafters is empty; pass one or more checkpoints, e.g. --drafters '[runs/a/last.ckpt]'.")
        if self.n_resamples < 1 or not 0 < self.confidence < 1:
            raise UserError(f"--n_resamples ({self.n_resamples}) must be >= 1 and --confidence ({self.confidence}) "
                            "in (0, 1).")
        labels = arm_names(drafters, self.names)
        if trees is not None and tree is not None:
            raise UserError("pass --tree (one setting for every drafter) or --trees (one per drafter), not both.")
        if trees is not None and len(trees) != len(drafters):
            raise UserError(f"--trees has {len(trees)} settings for {len(drafters)} drafters; give one per drafter "
                            "(null for a chain).")
        per_drafter = ([t if t == "auto" else TreeConfig.coerce(t) for t in trees] if trees is not None
                       else [tree] * len(drafters))
        if "auto" in per_drafter and (self.mode != "online" or self.adapt):
            raise UserError("--tree auto picks a decoding by its measured speed: use it with --mode online and "
                            "without --adapt.")
        sampling = sampling_config(self.temperature, self.top_p, self.top_k)
        if self.adapt and self.mode != "online":
            raise UserError("--adapt true adapts drafters while they decode; use it with --mode online.")
        for drafter, setting in zip(drafters, per_drafter):
            if from_name(drafter) is None:
                continue
            if self.adapt:
                raise UserError(f"--drafters {drafter!r} is n-gram lookup, which has no weights to adapt; drop it from "
                                "--drafters or run without --adapt true.")
            if setting == "auto":
                raise UserError(f"--drafters {drafter!r} is n-gram lookup, which --tree auto already weighs for every "
                                "drafter; give it a chain (null) or a tree in --trees.")
        taken = [n for n in labels if self.adapt and n.endswith("+adapt") and n[: -len("+adapt")] in labels]
        if taken:
            raise UserError(f"--names {taken[0]!r} is also the name of an adapting arm (--adapt true); rename it.")
        return [Entry(n, d, t) for n, d, t in zip(labels, drafters, per_drafter)], sampling

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

    def adaptation(self) -> Adaptation | None:
        """The adapting copies' settings with ``--adapt true`` (None: no adapting arms)."""
        if not self.adapt:
            return None
        return Adaptation(scopes=self.adapt_scopes, lr=self.adapt_lr, steps=self.adapt_steps,
                          horizon_tokens=self.adapt_horizon, exploration=self.adapt_exploration,
                          force=self.adapt_force)
