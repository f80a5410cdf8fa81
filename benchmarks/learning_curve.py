"""The learning curve: what data, steps, draft vocabulary and depth buy a drafter here, per CPU-hour.

    .venv/bin/python benchmarks/learning_curve.py                          # every line of the grid (many hours)
    .venv/bin/python benchmarks/learning_curve.py --lines base vocab8192   # some lines
    .venv/bin/python benchmarks/learning_curve.py --max-steps 1000         # every line, points up to 1000 steps
    .venv/bin/python benchmarks/learning_curve.py --lines len512 --steps 2000   # one point of one line
    .venv/bin/python benchmarks/learning_curve.py --report-only --docs docs   # the table, and the plot in docs/

One start, the quickstart's exportable DFlash (``experiments/quickstart.yaml``: 1 layer, K = 8, a 2048-token draft
vocabulary, KL with the position decay, 1200 ShareGPT rows cut at 160 tokens), and lines that each move one knob
from it, every line at a few step budgets:

- ``base``: the start at 250 ... 4000 steps (the small set is seen ~19 times at 4000: where it overfits);
- ``rows8000``, ``rowsall``: ~5.6k and all usable ShareGPT conversations (``data.train_limit`` 8000 and null);
- ``len512``: conversations cut at 512 tokens instead of 160 (more tokens per conversation);
- ``vocab8192``, ``vocabfull``: the draft vocabulary (2048 covers ~78% of SmolLM2's greedy MT-Bench tokens);
- ``layers2``, ``k16``: depth (2 drafter layers) and block size (16 slots);
- ``eagle3``: EAGLE-3 (``experiments/drafters/eagle3.yaml``), the family most of the anchors use;
- ``dflash2``: DFlash2 (``experiments/drafters/dflash2.yaml``): the start's DFlash with the convolutions and the path
  selector, trained with ``SelectorCE`` over the start's KL, on the start's store.

Every fit reads the target's features from a feature store written once per (family's layers, rows, max_length)
(``lightning-spec features``), trains exactly its steps (the cosine schedule ends there, no time budget) and
validates once at the end (held-out loss on 16 batches). Each point records:

- exact offline MAL (``lightning-spec evaluate --mode offline``) on SmolLM2's greedy answers to the 80 MT-Bench
  prompts and to 80 HumanEval and 80 MMATH prompts (96 tokens each, drawn once by our engine), each with its 95%
  bootstrap CI over prompts, and AR_1, AR_2 on all of them;
- training loss (mean over the last 10% of steps) against the held-out loss: whether it learned its data or
  generalised;
- what it cost: the store's and the fit's CPU-hours (user + system time of their processes) and wall hours, on the
  CPU named in the table. A point's total cost counts its store in full: that is what the first run pays.

Each point lands in ``<out>/points/<name>.json`` as soon as it is done, and a rerun skips it (a killed run continues).
The table (markdown, printed and in ``<out>``) and the plot (MAL on MT-Bench against CPU-hours, one line per knob,
in ``<out>`` or ``--docs``) are written from every point found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from objective_memory import cpu_name  # this folder is on sys.path when the script runs

ROOT = Path(__file__).resolve().parents[1]
LS = [sys.executable, "-m", "lightning_spec"]
FAMILY_CONFIGS = {"dflash": [], "dflash2": ["-c", "experiments/drafters/dflash2.yaml"],
                  "eagle3": ["-c", "experiments/drafters/eagle3.yaml"]}
BLOCK_FAMILIES = ("dflash", "dflash2")  # DFlash's layers and target layers: one store, num_layers a knob


@dataclass(frozen=True)
class Knobs:
    """What a point trains: the family, its data (rows read, tokens kept per conversation) and its shape."""

    family: str = "dflash"
    rows: int | None = 1200  # data.train_limit (None: every usable conversation)
    max_length: int = 160
    vocab: int | None = 2048  # drafter.draft_vocab_size (None: the target's whole vocabulary)
    layers: int = 1  # DFlash's num_layers (EAGLE-3 has one)
    block: int = 8  # K

    @property
    def store(self) -> str:
        """The store a point reads: the target layers the drafter reads (DFlash spreads them over the target by its
        depth, hence ``d<layers>``) and the data decide it; the vocabulary and K do not."""
        if self.family in BLOCK_FAMILIES:  # DFlash2 reads DFlash's target layers: the same store
            return f"dflash-d{self.layers}-rows{self.rows or 'all'}-len{self.max_length}"
        return f"{self.family}-rows{self.rows or 'all'}-len{self.max_length}"

    def name(self, steps: int) -> str:
        return (f"{self.family}-rows{self.rows or 'all'}-len{self.max_length}-v{self.vocab or 'full'}-d{self.layers}"
                f"-k{self.block}-s{steps}")

    def overrides(self) -> list[str]:
        out = ["-c", "experiments/quickstart.yaml", *FAMILY_CONFIGS[self.family],
               f"--data.train_limit={'null' if self.rows is None else self.rows}",
               f"--data.max_length={self.max_length}",
               f"--model.drafter.init_args.draft_vocab_size={'null' if self.vocab is None else self.vocab}",
               f"--model.drafter.init_args.block_size={self.block}"]
        if self.family in BLOCK_FAMILIES:
            out.append(f"--model.drafter.init_args.num_layers={self.layers}")
        return out


@dataclass(frozen=True)
class Line:
    """One knob moved from the start: its id, what it moves, the knobs, and the step budgets it is trained at."""

    id: str
    knob: str
    knobs: Knobs
    steps: tuple[int, ...]


BASE = Knobs()
LINES = [
    Line("base", "steps", BASE, (250, 500, 1000, 2000, 4000)),
    Line("rows8000", "data", Knobs(rows=8000), (1000, 2000, 4000, 8000)),
    Line("rowsall", "data", Knobs(rows=None), (4000, 8000, 16000)),
    Line("len512", "data", Knobs(max_length=512), (500, 1000, 2000)),
    Line("vocab8192", "vocabulary", Knobs(vocab=8192), (500, 1000, 2000)),
    Line("vocabfull", "vocabulary", Knobs(vocab=None), (500, 1000)),
    Line("layers2", "depth", Knobs(layers=2), (500, 1000, 2000)),
    Line("k16", "depth", Knobs(block=16), (500, 1000)),
    Line("eagle3", "family", Knobs(family="eagle3"), (500, 1000, 2000)),
    Line("dflash2", "family", Knobs(family="dflash2"), (500, 1000, 2000)),
    Line("eagle3-rows8000", "family and data", Knobs(family="eagle3", rows=8000), (2000, 4000)),
]
# The same grid on the packaged tiny random target, for the benchmark's test: seconds, not hours.
TINY = Knobs(rows=24, max_length=64, vocab=64, block=4)
TINY_LINES = [Line("base", "steps", TINY, (2, 4)),
              Line("vocabfull", "vocabulary", Knobs(**{**asdict(TINY), "vocab": None}), (2,))]


@dataclass
class Settings:
    """Where and what: the output folder, the target, the evaluation rollouts' size, the fit's extra arguments."""

    out: Path
    target: str = "smollm2-135m-instruct"
    eval_prompts: int = 80
    eval_tokens: int = 96
    batch_size: int = 8  # data.batch_size of every fit (the quickstart's), recorded with each point
    extra: list[str] = field(default_factory=list)  # appended to every fit and store command

    @property
    def logs(self) -> Path:
        return self.out / "logs"


# ------------------------------------------------------------------------------------------------ processes
def run(name: str, cmd: list[str], logs: Path, tag: str = "curve") -> tuple[str, float, float]:
    """Run one command from the repository root, its output written as it comes to ``logs/<name>.log`` (``tail -f``
    follows a long fit); (its output, wall seconds, CPU seconds of its processes from the children's rusage). A
    failure stops the benchmark with the log's path. ``tag`` prefixes what it prints (benchmarks/testbed.py uses it
    too)."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    print(f"[{tag}] {name} (log: {log})", flush=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}).returncode
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"[{tag}] {name} failed ({code}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"[{tag}] {name}: {wall:.0f} s wall, {cpu:.0f} CPU-s", flush=True)
    return log.read_text(), wall, cpu


