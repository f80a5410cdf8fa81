"""The feature store: the frozen target's features of every training example, computed once, read lazily.

On a CPU the target forward is most of a training step, and its output never changes. So the features a drafter
reads (the context layers it asks for and the final normed hidden state, from which every objective gets the target
distribution through the LM head) are written once per

    (target weight fingerprint, layers, data fingerprint, compute dtype)

and every later epoch, and every later run with the same four, reads them back instead of running the target.

On disk a store is a folder:

    store.json                    what it holds (``StoreSpec``); a store of other weights, layers, data or dtype
                                  is refused in one sentence
    shards/<writer>-<n>.safetensors
        index        (n,)   int64   the examples' indices in the training split
        offsets      (n+1,) int64   where each example's tokens start in the two tensors below
        features     (T, F)         F = len(layers) x H, rows of all n examples one after the other
        last_hidden  (T, H)         the final normed hidden state

Shards are plain safetensors files (any safetensors reader opens them), each written whole and renamed into place,
so a killed writer leaves no torn shard; a writer (a process, a DDP rank) only ever adds shards of its own, so
several write one store at once. Reading does not map the files: an example's rows are one ``pread`` per tensor,
so memory holds the batch being read, never the store, and a DDP rank reads only the examples it trains on. Its
size is a count kept as examples are added (opening a store counts the shards' indices once), never a pass over them.
Examples are stored in 16-bit floats: bf16 when the target ran in bf16, else fp16 (refused in one sentence when a
value does not fit fp16's range).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from safetensors.torch import save_file
from torch import Tensor

from lightning_spec.assets import cache_dir
from lightning_spec.errors import UserError
from lightning_spec.files import atomic_write, atomic_write_json

FORMAT = 1
SPEC_FILE = "store.json"
SHARD_DIR = "shards"
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}
_MATCH = ("target_fingerprint", "layers", "data_fingerprint", "dtype")  # what a store is written for


def storage_dtype(compute: torch.dtype) -> torch.dtype:
    """Stored features are 16-bit: bf16 when the target computed in bf16, fp16 otherwise (3 more mantissa bits)."""
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float16


def human(size: float) -> str:
    """A byte count for people: 752.3 MB."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


@dataclass
class StoreSpec:
    """What a store holds. ``key`` names its folder under the cache; the ``_MATCH`` fields must agree for a fit to
    read it."""

    target: str  # the target's name as the fit spelled it
    target_fingerprint: str  # Target.fingerprint: its weights
    layers: list[int]  # the target layers of ``features``, in order
    data_fingerprint: str  # SpecDataModule.fingerprint: the training split's token ids
    dtype: str  # the dtype the target computed in
    hidden_size: int
    examples: int  # examples in the training split (the store is complete when it holds all of them)
    format: int = FORMAT

    @property
    def key(self) -> str:
        raw = "|".join(str(getattr(self, name)) for name in _MATCH) + f"|v{self.format}"
        return hashlib.sha256(raw.encode()).hexdigest()[:20]

    @property
    def storage(self) -> torch.dtype:
        return storage_dtype(getattr(torch, self.dtype))

    def bytes_per_token(self) -> int:
        return (len(self.layers) + 1) * self.hidden_size * self.storage.itemsize  # features (F) and last_hidden (H)

    def describe(self) -> str:
        return (f"target '{self.target}' (fingerprint {self.target_fingerprint}), layers {self.layers}, data "
                f"fingerprint {self.data_fingerprint}, dtype {self.dtype}")


