"""The testbed drafter: the recipe the learning curve (docs/learning_curve.md) says buys the most MAL per CPU-hour
here, trained once, scored exactly and timed against plain decoding and n-gram lookup (``make testbed``).

    .venv/bin/python benchmarks/testbed.py                              # the curve's recipe, into ./testbed
    .venv/bin/python benchmarks/testbed.py --steps 8000                 # longer
    .venv/bin/python benchmarks/testbed.py --regenerate 400 --family dflash --steps 600 --max-length 512  # the old one
    .venv/bin/python benchmarks/testbed.py --regenerate 5638 --compare-sharegpt --steps 2000   # do own answers help?

The recipe (defaults): EAGLE-3 (``experiments/drafters/eagle3.yaml`` over the quickstart: 1 layer, K = 8, the
2048-token draft head, KL with the quickstart's decay) on ShareGPT's own conversations, the first 8000 rows read
(``data.train_limit``: ~5.6k conversations, 160 tokens each), 4000 steps of batch 8 (~5.7 epochs). On the curve,
EAGLE-3 beat the quickstart's DFlash by +0.089 MAL at equal steps and cost, and 5.6k conversations kept paying
where 0.8k overfit past 1000 steps; a larger draft head and a second layer bought nothing.

Each step writes into ``--out`` (the feature store into the cache folder, keyed as every store is, so a second
recipe over the same data reads it) and is skipped when its output is there, so a killed recipe rerun continues:

1. ``mtbench-greedy``: the target's greedy answers to the 80 MT-Bench prompts (``--eval-tokens`` each), drawn by our
   own engine so that they are exactly what plain greedy decoding gives: the exact offline evaluation's rollouts;
2. with ``--regenerate N`` only: the target's greedy answers to N ShareGPT prompts (first turns of at most 256
   tokens, ``--max-new-tokens`` each), trained on instead of ShareGPT's answers. They are read from the kept archive
   ``regenerated/<target>-sharegpt-greedy-<N>.rollouts.jsonl.gz`` (``--kept``) when the repository has it (5,638
   are kept); otherwise vLLM's server draws them into ``sharegpt-regen`` (``serve_target.py``, ``make serve-setup``;
   bf16 where the CPU multiplies it natively: 5.6k answers take ~32 min on a 2-core AMX Xeon) and they are packed
   into that archive, to be committed;
3. the feature store (``lightning-spec features``; the cache folder's, or ``--store``);
4. ``fit``: ``--steps`` steps, no time budget, no decoding during training;
5. exact offline MAL on ``mtbench-greedy``, as a chain and as trees (``lightning-spec evaluate --mode offline``);
6. real greedy decoding against plain decoding on 6 MT-Bench prompts (``decode_speed.py`` with a tree ``--plan``: the
   chain, the drafter's tree, n-gram lookup alone as a chain and a trie, the drafter's tree with n-gram nodes, and
   decoding auto's pick), fp32 and, where the CPU multiplies bf16 natively, bf16; with the ratios the goals of issue
   33 are stated in (best tree against plain, the tree with n-gram nodes against n-grams alone).

With ``--compare-sharegpt`` (docs/reproductions.md, "Training on the target's own answers beats the dataset's answers
to the same prompts") the same drafter, objective and steps also train on ShareGPT's own answers to the regenerated
prompts, cut to the same token budget (``sharegpt-answers.jsonl``), and the arms are compared on the target's greedy
answers to 80 MT-Bench, 80 HumanEval and 80 MMATH prompts (``heldout-greedy``), paired over prompts, per domain, with
AR_1 and AR_2 and each arm's CPU-hours; ``--mixed`` adds an arm trained on both sets of answers.

The figures go to stdout and ``<out>/summary.json`` (with the CPU-seconds of every step, from the children's
rusage); the logs of every step to ``<out>/logs``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from learning_curve import FAMILY_CONFIGS, losses, run  # this folder is on sys.path when the script runs
from lightning_spec.data.rollout_archive import SUFFIX as ARCHIVE_SUFFIX
from objective_memory import cpu_name
from serve_target import ROOT, start, stop

LS = [sys.executable, "-m", "lightning_spec"]
KEPT = ROOT / "regenerated"  # regenerations kept in the repository (gzip-compressed token ids and their record)
# --target tiny-random: the packaged tiny random target at toy sizes, for the recipe's test (seconds, not hours)
TINY = ["--model.target=tiny-random", "--model.drafter.init_args.draft_vocab_size=64",
        "--model.drafter.init_args.block_size=4", "--data.batch_size=4", "--trainer.log_every_n_steps=1"]


def step(name: str, cmd: list[str], logs: Path, cpu: dict[str, float] | None = None) -> str:
    """``learning_curve.run`` (its log written as it comes, to ``logs/<name>.log``), its CPU-seconds into ``cpu``;
    its output, or the recipe stops when it fails."""
    text, _, seconds = run(name, cmd, logs, tag="testbed")
    if cpu is not None:
        cpu[name] = seconds
    return text


def sharegpt_answers(regen: Path, path: Path) -> int:
    """ShareGPT's own first answers to the prompts the target answered in ``regen`` (a rollouts folder or a kept
    archive), as a JSONL of conversations, each cut to the regeneration's ``max_new_tokens`` tokens as the target's
    answers were: equal answer budgets."""
    from lightning_spec.data.prompts import opening
    from lightning_spec.data.rollouts import load_rollouts
    from lightning_spec.data.sources import load_source
    from lightning_spec.target_loading import load_tokenizer

    ds, meta = load_rollouts(regen)
    ids, tokenizer = set(ds["prompt_id"]), load_tokenizer(meta["target"])
    rows = []
    for row in load_source("sharegpt", limit=None):
        if row["id"] in ids:
            ids.discard(row["id"])  # ShareGPT repeats some ids: the first, as the prompt selection
            first = opening(row)
            if len(row["messages"]) > len(first):  # a conversation without an answer has nothing to compare
                answer = row["messages"][len(first)]
                cut = tokenizer(answer["content"], add_special_tokens=False)["input_ids"][: meta["max_new_tokens"]]
                rows.append({"id": row["id"], "messages": [*first, {**answer, "content": tokenizer.decode(cut)}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def recipe(args: argparse.Namespace, sources: Path | str, store: str | None) -> list[str]:
    """The fit's configuration: the quickstart, the family's overlay, ``experiments/testbed.yaml``, and the data, steps
    and store of this run. Without ``--regenerate`` the rows are ShareGPT's first ``--rows``; regenerated answers are
    read whole."""
    out = ["-c", "experiments/quickstart.yaml", *FAMILY_CONFIGS[args.family], "-c", "experiments/testbed.yaml",
           f"--data.train_sources=[{sources}]", f"--data.max_length={args.max_length}",
           f"--data.train_limit={'null' if args.regenerate or not args.rows else args.rows}",
           f"--trainer.max_steps={args.steps}", "--trainer.check_val_every_n_epoch=null",
           f"--trainer.val_check_interval={args.steps}"]  # the held-out loss once, at the last step
    return out + (TINY if args.target == "tiny-random" else []) + ([f"--model.feature_store={store}"] if store else [])


def train(name: str, overlay: list[str], out: Path, logs: Path, cpu: dict[str, float], tracking_uri: str,
          summary: dict | None = None) -> Path:
    """The store (computing only what it misses; a store another run completed costs nothing here) and the fit of
    ``overlay``; ``<out>/<name>.ckpt`` links to the checkpoint, and a rerun finds it there. A fit that ran puts its
    MLflow run and its training and held-out losses into ``summary``."""
    earlier = cpu.get(f"features-{name}")
    text = step(f"features-{name}", [*LS, "features", *overlay, "--progress=false"], logs, cpu)
    if re.search(r"^features: 0 of", text, flags=re.M) and earlier is not None:
        cpu[f"features-{name}"] = earlier  # complete already: what computing it cost stays its figure
    checkpoint = out / f"{name}.ckpt"
    if not checkpoint.exists():
        text = step(f"fit-{name}", [*LS, "fit", *overlay, f"--trainer.default_root_dir={out / 'runs'}",
                                    "--trainer.logger.init_args.experiment_name=testbed",
                                    f"--trainer.logger.init_args.tracking_uri={tracking_uri}"], logs, cpu)
        found = re.findall(r"^checkpoint: (\S+)", text, flags=re.M)
        if not found:
            raise SystemExit(f"[testbed] fit-{name} printed no checkpoint; see {logs / f'fit-{name}.log'}")
        checkpoint.symlink_to(Path(found[-1]).resolve())
        run = re.findall(r"^MLflow run: (\w+)", text, flags=re.M)
        if summary is not None and run:
            summary["fit"] = {"mlflow_run": run[-1], **losses(tracking_uri, run[-1])}
    return checkpoint


def kept_path(args: argparse.Namespace) -> Path:
    """Where the regeneration of ``--regenerate N`` prompts is kept in the repository (``--kept`` overrides it)."""
    return Path(args.kept) if args.kept else KEPT / f"{args.target}-sharegpt-greedy-{args.regenerate}{ARCHIVE_SUFFIX}"


def check_kept(kept: Path, args: argparse.Namespace) -> None:
    """A kept regeneration must be what ``--regenerate`` asks for: the target, greedy, the prompt count and the
    answer budget; anything else is one sentence naming the option."""
    from lightning_spec.data.rollout_archive import read_header

    header = read_header(kept)
    meta = header["rollouts"]
    prompts = header["rows"] // max(1, meta.get("n_per_prompt", 1))
    wanted = {"target": args.target, "temperature": 0.0, "prompts": args.regenerate,
              "max_new_tokens": args.max_new_tokens}
    found = {"target": meta.get("target"), "temperature": float(meta["sampling"]["temperature"]), "prompts": prompts,
             "max_new_tokens": meta.get("max_new_tokens")}
    for name, value in wanted.items():
        if found[name] != value:
            raise SystemExit(f"[testbed] {kept} holds {name} {found[name]!r}, not the {value!r} this run asks for; "
                             "pass the --regenerate/--max-new-tokens it was drawn with, or another --kept path.")


def regenerate(args: argparse.Namespace, out: Path, logs: Path, summary: dict) -> Path:
    """The target's greedy answers to ``--regenerate`` ShareGPT prompts: the kept archive when the repository has it
    (nothing is drawn), else drawn by vLLM's server (started for this step only, in ``--serve-dtype``) into
    ``<out>/sharegpt-regen`` and packed into the kept archive, with how it was drawn, for the next machine."""
    from lightning_spec.data.rollout_archive import write_archive
    from lightning_spec.target_loading import load_target

    kept = kept_path(args)
    if kept.exists():
        check_kept(kept, args)
        return kept
    regen, log = out / "sharegpt-regen", logs / "sharegpt-regen.log"
    if not (regen / "rollouts.json").exists():
        if not Path(args.python).exists():
            raise SystemExit(f"[testbed] no kept regeneration of {args.regenerate} prompts ({kept}) and no vLLM at "
                             f"{args.python} to draw one: run `make serve-setup`, or pass --regenerate with a kept "
                             "count (ls regenerated/).")
        serve = argparse.Namespace(python=args.python, target="smollm2-135m-instruct", name=None, port=args.port,
                                   dtype=args.serve_dtype, max_model_len=2048, max_num_seqs=args.concurrency,
                                   kv_gb=4, start_timeout=600, log=str(logs / "vllm.log"))
        logs.mkdir(parents=True, exist_ok=True)
        proc, url = start(serve)
        try:
            step("sharegpt-regen", [*LS, "rollouts", "--backend=server", f"--server_url={url}",
                                    f"--concurrency={args.concurrency}", "--sources=[sharegpt]",
                                    f"--prompts_per_source={args.regenerate}", "--max_prompt_tokens=256",
                                    "--max_turns=1", "--temperature=0", f"--max_new_tokens={args.max_new_tokens}",
                                    f"--out={regen}"], logs)
        finally:
            stop(proc)
    rate = re.findall(r"at ([0-9.]+) tokens/s", log.read_text()) if log.exists() else []
    summary["regeneration_tokens_per_s"] = float(rate[-1]) if rate else None
    version = subprocess.run([args.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip() or None
    write_archive(regen, kept, target=load_target(args.target), provenance={
        "engine": {"name": "vllm", "version": version, "dtype": args.serve_dtype, "max_num_seqs": args.concurrency,
                   "concurrency": args.concurrency, "max_prompt_tokens": 256, "max_turns": 1},
        "cpu": cpu_name(), "tokens_per_s": summary["regeneration_tokens_per_s"],
        "drawn_by": "benchmarks/testbed.py --regenerate"})
    print(f"[testbed] the regeneration is kept in {kept} ({kept.stat().st_size / 1e6:.1f} MB): commit it, and the "
          "next machine trains on it without vLLM", flush=True)
    return kept


def speed_goals(modes: list[dict]) -> dict:
    """The ratios the goals are stated in, from decode_speed's table: the drafter's best tree against plain, and the
    drafter's tree with n-gram nodes against n-gram lookup alone (its faster of chain and trie)."""
    by = {m["mode"]: m for m in modes}
    trees = [m for m in modes if m["mode"].startswith(("tree (", "tree + n-gram"))]
    ngram = [m for m in modes if m["mode"].startswith(("n-gram lookup", "n-gram trie"))]
    merged = [m for m in modes if m["mode"].startswith("tree + n-gram")]
    best = max(trees, key=lambda m: m["tokens_per_s"], default=None)
    alone = max(ngram, key=lambda m: m["tokens_per_s"], default=None)
    return {"plain_tokens_per_s": by["plain"]["tokens_per_s"],
            "chain": next((m["vs_plain"] for m in modes if m["mode"].startswith("chain")), None),
            "best_tree": best and {"mode": best["mode"], "vs_plain": best["vs_plain"]},
            "tree_with_ngram_vs_ngram": merged and alone and merged[0]["tokens_per_s"] / alone["tokens_per_s"],
            "auto": next(({"mode": m["mode"], "vs_plain": m["vs_plain"]} for m in modes
                          if m["mode"].startswith("auto")), None)}


