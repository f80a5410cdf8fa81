"""Where an artifact came from: the command that made it, its resolved config, the package versions and commit it
ran with, and a checksum of its weights, so a drafter someone downloads can be rebuilt and checked.

Every drafter artifact carries one (issue 47): the fit's checkpoint stores the fit's record (``run_record``, under
``PROVENANCE_KEY``), and every folder written from it (``export``, ``save_drafter``, the MLflow logged model) a
``provenance.json`` (``folder_record``): the fit's record, the command that wrote the folder, the target's weights
fingerprint and the SHA-256 of the weights file. ``lightning-spec evaluate`` puts its own record and the checksums
of its inputs in its report. speculators added the same to every released drafter after an ablation could not be
reproduced (RFC #880).

Rebuilding: write ``record["fit"]["config"]`` to a file and run ``lightning-spec fit --config <file>`` with the
same versions; on the same machine and thread count the weights' SHA-256 is the recorded one
(``tests/test_provenance.py``).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

PROVENANCE_KEY = "provenance"  # the checkpoint's key for the fit's record
PROVENANCE_FILE = "provenance.json"  # the record in every folder written from a checkpoint
COMMAND: list[str] = []  # the command line, as ``lightning-spec`` received it (``cli.main``); empty: ``sys.argv``
PACKAGES = ("lightning_spec", "torch", "transformers", "lightning", "vllm")  # the versions that change the weights
# or how they are served (vLLM: only when installed here; a serve check records the serving venv's itself)


def versions() -> dict[str, str]:
    """The installed version of each of ``PACKAGES`` (those installed), and Python's."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


@functools.cache
def commit() -> dict[str, Any] | None:
    """The commit of this package's checkout and whether it had uncommitted changes (None when it runs from an
    installed wheel, or git is missing); asked of git once per process, not at every checkpoint."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": head, "dirty": bool(status.strip())}


def command() -> str:
    """This process's command line, as a shell would take it back: the ``lightning-spec`` command it runs (also when
    called as ``cli.main(args)``), else ``sys.argv``."""
    return shlex.join(COMMAND or sys.argv)


def run_record(config: str | None = None) -> dict[str, Any]:
    """What this process is: its command, its resolved config (YAML, None where there is none), when, the package
    versions, the commit and the machine."""
    return {"command": command(), "config": config, "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "versions": versions(), "commit": commit(), "machine": f"{platform.system()} {platform.machine()}"}


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_record(weights: Path, target_fingerprint: str, fit: dict[str, Any] | None) -> dict[str, Any]:
    """``provenance.json`` of a drafter folder: the fit that trained it (None: not recorded, e.g. a drafter saved
    from Python), the command that wrote this folder, the target's weights fingerprint, and the weights file's
    name and SHA-256."""
    return {"fit": fit, "written_by": run_record(), "target_fingerprint": target_fingerprint,
            "weights_file": weights.name, "weights_sha256": sha256_file(weights)}


def input_checksums(paths: list[str]) -> dict[str, str | None]:
    """path -> the SHA-256 of each input file (a folder: of its weights file; None: not a file here, e.g.
    ``ngram``)."""
    out: dict[str, str | None] = {}
    for p in paths:
        path = Path(p)
        if path.is_dir():
            path = next((path / n for n in ("model.safetensors", "drafter.pt") if (path / n).is_file()), path)
        out[str(p)] = sha256_file(path) if path.is_file() else None
    return out
