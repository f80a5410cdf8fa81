"""EDR, Expected Decoding Rounds (Zhao & Cai 2026, arXiv 2610.10411, §3): the objective parts.

Condition on a target rollout x. Round states are (n, t): the round started after the committed prefix x_{≤n}
(anchor n) and is verifying position t. With A_{n,t} = min(1, q_{n,t}(x_t) / p_t(x_t)) the Bayes acceptance of
the realised token and R = 1 - A, the chain moves (n, t) -> (n, t + 1) w.p. A and (n, t) -> (t, t + 1) w.p. R;
the bonus slot t = n + K + 1 always ends the round. Expected rounds = 1 + Σ_{n,t} ω_{n,t} c_{n,t} (Thm 1) with
occupancies ω (forward recursion) and the EOS-aware local cost c (Def. 1); its gradient is Theorem 2's
temporal-difference form Σ ω [∇c + ∇A (V_{n,t+1} - V_{t,t+1})] with V from the backward recursion (Eq. 12).

The chain itself (its structure, both recursions, the target's table, the slot statistics, the drafter from
every start) is ``lightning_spec/decoding/rounds.py``, shared with the offline evaluator. Here:
- ``inclusion_probabilities`` + ``systematic_sample``: at most ``max_anchors`` anchors per sequence, π_n =
  min(1, λ ω_{n,n+1}) with Σ π = budget (water-filling), drawn by random-start systematic sampling (each
  anchor is drawn with probability exactly π_n), weights sg(ω / π): an unbiased estimate of the full sum.
- The parts: ``EDROccupancy`` (a_n = sg(ω_{n,n+1} / π_n); it also chooses the anchors), ``EDRReach``
  (b = sg(Π_{s<t} A)), ``EDRCost`` (ℓ = c + A·sg(V_{n,t+1} - V_{t,t+1})), assembled by ``EDR``.

Train on target rollouts (``lightning-spec rollouts``, docs/data.md "Rollouts: the target's own answers") for the
estimate to be the expected rounds of real decoding: on other data, where the warped target gives the data's token
probability 0, A = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_spec.decoding.rounds import (
    Chain,
    ChainValues,
    TargetTable,
    chain,
    chain_dp,
    every_anchor,
    slot_statistics,
    target_table,
)
from lightning_spec.drafters.base import Anchors, DraftOutput, seeded_rand
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import PerAnchor, StepContext
from lightning_spec.objectives.losses import Loss
from lightning_spec.objectives.objective import DraftFn, Objective, TargetInfo
from lightning_spec.objectives.weights import AnchorWeight, PositionWeight
from lightning_spec.sampling import SamplingConfig


# ------------------------------------------------------------------------------------------- anchor sampling
def inclusion_probabilities(mass: Tensor, budget: int) -> Tensor:
    """π_n = min(1, λ·mass_n) per row, λ chosen so that Σ_n π_n = budget (water-filling); rows with at most
    ``budget`` positive masses get π = 1 on all of them (exact). mass (N, S) ≥ 0 -> π (N, S) float64."""
    mass = mass.double()
    positive = mass > 0
    s = mass.shape[-1]
    srt = mass.sort(-1, descending=True).values
    tail = srt.flip(-1).cumsum(-1).flip(-1)  # Σ_{j ≥ k} of the sorted masses
    k = torch.arange(s, device=mass.device, dtype=torch.float64)
    lam = (budget - k) / tail.clamp_min(1e-300)  # λ if the k largest are capped at 1
    ok = (lam * srt <= 1 + 1e-12) & (k < budget)  # the smallest such k is the water level
    lam_star = lam.gather(-1, ok.float().argmax(-1, keepdim=True))
    pi = (lam_star * mass).clamp(max=1)
    exact = positive.sum(-1, keepdim=True) <= budget
    return torch.where(exact, positive.double(), pi)


def systematic_sample(
    pi: Tensor, budget: int, generator: torch.Generator | None = None, seeds: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Random-start systematic sampling: unit n is drawn iff [C_{n-1}, C_n) (C the running sum of π) contains
    one of u, u + 1, ...; u ~ U[0, 1) per row. Each unit is drawn with probability exactly π_n ≤ 1, Σ π of
    them in all. Returns sorted indices (N, B) and keep (N, B), B ≤ budget.

    ``seeds`` (N,) int: row i draws its u from its own generator seeded with ``seeds[i]`` (the same draw in
    whatever batch or DDP rank the row lands); otherwise u comes from ``generator`` or the global RNG."""
    n, s = pi.shape
    c = pi.double().cumsum(-1)
    if seeds is not None:
        u = seeded_rand(seeds, 1, dtype=torch.float64)  # (N, 1)
    else:
        u = torch.rand(n, 1, dtype=torch.float64, generator=generator, device="cpu" if generator else pi.device)
    u = u.to(pi.device)
    prev = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], -1)
    drawn = (torch.floor(c - u) - torch.floor(prev - u)) > 0  # (N, S)
    width = max(1, min(budget, int(drawn.sum(-1).max())))
    pos = torch.arange(s, device=pi.device).expand(n, s)
    key = torch.where(drawn, pos, pos + s)  # drawn units first, in order
    index = key.sort(-1).values[:, :width]
    keep = index < s
    return torch.where(keep, index, torch.zeros_like(index)), keep


