"""The testbed drafter: SmolLM2's own answers through vLLM, the feature store, training, and the figures that say
whether speculative decoding pays (``make testbed``, about an hour on 2 cores).

    .venv/bin/python benchmarks/testbed.py                     # everything, into ./testbed
    .venv/bin/python benchmarks/testbed.py --prompts 200 --steps 300 --out testbed-small

Each step writes into ``--out`` and is skipped when its output is there, so a killed recipe rerun continues (the
rollouts and the store also resume within a step; the speed measurement always runs, unless ``--no-speed``):

1. ``mtbench-greedy``: the target's greedy answers to the 80 MT-Bench prompts (``--eval-tokens`` each), drawn by our
   own engine so that they are exactly what plain greedy decoding gives: the exact offline evaluation's rollouts;
2. ``sharegpt-regen``: its greedy answers to ``--prompts`` ShareGPT prompts (first turns of at most 256 tokens,
   ``--max-new-tokens`` each), drawn by vLLM's server (``serve_target.py``, started for this step only);
3. the feature store of those conversations (``lightning-spec features``);
4. ``fit``: the quickstart's drafter with ``experiments/testbed.yaml`` (the regenerated answers, the store, ``--steps``
   steps, no time budget);
5. exact offline MAL on ``mtbench-greedy``, as a chain and as trees (``lightning-spec evaluate --mode offline``);
6. real greedy decoding speed against plain decoding, chain and tree, on 6 MT-Bench prompts
   (``decode_speed.py``, fp32 and, where the CPU multiplies bf16 natively, bf16).

With ``--compare-sharegpt`` (does regeneration help? docs/reproductions.md, "Training on the target's own answers
beats the dataset's answers to the same prompts") the same drafter, objective and steps also train on ShareGPT's
own answers to the same prompts, cut to the same token budget (``sharegpt-answers.jsonl``, its own store), and the
two are compared on ``mtbench-greedy``, paired over prompts.

The figures go to stdout and ``<out>/summary.json``; the logs of every step to ``<out>/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from objective_memory import cpu_name  # this folder is on sys.path when the script runs
from serve_target import ROOT, start, stop

LS = [sys.executable, "-m", "lightning_spec"]


def step(name: str, cmd: list[str], logs: Path, env: dict | None = None) -> str:
    """Run one step, its output teed to ``logs/<name>.log``; stop the recipe when it fails."""
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[testbed] {name}: {' '.join(cmd)}", flush=True)
    start_time = time.perf_counter()
    with open(logs / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        log.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"[testbed] {name} failed ({proc.returncode}); see {logs / f'{name}.log'}")
    print(f"[testbed] {name}: done in {time.perf_counter() - start_time:.0f} s", flush=True)
    return proc.stdout


def sharegpt_answers(regen: Path, path: Path) -> int:
    """ShareGPT's own first answers to the prompts the target answered in ``regen``, as a JSONL of conversations,
    each cut to the regeneration's ``max_new_tokens`` tokens as the target's answers were: equal answer budgets."""
    from transformers import AutoTokenizer

    from lightning_spec.data.prompts import opening
    from lightning_spec.data.rollouts import load_rollouts
    from lightning_spec.data.sources import load_source

    ds, meta = load_rollouts(regen)
    ids, tokenizer = set(ds["prompt_id"]), AutoTokenizer.from_pretrained(meta["tokenizer"])
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


def compare_sharegpt(args, out: Path, overlay: list[str], evaluation: Path, regenerated: Path, logs: Path) -> dict:
    """The same fit on ShareGPT's answers to the same prompts, and the paired offline comparison."""
    answers = out / "sharegpt-answers.jsonl"
    if not answers.exists():
        sharegpt_answers(out / "sharegpt-regen", answers)
    arm = [*overlay[:4], f"--data.train_sources=[{answers}]", f"--trainer.max_steps={args.steps}",
           f"--model.feature_store={out / 'features-sharegpt'}"]
    step("features-sharegpt", [*LS, "features", *arm, "--progress=false"], logs)
    checkpoint = out / "drafter-sharegpt.ckpt"
    if not checkpoint.exists():
        text = step("fit-sharegpt", [*LS, "fit", *arm, f"--trainer.default_root_dir={out / 'runs'}",
                                     "--trainer.logger.init_args.experiment_name=testbed"], logs)
        checkpoint.symlink_to(Path(re.findall(r"^checkpoint: (\S+)", text, flags=re.M)[-1]).resolve())
    report = out / "regeneration_vs_sharegpt.json"
    step("offline-sharegpt", [*LS, "evaluate", "--mode=offline", f"--rollouts={evaluation}",
                              f"--drafters=[{checkpoint}, {regenerated}]", "--names=[sharegpt, regenerated]",
                              f"--output={report}"], logs)
    result = json.loads(report.read_text())
    return {"arms": {name: arm["mal"] for name, arm in result["arms"].items()}, "comparison": result["comparison"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="testbed")
    parser.add_argument("--prompts", type=int, default=400, help="ShareGPT prompts to regenerate")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per regenerated answer")
    parser.add_argument("--eval-tokens", type=int, default=96, help="per MT-Bench evaluation rollout")
    parser.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench prompts for the exact evaluation")
    parser.add_argument("--steps", type=int, default=600, help="training steps")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--python", default=str(ROOT / ".venv-serve" / "bin" / "python"), help="the serving venv's")
    parser.add_argument("--port", type=int, default=8012)
    parser.add_argument("--compare-sharegpt", action="store_true", help="also train on ShareGPT's answers")
    parser.add_argument("--no-speed", action="store_true", help="skip step 6 (it wants a machine doing nothing else)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    logs = out / "logs"
    previous = out / "summary.json"  # a rerun keeps the figures of the steps it skips
    summary = {**(json.loads(previous.read_text()) if previous.exists() else {}), "cpu": cpu_name()}
    overlay = ["-c", "experiments/quickstart.yaml", "-c", "experiments/testbed.yaml",
               f"--data.train_sources=[{out / 'sharegpt-regen'}]", f"--trainer.max_steps={args.steps}",
               f"--model.feature_store={out / 'features'}"]
    started = time.perf_counter()

    evaluation = out / "mtbench-greedy"
    if not (evaluation / "rollouts.json").exists():
        step("mtbench-greedy", [*LS, "rollouts", "--sources=[mt-bench]", f"--prompts_per_source={args.eval_prompts}",
                                "--temperature=0", f"--max_new_tokens={args.eval_tokens}", "--batch_size=16",
                                f"--out={evaluation}"], logs)
    regen = out / "sharegpt-regen"
    if not (regen / "rollouts.json").exists():
        serve = argparse.Namespace(python=args.python, target="smollm2-135m-instruct", name=None, port=args.port,
                                   dtype="float32", max_model_len=2048, max_num_seqs=args.concurrency, kv_gb=4,
                                   start_timeout=600, log=str(logs / "vllm.log"))
        logs.mkdir(parents=True, exist_ok=True)
        proc, url = start(serve)
        try:
            text = step("sharegpt-regen", [*LS, "rollouts", "--backend=server", f"--server_url={url}",
                                           f"--concurrency={args.concurrency}", "--sources=[sharegpt]",
                                           f"--prompts_per_source={args.prompts}", "--max_prompt_tokens=256",
                                           "--max_turns=1", "--temperature=0",
                                           f"--max_new_tokens={args.max_new_tokens}", f"--out={regen}"], logs)
        finally:
            stop(proc)
        rate = re.search(r"at ([0-9.]+) tokens/s", text)
        summary["regeneration_tokens_per_s"] = float(rate.group(1)) if rate else None
    step("features", [*LS, "features", *overlay, "--progress=false"], logs)  # computes only what is missing
    checkpoint = out / "drafter.ckpt"
    if not checkpoint.exists():
        text = step("fit", [*LS, "fit", *overlay, f"--trainer.default_root_dir={out / 'runs'}",
                            "--trainer.logger.init_args.experiment_name=testbed"], logs)
        found = re.findall(r"^checkpoint: (\S+)", text, flags=re.M)
        if not found:
            raise SystemExit(f"[testbed] fit printed no checkpoint; see {logs / 'fit.log'}")
        checkpoint.symlink_to(Path(found[-1]).resolve())
    report = out / "offline.json"
    trees = "[null, {nodes: 8, top_k: 4}, {nodes: 16, top_k: 4}, {nodes: 32, top_k: 6}]"
    if not report.exists() or report.stat().st_mtime < checkpoint.resolve().stat().st_mtime:
        step("offline", [*LS, "evaluate", "--mode=offline", f"--rollouts={evaluation}",
                     f"--drafters=[{checkpoint}, {checkpoint}, {checkpoint}, {checkpoint}]",
                         "--names=[chain, tree8, tree16, tree32]", f"--trees={trees}", f"--output={report}"], logs)
    summary["offline"] = {name: arm["mal"] for name, arm in json.loads(report.read_text())["arms"].items()}
    summary["offline_accept_rate"] = json.loads(report.read_text())["arms"]["chain"]["accept_rate"]
    from lightning_spec.target import native_bf16

    for dtype in ([] if args.no_speed else ["float32"] + (["bfloat16"] if native_bf16() else [])):
        text = step(f"speed-{dtype}", [sys.executable, "benchmarks/decode_speed.py", f"--drafter={checkpoint}",
                                       "--tree=8,4", "--no-peers", "--prompts=6", "--max-new-tokens=64",
                                       f"--dtype={dtype}"], logs)
        summary[f"speed_{dtype}"] = text[text.find("tokens  rounds"):][:1500]
        print(text[text.find("tokens  rounds"):][:1500])
    if args.compare_sharegpt:
        summary["regeneration_vs_sharegpt"] = compare_sharegpt(args, out, overlay, evaluation, checkpoint, logs)
    summary["minutes"] = (time.perf_counter() - started) / 60
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("speed")}, indent=2))


if __name__ == "__main__":
    main()