def evaluation_rollouts(settings: Settings) -> Path:
    """The target's greedy answers to MT-Bench, HumanEval and MMATH prompts, drawn once by our engine: exactly what
    plain greedy decoding gives, so offline MAL is what real greedy decoding would reach."""
    folder = settings.out / "eval"
    if not (folder / "rollouts.json").exists():
        run("eval-rollouts", [*LS, "rollouts", f"--target={settings.target}", "--sources=[mt-bench, humaneval, mmath]",
                              f"--prompts_per_source={settings.eval_prompts}", "--temperature=0",
                              f"--max_new_tokens={settings.eval_tokens}", "--batch_size=16", f"--out={folder}",
                              "--progress=false"], settings.logs)
    return folder


def feature_store(knobs: Knobs, settings: Settings) -> dict:
    """The store of ``knobs``, written once, and what writing it cost, recorded beside it when it is done. A store a
    killed run left half-written is finished by the next (``lightning-spec features`` resumes), and only that run's
    cost and tokens are recorded."""
    folder, record = settings.out / "stores" / knobs.store, settings.out / "stores" / f"{knobs.store}.json"
    if record.exists():
        return json.loads(record.read_text())
    text, wall, cpu = run(f"store-{knobs.store}", [*LS, "features", *knobs.overrides(), *settings.extra,
                                                   "--model.feature_cache=disk", f"--model.feature_store={folder}",
                                                   "--progress=false"], settings.logs)
    found = re.search(r"features: \d+ of (\d+) examples.*?([\d,]+) tokens", text)
    cost = {"wall_s": wall, "cpu_s": cpu, "examples": int(found.group(1)) if found else None,
            "tokens": int(found.group(2).replace(",", "")) if found else None}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(cost, indent=2))
    return cost


