"""The training-regime Reproductions rows, re-run from a strong base: each regime continues a trained drafter for a
number of steps, against supervised training (SFT) continued from the same drafter for the same steps at the same
learning rate, scored by exact offline MAL paired over prompts (docs/reproductions.md).

    .venv/bin/python benchmarks/regimes_from_base.py                           # every row (~2 hours on 2 cores)
    .venv/bin/python benchmarks/regimes_from_base.py --arms draft-opd grpo     # some arms (and their SFT twins)
    .venv/bin/python benchmarks/regimes_from_base.py --report-only             # the table from what is done

The bases are what the learning curve found strongest (docs/learning_curve.md): the testbed drafter (``make
testbed``: EAGLE-3, 5.6k ShareGPT conversations, 4000 steps) for Draft-OPD, GRPO and EDR, and the curve's DFlash on
the same data at 2000 steps for AdaFlash (its loss and length head are DFlash's). SFT continues on the base's own
data (the testbed recipe's ShareGPT rows, features from its store). The arms:

- ``draft-opd``: ``experiments/regimes/sft_then_opd.yaml`` (greedy on-policy rollouts, both streams), 150 steps;
  ``draft-opd-response``: the response stream alone (``rejected_weight: 0``), and ``draft-opd-sampled``: rollouts
  drawn at T = 1 (the paper samples), which test the earlier row's reading that greedy rollouts turn the
  rejected-draft stream into a push against the drafter's own argmax;
- ``grpo``: ``experiments/regimes/eal_then_grpo.yaml`` (GRPO on simulated greedy acceptance), 150 steps;
- ``edr``, ``edr-e2e``, ``edr-base``: ``experiments/regimes/edr_finetune.yaml``, one epoch of the target's T = 1
  answers to 320 ShareGPT prompts with EDR, with E2E-TV and with the base's own objective (KL with the decay:
  its SFT twin), scored on T = 1 rollouts;
- ``adaflash``: ``experiments/regimes/adaflash.yaml`` (reverse-KL on-policy distillation with the length head),
  24 steps of 6 buffers of 16 rollouts, 2 passes each, as the earlier row; scored by MAL and by the spread of the
  three domains' MAL (the paper's claim), with a bootstrap CI of the spread's difference.

Every regime except EDR gets an SFT twin (``sft-<arm>``: the base recipe at the regime's steps, learning rate and
warm-up). A regime's overlay is used as written, minus its decode-validation callback (each arm is scored offline
instead) and its time cap (arms compare at equal steps). Greedy arms are scored on the target's greedy answers to
80 MT-Bench, HumanEval and MMATH prompts each (96 tokens; the learning curve's), T = 1 arms on 30 T = 1 answers
per domain. The bases themselves are scored too, so every row states where it started.

Each arm's fit and evaluation land in ``<out>/arms/<name>.json`` as soon as they are done, and a rerun skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from learning_curve import LS, ROOT, Settings, evaluation_rollouts, run  # this folder is on sys.path when it runs
from objective_memory import cpu_name
from testbed import TINY as TESTBED_TINY

BASE_RECIPES = {  # the base's own training recipe: what its SFT twin continues
    "eagle3": ["-c", "experiments/quickstart.yaml", "-c", "experiments/drafters/eagle3.yaml",
               "-c", "experiments/testbed.yaml"],
    "dflash": ["-c", "experiments/quickstart.yaml", "-c", "experiments/testbed.yaml"],
}
BASES = {"eagle3": "testbed/drafter.ckpt",
         "dflash": "curve/runs/dflash-rows8000-len160-v2048-d1-k8-s2000"}  # a runs folder: its last.ckpt is found
DROP = object()  # in an arm's patch: remove the key from the regime's YAML (edr-base: the base recipe's objective)


@dataclass(frozen=True)
class Arm:
    """One continuation of a base: the regime overlay it runs (None: SFT), what it changes in that overlay, its
    steps (None: the overlay's one epoch), the temperature it is scored at, and the arm it is compared with."""

    name: str
    base: str
    regime: str | None
    steps: int | None
    patch: dict = field(default_factory=dict)
    temperature: float = 0.0
    control: str | None = None  # None: the SFT twin ``sft-<name>``, built from this arm


ARMS = [
    Arm("draft-opd", "eagle3", "sft_then_opd", 150),
    Arm("grpo", "eagle3", "eal_then_grpo", 150),
    Arm("edr-base", "eagle3", "edr_finetune", None, {"model": {"objective": DROP}}, 1.0, "edr-base"),
    Arm("edr-e2e", "eagle3", "edr_finetune", None,
        {"model": {"objective": {"class_path": "lightning_spec.objectives.E2E",
                                 "init_args": {"sampling": {"temperature": 1.0}, "normalize": "sequences"}}}},
        1.0, "edr-base"),  # E2E-TV at EDR's temperature and normalisation
    Arm("edr", "eagle3", "edr_finetune", None, {}, 1.0, "edr-base"),
    Arm("adaflash", "dflash", "adaflash", 24,
        {"on_policy": {"buffer_size": 16, "refresh_every": 4}}),  # the earlier row's 6 buffers of 16, 2 passes
    Arm("draft-opd-response", "eagle3", "sft_then_opd", 150,
        {"model": {"objective": {"init_args": {"rejected_weight": 0.0}}}}, control="sft-draft-opd"),
    Arm("draft-opd-sampled", "eagle3", "sft_then_opd", 150,  # rollouts drawn at T = 1, as the paper's
        {"on_policy": {"sampling": {"temperature": 1.0}}}, control="sft-draft-opd"),
]
SECOND_COMPARISONS = [("edr", "edr-e2e")]  # EDR's claim is over E2E as well as over the base objective
# --target tiny-random: the testbed's toy sizes on the packaged tiny target, and a small data set, for the test
TINY = [*TESTBED_TINY, "--data.train_limit=24", "--data.max_length=64"]
TINY_ON_POLICY = {"buffer_size": 4, "refresh_every": 1, "rollouts_per_refresh": 2, "max_new_tokens": 8}


def merge(into: dict, patch: dict) -> dict:
    """``patch`` merged into ``into`` key by key (nested dicts merged, anything else replaced, a class of another
    ``class_path`` replaced whole; ``DROP`` removes the key)."""
    for key, value in patch.items():
        if value is DROP:
            into.pop(key, None)
        elif (isinstance(value, dict) and isinstance(into.get(key), dict)
              and value.get("class_path", into[key].get("class_path")) == into[key].get("class_path")):
            merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def overlay(arm: Arm, out: Path, tiny: bool) -> Path:
    """The arm's regime overlay as a file under ``<out>/overlays``: the regime's YAML without its decode-validation
    callback and time cap, its on-policy callback's settings patched, then the arm's patch."""
    config = yaml.safe_load((ROOT / "experiments" / "regimes" / f"{arm.regime}.yaml").read_text())
    trainer = config.setdefault("trainer", {})
    trainer.pop("max_time", None)
    patch = dict(arm.patch)
    on_policy = {**patch.pop("on_policy", {}), **(TINY_ON_POLICY if tiny else {})}
    if "callbacks" in trainer:
        trainer["callbacks"] = [c for c in trainer["callbacks"] if not c["class_path"].endswith("SpecDecodeValidation")]
        for c in trainer["callbacks"]:
            if c["class_path"].endswith("OnPolicyRollouts"):
                c["init_args"].update(on_policy)
    path = out / "overlays" / f"{arm.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# written by benchmarks/regimes_from_base.py from experiments/regimes/{arm.regime}.yaml\n"
                    + yaml.safe_dump(merge(config, patch), sort_keys=False))
    return path


