"""``lightning-spec features -c experiments/X.yaml``: write the feature store of a fit before the fit runs (its
command line, ``fit``'s own options, is parsed in ``cli.py``; the work is ``write_store`` here).

The same YAML as ``fit`` says which target, layers, data and feature dtype; this command runs the target over every
training example once, longest first in batches, through the fit's own ``FeatureSource`` (``source.py``), and
writes the store a fit with ``model.feature_cache: disk`` reads (``--out`` here and ``model.feature_store`` there
name another folder than the cache's). It prints the disk the store will take before it starts, refuses when the
disk cannot hold it, and resumes: examples already stored are skipped, so a killed run continues where its last
shard ended.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_spec.errors import UserError
from lightning_spec.features.source import FeatureSource
from lightning_spec.features.store import FeatureStore, human, store_folder
from lightning_spec.loaders import collate
from lightning_spec.progress import progress_bar

if TYPE_CHECKING:
    from lightning_spec.datamodule import SpecDataModule


class StoreWriter(Protocol):
    """What the command needs of a fit's module (``DraftModule``, which imports this package: named by what it
    offers, not imported): its feature source, the target's name, and its hyperparameters' ``feature_store``."""

    feature_source: FeatureSource
    target_spec: str
    hparams: Any


@torch.no_grad()
def write_store(module: StoreWriter, dm: SpecDataModule, out: str | None = None, batch_size: int = 16,
                progress: bool = True, echo: Callable[[str], None] = print) -> FeatureStore:
    """Run ``module``'s feature target over every training example of ``dm`` (set up) not yet stored, and write
    them to the store a fit of ``module`` would key, in ``out`` (default: the folder a fit would use), through the
    module's own ``FeatureSource``: the rows a fit would compute, batched here longest first."""
    if batch_size < 1:
        raise UserError(f"--batch_size={batch_size} must be at least 1.")
    examples = dm.train_dataset
    spec = module.feature_source.store_spec(module.target_spec, dm.fingerprint, len(examples))
    directory = Path(out).expanduser() if out else store_folder(spec, module.hparams.feature_store)
    store = FeatureStore.open(directory, spec, field_name="--out" if out else "model.feature_store", writer="cli")
    source = module.feature_source.with_store(store)
    lengths = [len(examples[i]["input_ids"]) for i in range(len(examples))]
    todo = sorted((i for i in range(len(examples)) if i not in store), key=lambda i: (-lengths[i], i))
    tokens = sum(lengths[i] for i in todo)
    need = tokens * spec.bytes_per_token()
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    echo(f"features: {len(todo)} of {len(examples)} examples to compute ({len(examples) - len(todo)} stored), "
         f"{tokens:,} tokens; target '{spec.target}' in {spec.dtype}, layers {spec.layers}; {human(need)} to write "
         f"to {directory} ({human(free)} free)")
    if need > free:
        raise UserError(f"the feature store needs {human(need)} but {directory} has {human(free)} free; free space "
                        "or point --out (model.feature_store) at a larger disk.")
    start, done_tokens = time.perf_counter(), 0
    columns = {"rate": "- tokens/s"}
    with progress_bar("features", len(todo), progress, columns) as bar:
        for lo in range(0, len(todo), batch_size):
            batch = todo[lo : lo + batch_size]
            source.fill(collate([examples[i] for i in batch], dm.pad_id))  # (N, S) right-padded, as a fit's batch
            done_tokens += sum(lengths[i] for i in batch)
            rate = done_tokens / max(time.perf_counter() - start, 1e-9)
            bar.advance(len(batch), rate=f"{rate:,.0f} tokens/s")
    store.flush()
    seconds = time.perf_counter() - start
    echo(f"features: {len(store)} of {len(examples)} examples stored in {directory} ({human(store.disk_bytes())}); "
         f"{done_tokens:,} tokens in {seconds:.0f} s")
    return store
