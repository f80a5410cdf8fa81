"""The one equation: every objective is L = Σ_n a_n Σ_t b_{n,t} ℓ_{n,t} / Z, composed from parts in YAML.

The template is EDR's (Zhao & Cai 2026, arXiv 2610.10411, §4.2, Table 1); the normaliser Z is an explicit choice
added here. A new objective is a new part, never a new training loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import CE, Loss, NegProb, TVMinusOne
from lightning_spec.objectives.part import DraftFn, TargetInfo
from lightning_spec.objectives.weights import (
    AnchorUniform,
    AnchorWeight,
    E2EWeight,
    EALWeight,
    PositionWeight,
    Uniform,
    WTVWeight,
)
from lightning_spec.sampling import SamplingConfig

NORMALIZE = ("weight", "anchors", "slots", "sequences")


@dataclass
class LossTerms:
    """Numerator and normaliser of one micro-batch. The module sums both across gradient accumulation and
    DDP ranks and divides once, so the gradient does not depend on how the batch was split.

    ``metrics`` are extra scalars the objective wants logged (the module logs them as ``train/<name>``), e.g.
    EDR's expected number of rounds, which the surrogate's value is not.
    """

    num: Tensor  # scalar, carries the gradient
    den: Tensor  # scalar, no gradient
    metrics: dict[str, Tensor] = field(default_factory=dict)

    @property
    def value(self) -> Tensor:
        return self.num.detach() / self.den.clamp_min(1e-12)



def check_loss_chunk(loss_chunk: int | None) -> None:
    """``model.loss_chunk`` is a number of anchors >= 1, or None (all anchors at once)."""
    if loss_chunk is not None and loss_chunk < 1:
        raise UserError(f"model.loss_chunk is {loss_chunk}; it must be >= 1 anchors, or null for no chunks.")


class Objective:
    """An objective composed of a per-slot loss, a block-position weight and an anchor weight.

    Args:
        loss: ℓ, e.g. ``CE``, ``KL``, ``TV``.
        position_weight: b, e.g. ``Uniform``, ``ExpDecay``.
        anchor_weight: a, e.g. ``AnchorUniform``.
        normalize: Z. ``weight`` = Σ a·b over valid slots (SpecForge DFlash); ``anchors`` = number of anchors
            with at least one valid slot; ``slots`` = number of valid slots (vLLM speculators); ``sequences`` =
            number of sequences with at least one valid slot (EDR: the loss per rollout).

    What the module reads, aggregated from the parts' declarations (``part.Part``):
        ``needs_target``: any part reads the target's logits per slot.
        ``select_anchors(batch, draft_fn, target) -> (anchors, extra) | None``: a part that chooses the anchors
        itself (EDR) returns them; ``None`` lets the drafter sample them. ``extra`` lands in ``ctx.extra`` for the
        parts to read; ``extra["metrics"]`` is returned in ``LossTerms.metrics``.
    And declared by the objective itself: ``needs_rollouts``, ``needs_reference`` (below).

    Called as ``objective(draft, ctx, chunk=...)``: the drafter's ``DraftOutput`` and the module's ``StepContext``
    (``context.py``), which every part, ``sums``, ``slot_mask`` and ``sequence_dens`` receive as they are, or
    sliced to a chunk of anchors.
    """

    def __init__(
        self,
        loss: Loss | None = None,
        position_weight: PositionWeight | None = None,
        anchor_weight: AnchorWeight | None = None,
        normalize: Literal["weight", "anchors", "slots", "sequences"] = "weight",
    ) -> None:
        self.loss = loss if loss is not None else CE()
        self.position_weight = position_weight if position_weight is not None else Uniform()
        self.anchor_weight = anchor_weight if anchor_weight is not None else AnchorUniform()
        if normalize not in NORMALIZE:
            choices = ", ".join(map(repr, NORMALIZE))
            raise UserError(f"objective.normalize must be one of {choices}, got {normalize!r}.")
        self.normalize = normalize

    #: trains on the rounds of on-policy rollouts (``DraftOPD``): the module refuses a fit without ``OnPolicyRollouts``
    needs_rollouts: bool = False
    #: reads the frozen starting drafter's logits (``GRPO``'s KL, ``ctx.reference_logits``): the module keeps a copy
    needs_reference: bool = False

    @property
    def parts(self) -> tuple[Any, ...]:
        return self.loss, self.position_weight, self.anchor_weight

    def check_fit(self, on_policy: bool) -> None:
        """Refuse, in one sentence, a fit this objective cannot train: one on rollouts without ``OnPolicyRollouts``."""
        if self.needs_rollouts and not on_policy:
            raise UserError(
                f"model.objective {type(self).__name__} trains on the rounds of on-policy rollouts; add "
                "lightning_spec.callbacks.OnPolicyRollouts to trainer.callbacks (see experiments/regimes/)."
            )

    @property
    def label(self) -> str:
        """A short name runs are compared by (MLflow's ``objective`` column): a ready-made objective's class
        (``E2E``, ``EDR``), else its parts that are not the default, e.g. ``KL + ExpDecay``."""
        if type(self) is not Objective:
            return type(self).__name__
        defaults = (Uniform, AnchorUniform)
        names = [type(self.loss).__name__] + [type(p).__name__ for p in self.parts[1:] if not isinstance(p, defaults)]
        return " + ".join(names)

    @property
    def needs_target(self) -> bool:
        """Whether any part reads ``ctx.target_logits`` (the OR over the parts' declarations)."""
        return any(part.needs_target for part in self.parts)

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Anchors, dict[str, Any]] | None:
        """Anchors chosen by a part (the anchor weight first), or None: the drafter samples them."""
        parts = (self.anchor_weight, self.position_weight, self.loss)
        chosen = [c for c in (p.select_anchors(batch, draft_fn, target) for p in parts) if c is not None]
        if len(chosen) > 1:
            raise UserError("At most one part of an objective may choose the anchors (select_anchors).")
        return chosen[0] if chosen else None

    def slot_mask(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        """(N, A, K) bool: the slots that count. Default: the drafter's ``valid`` (supervised, in the draft vocab)."""
        return draft.valid

    # ------------------------------------------------------------------------------------------ reduction
    def sums(self, draft: DraftOutput, ctx: StepContext) -> list[tuple[Tensor, Tensor]]:
        """[(num, den)] of this objective on ``draft`` (one pair; a mixture has one per component). Both are
        sums over anchors, except the ``sequences`` normaliser, which ``__call__`` takes from the whole batch."""
        if draft.sparse and not self.loss.reads_candidates:
            raise UserError(
                f"loss {type(self.loss).__name__} needs every token's draft probability, but this drafter's logits "
                "cover only each slot's candidates (DFlash2's selector); use lightning_spec.objectives.SelectorCE, "
                "which trains the selector and takes this loss as its base (experiments/drafters/dflash2.yaml)."
            )
        mask = self.slot_mask(draft, ctx)  # (N, A, K)
        valid = mask.float()
        ell = self.loss(draft, ctx)  # (N, A, K)
        w = self.anchor_weight(draft, ctx)[..., None] * self.position_weight(draft, ctx) * valid  # (N, A, K)
        num = (w * torch.where(mask, ell, torch.zeros_like(ell))).sum()
        if self.normalize == "weight":
            den = w.detach().sum()
        elif self.normalize == "anchors":
            den = mask.any(-1).sum().float()
        elif self.normalize == "sequences":
            den = mask.flatten(1).any(-1).sum().float()
        else:
            den = valid.sum()
        return [(num, den.to(num.dtype))]

    def sequence_dens(self, draft: DraftOutput, ctx: StepContext) -> list[Tensor | None]:
        """The ``sequences`` normalisers of the whole batch, per pair (None for the other normalisers)."""
        if self.normalize != "sequences":
            return [None]
        return [self.slot_mask(draft, ctx).flatten(1).any(-1).sum().float()]

    @property
    def num_pairs(self) -> int:
        """How many (num, den) pairs ``sums`` returns."""
        return 1

    def combine(self, pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """The (num, den) the module reduces, from ``sums``' pairs (summed over chunks), and metrics to log."""
        return pairs[0][0], pairs[0][1], {}

    def __call__(self, draft: DraftOutput, ctx: StepContext | None = None, chunk: int | None = None) -> LossTerms:
        """The loss terms of a batch; ``chunk`` anchors at a time when given. ``ctx`` None: ``StepContext()``, an
        objective called outside the module (no target side, no progress, no scratch).

        In chunks, each chunk's logits (draft and target) exist only while its terms are computed, and are
        recomputed in the backward pass (activation checkpointing): memory grows with ``chunk`` x K x Vd
        instead of A x K x Vd, for one more head forward per step. The result equals the unchunked one."""
        ctx = ctx if ctx is not None else StepContext()
        if chunk is None or draft.num_anchors <= chunk:
            pairs = self.sums(draft.materialize(), ctx.materialize())
        else:
            pairs = None
            for lo in range(0, draft.num_anchors, chunk):
                index = torch.arange(lo, min(lo + chunk, draft.num_anchors), device=draft.valid.device)
                flat = checkpoint(self._chunk_sums, draft, ctx, index, use_reentrant=False)
                part = list(zip(flat[::2], flat[1::2]))
                pairs = part if pairs is None else [(a + c, b + d) for (a, b), (c, d) in zip(pairs, part)]
            whole = self.sequence_dens(draft, ctx)
            pairs = [(num, den if full is None else full.to(den.dtype)) for (num, den), full in zip(pairs, whole)]
        num, den, metrics = self.combine(pairs)
        return LossTerms(num=num, den=den, metrics={**ctx.extra.get("metrics", {}), **metrics})

    def _chunk_sums(self, draft: DraftOutput, ctx: StepContext, index: Tensor) -> tuple[Tensor, ...]:
        return tuple(x for pair in self.sums(draft.chunk(index), ctx.chunk(index)) for x in pair)


# ------------------------------------------------------------------------------- ready-made loss/weight pairs
class E2E(Objective):
    """E2E-TV (Li et al. 2026c "Bebop", arXiv 2606.12370) as one YAML block:
    ℓ = TV - 1 (``TVMinusOne``) with b_t = Π_{s<t}(1 - TV_s) (``E2EWeight``, no stop-gradient), so a block
    contributes -Σ_k Π_{s≤k} α_s, minus its expected accepted length.

    Args:
        sampling: how p is formed from the target logits (and the draft temperature).
        normalize: Z; ``anchors`` makes the value minus the mean expected accepted length per block.
    """

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        normalize: Literal["weight", "anchors", "slots", "sequences"] = "anchors",
    ) -> None:
        super().__init__(TVMinusOne(sampling), E2EWeight(sampling), AnchorUniform(), normalize)
        self.sampling = sampling  # init arguments are kept under their names: checkpoint.describe rebuilds from them


class WTV(Objective):
    """WTV (Xia et al., arXiv 2609.24150) as one YAML block: L = -Σ_k Π_{j≤k} α^T_j with p and q both at
    temperature T (no top-k/top-p): ``TVMinusOne`` + ``WTVWeight`` at T. The formula is derived here from the
    paper's abstract, not stated in the paper.

    Args:
        temperature: T > 0.
        normalize: Z (``anchors``: minus the mean expected accepted length per block).
    """

    def __init__(
        self, temperature: float = 1.0, normalize: Literal["weight", "anchors", "slots", "sequences"] = "anchors"
    ) -> None:
        weight = WTVWeight(temperature)
        super().__init__(TVMinusOne(weight.sampling), weight, AnchorUniform(), normalize)
        self.temperature = temperature


class EAL(Objective):
    """EAL (Xia et al., arXiv 2609.24150) as one YAML block: L_EAL = -Σ_k Π_{j≤k} q_j(y*_j), ``NegProb`` +
    ``EALWeight`` (gradient through every product). The formula is derived here from the paper's abstract, not
    stated in the paper.

    Args:
        token: ``target_argmax`` (y* = argmax p) or ``gold``.
        normalize: Z (``anchors``: minus the mean EAL per block; ``slots`` ≈ the paper's optional 1/K).
    """

    def __init__(
        self,
        token: Literal["target_argmax", "gold"] = "target_argmax",
        normalize: Literal["weight", "anchors", "slots", "sequences"] = "anchors",
    ) -> None:
        super().__init__(NegProb(token), EALWeight(token), AnchorUniform(), normalize)
        self.token = token


# ------------------------------------------------------------------------------------------------ mixtures
class Mixture(Objective):
    """A weighted sum of objectives, each with its own parts and normaliser, e.g. DSpark's
    0.1·CE + 0.9·L1 with the decay on both (Cheng et al. 2026, arXiv 2607.05147, §3; L1 = 2·TV, so 1.8·TV here).

    Reduction. Component i returns (num_i, den_i); the mixture returns

        num = D·Σ_i w_i·num_i / den_i,   den = D,   D = den_0 (the first component's normaliser),

    so its value is Σ_i w_i·value_i. When every component has the same den (same ``normalize`` and the same
    weights, as DSpark's pair), D / den_i = 1 and this is exactly Σ_i w_i num_i / Σ den: the module's sum over
    micro-batches and ranks is then exactly invariant to how the batch is split. When the dens differ, each
    micro-batch contributes its own ratio den_0/den_i, so the global gradient is a den_0-weighted average of
    per-micro-batch mixtures: invariant only approximately (exactly if den_0/den_i is the same in every
    micro-batch). Keeping one (num, den) pair per component through the module would be exact but would
    change the module's reduction for every objective; give components the same ``normalize`` when it matters.

    At most one component may choose anchors (EDR); the others are evaluated on the same blocks.

    Args:
        objectives: the components.
        weights: w_i, one per component.
    """

    def __init__(self, objectives: list[Objective], weights: list[float]) -> None:
        if len(objectives) != len(weights) or not objectives:
            raise UserError(
                f"objective.objectives ({len(objectives)}) and objective.weights ({len(weights)}) must be "
                "non-empty lists of the same length."
            )
        self.objectives = list(objectives)
        self.weights = [float(w) for w in weights]

    @property
    def parts(self) -> tuple[Any, ...]:
        return tuple(self.objectives)

    @property
    def label(self) -> str:
        return " + ".join(f"{w:g}·{o.label}" for o, w in zip(self.objectives, self.weights))

    @property
    def needs_rollouts(self) -> bool:  # any component's needs are the mixture's
        return any(o.needs_rollouts for o in self.objectives)

    @property
    def needs_reference(self) -> bool:
        return any(o.needs_reference for o in self.objectives)

    def select_anchors(self, batch, draft_fn, target):
        chosen = [c for c in (o.select_anchors(batch, draft_fn, target) for o in self.objectives) if c is not None]
        if len(chosen) > 1:
            raise UserError("At most one component of a Mixture may choose the anchors (select_anchors).")
        return chosen[0] if chosen else None

    def slot_mask(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        masks = [o.slot_mask(draft, ctx) for o in self.objectives]
        return torch.stack(masks).any(0)

    def sums(self, draft: DraftOutput, ctx: StepContext) -> list[tuple[Tensor, Tensor]]:
        return [pair for o in self.objectives for pair in o.sums(draft, ctx)]

    def sequence_dens(self, draft: DraftOutput, ctx: StepContext) -> list[Tensor | None]:
        return [d for o in self.objectives for d in o.sequence_dens(draft, ctx)]

    @property
    def num_pairs(self) -> int:
        return sum(o.num_pairs for o in self.objectives)

    def combine(self, pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        parts, metrics, i = [], {}, 0
        for o in self.objectives:  # each component's own (num, den), nested mixtures included
            num, den, inner = o.combine(pairs[i : i + o.num_pairs])
            parts.append((num, den))
            metrics.update(inner)
            i += o.num_pairs
        for j, (num, den) in enumerate(parts):
            metrics[f"mixture/{j}"] = num.detach() / den.clamp_min(1e-12)
        d = parts[0][1]
        return sum(w * num * (d / den.clamp_min(1e-12)) for w, (num, den) in zip(self.weights, parts)), d, metrics
