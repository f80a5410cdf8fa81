"""What the tests of drafters that cut their blocks (DSpark's scheduler, AdaFlash's length head) share: the target's
logits attached to a training forward, and the draft lengths ``propose`` submits."""

import torch

from lightning_spec.drafters import DraftOutput
from lightning_spec.objectives import StepContext


def target_context(draft: DraftOutput, drafter, target, batch) -> StepContext:
    """The target's logits of every slot over the draft vocabulary (what the module gives the objective): position
    n + t - 1, (N, A, K, Vd)."""
    last = target(batch["input_ids"], logits=False).last_hidden  # (N, S, H)
    n, a, k = draft.valid.shape
    pos = (draft.anchors[..., None] + torch.arange(k)).clamp(max=last.shape[1] - 1).reshape(n, -1)
    h = last.gather(1, pos[..., None].expand(-1, -1, last.shape[-1])).view(n, a, k, -1)
    return StepContext(target_logits=drafter.head(h).detach())


def record_draft_lengths(drafter) -> list[int]:
    """The list every later ``drafter.propose`` appends its proposal's draft length to."""
    lengths = []
    propose = drafter.propose

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        lengths.append(proposal.num_drafted)
        return proposal

    drafter.propose = recording
    return lengths