def sft_twin(arm: Arm) -> Arm:
    """Supervised training continued from the same base for the arm's steps, at the arm's learning rate and
    warm-up (read from its regime), on the base's own data: what the regime has to beat."""
    model = yaml.safe_load((ROOT / "experiments" / "regimes" / f"{arm.regime}.yaml").read_text()).get("model", {})
    settings = {k: model[k] for k in ("lr", "warmup_ratio") if k in model}
    return Arm(f"sft-{arm.name}", arm.base, None, arm.steps, {"model": settings}, arm.temperature, "")


def checkpoint_of(path: str, family: str) -> str:
    """The base of ``family``: a checkpoint file, or the ``last.ckpt`` under a runs folder."""
    p = ROOT / path
    if p.is_dir():
        found = sorted(p.rglob("last.ckpt"))
        if not found:
            raise SystemExit(f"[regimes] no last.ckpt under {p}: pass the base checkpoint with --base-{family}")
        return str(found[-1])
    if not p.exists():
        raise SystemExit(f"[regimes] the base {p} does not exist: train it (make testbed, or benchmarks/"
                         f"learning_curve.py --lines rows8000 --max-steps 2000) or pass --base-{family}")
    return str(p)


def fit(arm: Arm, args: argparse.Namespace, train_t1: Path) -> dict:
    """Train ``arm`` from its base; the checkpoint and what the fit cost."""
    cmd = [*LS, "fit", *BASE_RECIPES[arm.base], *(TINY if args.target == "tiny-random" else [])]
    if arm.regime is not None:
        cmd += ["-c", str(overlay(arm, args.out, args.target == "tiny-random"))]
    else:
        cmd += [f"--model.{k}={v}" for k, v in arm.patch.get("model", {}).items()]
    if arm.regime == "edr_finetune":  # its epoch reads the target's T = 1 answers, not the base's store
        cmd += [f"--data.train_sources=[{train_t1}]", "--data.train_limit=null", "--model.feature_cache=off"]
    steps = args.steps or arm.steps
    cmd += [f"--trainer.max_steps={steps if steps else -1}", "--trainer.max_time=null",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            f"--model.init_from={getattr(args, f'base_{arm.base}')}",
            f"--trainer.default_root_dir={args.out / 'runs' / arm.name}",
            "--trainer.logger.init_args.experiment_name=regimes-from-base",
            f"--trainer.logger.init_args.tracking_uri=sqlite:///{args.out / 'mlflow.db'}",
            f"--trainer.logger.init_args.run_name={arm.name}"]
    text, wall, cpu = run(f"fit-{arm.name}", cmd, args.out / "logs", tag="regimes")
    found = re.findall(r"^checkpoint: (\S+)", text, flags=re.M)
    if not found:
        raise SystemExit(f"[regimes] fit-{arm.name} printed no checkpoint; see {args.out / 'logs'}")
    import torch

    reached = torch.load(found[-1], map_location="cpu", weights_only=False, mmap=True)["global_step"]  # an epoch's
    return {"checkpoint": found[-1], "wall_s": wall, "cpu_s": cpu, "steps_reached": reached}


