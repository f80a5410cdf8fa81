"""FeatureSource: the one door to the target's training features, used by ``DraftModule`` in every training step and
by ``lightning-spec features`` (``command.py``) ahead of a fit.

A batch's features come from the store where one is attached: what it holds is read back, what it lacks is computed
by the target first and written to it, so a row's features are the same bytes whichever of the two computed them.
Without a store (``model.feature_cache: off``, validation, on-policy data) the target runs over the whole batch.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_spec.errors import UserError
from lightning_spec.features.store import StoreSpec, open_training_store, store_folder
from lightning_spec.target import dtype_name

if TYPE_CHECKING:
    from lightning_spec.features.store import FeatureStore
    from lightning_spec.target import Target


def check_feature_options(feature_cache: str, feature_dtype: str, target_dtype: str, shard_target: bool) -> None:
    """``model.feature_cache`` is one of memory, disk, off; a sharded target computes every batch's features on
    every rank in step, so it trains without a cache and in the target's dtype (one sentence each)."""
    if feature_cache not in ("memory", "disk", "off"):
        raise UserError(f"model.feature_cache must be 'memory', 'disk' or 'off', got {feature_cache!r}.")
    if shard_target and (feature_cache != "off" or feature_dtype not in ("target", target_dtype)):
        raise UserError(
            "model.shard_target runs the target's forward on every rank in step, so each rank must compute the "
            "features of every batch: set model.feature_cache: off and model.feature_dtype: target (or write the "
            "features ahead with `lightning-spec features` and train without shard_target)."
        )


class FeatureSource:
    """The features of ``layers`` of ``target`` (computed in ``dtype``: None is the target's own) for batches of
    training rows, through ``store`` when there is one (``FeatureStore``; in memory for ``feature_cache: memory``).

    A batch is a collated one (``loaders.collate``): ``input_ids`` (N, S) right-padded, ``attention_mask`` (N, S),
    and ``index`` (N,), the rows' keys in the store.
    """

    def __init__(self, target: Target, layers: Sequence[int], store: FeatureStore | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.layers = list(layers)
        self.store = store
        self._target = target
        # a copy of the target in the feature dtype (its own weights, so decoding keeps the target's dtype); a plain
        # attribute, so neither a submodule of the LightningModule nor in its checkpoints
        self._copy: Target | None = None if dtype in (None, target.dtype) else target.converted(dtype)
        self._work = [0.0, 0]  # seconds and examples of target forwards since the last take_work

    def with_store(self, store: FeatureStore | None) -> FeatureSource:
        """This source reading and writing ``store``: the same target, its feature-dtype copy not made again."""
        source = copy.copy(self)
        source.store, source._work = store, [0.0, 0]
        return source

    @property
    def target(self) -> Target:
        """The target that computes the features: the target, or its copy in the feature dtype, moved to where the
        target is (Lightning moves the module, and the target with it, after this source was built)."""
        if self._copy is None:
            return self._target
        if self._copy.device != self._target.device:
            self._copy.to(self._target.device)
        return self._copy

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the features are computed in (a store is written for it)."""
        return (self._target if self._copy is None else self._copy).dtype

    def store_spec(self, target_spec: str, data_fingerprint: str, examples: int) -> StoreSpec:
        """What a store of this source's features over ``examples`` rows of the data ``data_fingerprint`` holds: the
        target (``target_spec``, its weights' fingerprint), the layers and the dtype they are computed in."""
        return StoreSpec(target=target_spec, target_fingerprint=self._target.fingerprint, layers=list(self.layers),
                         data_fingerprint=data_fingerprint, dtype=dtype_name(self.dtype),
                         hidden_size=self._target.hidden_size, examples=examples)

    def for_fit(self, target_spec: str, data_fingerprint: str, examples: int, cache: str, folder: str | None,
                rank: int) -> FeatureSource:
        """This source with the store of a fit's ``examples`` (``model.feature_cache``): ``disk``, in ``folder``
        (``model.feature_store``; None: the cache's folder of the store's key), or ``memory``."""
        spec = self.store_spec(target_spec, data_fingerprint, examples)
        return self.with_store(open_training_store(store_folder(spec, folder) if cache == "disk" else None, spec, rank))

    def refresh(self) -> None:
        """Read what other ranks or processes wrote to the store since (no store: nothing)."""
        if self.store is not None:
            self.store.refresh()

    def flush(self) -> bool:
        """Write what the store holds only in memory to disk; whether there is a store."""
        if self.store is None:
            return False
        self.store.flush()
        return True

    def uncached(self, examples: int) -> int:
        """How many of ``examples`` training examples the store does not hold yet (0 without a store)."""
        return 0 if self.store is None else max(examples - len(self.store), 0)  # len: a count, not a pass

    def take_work(self) -> tuple[float, int]:
        """Seconds and examples of target forwards since the last call (the training clock's projection,
        ``schedule.py``), counted from zero again."""
        seconds, examples = self._work
        self._work = [0.0, 0]
        return seconds, examples

    # ------------------------------------------------------------------------------------------- the door
    def __call__(self, batch: Mapping[str, Tensor], use_store: bool = True) -> tuple[Tensor, Tensor]:
        """Context features (N, S, F) and final normed hidden states (N, S, H) of the batch's rows.

        Through the store (one is attached, ``use_store``, the batch names its rows' ``index``): float32, zero past
        each row's length, rounded as the store keeps them. Else the target's own output over every position."""
        if self.store is None or not use_store or "index" not in batch:
            out = self.target(batch["input_ids"], layers=self.layers, logits=False)  # right padding: causal, no mask
            return out.features, out.last_hidden
        self.fill(batch)
        return self._read(batch["index"].tolist(), batch["input_ids"])

    def fill(self, batch: Mapping[str, Tensor]) -> int:
        """Compute the rows the attached store lacks with one target forward and write them to it; how many were
        computed (a row twice in the batch, as domain-weighted sampling draws, is computed twice and stored once)."""
        index = batch["index"].tolist()
        lengths = batch["attention_mask"].sum(1).tolist()
        missing = [i for i, x in enumerate(index) if x not in self.store]
        if not missing:
            return 0
        start = time.perf_counter()
        target = self.target
        ids = batch["input_ids"][missing].to(target.device)  # (M, S) right-padded: causal, no mask needed
        out = target(ids, layers=self.layers, logits=False)
        for j, i in enumerate(missing):
            self.store.put(index[i], out.features[j, : lengths[i]], out.last_hidden[j, : lengths[i]])
        self._work[0] += time.perf_counter() - start
        self._work[1] += len(missing)
        return len(missing)

    def _read(self, index: list[int], ids: Tensor) -> tuple[Tensor, Tensor]:
        """The stored rows of ``index``, padded with zeros to the batch's (N, S), in float32 on ``ids``' device."""
        n, s = ids.shape
        hidden = self._target.hidden_size
        feats = ids.new_zeros((n, s, len(self.layers) * hidden), dtype=torch.float32)  # (N, S, F)
        last = ids.new_zeros((n, s, hidden), dtype=torch.float32)  # (N, S, H)
        for i, x in enumerate(index):
            f, h = self.store.get(x)  # (S_i, F), (S_i, H) in the storage dtype, on CPU
            feats[i, : f.shape[0]] = f.to(feats.device, feats.dtype)
            last[i, : h.shape[0]] = h.to(last.device, last.dtype)
        return feats, last
