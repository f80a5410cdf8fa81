"""Acceptance metrics as ratios of sums, with the sums added across DDP ranks before any ratio is taken.

MAL is pooled: Σ committed tokens / Σ rounds, bonus included — never a mean of per-prompt ratios, nor of per-rank
ratios. Conditional acceptance per slot AR_k = #rounds that accepted draft k / #rounds that reached draft k
(EDR eq. 19, DSpark §4.3.1). The decoding callbacks measure their share of the prompts (or rollouts) on every
rank, add the sums with ``reduce_sums`` (one collective) and divide with ``acceptance_metrics``, so every rank
logs the value one process would have measured. ``RatioOfSums`` is the same rule for a metric that goes through
Lightning's ``self.log`` (the validation loss), where torchmetrics does the adding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def slot_counts(
    accept_lengths: Sequence[int], block_size: int, draft_lengths: Sequence[int] | None = None
) -> tuple[Tensor, Tensor]:
    """(accepted, reached), each (K,) float64, from every round's accepted drafts ``a`` and submitted drafts ``d``
    (default K): the round verified slots 1..min(a + 1, d) and accepted slots 1..a. A slot a round did not draft
    (a variable-length proposal cut the block) is not counted as reached."""
    acc = torch.as_tensor(list(accept_lengths), dtype=torch.float64)  # (R,)
    drafted = acc.new_full(acc.shape, float(block_size))
    if draft_lengths is not None and len(draft_lengths):
        drafted = torch.as_tensor(list(draft_lengths), dtype=torch.float64)
    k = torch.arange(1, block_size + 1, dtype=torch.float64)  # (K,)
    reached = (acc[:, None] >= k - 1) & (drafted[:, None] >= k)
    return (acc[:, None] >= k).sum(0).double(), reached.sum(0).double()


def acceptance_sums(
    domain_sums: Mapping[str, tuple[float, float]], accepted: Tensor, reached: Tensor, domains: Sequence[str]
) -> dict[str, Tensor]:
    """The sums MAL and AR_k are ratios of, as float64 tensors laid out the same on every rank.

    ``domain_sums`` maps domain -> (Σ tokens, Σ rounds) of this rank's share (a domain it decoded nothing of is 0);
    ``domains`` are all the domains of the evaluation, in one order that every rank shares.
    """
    tokens = torch.tensor([float(domain_sums.get(d, (0.0, 0.0))[0]) for d in domains], dtype=torch.float64)  # (D,)
    rounds = torch.tensor([float(domain_sums.get(d, (0.0, 0.0))[1]) for d in domains], dtype=torch.float64)  # (D,)
    return {"tokens": tokens, "rounds": rounds, "accepted": accepted.double().cpu(), "reached": reached.double().cpu()}


def reduce_sums(trainer: Any, sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor of ``sums`` summed over the ranks of ``trainer`` in one all-reduce; float64 on the CPU.

    Every rank must pass the same keys with the same shapes (the collective lines them up by position). One
    process: the sums themselves.
    """
    if trainer.world_size == 1:
        return {key: value.double().cpu() for key, value in sums.items()}
    flat = [value.double().reshape(-1).cpu() for value in sums.values()]
    # on the strategy's device: NCCL reduces CUDA tensors only
    packed = trainer.strategy.reduce(torch.cat(flat).to(trainer.strategy.root_device), reduce_op="sum").cpu()
    parts = packed.split([t.numel() for t in flat])
    return {key: part.reshape(value.shape) for (key, value), part in zip(sums.items(), parts, strict=True)}


def acceptance_metrics(
    sums: Mapping[str, Tensor], domains: Sequence[str], mal: str, accept_rate: str
) -> dict[str, float]:
    """``<mal>`` (pooled over domains), ``<mal>/<domain>`` and ``<accept_rate>/t<k>`` for k = 1..K from the
    (reduced) ``acceptance_sums``."""
    tokens, rounds = sums["tokens"], sums["rounds"]
    out = {mal: ratio(tokens.sum(), rounds.sum())}
    out.update({f"{mal}/{d}": ratio(tokens[i], rounds[i]) for i, d in enumerate(domains)})
    rates = sums["accepted"] / sums["reached"].clamp_min(1e-12)  # (K,)
    out.update({f"{accept_rate}/t{k}": rate for k, rate in enumerate(rates.tolist(), start=1)})
    return out


def ratio(num: float | Tensor, den: float | Tensor) -> float:
    """num / den, 0 when both are 0 (nothing measured)."""
    return float(num) / max(float(den), 1e-12)


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


def global_totals(num: Tensor, den: Tensor, hits: Tensor, labels: Tensor,
                  reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One training step's (Σ num, Σ den, acceptance per slot (K,)) over the global batch: ``hits`` and ``labels``
    (N, A, K) bool counted per slot, everything summed over the DDP ranks in one all-reduce (``reduce``), so a logged
    value is a ratio of sums, the same as one process with the whole batch."""
    k = labels.shape[-1]
    sums = torch.cat([num.detach().double().view(1), den.detach().double().view(1), hits.sum((0, 1)).double(),
                      labels.sum((0, 1)).double()])
    if reduce is not None:
        sums = reduce(sums)
    return sums[0], sums[1], sums[2 : 2 + k] / sums[2 + k :].clamp_min(1)


def sum_over_ranks(trainer: Any) -> Callable[[Tensor], Tensor] | None:
    """The sum of a tensor over a Lightning ``trainer``'s DDP ranks (its strategy's all-reduce); None on one process."""
    if trainer.world_size == 1:
        return None
    return lambda t: trainer.strategy.reduce(t, reduce_op="sum")