def compare_sharegpt(args, out: Path, regenerated_source: Path, regenerated: Path, logs: Path, cpu: dict) -> dict:
    """The same fit on ShareGPT's answers to the same prompts (and with ``--mixed`` on both sets of answers), and the
    paired offline comparison on the target's greedy answers to MT-Bench, HumanEval and MMATH (``--eval-prompts``
    each): MAL overall and per domain with paired 95% CIs against the ShareGPT arm, and acceptance per slot."""
    answers = out / "sharegpt-answers.jsonl"
    if not answers.exists():
        sharegpt_answers(regenerated_source, answers)
    arms = {"sharegpt": train("drafter-sharegpt", recipe(args, answers, args.store and f"{args.store}-sharegpt"), out,
                              logs, cpu, args.tracking_uri),
            "regenerated": regenerated}
    if args.mixed:
        arms["mixed"] = train("drafter-mixed", recipe(args, f"{regenerated_source}, {answers}",
                                                      args.store and f"{args.store}-mixed"), out, logs, cpu,
                              args.tracking_uri)
    heldout = out / "heldout-greedy"
    if not (heldout / "rollouts.json").exists():
        step("heldout-greedy", [*LS, "rollouts", f"--target={args.target}", "--sources=[mt-bench, humaneval, mmath]",
                                f"--prompts_per_source={args.eval_prompts}", "--temperature=0",
                                f"--max_new_tokens={args.eval_tokens}", "--batch_size=16", f"--out={heldout}",
                                "--progress=false"], logs, cpu)
    report = out / "regeneration_vs_sharegpt.json"
    step("offline-sharegpt", [*LS, "evaluate", "--mode=offline", f"--rollouts={heldout}",
                              f"--drafters=[{', '.join(map(str, arms.values()))}]", f"--names=[{', '.join(arms)}]",
                              "--baseline=sharegpt", f"--output={report}", "--progress=false"], logs)
    result = json.loads(report.read_text())
    return {"rollouts": result["comparison"]["rows"],
            "arms": {name: {"mal": arm["mal"], "mal_by_domain": arm["mal_by_domain"],
                            "accept_rate": arm["accept_rate"][:2]} for name, arm in result["arms"].items()},
            "cpu_hours": {name: (cpu.get(f"features-{step_name}", 0.0) + cpu.get(f"fit-{step_name}", 0.0)) / 3600
                          for name, step_name in (("sharegpt", "drafter-sharegpt"), ("regenerated", "drafter"),
                                                  ("mixed", "drafter-mixed")) if name in arms},
            "comparison": result["comparison"]}


