"""Writing files so that a killed process never leaves half of one, and checking a path before hours of work.

Every file the framework writes for later reading (rollout shards and metadata, feature caches, converted
assets, sweep tables) goes through ``atomic_write``: the bytes land in a temporary file beside the target, which
then replaces it in one rename, so readers see the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_spec.errors import UserError


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` to fill a temporary file next to ``path``, then rename it onto ``path``.

    The temporary name carries the pid, so two processes writing the same file do not share a temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    """``payload`` as indented, key-sorted JSON (stable across runs, readable in a diff)."""
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def writable_dir(path: str | os.PathLike, field: str) -> Path:
    """Create ``path`` (a folder) if needed and check that files can be written in it, before any long work.

    Raises ``UserError`` naming ``field`` (the option the user set) when it cannot be written."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"{field} '{path}' cannot be written ({err.strerror or err}); pick a folder you can write to."
        ) from None
    return path
