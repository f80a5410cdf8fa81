"""A finished rollouts folder as one gzip-compressed file, small enough to keep in a repository.

Regenerating a training set with the target takes hours of a CPU (docs/data.md); its answers are a few MB of token
ids. ``write_archive`` packs a finished folder (``rollouts.py``'s format) into ``<name>.rollouts.jsonl.gz``:

    line 1     {"archive": 1, "rollouts": <rollouts.json>, "rows": N, "provenance": {...}}
    lines 2..  one row each, every column of the folder (token ids, the regenerated text, the flags)

``rollouts.json`` inside it records the target's weight fingerprint, the sampling config, the seed, the prompt
sources and the engine, as the folder did; ``provenance`` adds what the folder cannot know (the serving command and
its dtype). The bytes are deterministic (gzip without a timestamp, rows in the folder's order), so packing the same
folder twice changes nothing a diff would show.

Everything that reads a rollouts folder reads an archive in its place (``load_rollouts``, so ``data.train_sources``,
``lightning-spec evaluate --rollouts`` and the testbed): it is unpacked once into
``$LIGHTNING_SPEC_CACHE/rollouts/<content hash>`` and read from there.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target

SUFFIX = ".rollouts.jsonl.gz"
FORMAT = 1


def is_archive(path: str | os.PathLike) -> bool:
    """An existing file named ``*.rollouts.jsonl.gz``."""
    path = Path(path).expanduser()
    return path.name.endswith(SUFFIX) and path.is_file()


def write_archive(folder: str | os.PathLike, path: str | os.PathLike, provenance: dict[str, Any] | None = None,
                  target: Target | None = None) -> Path:
    """Pack the finished rollouts ``folder`` into ``path`` (which must end with ``.rollouts.jsonl.gz``); no name or
    time in the gzip header, so the same folder packs to the same bytes. With ``target`` (the weights it was drawn
    from) the archive records ``target.fingerprint``, which every machine computes alike, also for a folder that
    recorded the earlier, path-dependent one (``Target.fingerprints``)."""
    from lightning_spec.data.rollouts import COLUMNS, load_rollouts  # rollouts.py reads archives: imported here
    from lightning_spec.files import atomic_write

    path = Path(path).expanduser()
    if not path.name.endswith(SUFFIX):
        raise UserError(f"A rollouts archive's name ends with {SUFFIX}, not '{path.name}'; rename it.")
    dataset, meta = load_rollouts(folder)
    if target is not None:
        if meta.get("target_fingerprint") not in target.fingerprints:
            raise UserError(f"{folder} was drawn from target weights {meta.get('target_fingerprint')}, not from "
                            f"'{target.name}' ({target.fingerprint}); pack it with the target it was drawn from.")
        meta = {**meta, "target_fingerprint": target.fingerprint}
    header = {"archive": FORMAT, "rollouts": meta, "rows": len(dataset), "provenance": provenance or {}}

    def write(tmp: Path) -> None:
        with (
            open(tmp, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, compresslevel=9) as out,
        ):
            out.write((json.dumps(header, sort_keys=True) + "\n").encode())
            for row in dataset:
                out.write((json.dumps({c: row[c] for c in COLUMNS if c in row}) + "\n").encode())

    return atomic_write(path, write)


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The archive's first line: its rollouts record, row count and provenance."""
    with gzip.open(Path(path).expanduser(), "rt", encoding="utf-8") as f:
        header = json.loads(f.readline())
    if header.get("archive") != FORMAT:
        raise UserError(f"{path} is not a rollouts archive of format {FORMAT}; pack it again with this version.")
    return header


def unpacked(path: str | os.PathLike) -> Path:
    """The rollouts folder of the archive ``path``, unpacked into the cache folder on first use (by its content hash,
    so an edited archive is a new folder); a concurrent unpack of the same archive keeps whichever finished first."""
    import datasets

    from lightning_spec.assets import cache_dir
    from lightning_spec.data.rollouts import FEATURES, META_FILE
    from lightning_spec.files import atomic_write_json

    path = Path(path).expanduser()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:24]
    folder = cache_dir() / "rollouts" / digest
    if (folder / META_FILE).is_file():
        return folder
    header = read_header(path)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        f.readline()
        rows = [json.loads(line) for line in f]
    if len(rows) != header["rows"]:
        raise UserError(
            f"{path} holds {len(rows)} rows where its header says {header['rows']}; it is truncated: copy it again."
        )
    tmp = folder.with_name(f"{digest}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    columns = {name: [r.get(name) for r in rows] for name in FEATURES}
    datasets.Dataset.from_dict(columns, features=FEATURES).save_to_disk(str(tmp))
    atomic_write_json(tmp / META_FILE, header["rollouts"])
    try:
        os.replace(tmp, folder)
    except OSError:  # another process unpacked it first: theirs is the same content
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