def comparison_table(result: dict, cpu: str) -> str:
    """The own-answers comparison as markdown rows: MAL per arm overall and per domain, its paired difference from
    the ShareGPT arm with the 95% CI, AR_1 and AR_2, and the arm's CPU-hours (store + fit)."""
    comparison = result["comparison"]
    lines = [f"exact offline MAL on {result['rollouts']} greedy held-out rollouts ({cpu}); Δ paired against sharegpt",
             "| arm | MAL | Δ [95% CI] | " + " | ".join(comparison["by_domain"]) + " | AR_1 | AR_2 | CPU-h |",
             "|---" * (6 + len(comparison["by_domain"])) + "|"]
    for name, arm in result["arms"].items():
        row = comparison["arms"][name]
        delta = "-" if name == comparison["baseline"] else \
            f"{row['delta_mal']:+.3f} [{row['delta_mal_ci'][0]:+.3f}, {row['delta_mal_ci'][1]:+.3f}]"
        domains = [f"{comparison['by_domain'][d][name]['mal']:.3f}" for d in comparison["by_domain"]]
        rates = [f"{r:.3f}" for r in arm["accept_rate"]]
        lines.append(f"| {name} | {arm['mal']:.3f} | {delta} | {' | '.join(domains)} | {' | '.join(rates)} | "
                     f"{result['cpu_hours'].get(name, 0.0):.2f} |")
    return "\n".join(lines)


