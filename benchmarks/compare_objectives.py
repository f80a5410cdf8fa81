"""Same budget, same seed, same data: greedy MAL per domain after training with each objective.

    .venv/bin/python benchmarks/compare_objectives.py --steps 150
    .venv/bin/python benchmarks/compare_objectives.py --objectives ce_uniform kl_decay edr --steps 300

Each run is ``lightning-spec fit -c experiments/quickstart.yaml -c experiments/objectives/<name>.yaml`` (the
quickstart setting with only the objective changed) in its own process, plus a third ``-c`` file with this
benchmark's changes: a fixed number of optimizer steps instead of the quickstart's time budget, the target
features cached on disk (computed by the first run, reused by the others), and one decode-validation at the end
(greedy, held-out prompts). Results go to the MLflow experiment ``objectives-compare`` in ./mlflow.db and to a
printed table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["ce_uniform", "ce_decay", "kl_decay", "lk_lambda", "auf", "e2e", "edr"]
EXPERIMENT = "objectives-compare"
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def overrides(name: str, steps: int, prompts: int, max_new_tokens: int) -> dict:
    """The last ``-c`` file of a run: what this benchmark changes in the quickstart setting. Its callbacks list
    states the quickstart's one callback in full (a list entry merges with the base's only when both lists have
    the same length)."""
    validation = {
        "class_path": "lightning_spec.callbacks.SpecDecodeValidation",
        "init_args": {"prompts_per_domain": prompts, "max_new_tokens": max_new_tokens,
                      "sampling": [{"temperature": 0.0}], "measure_speedup": False, "before_training": False,
                      "print_summary": False},
    }
    logger = {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"experiment_name": EXPERIMENT, "tracking_uri": "sqlite:///mlflow.db", "run_name": name},
    }
    return {
        "trainer": {"max_steps": steps, "max_time": None, "max_epochs": -1, "logger": logger,
                    "callbacks": [validation]},
        "model": {"feature_cache": "disk"},
    }


def fit_args(name: str, overrides_file: str) -> list[str]:
    """``fit`` with the quickstart, the objective's overlay and this benchmark's overrides, in that order."""
    return ["fit", "-c", str(QUICKSTART), "-c", str(ROOT / "experiments" / "objectives" / f"{name}.yaml"),
            "-c", overrides_file]


def final_metrics(run_name: str) -> dict[str, float]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri="sqlite:///mlflow.db")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return dict(runs[0].data.metrics) if runs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objectives", nargs="+", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per run (same for all)")
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    exe = Path(sys.executable).with_name("lightning-spec")
    rows = []
    for name in args.objectives:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(overrides(name, args.steps, args.prompts, args.max_new_tokens), f)
        start = time.perf_counter()
        proc = subprocess.run([str(exe), *fit_args(name, f.name)], capture_output=True, text=True,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        seconds = time.perf_counter() - start
        os.unlink(f.name)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        m = final_metrics(name)
        rows.append((name, m, seconds))
        print(f"{name}: val/mal={m.get('val/mal', float('nan')):.3f} in {seconds:.0f} s", flush=True)
    domains = sorted({k.split("/")[-1] for _, m, _ in rows for k in m if k.startswith("val/mal/")})
    print(f"\ngreedy MAL after {args.steps} steps ({args.prompts} held-out prompts per domain, "
          f"{args.max_new_tokens} new tokens)")
    print("| objective | " + " | ".join(domains) + " | all | train/acc/t1 | seconds |")
    print("|---" * (len(domains) + 4) + "|")
    for name, m, seconds in rows:
        cells = [f"{m.get(f'val/mal/{d}', float('nan')):.3f}" for d in domains]
        print(f"| {name} | " + " | ".join(cells) + f" | {m.get('val/mal', float('nan')):.3f} | "
              f"{m.get('train/acc/t1', float('nan')):.2f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
