"""DFlash2's loss as one per-slot loss of the objective template (``objective.py``).

A DFlash2 drafter (``drafters/dflash2.py``) has two heads per slot: the unary logits u_t of its DFlash backbone over
the draft vocabulary, and the path selector's scores s_t over the k best tokens of u_t (-inf elsewhere), which is
what decoding draws from. Both are trained: the backbone as DFlash is (any dense loss: CE, KL, ...), the selector with
a k-way cross-entropy on the gold token (speculators #1006 trains the selector with an α-weighted k-way CE term).

A gold token outside the k candidates is **skipped** by the selector term (NeMo's rule; SpecForge injects it into the
candidate set instead): such a slot cannot be drafted whatever the selector scores, so injecting it would train the
pairwise term on a candidate set decoding never builds; the base term still pulls the token up into the top k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.drafters.base import DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.losses import CE, Loss, _upcast


class SelectorCE(Loss):
    """ℓ_t = base(u_t) + α · CE_k(s_t) · 1[x_t in C_t], with CE_k(s_t) = -log softmax_{c in C_t}(s_t)[x_t]
    (the module docstring). ``draft.logits`` are the selector's (sparse), ``draft.aux[branch]`` the unary head's.

    Args:
        alpha: α >= 0, the selector term's weight (1: as much as the backbone's).
        base: the loss on the unary logits (default ``CE``; ``KL`` trains the backbone against the target).
        branch: the ``draft.aux`` head holding the unary logits.
    """

    reads_candidates = True

    def __init__(self, alpha: float = 1.0, base: Loss | None = None, branch: str = "base_logits") -> None:
        if not alpha >= 0:
            raise UserError(f"loss.alpha must be >= 0 (the selector term's weight), got {alpha}.")
        self.alpha = alpha
        self.base = base if base is not None else CE()
        self.branch = branch
        if self.base.reads_candidates:
            raise UserError(f"loss.base must be a loss on the dense unary logits (CE, KL, ...), not "
                            f"{type(self.base).__name__}.")

    @property
    def needs_target(self) -> bool:  # the base loss may read the target (KL)
        return self.base.needs_target

    def __call__(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        if self.branch not in draft.aux:
            raise UserError(
                f"loss SelectorCE needs the drafter's unary head draft.aux[{self.branch!r}], which this drafter does "
                f"not give (it has {sorted(draft.aux) or 'none'}); use it with DFlash2Drafter or set loss.branch."
            )
        unary = draft.aux[self.branch]
        if callable(unary):  # a head not yet evaluated (the objective materialises or chunks it first)
            unary = unary(draft.hidden, torch.arange(draft.num_anchors, device=draft.valid.device))
        dense = DraftOutput(unary, draft.labels, draft.valid, draft.anchors, aux=draft.aux, drafted=draft.drafted)
        base = self.base(dense, ctx)  # (N, A, K)
        logq = _upcast(draft.logits).log_softmax(-1).gather(-1, draft.labels[..., None])[..., 0]  # (N, A, K)
        inside = torch.isfinite(logq)  # the gold token is one of the slot's candidates
        return base + self.alpha * torch.where(inside, -logq, torch.zeros_like(logq))
