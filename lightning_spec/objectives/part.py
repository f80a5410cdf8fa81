"""Part: what every part of the objective template (a loss ℓ, a position weight b, an anchor weight a) declares.

``Objective`` reads these declarations to tell the module what to provide; it never probes a part for
attributes or methods (``Loss``, ``PositionWeight`` and ``AnchorWeight`` derive from this class). ``TargetInfo``
and ``DraftFn`` are what a part that chooses its own anchors is given.

A part is called as ``part(draft, ctx)``: ``draft`` the drafter's ``DraftOutput`` (its logits, labels, valid
slots, aux heads), ``ctx`` the ``StepContext`` the module wrote (``context.py``: the target's logits per slot,
the reference drafter's, ``extra`` from ``select_anchors``, the training progress, the examples' seeds). A part
reads both and writes to neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab

if TYPE_CHECKING:
    from lightning_spec.target import Target


@dataclass
class TargetInfo:
    """What an objective that picks its own anchors may read: the frozen target's states (no gradient), and the
    drafter's vocabulary and block size.

    ``last_hidden[:, s]`` gives the target's distribution of the token at position s + 1 (the shift).
    """

    last_hidden: Tensor  # (N, S, H) final normed hidden states
    logits: Callable[[Tensor], Tensor]  # (..., H) -> (..., V) full-vocabulary target logits
    vocab: DraftVocab  # the drafter's draft vocabulary
    block_size: int  # the drafter's K
    eos_ids: list[int] = field(default_factory=list)  # target ids that end a generation

    @classmethod
    def of(cls, target: Target, drafter: Drafter, last_hidden: Tensor) -> TargetInfo:
        """The target's side of a training step (``last_hidden`` (N, S, H)) with the drafter's vocabulary and K."""
        head = target.lm_head
        return cls(last_hidden, lambda h: head(h.to(head.weight.dtype)).float(), drafter.vocab, drafter.block_size,
                   target.eos_token_ids)


DraftFn = Callable[[Anchors], DraftOutput]  # the drafter's training forward from chosen anchors


class Part:
    """A part of ``Objective``'s template.

    Declarations (override where true):
        needs_target: the part reads ``ctx.target_logits``; the module gives the target's side of every slot
            (a class attribute, or a property when it depends on the part's arguments).
        select_anchors: the part chooses the anchors itself (EDR's ``EDROccupancy``) and returns
            ``(anchors, extra)``; the default returns None: the drafter samples them. ``extra`` reaches the
            parts as ``ctx.extra``.
    """

    needs_target: bool = False

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Anchors, dict[str, Any]] | None:
        return None
