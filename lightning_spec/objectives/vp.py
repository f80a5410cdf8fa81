"""The variable-prefix position weight of D²SD's VP-drafter loss (Zhang et al. 2026, arXiv 2606.04446, §3).

With l known tokens after the anchor (``D2SDDrafter``), slots 1..l are inputs and slot l + 1 is the first prediction:
the DFlash decay restarts there. ``Objective(loss=CE(), position_weight=VPDecay(tau))`` with the default
``normalize="weight"`` is the paper's

    L_VP = Σ_{t>l} w_t (-log q_t(x*_t)) / Σ_{t>l} w_t,   w_t = exp(-(t - l - 1) / tau).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.weights import PositionWeight


class VPDecay(PositionWeight):
    """b_t = exp(-(t - l - 1) / tau) for slots t > l, 0 for t <= l, with l the anchor's known prefix length read
    from ``draft.aux["prefix_length"]`` (N, A) (``D2SDDrafter`` puts it there). A drafter without a known prefix (every
    other DFlash-family drafter) has l = 0, where this is ``ExpDecay(tau)``.

    Args:
        tau: the decay length, > 0 (larger: later slots matter more); the paper's τ, DFlash's gamma.
    """

    def __init__(self, tau: float = 7.0) -> None:
        if not tau > 0:
            raise UserError(f"position_weight.tau must be > 0, got {tau}.")
        self.tau = tau

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        device = draft.valid.device
        prefix = draft.aux.get("prefix_length")
        length = torch.zeros(draft.valid.shape[:2], device=device) if prefix is None else prefix.to(device)  # (N, A)
        t = torch.arange(1, draft.block_size + 1, device=device, dtype=torch.float32)  # (K,)
        offset = t - length[..., None].float() - 1  # (N, A, K): 0 at the first predicted slot
        return torch.where(offset >= 0, torch.exp(-offset.clamp(min=0) / self.tau), torch.zeros_like(offset))
