"""Target features computed once and reused across epochs.

On CPU the frozen target forward is more than half of a training step, and its output never changes, so
we keep each training example's features (the drafter's context layers and the final normed hidden state
that gives the target logits) in fp16. The key hashes the target weights' fingerprint, the layers and the
data fingerprint, so a cache never serves features of another target, layer set or tokenisation. With a
``directory`` the cache is also written to disk (one file per key) and reloaded by the next run.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor


def cache_key(target_fingerprint: str, layers: list[int], data_fingerprint: str) -> str:
    raw = f"{target_fingerprint}|{','.join(map(str, layers))}|{data_fingerprint}|v1"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


class FeatureCache:
    """example index -> (features (S_i, F), last_hidden (S_i, H)) in fp16."""

    def __init__(self, key: str, directory: str | Path | None = None) -> None:
        self.key = key
        self.path = Path(directory) / f"{key}.pt" if directory is not None else None
        self.store: dict[int, tuple[Tensor, Tensor]] = {}
        self.dirty = False
        if self.path is not None and self.path.exists():
            self.store = torch.load(self.path, map_location="cpu", weights_only=True)

    def __contains__(self, index: int) -> bool:
        return index in self.store

    def __len__(self) -> int:
        return len(self.store)

    def put(self, index: int, features: Tensor, last_hidden: Tensor) -> None:
        self.store[index] = (features.detach().to("cpu", torch.float16), last_hidden.detach().to("cpu", torch.float16))
        self.dirty = True

    def get(self, index: int) -> tuple[Tensor, Tensor]:
        return self.store[index]

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        torch.save(self.store, tmp)
        tmp.replace(self.path)  # atomic: a killed run never leaves a half-written cache
        self.dirty = False
