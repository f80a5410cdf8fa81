"""Part: what every part of the objective template (a loss ℓ, a position weight b, an anchor weight a) declares.

``Objective`` reads these declarations to tell the module what to provide; it never probes a part for
attributes or methods (``Loss``, ``PositionWeight`` and ``AnchorWeight`` derive from this class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from lightning_spec.drafters.base import Anchors
    from lightning_spec.objectives.objective import DraftFn, TargetInfo


class Part:
    """A part of ``Objective``'s template.

    Declarations (override where true):
        needs_target: the part reads ``draft.target_logits``; the module attaches the target's side of every slot
            (a class attribute, or a property when it depends on the part's arguments).
        select_anchors: the part chooses the anchors itself (EDR's ``EDROccupancy``) and returns
            ``(anchors, extra)``; the default returns None: the drafter samples them.
    """

    needs_target: bool = False

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Anchors, dict[str, Any]] | None:
        return None
