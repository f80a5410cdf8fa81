"""The tokenised training set: conversations -> token ids and loss masks, once, kept on disk as Arrow.

Tokenising with the chat template (``chat.tokenize_conversation``: the template, the assistant spans, the offsets) is
a Python loop over conversations and the slow part of preparing data. ``tokenized_set`` runs it through
``datasets.Dataset.map`` (in ``num_proc`` processes when there are enough conversations to share) once per

    (the sources and their files, limits, tokenizer and chat template and its arguments, max_length, the held-out
     eval prompts)

and saves the result under ``$LIGHTNING_SPEC_DATA_CACHE/<key>`` (default ``$LIGHTNING_SPEC_CACHE/data``): the next
run, and every DDP rank after the first (Lightning's ``prepare_data`` builds it on one process per node before the
others set up), memory-maps it instead of reading and tokenising again. The key is computed from what the sources
are (package versions, file sizes and times, a rollouts folder's record), not from their rows, so a cached set is
found without reading them.

``Examples`` is one split of it (train or validation) as the loaders want it: example ``i`` is a dict of tensors read
from the memory-mapped table when asked for, so memory holds the batches, not the set, and a DDP rank reads only
the examples its sampler gives it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from lightning_spec.assets import PACKAGED_DATA_PACKAGES, cache_dir
from lightning_spec.files import atomic_write_json

VERSION = 1  # bump when what a cached set holds, or how it is tokenised, changes
META_FILE = "tokenized.json"
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "domain": datasets.Value("string"),
    "key": datasets.Value("string"),  # conversations sharing it (an opening prompt) stay on one side of the split
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("bool")),
})
PARALLEL_FROM = 4000  # conversations per process below which extra processes cost more than they save


def data_cache() -> Path:
    """``$LIGHTNING_SPEC_DATA_CACHE``, default ``$LIGHTNING_SPEC_CACHE/data``: the tokenised sets."""
    return Path(os.environ.get("LIGHTNING_SPEC_DATA_CACHE") or cache_dir() / "data").expanduser()


def source_identity(name: str) -> dict[str, Any]:
    """What a source is, cheaply: a packaged set's package version, a local file's (or folder's files') size and
    modification time, a rollouts folder's record, or a hub id (whose own cache ``datasets`` keeps)."""
    from lightning_spec.data.rollouts import META_FILE as ROLLOUTS_META

    if name in PACKAGED_DATA_PACKAGES:
        package = PACKAGED_DATA_PACKAGES[name]
        return {"packaged": name, "package": package, "version": importlib.metadata.version(package)}
    path = Path(name).expanduser()
    if (path / ROLLOUTS_META).is_file():
        record = hashlib.sha256((path / ROLLOUTS_META).read_bytes()).hexdigest()
        return {"rollouts": str(path.resolve()), "record": record}
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path.resolve()), "files": [[str(f.relative_to(path)) if f != path else f.name,
                                                         f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    return {"hub": name}


def tokenizer_identity(tokenizer: Any, name: str) -> dict[str, Any]:
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"tokenizer": name, "size": len(tokenizer), "template": hashlib.sha256(str(template).encode()).hexdigest()}


def cache_key(parts: dict[str, Any]) -> str:
    text = json.dumps({**parts, "version": VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def tokenized_set(
    key: str,
    read: Callable[[], list[tuple[datasets.Dataset, Callable[[dict], dict]]]],
    num_proc: int | None = None,
    folder: Path | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The tokenised set of ``key`` and its record (``fingerprint``, ``examples``, ``conversations`` read): loaded
    from ``folder`` (default ``data_cache() / key``) when it is there, else built from ``read()`` and saved there.

    ``read()`` gives, per source, a dataset of conversations and the function that tokenises one row into the
    ``FEATURES`` columns (``input_ids`` empty: dropped), or the ``FEATURES`` columns themselves and None. The content
    fingerprint hashes every example's ids and mask, computed once when the set is built."""
    folder = folder or data_cache() / key
    if (folder / META_FILE).is_file():
        return datasets.load_from_disk(str(folder)), json.loads((folder / META_FILE).read_text())
    parts, conversations = [], 0
    for i, (rows, tokenize) in enumerate(read()):
        conversations += len(rows)
        if tokenize is None:  # already tokenised (rollouts)
            parts.append(rows.cast(FEATURES))
            continue
        procs = num_proc if num_proc is not None else min(os.cpu_count() or 1, max(1, len(rows) // PARALLEL_FROM))
        mapped = rows.map(tokenize, remove_columns=rows.column_names, features=FEATURES,
                          num_proc=procs if procs > 1 else None, desc="tokenising", new_fingerprint=f"{key}-{i}")
        parts.append(mapped.filter(lambda e: len(e["input_ids"]) > 0, new_fingerprint=f"{key}-{i}-kept"))
    empty = datasets.Dataset.from_dict({name: [] for name in FEATURES}, features=FEATURES)
    table = datasets.concatenate_datasets(parts) if parts else empty
    digest = hashlib.sha256(f"{len(table)}".encode())
    for batch in table.with_format("numpy").iter(batch_size=1000):
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            digest.update(len(ids).to_bytes(4, "little"))
            digest.update(ids.astype("int32").tobytes())
            digest.update(mask.astype("bool").tobytes())
    meta = {"fingerprint": digest.hexdigest()[:16], "examples": len(table), "conversations": conversations,
            "version": VERSION}
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    table.save_to_disk(str(tmp))
    atomic_write_json(tmp / META_FILE, meta)
    try:
        tmp.rename(folder)  # whole or absent: a killed build leaves only a tmp folder
    except OSError:  # another process built it meanwhile (its rename came first): theirs is the same
        if not (folder / META_FILE).is_file():
            raise
        shutil.rmtree(tmp)
    return datasets.load_from_disk(str(folder)), meta


class Examples(torch.utils.data.Dataset):
    """One split of a tokenised set: example ``i`` (its ``index``, the key of anchor seeds and the feature store) is
    row ``rows[i]`` of ``table``, read when asked for as ``{input_ids, loss_mask, domain_id, domain, index, id}``."""

    def __init__(self, table: datasets.Dataset, rows: Sequence[int], domain_id: dict[str, int]) -> None:
        self.table, self.rows, self.domain_id = table, list(rows), domain_id
        self._domains: list[str] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self.rows) <= i < len(self.rows):
            raise IndexError(i)
        i = i % len(self.rows)
        row = self.table[self.rows[i]]
        return {
            "input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool),
            "domain_id": self.domain_id[row["domain"]],
            "domain": row["domain"],
            "index": i,
            "id": row["id"],
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    @property
    def domains(self) -> list[str]:
        """Every example's domain, in order (one column read, kept)."""
        if self._domains is None:
            column = self.table.select_columns(["domain"])[self.rows] if self.rows else {"domain": []}
            self._domains = list(column["domain"])
        return list(self._domains)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.table.select(self.rows)["input_ids"]]
