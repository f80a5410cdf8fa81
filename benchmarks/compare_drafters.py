"""Every drafter family at the quickstart budget: the same data, the same CPU time, the same evaluation.

    .venv/bin/python benchmarks/compare_drafters.py                       # every family, the quickstart's time
    .venv/bin/python benchmarks/compare_drafters.py --families dflash eagle3 --minutes 2
    .venv/bin/python benchmarks/compare_drafters.py --extra domino_auf    # + the AUF-on-Domino arm
    .venv/bin/python benchmarks/compare_drafters.py --families dflash --extra dflash_ce_decay dflash_auf
    .venv/bin/python benchmarks/compare_drafters.py --steps 200 --extra domino_auf   # equal steps, not equal time
    .venv/bin/python benchmarks/compare_drafters.py --families dflash --extra dflash_shortcut --steps 500 \
        --feature-store DIR   # the exportable default against the slot inputs, from one store written ahead

Each family trains with ``lightning-spec fit -c experiments/quickstart.yaml -c experiments/drafters/<family>.yaml``
(DFlash is the quickstart itself) in its own process, with the quickstart's ``trainer.max_time`` as the budget
for every family (``max_steps`` lifted, so the schedule runs on time and every run ends annealed; the steps each
family reached are reported) and no decode-validation. On a machine shared with other work a time budget gives
each arm whatever the load left it; ``--steps N`` trains every arm for exactly N steps instead (its schedule ends
at N) and reports the seconds each took. Then, all checkpoints together:

1. exact offline MAL on SmolLM2's greedy answers to all 80 MT-Bench prompts (96 tokens each), paired against
   DFlash with a bootstrap CI over prompts, and the per-slot acceptance AR_1, AR_2
   (``lightning-spec evaluate --mode offline``);
2. real greedy speculative decoding of 3 held-out prompts per domain (MT-Bench, HumanEval, MMATH), 48 new
   tokens, every drafter and plain decoding interleaved prompt by prompt in one process: tokens/s, speedup over
   plain, draft time per round (``lightning-spec evaluate --mode online``).

Results: a markdown table on stdout, the JSON of both evaluations and the checkpoints under ``--out``, and the
fits in the MLflow experiment ``drafters-compare`` of ./mlflow.db.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["dflash", "eagle3", "dspark", "dfly", "domino", "medusa", "mtp", "d2sd", "specblock"]
# extra arms: name -> (family overlay, more overlay text)
EXTRAS = {
    "domino_auf": ("domino", "experiments/drafters/domino_auf.yaml"),
    # AUF against the position decay on DFlash (the Domino claim of docs/reproductions.md, "AUF's support weight
    # beats the position decay on Domino"): both with CE, as the paper's pair
    "dflash_ce_decay": ("dflash", "experiments/objectives/ce_decay.yaml"),
    "dflash_auf": ("dflash", "experiments/objectives/auf.yaml"),
    # the quickstart's drafter before it became DFlash's exportable layout: EAGLE-style slot inputs (issue 24)
    "dflash_shortcut": ("dflash", "experiments/drafters/dflash_shortcut.yaml"),
}
EXPERIMENT = "drafters-compare"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def overlays(arm: str) -> list[str]:
    """The -c files of an arm: the quickstart, then the family's overlay (DFlash: none), then extras."""
    files = ["experiments/quickstart.yaml"]
    family, extra = EXTRAS.get(arm, (arm, None))
    if family != "dflash":
        files.append(f"experiments/drafters/{family}.yaml")
    if extra:
        files.append(extra)
    return files


def run(cmd: list[str], log: Path) -> None:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}); see {log}")