def evaluate(name: str, checkpoint: str, rollouts: Path, out: Path) -> dict:
    """Exact offline MAL of one checkpoint on ``rollouts`` at their own sampling; the per-row rounds the pairing
    needs are in the JSON it writes."""
    from lightning_spec.evaluation.cli import Evaluate

    output = out / "evaluations" / f"{name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(out / "logs" / f"evaluate-{name}.log", "w") as log, contextlib.redirect_stdout(log):  # its tables
        result = Evaluate([checkpoint], mode="offline", names=["arm"], rollouts=str(rollouts), output=str(output),
                          progress=False).run()
    arm = result["comparison"]["arms"]["arm"]
    return {"mal": arm["mal"], "mal_ci": arm["mal_ci"], "evaluation": str(output),
            "by_domain": {d: arms["arm"]["mal"] for d, arms in result["comparison"]["by_domain"].items()}}


def rollouts(args: argparse.Namespace, arms: list[Arm]) -> tuple[Path, Path, Path]:
    """The greedy and T = 1 evaluation rollouts and the T = 1 training rollouts EDR's epoch reads, each drawn once
    and only when one of ``arms`` needs it."""
    tiny = args.target == "tiny-random"
    greedy = evaluation_rollouts(Settings(out=args.out, target=args.target, eval_prompts=4 if tiny else 80,
                                          eval_tokens=16 if tiny else 96))
    needed = {"eval-t1": any(a.temperature for a in arms), "train-t1": any(a.regime == "edr_finetune" for a in arms)}
    for folder, sources, prompts, tokens in (
            ("eval-t1", "[mt-bench, humaneval, mmath]", 4 if tiny else 30, 16 if tiny else 96),
            ("train-t1", "[sharegpt]", 16 if tiny else 320, 16 if tiny else 64)):  # EDR's overlay's own command
        path = args.out / folder
        if needed[folder] and not (path / "rollouts.json").exists():
            short = ["--max_prompt_tokens=96"] if folder == "train-t1" else []
            run(folder, [*LS, "rollouts", f"--target={args.target}", f"--sources={sources}", *short,
                         f"--prompts_per_source={prompts}", "--temperature=1.0", f"--max_new_tokens={tokens}",
                         "--batch_size=16", f"--out={path}", "--progress=false"], args.out / "logs", tag="regimes")
    return greedy, args.out / "eval-t1", args.out / "train-t1"


