"""Block-position weights b_{n,t} and anchor weights a_n of the objective template (METHODS.md §3.1)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput


class PositionWeight:
    """b_{n,t}: returns (N, A, K); the template multiplies it by the valid mask."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        raise NotImplementedError


class Uniform(PositionWeight):
    """b_t = 1 for every slot."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        return torch.ones_like(draft.valid, dtype=torch.float32)  # (N, A, K)


class ExpDecay(PositionWeight):
    """b_t = exp(-(t - 1) / gamma), the DFlash block-position decay (METHODS.md §3.5, DFlash Eq. 4).

    Slot convention: t = 1..K counts *predictions* (the anchor is the input, DFlash style), so the first
    prediction gets weight 1. DSpark, whose anchor slot is itself a prediction, writes the same weights as
    exp(-k / gamma) with k = t - 1. gamma = 7 for DFlash B = 16; 4 for blocks of 7-8 (DeepSpec, ModelOpt).
    """

    def __init__(self, gamma: float = 7.0) -> None:
        if gamma <= 0:
            raise ValueError(f"position_weight.gamma must be > 0, got {gamma}.")
        self.gamma = gamma  # larger gamma: later slots matter more

    def __call__(self, draft: DraftOutput) -> Tensor:
        t = torch.arange(1, draft.block_size + 1, device=draft.logits.device, dtype=torch.float32)
        return torch.exp(-(t - 1) / self.gamma).expand(draft.valid.shape)  # (N, A, K)


class AnchorWeight:
    """a_n: returns (N, A)."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        raise NotImplementedError


class AnchorUniform(AnchorWeight):
    """a_n = 1 for every sampled anchor."""

    def __call__(self, draft: DraftOutput) -> Tensor:
        return torch.ones(draft.valid.shape[:2], device=draft.logits.device)  # (N, A)