def losses(tracking_uri: str, run_id: str) -> dict[str, float]:
    """The fit's training loss (mean of the logged steps in its last 10%) and held-out loss (the last validation)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    train = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    val = sorted(client.get_metric_history(run_id, "val/loss"), key=lambda m: m.step)
    tail = [m.value for m in train if m.step >= 0.9 * train[-1].step] if train else []
    return {"train_loss": sum(tail) / len(tail) if tail else float("nan"),
            "val_loss": val[-1].value if val else float("nan")}


def fit(knobs: Knobs, steps: int, settings: Settings) -> dict:
    """Train ``knobs`` for exactly ``steps`` steps on its store, validating once at the end; the checkpoint, the
    losses and what the fit cost."""
    uri = f"sqlite:///{settings.out / 'mlflow.db'}"
    name = knobs.name(steps)
    text, wall, cpu = run(f"fit-{name}", [
        *LS, "fit", *knobs.overrides(), *settings.extra, f"--data.batch_size={settings.batch_size}",
        f"--trainer.max_steps={steps}", "--trainer.max_time=null",
        "--trainer.callbacks=[]", "--trainer.check_val_every_n_epoch=null", f"--trainer.val_check_interval={steps}",
        "--trainer.limit_val_batches=16", "--model.feature_cache=disk",
        f"--model.feature_store={settings.out / 'stores' / knobs.store}",
        f"--trainer.default_root_dir={settings.out / 'runs' / name}", "--trainer.enable_progress_bar=false",
        "--trainer.logger.init_args.experiment_name=learning-curve", f"--trainer.logger.init_args.tracking_uri={uri}",
        f"--trainer.logger.init_args.run_name={name}"], settings.logs)
    checkpoint = re.findall(r"^checkpoint: (\S+)", text, flags=re.M)
    run_id = re.findall(r"^MLflow run: (\w+)", text, flags=re.M)
    if not checkpoint or not run_id:
        raise SystemExit(f"[curve] fit-{name} printed no checkpoint or MLflow run; see {settings.logs}")
    return {"checkpoint": checkpoint[-1], "mlflow_run": run_id[-1], "batch_size": settings.batch_size,
            "train_wall_s": wall, "train_cpu_s": cpu, **losses(uri, run_id[-1])}


def offline_mal(checkpoint: str, rollouts: Path, settings: Settings, name: str) -> dict:
    """Exact offline MAL with its 95% CI overall and per domain, and AR_1, AR_2 (``evaluate --mode offline``)."""
    output = settings.out / "evaluations" / f"{name}.json"
    run(f"evaluate-{name}", [*LS, "evaluate", "--mode=offline", f"--rollouts={rollouts}", f"--drafters=[{checkpoint}]",
                             "--names=[point]", f"--output={output}", "--progress=false"], settings.logs)
    result = json.loads(output.read_text())
    comparison = result["comparison"]
    out = {"mal": comparison["arms"]["point"]["mal"], "mal_ci": comparison["arms"]["point"]["mal_ci"],
           "by_domain": {d: {"mal": arms["point"]["mal"], "mal_ci": arms["point"]["mal_ci"]}
                         for d, arms in comparison["by_domain"].items()}}
    rates = result["arms"]["point"]["accept_rate"]
    out["ar1"], out["ar2"] = rates[0], rates[1] if len(rates) > 1 else float("nan")
    return out


def point(line: Line, steps: int, rollouts: Path, settings: Settings) -> dict:
    """One point: its store (written once per store key), its fit, its evaluation, saved as soon as it is done."""
    name = line.knobs.name(steps)
    path = settings.out / "points" / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    store = feature_store(line.knobs, settings)
    trained = fit(line.knobs, steps, settings)
    result = {"name": name, "line": line.id, "knob": line.knob, "knobs": asdict(line.knobs), "steps": steps,
              "store": {**store, "key": line.knobs.store}, **trained,
              "eval": offline_mal(trained["checkpoint"], rollouts, settings, name), "cpu": cpu_name()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"[curve] {name}: MAL {result['eval']['mal']:.3f} [{result['eval']['mal_ci'][0]:.3f}, "
          f"{result['eval']['mal_ci'][1]:.3f}]", flush=True)
    return result


# -------------------------------------------------------------------------------------------------- report
def hours(p: dict) -> float:
    """A point's CPU-hours: its fit, plus its store in full (what a first run of it pays)."""
    return (p["train_cpu_s"] + p["store"]["cpu_s"]) / 3600