class FeatureStore:
    """Example index -> (features (S_i, F), last_hidden (S_i, H)), in the storage dtype, on CPU.

    ``directory=None`` keeps everything in memory (a short run, a test); otherwise examples are buffered and
    written in shards of about ``shard_bytes``. Use ``FeatureStore.open`` to create or reopen one.
    """

    def __init__(self, spec: StoreSpec, directory: Path | None = None, writer: str = "0",
                 shard_bytes: int = 64 << 20) -> None:
        self.spec = spec
        self.directory = directory
        self.writer = f"{writer}-{uuid.uuid4().hex[:8]}"  # unique per process: writers never share a shard name
        self.shard_bytes = shard_bytes
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}
        self._pending_bytes = 0
        self._shards: list[_Shard] = []
        self._where: dict[int, tuple[int, int]] = {}  # example -> (shard, row)
        self._count = 0  # distinct examples in _where or _pending: len() is asked every optimizer step
        self._written = 0
        self.refresh()

    @classmethod
    def open(cls, directory: str | os.PathLike | None, spec: StoreSpec, field_name: str = "model.feature_store",
             **kwargs: Any) -> FeatureStore:
        """The store of ``spec`` in ``directory`` (created when new or empty); one of other weights, layers, data or
        dtype is refused, naming ``field_name``, the option that pointed there."""
        if directory is None:
            return cls(spec, None, **kwargs)
        directory = Path(directory).expanduser()
        found = read_spec(directory)
        if found is None:
            # another rank may be creating the same store right now: its spec (or the spec's temporary file, or a
            # folder-write probe) is not "other files"; the spec both write is the same
            ours = (SHARD_DIR, SPEC_FILE, f"{SPEC_FILE}.tmp", ".write-test-")
            if directory.is_dir() and any(not p.name.startswith(ours) for p in directory.iterdir()):
                raise UserError(f"{field_name} '{directory}' is a folder that holds other files, not a feature "
                                "store; name a new or empty folder.")
            atomic_write_json(directory / SPEC_FILE, asdict(spec))
        else:
            check_spec(found, spec, directory, field_name)
        return cls(spec, directory, **kwargs)

    # ------------------------------------------------------------------------------------------- reading
    def refresh(self) -> None:
        """Index the shards on disk, including those other writers (DDP ranks, processes) added since."""
        if self.directory is None:
            return
        known = {s.path.name for s in self._shards}
        for path in sorted((self.directory / SHARD_DIR).glob("*.safetensors")):
            if path.name in known:
                continue
            shard = _Shard(path)
            number = len(self._shards)
            self._shards.append(shard)
            for row, example in enumerate(shard.index.tolist()):
                if example in self._where:
                    continue  # a duplicate (two writers raced) is the same data
                if example not in self._pending:  # the examples of our own new shard were counted when put
                    self._count += 1
                self._where[example] = (number, row)

    def __contains__(self, index: int) -> bool:
        return index in self._pending or index in self._where

    def __len__(self) -> int:
        return self._count

    @property
    def complete(self) -> bool:
        return len(self) >= self.spec.examples

    def get(self, index: int) -> tuple[Tensor, Tensor]:
        if index in self._pending:
            return self._pending[index]
        shard, row = self._where[index]
        return self._shards[shard].read(row)

    # ------------------------------------------------------------------------------------------- writing
    def put(self, index: int, features: Tensor, last_hidden: Tensor) -> None:
        """Buffer one example's features (S, F) and final hidden state (S, H); shards are written as they fill."""
        if index in self:
            return
        dtype = self.spec.storage
        features = features.detach().to("cpu", dtype)
        last_hidden = last_hidden.detach().to("cpu", dtype)
        if dtype == torch.float16 and not (bool(features.isfinite().all()) and bool(last_hidden.isfinite().all())):
            raise UserError(f"the target's features of training example {index} exceed float16's range, which the "
                            f"feature store uses for a {self.spec.dtype} target; set model.feature_dtype: bfloat16 "
                            "(stored in bf16) or model.feature_cache: off.")
        self._pending[index] = (features, last_hidden)
        self._count += 1
        self._pending_bytes += features.nbytes + last_hidden.nbytes
        if self.directory is not None and self._pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered examples as one shard (atomically); nothing to do in memory or with nothing new."""
        if self.directory is None or not self._pending:
            return
        order = sorted(self._pending)
        feats = [self._pending[i][0] for i in order]
        lengths = torch.tensor([0] + [f.shape[0] for f in feats])
        tensors = {"index": torch.tensor(order, dtype=torch.int64), "offsets": lengths.cumsum(0),
                   "features": torch.cat(feats), "last_hidden": torch.cat([self._pending[i][1] for i in order])}
        path = self.directory / SHARD_DIR / f"{self.writer}-{self._written:05d}.safetensors"
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": self.spec.key}))
        self._written += 1
        self.refresh()  # indexes the new shard while its examples are still pending: counted once
        self._pending.clear()
        self._pending_bytes = 0

    def disk_bytes(self) -> int:
        if self.directory is None:
            return 0
        return sum(p.stat().st_size for p in (self.directory / SHARD_DIR).glob("*.safetensors"))


class _Shard:
    """One shard file: its index and offsets in memory, its tensors read row range by row range."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        self.base = 8 + size
        self.meta = {k: v for k, v in header.items() if k != "__metadata__"}
        self.index = self._whole("index")
        self.offsets = self._whole("offsets").tolist()

    def _range(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``start:stop`` of tensor ``name`` (a 1-D tensor's elements), read with one pread."""
        info = self.meta[name]
        dtype, shape = _DTYPES[info["dtype"]], info["shape"]
        width = math.prod(shape[1:])
        row_bytes = width * dtype.itemsize
        begin = self.base + info["data_offsets"][0] + start * row_bytes
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = bytearray(os.pread(fd, (stop - start) * row_bytes, begin))
        finally:
            os.close(fd)
        out = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return out.view(stop - start, *shape[1:])

    def _whole(self, name: str) -> Tensor:
        return self._range(name, 0, self.meta[name]["shape"][0])

    def read(self, row: int) -> tuple[Tensor, Tensor]:
        start, stop = self.offsets[row], self.offsets[row + 1]
        return self._range("features", start, stop), self._range("last_hidden", start, stop)


# ------------------------------------------------------------------------------------------------ specs
def read_spec(directory: str | os.PathLike) -> StoreSpec | None:
    path = Path(directory) / SPEC_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT:
        raise UserError(f"the feature store '{directory}' has format {raw.get('format')}, this version reads "
                        f"format {FORMAT}; delete it (it is rewritten on the next run).")
    return StoreSpec(**{k: v for k, v in raw.items() if k in StoreSpec.__dataclass_fields__})


def check_spec(found: StoreSpec, wanted: StoreSpec, directory: Path, field_name: str) -> None:
    """Refuse, in one sentence, a store written for other weights, layers, data or dtype."""
    differ = [name for name in _MATCH if getattr(found, name) != getattr(wanted, name)]
    if not differ:
        return
    names = {"target_fingerprint": "target weights", "layers": "layers", "data_fingerprint": "data (tokenisation)",
             "dtype": "dtype"}
    raise UserError(
        f"{field_name} '{directory}' holds features of {found.describe()}, but this run needs {wanted.describe()} "
        f"({', '.join(names[d] for d in differ)} differ); point {field_name} at another folder or delete that one."
    )


def store_folder(spec: StoreSpec, folder: str | os.PathLike | None) -> Path:
    """Where a fit's store lives: ``folder`` (``model.feature_store``), else its folder in the cache, named by its
    key."""
    return Path(folder or cache_dir() / "features" / spec.key).expanduser()


def open_training_store(directory: Path | None, spec: StoreSpec, rank: int) -> FeatureStore:
    """A fit's feature store, opened by rank ``rank``: on disk in ``directory`` (``model.feature_cache: disk``), in
    memory without one; rank 0 says how much of it is already stored."""
    store = FeatureStore.open(directory, spec, writer=f"rank{rank}")
    if directory is not None:
        rest = ("the target never runs in training" if store.complete else
                "the first epoch writes the rest as it computes them")
        rank_zero_info(f"feature store {directory}: {len(store)} of {spec.examples} training examples stored "
                       f"({human(store.disk_bytes())}); {rest}")
    return store