# ------------------------------------------------------------------------------------------------ the parts
@dataclass
class EDRBatch(PerAnchor):
    """What ``EDROccupancy.select_anchors`` leaves in ``ctx.extra["edr"]`` for the parts (no gradient)."""

    anchor_weight: Tensor  # (N, A) ω_{n,n+1} / π_n (0 for padding anchors)
    reach: Tensor  # (N, A, K) Π_{s<t} A_{n,s}
    advantage: Tensor  # (N, A, K) V_{n,t+1} - V_{t,t+1}
    mask: Tensor  # (N, A, K) bool: slots whose cost and acceptance matter (the generation's last token excluded)
    table: TargetTable
    draft_sampling: SamplingConfig

    def chunk(self, index: Tensor) -> EDRBatch:
        """The anchors ``index`` only (the objective is evaluated in chunks of anchors); the table is per position."""
        return EDRBatch(self.anchor_weight[:, index], self.reach[:, index], self.advantage[:, index],
                        self.mask[:, index], self.table, self.draft_sampling)


def _edr_batch(ctx: StepContext) -> EDRBatch:
    batch = ctx.extra.get("edr")
    if batch is None:
        raise UserError(
            "This EDR part needs EDROccupancy to choose the anchors: put EDROccupancy as the objective's "
            "anchor_weight (or use lightning_spec.objectives.EDR)."
        )
    return batch


def _like(x: Tensor, draft: DraftOutput) -> Tensor:
    return x.to(torch.float64 if draft.logits.dtype == torch.float64 else torch.float32)


class EDROccupancy(AnchorWeight):
    """EDR's anchor weight a_n = sg(ω_{n,n+1} / π_n) (Zhao & Cai 2026, arXiv 2610.10411, Table 1 "TD form"),
    and the part that chooses the anchors (Alg. 1, App. C.2):

    1. no gradient: the target's p_t at every position; the drafter from *every* supervised start, in chunks
       of ``chunk_size`` anchors; A and c (Def. 1) of every slot;
    2. both recursions (``chain_dp``, float64): occupancies ω, values V, TD advantages;
    3. π_n = min(1, λ ω_{n,n+1}) with Σ π = ``max_anchors`` per sequence (all starts, π = 1, when they fit),
       drawn by random-start systematic sampling;
    4. the module re-runs the drafter with gradient from the drawn anchors only (pass 2).

    Logs ``edr_expected_rounds`` (mean over generations of 1 + V at the first anchor, the estimate of
    E[#rounds], Thm 1) and ``edr_mal`` (Σ committed tokens / Σ expected rounds, bonus included).

    With another loss it gives occupancy-weighted training, e.g. ``Objective(CE, EDRReach, EDROccupancy)``:
    under greedy decoding (``sampling: {temperature: 0}``) that is CE on exactly the slots greedy decoding of
    the data verifies, up to and including each round's first miss.

    Args:
        sampling: the target distribution p the rollouts are decoded with (temperature, top-k, top-p); must
            match evaluation: lossless acceptance compares exactly the distributions tokens are drawn from.
        draft_sampling: the draft distribution q; None = the same config, as the decoding engine's drafter
            uses. The EDR paper drafts at the target's temperature without top-k/top-p: pass
            ``{temperature: T}`` for that. Temperature 0 = greedy drafting (statistics, no gradient).
        max_anchors: ρ, the anchor budget per sequence (EDR: 512).
        chunk_size: anchors per no-gradient drafter call in pass 1 (memory, not results).
    """

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        draft_sampling: SamplingConfig | None = None,
        max_anchors: int = 512,
        chunk_size: int = 64,
    ) -> None:
        if max_anchors < 1 or chunk_size < 1:
            raise UserError(f"max_anchors ({max_anchors}) and chunk_size ({chunk_size}) must be >= 1.")
        self.sampling = sampling
        self.draft_sampling = draft_sampling if draft_sampling is not None else sampling
        self.max_anchors = max_anchors
        self.chunk_size = chunk_size

    @torch.no_grad()
    def statistics(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[TargetTable, Chain, ChainValues]:
        """Pass 1 and the recursions: the no-gradient statistics from every supervised start."""
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        table = target_table(target.last_hidden, target.logits, ids, loss_mask, self.sampling, target.vocab,
                             target.eos_ids)
        stats = every_anchor(draft_fn, loss_mask, table, target.block_size, self.draft_sampling, self.chunk_size)
        ch = chain(loss_mask, target.block_size)
        return table, ch, chain_dp(stats.accept, stats.cost, ch)

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Anchors, dict[str, Any]]:
        table, ch, values = self.statistics(batch, draft_fn, target)
        with torch.no_grad():
            pi = inclusion_probabilities(values.start, self.max_anchors)  # (N, S)
            anchors, keep = systematic_sample(pi, self.max_anchors, seeds=batch.get("anchor_seed"))  # (N, A)
            n, na = anchors.shape
            k = values.reach.shape[-1]
            idx = anchors[..., None].expand(n, na, k)

            def at(x: Tensor) -> Tensor:
                return x.gather(1, idx)

            weight = values.start.gather(1, anchors) / pi.gather(1, anchors).clamp_min(1e-300) * keep
            mask = at(ch.exists & ~ch.terminal) & keep[..., None]
            edr = EDRBatch(weight, at(values.reach), at(values.advantage), mask, table, self.draft_sampling)
            rounds, generations = values.rounds.sum(), values.generations.sum()
            metrics = {
                "edr_expected_rounds": (rounds / generations.clamp_min(1)).float(),
                "edr_mal": (values.tokens.sum() / rounds.clamp_min(1e-12)).float(),
            }
        return Anchors(anchors, keep), {"edr": edr, "metrics": metrics}

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return _like(_edr_batch(ctx).anchor_weight, draft)  # (N, A)


