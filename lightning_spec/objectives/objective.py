"""The one equation (DESIGN.md): L = Σ_n a_n Σ_t b_{n,t} ℓ_{n,t} / Z, composed from parts in YAML."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.objectives.losses import CE, Loss
from lightning_spec.objectives.weights import AnchorUniform, AnchorWeight, PositionWeight, Uniform


@dataclass
class LossTerms:
    """Numerator and normaliser of one micro-batch. The module sums both across gradient accumulation and
    DDP ranks and divides once, so the gradient does not depend on how the batch was split."""

    num: Tensor  # scalar, carries the gradient
    den: Tensor  # scalar, no gradient

    @property
    def value(self) -> Tensor:
        return self.num.detach() / self.den.clamp_min(1e-12)


class Objective:
    """An objective composed of a per-slot loss, a block-position weight and an anchor weight.

    Args:
        loss: ℓ, e.g. ``CE``, ``KL``, ``TV``.
        position_weight: b, e.g. ``Uniform``, ``ExpDecay``.
        anchor_weight: a, e.g. ``AnchorUniform``.
        normalize: Z. ``weight`` = Σ a·b over valid slots (SpecForge DFlash); ``anchors`` = number of anchors
            with at least one valid slot; ``slots`` = number of valid slots (vLLM speculators).
    """

    def __init__(
        self,
        loss: Loss | None = None,
        position_weight: PositionWeight | None = None,
        anchor_weight: AnchorWeight | None = None,
        normalize: Literal["weight", "anchors", "slots"] = "weight",
    ) -> None:
        self.loss = loss if loss is not None else CE()
        self.position_weight = position_weight if position_weight is not None else Uniform()
        self.anchor_weight = anchor_weight if anchor_weight is not None else AnchorUniform()
        if normalize not in ("weight", "anchors", "slots"):
            raise ValueError(f"objective.normalize must be 'weight', 'anchors' or 'slots', got {normalize!r}.")
        self.normalize = normalize

    @property
    def needs_target(self) -> bool:
        return self.loss.needs_target

    def __call__(self, draft: DraftOutput) -> LossTerms:
        valid = draft.valid.float()  # (N, A, K)
        ell = self.loss(draft)  # (N, A, K)
        w = self.anchor_weight(draft)[..., None] * self.position_weight(draft) * valid  # (N, A, K)
        num = (w * torch.where(draft.valid, ell, torch.zeros_like(ell))).sum()
        if self.normalize == "weight":
            den = w.detach().sum()
        elif self.normalize == "anchors":
            den = draft.valid.any(-1).sum().float()
        else:
            den = valid.sum()
        return LossTerms(num=num, den=den)
