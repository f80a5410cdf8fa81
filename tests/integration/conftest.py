"""One launch for every DDP fit of the integration tests: the processes start once.

A module whose tests use the ``ddp_fits`` fixture defines ``ddp_jobs(root) -> list[(cwd, args, ranks)]``: ``fit -c
experiments/tiny.yaml *args`` in ``cwd`` under ``root``, in 1 process or as 2 gloo ranks. The fixture runs the jobs of
every such module in one process (ranks 1) beside two ranks (ranks 2), each running its jobs in turn
(``helpers.fits.fit_jobs_together``): starting a process (importing torch, Lightning, transformers, loading the
target) costs more than a tiny fit. pytest-xdist workers share the results: the first to ask runs the launch under a
file lock, the others wait for it and read the same folder.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock
from helpers.fits import fit_jobs_together


@pytest.fixture(scope="session")
def ddp_fits(request, tmp_path_factory) -> Path:
    """The folder under which every module's ``ddp_jobs`` ran (each job in its own ``cwd``)."""
    base = tmp_path_factory.getbasetemp()  # this run's; an xdist worker's is one folder below the run's
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ddp-fits"
    modules = {item.module for item in request.session.items if "ddp_fits" in item.fixturenames}
    jobs = [job for module in sorted(modules, key=lambda m: m.__name__) for job in module.ddp_jobs(root)]
    with FileLock(str(root) + ".lock"):
        done = root / "done"
        if not done.exists():
            one = [(cwd, args) for cwd, args, ranks in jobs if ranks == 1]
            two = [(cwd, args) for cwd, args, ranks in jobs if ranks == 2]
            for attempt in range(2):  # the free port the ranks meet on can be taken in between: once more then
                for cwd, _, _ in jobs:  # afresh: a stored feature or a probe of the first try would mislead
                    shutil.rmtree(cwd, ignore_errors=True)
                (first,), ranks = fit_jobs_together([(one, 1), (two, 2)], root / f"jobs{attempt}")
                failed = [p for p in [first, *ranks] if p.returncode != 0]
                if not any("address already in use" in p.stderr.lower() for p in failed):
                    break
            assert not failed, failed[0].stderr[-3000:]
            done.write_text("\n".join(str(cwd) for cwd, _, _ in jobs))
    ran = set(done.read_text().splitlines())
    assert all(str(cwd) in ran for cwd, _, _ in jobs), "a worker collected DDP jobs the launch did not run"
    return root