def fit(arm: str, minutes: float, out: Path, steps: int | None = None, store: Path | None = None) -> Path:
    """Train one arm for ``minutes`` (or exactly ``steps`` optimizer steps); returns its last.ckpt (copied to
    ``out/<arm>.ckpt``). ``store``: a feature store every arm reads (``lightning-spec features --out``), so no arm
    pays the target's forwards and arms with the same target layers share them."""
    target = out / f"{arm}.ckpt"
    if target.exists():
        print(f"{arm}: {target} exists, not retrained", flush=True)
        return target
    exe = str(Path(sys.executable).with_name("lightning-spec"))
    seconds = int(minutes * 60)
    budget = ([f"--trainer.max_steps={steps}", "--trainer.max_time=null"] if steps else
              ["--trainer.max_steps=1000000", f"--trainer.max_time=00:00:{seconds // 60:02d}:{seconds % 60:02d}"])
    features = ["--model.feature_cache=disk", f"--model.feature_store={store}"] if store else []
    cmd = [exe, "fit"] + [a for f in overlays(arm) for a in ("-c", f)] + budget + features + [
        "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.experiment_name={EXPERIMENT}", f"--trainer.logger.init_args.run_name={arm}",
        f"--trainer.default_root_dir={out / 'runs' / arm}",
    ]
    start = time.perf_counter()
    run(cmd, out / f"{arm}.fit.log")
    (last,) = sorted((out / "runs" / arm).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)[-1:]
    target.write_bytes(last.read_bytes())
    print(f"{arm}: trained in {time.perf_counter() - start:.0f} s", flush=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=FAMILIES)
    ap.add_argument("--extra", nargs="*", default=[], choices=list(EXTRAS))
    ap.add_argument("--minutes", type=float, default=None, help="training time per arm (default: the quickstart's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="train every arm for exactly this many optimizer steps instead of a time budget (results "
                         "then do not depend on the machine's load; the time each arm took is reported)")
    ap.add_argument("--feature-store", type=Path, default=None,
                    help="a feature store written ahead (lightning-spec features -c experiments/quickstart.yaml --out "
                         "DIR): every arm reads it instead of running the target (arms whose target layers differ "
                         "from the store's are refused by the fit)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "drafters-compare")
    ap.add_argument("--rollouts", type=Path, default=None, help="default: <out>/eval_mt80_g96 (made if missing)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    quick = yaml.safe_load((ROOT / "experiments" / "quickstart.yaml").read_text())
    if args.minutes is None:
        d, h, m, s = (int(x) for x in quick["trainer"]["max_time"].split(":"))
        args.minutes = ((d * 24 + h) * 60 + m) + s / 60
    exe = str(Path(sys.executable).with_name("lightning-spec"))
    rollouts = args.rollouts or args.out / "eval_mt80_g96"
    if not (rollouts / "rollouts.json").exists():
        run([exe, "rollouts", "--sources", "[mt-bench]", "--prompts_per_source", "80", "--temperature", "0",
             "--max_new_tokens", "96", "--out", str(rollouts)], args.out / "rollouts.log")

    arms = list(args.families) + list(args.extra)
    ckpts, seconds = {}, {}
    for arm in arms:
        start = time.perf_counter()
        ckpts[arm] = fit(arm, args.minutes, args.out, args.steps, args.feature_store)
        seconds[arm] = time.perf_counter() - start
    paths = "[" + ", ".join(str(ckpts[a]) for a in arms) + "]"
    names = "[" + ", ".join(arms) + "]"
    offline_json, online_json = args.out / "offline.json", args.out / "online.json"
    run([exe, "evaluate", "--mode", "offline", "--drafters", paths, "--names", names, "--rollouts", str(rollouts),
         "--temperature", "0", "--output", str(offline_json)], args.out / "offline.log")
    run([exe, "evaluate", "--mode", "online", "--drafters", paths, "--names", names, "--sources",
         "[mt-bench, humaneval, mmath]", "--prompts_per_source", "3", "--max_new_tokens", "48", "--temperature", "0",
         "--output", str(online_json)], args.out / "online.log")

    off, on = json.loads(offline_json.read_text()), json.loads(online_json.read_text())
    cmp_arms = off["comparison"]["arms"]
    budget = f"{args.steps} optimizer steps per arm" if args.steps else f"{args.minutes:g} min of training per arm"
    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads; {budget}")
    print("| drafter | steps | fit s | params | exact MAL [95% CI] | ΔMAL vs dflash [95% CI] | AR1 | AR2 "
          "| draft ms/round | tok/s | speedup |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for arm in arms:
        step = torch.load(ckpts[arm], map_location="cpu", weights_only=True)["global_step"]
        c, o, a = cmp_arms[arm], on["arms"][arm], off["arms"][arm]
        delta = "—" if arm == arms[0] else (f"{c['delta_mal']:+.3f} [{c['delta_mal_ci'][0]:+.3f}, "
                                            f"{c['delta_mal_ci'][1]:+.3f}]")
        ar = a["accept_rate"] + [float("nan")] * 2
        print(f"| {arm} | {step} | {seconds[arm]:.0f} | {o['parameters'] / 1e6:.1f} M | "
              f"{c['mal']:.3f} [{c['mal_ci'][0]:.3f}, {c['mal_ci'][1]:.3f}] | {delta} | {ar[0]:.2f} | {ar[1]:.2f} | "
              f"{o['draft_ms_per_round']:.1f} | {o['tokens_per_s']:.1f} | {o['speedup']:.2f}x |")
    print(f"plain decoding: {on['plain']['tokens_per_s']:.1f} tokens/s (same prompts, same process)")


if __name__ == "__main__":
    main()
