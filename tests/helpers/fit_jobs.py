"""Several ``lightning-spec fit`` jobs run one after another in one process: ``python -m helpers.fit_jobs JOBS``.

``JOBS`` is a JSON file, a list of ``{"cwd": folder, "args": [...]}``; each job is ``fit -c experiments/tiny.yaml
*args`` run in its folder, exactly as ``lightning-spec fit`` runs it. What costs a DDP test is starting processes
(importing torch, Lightning and transformers takes most of a tiny fit), so ``helpers.fits.fit_jobs`` starts the
ranks once and runs every job in them: the ranks are launched from outside (``LOCAL_RANK`` and friends set, as
torchrun does), so Lightning spawns nothing, and the gloo process group the first fit opens serves the next ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lightning_spec.cli import run_cli

TINY = Path(__file__).resolve().parents[2] / "experiments" / "tiny.yaml"


def main(jobs_file: str) -> None:
    for job in json.loads(Path(jobs_file).read_text()):
        cwd = Path(job["cwd"])
        cwd.mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
        print(f"[fit_jobs] {cwd}", file=sys.stderr, flush=True)
        run_cli(["fit", "-c", str(TINY), "--trainer.enable_progress_bar=false", *job["args"]])


if __name__ == "__main__":
    main(sys.argv[1])