DOMAINS = {"chat": "MT-Bench", "code": "HumanEval", "math": "MMATH"}  # the evaluation sources' domains


def paired_delta(p: dict, points: list[dict], settings: Settings) -> str:
    """ΔMAL of ``p`` against the ``base`` point of equal steps, paired over the same rollouts (95% bootstrap CI over
    prompts, ``paired.compare``); empty for the base line or where that point is missing."""
    import numpy as np

    from lightning_spec.paired import compare

    base = next((b for b in points if b["line"] == "base" and b["steps"] == p["steps"]), None)
    if p["line"] == "base" or base is None:
        return ""
    results = [json.loads((settings.out / "evaluations" / f"{x['name']}.json").read_text()) for x in (base, p)]
    rows = results[0]["rows"]
    rounds = {arm: np.asarray(r["arms"]["point"]["rounds"]) for arm, r in zip(("base", "point"), results)}  # (R,)
    c = compare(rounds, np.asarray(rows["tokens"]), rows["prompt_id"], rows["domain"], baseline="base").arm("point")
    return f"{c.delta:+.3f} [{c.delta_ci[0]:+.3f}, {c.delta_ci[1]:+.3f}]"


def table(points: list[dict], settings: Settings) -> str:
    """The markdown table: one row per point, grouped by line, fewest steps first."""
    cpus = sorted({p["cpu"] for p in points})
    domains = sorted({d for p in points for d in p["eval"]["by_domain"]})
    head = ["line", "steps", "epochs", "MAL, all (95% CI)", "Δ vs base, same steps",
            *(DOMAINS.get(d, d) for d in domains), "AR_1", "AR_2", "train loss", "held-out loss", "store CPU-h",
            "fit CPU-h", "fit wall h"]
    rows = [f"CPU: {', '.join(cpus)}. MAL: exact offline, greedy, on the target's {settings.eval_tokens}-token answers "
            "to each domain's prompts; a point's total cost is its fit and its whole store.", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=lambda p: (order(p["line"]), p["steps"])):
        e = p["eval"]
        examples = p["store"].get("examples")
        epochs = f"{p['steps'] * p['batch_size'] / examples:.1f}" if examples else "?"
        cells = [p["line"], str(p["steps"]), epochs, f"{e['mal']:.3f} [{e['mal_ci'][0]:.3f}, {e['mal_ci'][1]:.3f}]",
                 paired_delta(p, points, settings),
                 *(f"{e['by_domain'][d]['mal']:.3f} [{e['by_domain'][d]['mal_ci'][0]:.2f}, "
                   f"{e['by_domain'][d]['mal_ci'][1]:.2f}]" if d in e["by_domain"] else "" for d in domains),
                 f"{e['ar1']:.3f}", f"{e['ar2']:.3f}", f"{p['train_loss']:.3f}", f"{p['val_loss']:.3f}",
                 *(f"{seconds / 3600:.2f}" for seconds in (p["store"]["cpu_s"], p["train_cpu_s"], p["train_wall_s"]))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def order(line_id: str) -> int:
    ids = [line.id for line in LINES]
    return ids.index(line_id) if line_id in ids else len(ids)


def plot(points: list[dict], path: Path, domain: str = "chat") -> None:
    """MAL on ``domain`` (all domains pooled when it is missing) against CPU-hours, one line per knob line, with
    the CIs as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for line_id in sorted({p["line"] for p in points}, key=order):
        mine = sorted((p for p in points if p["line"] == line_id), key=hours)
        evals = [p["eval"]["by_domain"].get(domain, p["eval"]) for p in mine]
        y = [e["mal"] for e in evals]
        err = [[m - e["mal_ci"][0] for m, e in zip(y, evals)], [e["mal_ci"][1] - m for m, e in zip(y, evals)]]
        ax.errorbar([hours(p) for p in mine], y, yerr=err, marker="o", capsize=3, label=line_id)
    ax.set_xlabel(f"CPU-hours (store + fit), {', '.join(sorted({p['cpu'] for p in points}))}")
    ax.set_ylabel(f"exact offline MAL on {DOMAINS.get(domain, domain)} (greedy, 95% CI)")
    ax.set_title("What an hour buys: the drafter's learning curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(settings: Settings, docs: Path | None) -> None:
    """The table (printed, and in ``<out>/learning_curve_table.md``) and the plot (in ``docs``, else ``<out>``)."""
    points = [json.loads(p.read_text()) for p in sorted((settings.out / "points").glob("*.json"))]
    if not points:
        raise SystemExit(f"[curve] no points under {settings.out / 'points'} yet: run without --report-only first.")
    text = table(points, settings)
    (settings.out / "learning_curve_table.md").write_text(text)
    figure = (docs or settings.out) / "learning_curve.png"
    plot(points, figure)
    print(text)
    print(f"[curve] wrote {settings.out / 'learning_curve_table.md'} and {figure}")


# ----------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="curve", help="where stores, runs, points and logs go (resumable)")
    parser.add_argument("--lines", nargs="*", help=f"the lines to run (default all): {[line.id for line in LINES]}")
    parser.add_argument("--max-steps", type=int, help="only the points of at most this many steps")
    parser.add_argument("--steps", type=int, nargs="*", help="only the points of exactly these budgets (a line's "
                        "last point without its shorter ones, e.g. --lines len512 --steps 2000)")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="tiny-random: the packaged tiny target and a seconds-long grid (the benchmark's test)")
    parser.add_argument("--eval-prompts", type=int, default=80, help="per domain (MT-Bench has 80)")
    parser.add_argument("--eval-tokens", type=int, default=96, help="per evaluation rollout")
    parser.add_argument("--report-only", action="store_true", help="only write the table and plot of what is done")
    parser.add_argument("--docs", help="write the plot here (default: --out); the table goes to --out")
    args = parser.parse_args()
    settings = Settings(Path(args.out).resolve(), args.target, args.eval_prompts, args.eval_tokens)
    lines = LINES
    if args.target == "tiny-random":
        settings.batch_size, lines = 4, TINY_LINES
        settings.extra = ["--model.target=tiny-random", "--trainer.log_every_n_steps=1"]
    unknown = set(args.lines or []) - {line.id for line in lines}
    if unknown:
        raise SystemExit(f"--lines: no line {sorted(unknown)}; the lines are {[line.id for line in lines]}.")
    if not args.report_only:
        rollouts = evaluation_rollouts(settings)
        for line in lines:
            if args.lines and line.id not in args.lines:
                continue
            for steps in line.steps:
                if (args.max_steps is None or steps <= args.max_steps) and (not args.steps or steps in args.steps):
                    point(line, steps, rollouts, settings)
    report(settings, Path(args.docs).resolve() if args.docs else None)


if __name__ == "__main__":
    main()
