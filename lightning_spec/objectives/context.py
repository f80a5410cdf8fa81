"""StepContext: what the module gives an objective next to the drafter's ``DraftOutput``.

The drafter writes its draft output and nothing else writes to it. What a training step adds (the target's side of
every slot, a frozen reference drafter's logits, the objective's own scratch from ``select_anchors``, the share of
training done, the examples' seeds) travels here, written once by the module (``DraftModule.draft_step``). Every
part of the objective is called as ``part(draft, ctx)``: shapes of ``draft`` are the drafter's, (N, A, K) slots.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_spec.drafters.base import Drafter, DraftOutput
    from lightning_spec.target import Target


class PerAnchor:
    """Base of an objective's scratch values that hold one entry per anchor (``StepContext.extra``): when the
    objective is evaluated in chunks of anchors, ``StepContext.chunk`` slices them with ``chunk(index)``."""

    def chunk(self, index: Tensor) -> PerAnchor:
        """The anchors ``index`` (a,) only."""
        raise NotImplementedError(f"{type(self).__name__} must implement chunk")


class StepContext:
    """The values of one training step that the drafter does not own, each written by the module once.

    ``StepContext()`` is an objective called outside the module: no target side, no reference, no scratch, no
    progress, no seeds. The target's logits can be given as a tensor or lazily as ``target_hidden`` +
    ``target_head``: the objective then evaluates them in chunks of anchors (``chunk``), like the drafter's.

    Args:
        target_logits: (N, A, K, Vd) the target's logits over the draft vocabulary at position n + t - 1 (the
            shift: they predict x_{n+t}); the module gives them lazily, for objectives with ``needs_target``.
        target_hidden: (N, A, K, H) the target's final normed hidden state at n + t - 1, no gradient.
        target_head: (..., H) -> (..., Vd) turns ``target_hidden`` into ``target_logits`` (no gradient).
        reference_logits: (N, A, K, Vd) a frozen reference drafter's logits at the same anchors (the module gives
            them for objectives with ``needs_reference``, e.g. GRPO's KL to its starting drafter).
        extra: the objective's scratch space, what its ``select_anchors`` computed for its parts (EDR's statistics,
            Draft-OPD's rounds; ``extra["metrics"]`` is logged). Entries that are ``PerAnchor`` are sliced with the
            chunk; the rest are shared.
        progress: the share 0..1 of training done (parts with a schedule read it); None outside the module.
        seeds: (N,) the batch's per-example seeds (the module's ``anchor_seed``: a function of the example, not of
            its batch), for parts that draw their own randomness per example (GRPO's drafts); None without them.
    """

    __slots__ = ("_target_logits", "target_hidden", "target_head", "reference_logits", "extra", "progress", "seeds")

    def __init__(
        self,
        *,
        target_logits: Tensor | None = None,
        target_hidden: Tensor | None = None,
        target_head: Callable[[Tensor], Tensor] | None = None,
        reference_logits: Tensor | None = None,
        extra: dict[str, Any] | None = None,
        progress: float | None = None,
        seeds: Tensor | None = None,
    ) -> None:
        if target_hidden is not None and target_head is None:
            raise ValueError("StepContext's target_hidden needs its target_head.")
        self._target_logits, self.target_hidden, self.target_head = target_logits, target_hidden, target_head
        self.reference_logits = reference_logits
        self.extra = extra if extra is not None else {}
        self.progress = progress
        self.seeds = seeds

    @property
    def target_logits(self) -> Tensor | None:
        """(N, A, K, Vd), computed (once) from ``target_hidden`` when given lazily; None without a target side."""
        if self._target_logits is None and self.target_hidden is not None:
            self._target_logits = self.target_head(self.target_hidden)
        return self._target_logits

    def materialize(self) -> StepContext:
        """The lazy target logits computed over all anchors (and kept)."""
        _ = self.target_logits
        return self

    def chunk(self, index: Tensor) -> StepContext:
        """The anchors ``index`` (a,) only, the target's logits computed for them alone."""

        def take(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(1, index.to(x.device))

        target = take(self._target_logits)
        if target is None and self.target_hidden is not None:
            target = self.target_head(take(self.target_hidden))
        extra = {k: v.chunk(index) if isinstance(v, PerAnchor) else v for k, v in self.extra.items()}
        return StepContext(target_logits=target, reference_logits=take(self.reference_logits), extra=extra,
                           progress=self.progress, seeds=self.seeds)


def slot_hidden(anchors: Tensor, block_size: int, last_hidden: Tensor) -> Tensor:
    """The target's side of every slot (N, A, K, H), no gradient: its final hidden state (N, S, H) at position
    n + t - 1 for the anchor n (N, A) and slot t = 1..K, which predicts x_{n+t} (the shift). ``target_head`` turns
    it into logits lazily (an objective may evaluate them in chunks of anchors)."""
    n, a = anchors.shape
    pos = (anchors[..., None] + torch.arange(block_size, device=anchors.device)).clamp(max=last_hidden.shape[1] - 1)
    h = last_hidden.gather(1, pos.reshape(n, -1, 1).expand(-1, -1, last_hidden.shape[-1]))  # (N, A*K, H)
    return h.view(n, a, block_size, -1).detach()


class ReferenceDrafter:
    """The drafter as the fit started, frozen: what an objective that declares ``needs_reference`` regularises
    towards (GRPO's KL to the reference). Held in a list, so it is neither a submodule of the trained module nor in
    its checkpoints."""

    def __init__(self, drafter: Drafter) -> None:
        self._frozen = [copy.deepcopy(drafter).eval().requires_grad_(False)]

    @property
    def drafter(self) -> Drafter:
        return self._frozen[0]

    @torch.no_grad()
    def logits(self, draft: DraftOutput, batch: dict[str, Tensor], features: Tensor, anchors: Any,
               target: Target) -> Tensor:
        """Its logits (N, A, K, Vd) at the same anchors as ``draft``: the same chosen anchors, or the same seeded
        draw (``anchor_seed``) when the drafter samples them."""
        reference = self._frozen[0]
        if reference.vocab.ids.device != draft.valid.device:
            reference.to(draft.valid.device)
        reference.bind(target)
        ref = reference(batch, features, anchors)
        if not torch.equal(ref.anchors, draft.anchors):
            raise RuntimeError(
                "The reference drafter drew other anchors than the trained one; the objective's reference KL needs "
                "seeded anchors (batches with an 'index') or anchors chosen by the objective."
            )
        return ref.materialize().logits.detach()  # (N, A, K, Vd)