def one(arm: Arm, args: argparse.Namespace, evaluation: dict[float, Path], train_t1: Path) -> dict:
    """Fit and score ``arm`` (or only score a base, ``base-*``), saved as soon as it is done."""
    path = args.out / "arms" / f"{arm.name}.json"
    if path.exists():
        return json.loads(path.read_text())
    trained = ({"checkpoint": getattr(args, f"base_{arm.base}"), "wall_s": 0.0, "cpu_s": 0.0}
               if arm.name.startswith("base-") else fit(arm, args, train_t1))
    steps = 0 if arm.name.startswith("base-") else args.steps or arm.steps
    result = {"name": arm.name, "base": arm.base, "regime": arm.regime, "steps": steps,
              "temperature": arm.temperature, "control": arm.control, **trained, "cpu": cpu_name(),
              "eval": evaluate(arm.name, trained["checkpoint"], evaluation[arm.temperature], args.out)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    e = result["eval"]
    print(f"[regimes] {arm.name}: MAL {e['mal']:.3f} [{e['mal_ci'][0]:.3f}, {e['mal_ci'][1]:.3f}]", flush=True)
    return result


# -------------------------------------------------------------------------------------------------- report
def scored(result: dict) -> dict:
    """The evaluation JSON of an arm's result: its rows and per-row rounds."""
    return json.loads(Path(result["eval"]["evaluation"]).read_text())


def paired(a: dict, b: dict) -> str:
    """ΔMAL of arm ``a`` over arm ``b`` on the same rollouts, with its 95% bootstrap CI over prompts."""
    import numpy as np

    from lightning_spec.paired import compare

    ja, jb = scored(a), scored(b)
    rows = ja["rows"]
    if rows["prompt_id"] != jb["rows"]["prompt_id"]:
        raise SystemExit(f"[regimes] {a['name']} and {b['name']} were scored on different rollouts")
    rounds = {"b": np.asarray(jb["arms"]["arm"]["rounds"]), "a": np.asarray(ja["arms"]["arm"]["rounds"])}  # (R,)
    c = compare(rounds, np.asarray(rows["tokens"]), rows["prompt_id"], baseline="b").arm("a")
    return f"{c.delta:+.3f} [{c.delta_ci[0]:+.3f}, {c.delta_ci[1]:+.3f}]"


def spread_delta(a: dict, b: dict, n_resamples: int = 2000, seed: int = 0) -> tuple[float, float, tuple[float, float]]:
    """The spread of MAL across domains (population std of the domains' pooled MAL) of arms ``a`` and ``b``, and
    the 95% CI of spread(a) - spread(b), resampling each domain's prompts (clusters) with both arms paired."""
    import numpy as np

    ja, jb = scored(a), scored(b)
    rows = ja["rows"]
    prompts = sorted({(d, p) for d, p in zip(rows["domain"], rows["prompt_id"])})
    index = {key: i for i, key in enumerate(prompts)}
    at = np.array([index[(d, p)] for d, p in zip(rows["domain"], rows["prompt_id"])])
    sums = np.zeros((3, len(prompts)))  # tokens, a's rounds, b's rounds per prompt
    for k, values in enumerate((rows["tokens"], ja["arms"]["arm"]["rounds"], jb["arms"]["arm"]["rounds"])):
        np.add.at(sums[k], at, np.asarray(values, dtype=np.float64))
    rng = np.random.default_rng(seed)
    domains = sorted({d for d, _ in prompts})
    point, boot = np.zeros((2, len(domains))), np.zeros((2, n_resamples, len(domains)))
    for j, d in enumerate(domains):
        sel = np.array([i for i, (dd, _) in enumerate(prompts) if dd == d])
        tok, ra, rb = sums[:, sel]
        point[:, j] = tok.sum() / ra.sum(), tok.sum() / rb.sum()
        counts = rng.multinomial(len(sel), np.full(len(sel), 1 / len(sel)), size=n_resamples)  # (n, P_d)
        boot[0, :, j], boot[1, :, j] = counts @ tok / (counts @ ra), counts @ tok / (counts @ rb)
    diff = boot[0].std(axis=1) - boot[1].std(axis=1)  # (n,)
    return float(point[0].std()), float(point[1].std()), (float(np.percentile(diff, 2.5)),
                                                           float(np.percentile(diff, 97.5)))


def table(results: dict[str, dict]) -> str:
    """One row per arm: its start, steps, MAL, Δ against its base and its control (paired 95% CIs), its cost."""
    head = ["arm", "base", "steps", "T", "MAL (95% CI)", "Δ vs base", "compared with", "Δ vs that", "fit min",
            "fit CPU-h"]
    cpus = sorted({r["cpu"] for r in results.values()})
    lines = [f"CPU: {', '.join(cpus)}. MAL: exact offline on the target's answers (greedy: 80 prompts per domain, "
             "T = 1: 30); Δ paired over prompts.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        base = results.get(f"base-{r['base']}" + ("-t1" if r["temperature"] else ""))
        control = results.get(r["control"]) if r["control"] and r["control"] != name else None
        e = r["eval"]
        steps = r.get("steps_reached", r["steps"])
        cells = [name, r["base"], f"{steps}" + (" (1 epoch)" if r["steps"] is None else ""), f"{r['temperature']:g}",
                 f"{e['mal']:.3f} [{e['mal_ci'][0]:.3f}, {e['mal_ci'][1]:.3f}]",
                 paired(r, base) if base and base is not r else "",
                 control["name"] if control else "", paired(r, control) if control else "",
                 f"{r['wall_s'] / 60:.1f}", f"{r['cpu_s'] / 3600:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for a, b in SECOND_COMPARISONS:
        if a in results and b in results:
            lines += ["", f"{a} against {b}: Δ {paired(results[a], results[b])}"]
    if "adaflash" in results and "sft-adaflash" in results:
        a, b, ci = spread_delta(results["adaflash"], results["sft-adaflash"])
        lines += ["", f"AdaFlash's spread of MAL across domains: {a:.3f} against SFT continued {b:.3f}, "
                      f"Δ {a - b:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"]
    return "\n".join(lines) + "\n"


def plan(names: list[str] | None) -> list[Arm]:
    """The arms to run, in order: the bases first, then each requested arm after its SFT twin (or control)."""
    chosen = [a for a in ARMS if names is None or a.name in names]
    unknown = set(names or []) - {a.name for a in ARMS}
    if unknown:
        raise SystemExit(f"[regimes] unknown --arms {sorted(unknown)}; the arms are {[a.name for a in ARMS]}")
    arms: dict[str, Arm] = {}
    for base, temperature in sorted({(a.base, a.temperature) for a in chosen}):
        name = f"base-{base}" + ("-t1" if temperature else "")
        arms[name] = Arm(name, base, None, 0, temperature=temperature, control=None)
    by_name = {a.name: a for a in ARMS}
    for a in chosen:
        if a.control is None:
            arms.setdefault(f"sft-{a.name}", sft_twin(a))
            a = Arm(**{**a.__dict__, "control": f"sft-{a.name}"})
        elif a.control != a.name:  # another arm, or another arm's SFT twin
            arms.setdefault(a.control, by_name.get(a.control) or sft_twin(by_name[a.control.removeprefix("sft-")]))
        arms[a.name] = a
    return list(arms.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("regimes"), help="where arms, logs and the table go")
    parser.add_argument("--arms", nargs="+", default=None, help=f"some of {[a.name for a in ARMS]} (default: all)")
    parser.add_argument("--base-eagle3", default=BASES["eagle3"], help="the EAGLE-3 base (default: the testbed's)")
    parser.add_argument("--base-dflash", default=BASES["dflash"], help="the DFlash base (default: the curve's)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="tiny-random: toy sizes, for the test")
    parser.add_argument("--steps", type=int, default=None, help="every arm's steps instead of its own (tests)")
    parser.add_argument("--report-only", action="store_true", help="print the table from the arms done")
    args = parser.parse_args()
    args.out = args.out.resolve()
    arms = plan(args.arms)
    if not args.report_only:
        for base in {a.base for a in arms}:
            setattr(args, f"base_{base}", checkpoint_of(getattr(args, f"base_{base}"), base))
        greedy, eval_t1, train_t1 = rollouts(args, arms)
        for arm in arms:
            one(arm, args, {0.0: greedy, 1.0: eval_t1}, train_t1)
    done = {a.name: json.loads((args.out / "arms" / f"{a.name}.json").read_text()) for a in arms
            if (args.out / "arms" / f"{a.name}.json").exists()}
    text = table(done)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