def goals(summary: dict, native: bool) -> str:
    """The figures against issue 33's goals (the speed goal in bf16 where the CPU multiplies it natively, else fp32)."""
    chain = summary["offline"]["chain"]
    dtype = "bfloat16" if native else "float32"
    speed = summary.get(f"speed_{dtype}") or {}
    best, merged = speed.get("best_tree"), speed.get("tree_with_ngram_vs_ngram")
    rows = [("exact chain MAL, MT-Bench", f"{chain['mal']:.3f} [{chain['mal_ci'][0]:.3f}, {chain['mal_ci'][1]:.3f}]",
             ">= 2.0", chain["mal"] >= 2.0),
            ("CPU-hours, store (0 when cached) + fit", f"{summary['train_cpu_hours']:.2f}",
             "<= 3 (2-core Zen 4-class)", summary["train_cpu_hours"] <= 3),
            (f"best tree / plain, {dtype}", best and f"{best['vs_plain']:.2f}x ({best['mode']})",
             ">= 1.5x" if native else ">= 1.3x", best and best["vs_plain"] >= (1.5 if native else 1.3)),
            (f"tree with n-gram nodes / n-grams alone, {dtype}", merged and f"{merged:.2f}x", ">= 1.2x",
             merged and merged >= 1.2)]
    lines = [f"goals ({summary['cpu']}):"]
    for name, value, goal, met in rows:
        verdict = "not measured" if value is None else "reached" if met else "not reached"
        lines.append(f"  {name:<50}  {value or '-':<40}  {goal:<28}  {verdict}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="testbed")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="tiny-random: the packaged tiny target at toy sizes (the recipe's test)")
    parser.add_argument("--family", choices=sorted(FAMILY_CONFIGS), default="eagle3")
    parser.add_argument("--rows", type=int, default=8000, help="ShareGPT rows read (data.train_limit; 0: all)")
    parser.add_argument("--max-length", type=int, default=160, help="tokens kept per conversation")
    parser.add_argument("--steps", type=int, default=4000, help="training steps (batch 8)")
    parser.add_argument("--store", help="the feature store's folder (default: the cache folder's, by its key)")
    parser.add_argument("--regenerate", type=int, default=0,
                        help="train on the target's answers to this many ShareGPT prompts, drawn by vLLM (0: on "
                             "ShareGPT's own answers)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per regenerated answer")
    parser.add_argument("--eval-tokens", type=int, default=96, help="per MT-Bench evaluation rollout")
    parser.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench prompts for the exact evaluation")
    parser.add_argument("--speed-prompts", type=int, default=6, help="MT-Bench prompts decoded for the speed table")
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens per prompt for the speed table")
    parser.add_argument("--speed-tree", default="{kind: tree, nodes: 8, top_k: 4}",
                        help="decode_speed.py --plan: the timed tree, a decoding plan")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow's, for the fits")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--python", default=str(ROOT / ".venv-serve" / "bin" / "python"), help="the serving venv's")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--compare-sharegpt", action="store_true",
                        help="with --regenerate: also train on ShareGPT's answers to the same prompts")
    parser.add_argument("--mixed", action="store_true",
                        help="with --compare-sharegpt: a third arm trained on both the target's and ShareGPT's answers")
    parser.add_argument("--kept", help="the kept regeneration (.rollouts.jsonl.gz) to train on or to write (default: "
                                       "regenerated/<target>-sharegpt-greedy-<N>.rollouts.jsonl.gz)")
    parser.add_argument("--serve-dtype", choices=["float32", "bfloat16"],
                        help="vLLM's dtype for drawing a regeneration (default: bfloat16 where the CPU multiplies it "
                             "natively, else float32)")
    parser.add_argument("--no-speed", action="store_true", help="skip step 6 (it wants a machine doing nothing else)")
    args = parser.parse_args()
    from lightning_spec.target_loading import native_bf16

    args.serve_dtype = args.serve_dtype or ("bfloat16" if native_bf16() else "float32")
    if args.regenerate and args.target != "smollm2-135m-instruct" and not Path(kept_path(args)).exists():
        parser.error("--regenerate draws through vLLM serving the packaged SmolLM2: drop --target, or pass --kept "
                     "with a regeneration of this target.")
    if args.compare_sharegpt and not args.regenerate:
        parser.error("--compare-sharegpt compares regenerated answers with ShareGPT's: pass --regenerate N too.")
    if args.mixed and not args.compare_sharegpt:
        parser.error("--mixed is the third arm of --compare-sharegpt: pass --compare-sharegpt too.")
    out = Path(args.out).resolve()
    logs = out / "logs"
    previous = out / "summary.json"  # a rerun keeps the figures of the steps it skips
    summary = {**(json.loads(previous.read_text()) if previous.exists() else {}), "cpu": cpu_name()}
    cpu = summary.setdefault("cpu_seconds", {})  # per step that ran (a skipped step keeps its earlier figure)
    summary["recipe"] = {k: getattr(args, k) for k in ("family", "rows", "max_length", "steps", "regenerate")}
    started = time.perf_counter()

    def save() -> None:  # after every stage: a killed or failed recipe keeps the figures of what it finished
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))

    evaluation = out / "mtbench-greedy"
    if not (evaluation / "rollouts.json").exists():
        step("mtbench-greedy", [*LS, "rollouts", f"--target={args.target}", "--sources=[mt-bench]",
                                f"--prompts_per_source={args.eval_prompts}",
                                "--temperature=0", f"--max_new_tokens={args.eval_tokens}", "--batch_size=16",
                                f"--out={evaluation}", "--progress=false"], logs, cpu)
    sources = regenerate(args, out, logs, summary) if args.regenerate else "sharegpt"
    checkpoint = train("drafter", recipe(args, sources, args.store), out, logs, cpu, args.tracking_uri, summary)
    summary["train_cpu_hours"] = sum(cpu.get(k, 0.0) for k in ("features-drafter", "fit-drafter")) / 3600
    save()
    report = out / "offline.json"
    plans = ("[chain, {kind: tree, nodes: 8, top_k: 4}, {kind: tree, nodes: 16, top_k: 4}, "
             "{kind: tree, nodes: 32, top_k: 6}]")
    if not report.exists() or report.stat().st_mtime < checkpoint.resolve().stat().st_mtime:
        step("offline", [*LS, "evaluate", "--mode=offline", f"--rollouts={evaluation}",
                         f"--drafters=[{checkpoint}, {checkpoint}, {checkpoint}, {checkpoint}]",
                         "--names=[chain, tree8, tree16, tree32]", f"--decodings={plans}", f"--output={report}",
                         "--progress=false"], logs, cpu)
    result = json.loads(report.read_text())
    summary["offline"] = {name: {"mal": arm["mal"], "mal_ci": result["comparison"]["arms"][name]["mal_ci"]}
                          for name, arm in result["arms"].items()}
    summary["offline_accept_rate"] = result["arms"]["chain"]["accept_rate"]
    save()
    for dtype in ([] if args.no_speed else ["float32"] + (["bfloat16"] if native_bf16() else [])):
        table = out / f"speed-{dtype}.json"
        text = step(f"speed-{dtype}", [sys.executable, "benchmarks/decode_speed.py", f"--drafter={checkpoint}",
                                       f"--target={args.target}", f"--plan={args.speed_tree}", "--no-peers",
                                       f"--prompts={args.speed_prompts}", f"--max-new-tokens={args.speed_tokens}",
                                       f"--dtype={dtype}", f"--json={table}"], logs)
        summary[f"speed_{dtype}"] = speed_goals(json.loads(table.read_text())["modes"])
        save()
        print(text[text.find("every mode of our engine"):][:2500])
    if args.compare_sharegpt:
        summary["regeneration_vs_sharegpt"] = compare_sharegpt(args, out, sources, checkpoint, logs, cpu)
        save()
        print(comparison_table(summary["regeneration_vs_sharegpt"], summary["cpu"]))
    summary["minutes"] = (time.perf_counter() - started) / 60  # this run's: a resumed recipe skips what was done
    save()
    print(json.dumps({k: v for k, v in summary.items() if k != "cpu_seconds"}, indent=2))
    print(goals(summary, native_bf16()))


if __name__ == "__main__":
    main()
