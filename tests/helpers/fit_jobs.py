"""Several ``lightning-spec fit`` jobs run one after another in one process: ``python -m helpers.fit_jobs JOBS``.

``JOBS`` is a JSON file, a list of ``{"cwd": folder, "args": [...]}``; each job is ``fit -c experiments/tiny.yaml
*args`` run in its folder, exactly as ``lightning-spec fit`` runs it. What costs a DDP test is starting processes
(importing torch, Lightning and transformers takes most of a tiny fit), so ``helpers.fits.fit_jobs_together`` starts
the ranks once and runs every job in them: the ranks are launched from outside (``LOCAL_RANK`` and friends set, as
torchrun does), so Lightning spawns nothing, and the gloo process group the first fit opens serves the next ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers.fits import TINY
from lightning_spec.cli import run_cli


def main(jobs_file: str) -> None:
    """Each job's output (this process's stdout and stderr, file descriptors included) goes to ``fit-rank<r>.log`` in
    its folder, which a test reads; a job that fails prints its log's tail on the real stderr and ends the process."""
    rank = os.environ.get("LOCAL_RANK", "0")
    for job in json.loads(Path(jobs_file).read_text()):
        cwd = Path(job["cwd"])
        cwd.mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
        log = cwd / f"fit-rank{rank}.log"
        saved = [os.dup(1), os.dup(2)]
        try:
            with open(log, "w") as out:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                try:
                    run_cli(["fit", "-c", str(TINY), "--trainer.enable_progress_bar=false", *job["args"]])
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
        except BaseException:
            print(f"[fit_jobs] {cwd} failed; the end of {log.name}:\n{log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            for fd in saved:
                os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1])