class EDRReach(PositionWeight):
    """EDR's block-position weight in the TD form, b_{n,t} = sg(Π_{s<t} A_{n,s}) (Zhao & Cai 2026, Table 1):
    with ``EDROccupancy``, a_n b_{n,t} = sg(ω_{n,t} / π_n). Reads the statistics
    ``EDROccupancy`` computed."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return _like(_edr_batch(ctx).reach, draft)  # (N, A, K)


class EDRCost(Loss):
    """EDR's per-slot surrogate in the TD form, ℓ = c_{n,t} + A_{n,t}·sg(V_{n,t+1} - V_{t,t+1}) (Zhao & Cai
    2026, Table 1 and Theorem 2): c the EOS-aware local cost (Def. 1) and A the Bayes
    acceptance of the realised token, both with gradient, recomputed from the drafter's pass-2 logits with the
    distributions ``EDROccupancy`` was configured with. Its value is not the round count."""

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        edr = _edr_batch(ctx)
        accept, cost = slot_statistics(draft.logits, edr.table, draft.anchors, edr.draft_sampling)
        out = cost + accept * _like(edr.advantage, draft)
        return torch.where(edr.mask, out, torch.zeros_like(out))  # (N, A, K)


class EDR(Objective):
    """EDR, Expected Decoding Rounds (Zhao & Cai 2026, arXiv 2610.10411, §3): the TD surrogate

        L = (1 / #sequences) Σ_{n ∈ I} Σ_t sg(ω_{n,t} / π_n) [c_{n,t} + A_{n,t} sg(V_{n,t+1} - V_{t,t+1})],

    whose gradient is Theorem 2's unbiased gradient of the expected number of decoding rounds, with anchors I
    drawn by ``EDROccupancy``. One YAML block: ``EDRCost`` + ``EDRReach`` + ``EDROccupancy``. The bonus
    position's cost 1 is constant and left out of the surrogate; the round count itself is logged as
    ``train/edr_expected_rounds``.

    Args:
        sampling: the target distribution p (must match evaluation).
        draft_sampling: the draft distribution q (None = ``sampling``); greedy drafting has no gradient, use
            ``Objective(CE, EDRReach, EDROccupancy)`` for that.
        max_anchors: anchor budget per sequence (EDR: 512).
        chunk_size: anchors per no-gradient drafter call in pass 1.
        normalize: Z; ``sequences`` (the paper's 1/M over rollouts).
    """

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        draft_sampling: SamplingConfig | None = None,
        max_anchors: int = 512,
        chunk_size: int = 64,
        normalize: Literal["weight", "anchors", "slots", "sequences"] = "sequences",
    ) -> None:
        occupancy = EDROccupancy(sampling, draft_sampling, max_anchors, chunk_size)
        if occupancy.draft_sampling.greedy:
            raise UserError(
                "EDR's surrogate has no gradient under greedy drafting (draft_sampling.temperature = 0); use "
                "Objective(loss=CE, position_weight=EDRReach, anchor_weight=EDROccupancy) to weight CE by the "
                "greedy occupancies instead."
            )
        super().__init__(EDRCost(), EDRReach(), occupancy, normalize)
        # init arguments kept under their names: checkpoint.describe rebuilds the objective from them
        self.sampling, self.draft_sampling = sampling, draft_sampling
        self.max_anchors, self.chunk_size = max_anchors, chunk_size

    def slot_mask(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        return _edr_batch(ctx).mask  # out-of-vocabulary tokens still cost: not the drafter's ``valid``

