"""What every drafter gives the rest of the framework: ``DraftOutput`` for training, ``Proposal`` for decoding.

A drafter owns no loss, optimizer or logging: ``objectives/`` and ``module.py`` import drafters, never the
reverse, so every objective trains every drafter. It borrows the target's frozen embedding and LM head through
``bind(target)``; they are never registered as drafter parameters, so a drafter checkpoint holds the drafter
only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.sampling import SamplingConfig


@dataclass
class DraftOutput:
    """One training forward of a drafter over a batch, ``K`` prediction slots per anchor.

    Slot ``t`` (1..K) of anchor ``n`` predicts the token at position ``n + t``.
    """

    logits: Tensor  # (N, A, K, Vd) draft logits over the draft vocabulary
    labels: Tensor  # (N, A, K) gold tokens as draft-vocabulary ids (0 where invalid)
    valid: Tensor  # (N, A, K) bool: a supervised label that the draft vocabulary contains
    anchors: Tensor  # (N, A) anchor positions n (0 where the anchor slot is unused)
    target_logits: Tensor | None = None  # (N, A, K, Vd) target logits at position n + t - 1 (the shift!)
    extra: dict[str, Any] | None = None  # what an objective's select_anchors computed for its parts (EDR)

    @property
    def block_size(self) -> int:
        return self.logits.shape[-2]


@dataclass
class Proposal:
    """One round's draft: ``K`` tokens (target ids) and the distribution each was drawn from."""

    tokens: Tensor  # (K,) target-vocabulary ids
    probs: Tensor | None  # (K, V) q over the TARGET vocabulary (zeros outside the draft vocabulary); None if greedy


class Drafter(nn.Module):
    """Base class. Subclasses set ``block_size`` and ``target_layers`` and implement the four methods below."""

    block_size: int
    target_layers: list[int]

    def __init__(self) -> None:
        super().__init__()
        self._target: list[Any] = []  # a list so the frozen target is not registered as a submodule

    # -------------------------------------------------------------------------------------------- binding
    def bind(self, target: Any) -> None:
        """Attach the frozen target whose embedding and LM head the drafter uses; builds target-shaped layers."""
        self._target[:] = [target]

    @property
    def target(self) -> Any:
        if not self._target:
            raise RuntimeError("This drafter is not bound to a target yet; call drafter.bind(target) first.")
        return self._target[0]

    # --------------------------------------------------------------------------------------------- hooks
    def forward(self, batch: dict[str, Tensor], features: Tensor) -> DraftOutput:  # training
        raise NotImplementedError

    def begin(self, features: Tensor) -> Any:
        """Decoding state from the prefill features (1, S, F) of positions 0..S-1."""
        raise NotImplementedError

    def extend(self, state: Any, features: Tensor) -> None:
        """Append the features (1, T, F) of newly committed positions to the state."""
        raise NotImplementedError

    def propose(self, state: Any, anchor: Tensor, sampling: SamplingConfig, generator=None) -> Proposal:
        """Draft ``block_size`` tokens after ``anchor`` (1,), the committed token at position ``state.length``."""
        raise NotImplementedError

    def config_dict(self) -> dict[str, Any]:
        """The init arguments that rebuild this drafter (stored in checkpoints)."""
        raise NotImplementedError


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def seeded_rand(seeds: Tensor, size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """(N,) int seeds -> (N, size) uniforms on the CPU, row i from its own generator seeded with ``seeds[i]``.

    CPU generators draw serially, so a row's first k values are the same whatever ``size`` is: a row draws the
    same values in a batch padded to any length, next to any neighbours, on any DDP rank.
    """
    out = torch.empty(len(seeds), size, dtype=dtype)
    for row, seed in zip(out, seeds.tolist()):
        row.uniform_(generator=torch.Generator().manual_seed(int(seed)))
    return out
