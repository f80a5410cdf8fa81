"""Decoding metrics as torchmetrics, so they sum across DDP ranks before the ratio is taken.

MAL is pooled: Σ tokens / Σ rounds, bonus included (METHODS.md §1.3) — never a mean of per-prompt ratios.
Conditional acceptance per slot AR_k = #rounds that accepted draft k / #rounds that reached draft k
(EDR eq. 19, DSpark §4.3.1).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class MeanAcceptedLength(Metric):
    """Σ committed tokens / Σ rounds."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rounds", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, tokens: int, rounds: int) -> None:
        self.tokens += tokens
        self.rounds += rounds

    def compute(self) -> Tensor:
        return (self.tokens / self.rounds.clamp_min(1)).float()


class SlotAcceptance(Metric):
    """AR_k for k = 1..K from the accepted-draft counts of each round."""

    full_state_update = False

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.add_state("reached", default=torch.zeros(block_size, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("accepted", default=torch.zeros(block_size, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, accept_lengths: list[int]) -> None:
        acc = torch.as_tensor(accept_lengths, dtype=torch.float64, device=self.reached.device)  # (R,)
        k = torch.arange(1, self.block_size + 1, dtype=torch.float64, device=acc.device)  # (K,)
        self.reached += (acc[:, None] >= k - 1).sum(0)
        self.accepted += (acc[:, None] >= k).sum(0)

    def compute(self) -> Tensor:
        return (self.accepted / self.reached.clamp_min(1)).float()  # (K,)


class RatioOfSums(Metric):
    """A pair of sums (numerator, denominator) reduced across ranks; compute gives their ratio."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("num", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("den", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num: float | Tensor, den: float | Tensor) -> None:
        self.num += torch.as_tensor(num, dtype=torch.float64, device=self.num.device)
        self.den += torch.as_tensor(den, dtype=torch.float64, device=self.den.device)

    def compute(self) -> Tensor:
        return (self.num / self.den.clamp_min(1e-12)).float()
