"""On-policy training examples: a prompt, the response our engine decoded with the current drafter, and what each
round of that decoding did (the verification-exposed states Draft-OPD replays; Lei et al. 2026, arXiv 2605.29343).

The engine is lossless, so the response is a sample of the target under the rollout's sampling config whatever the
drafter; the drafter only decides where the rounds started and which drafts were rejected. An example is an
ordinary training example (``input_ids``, ``loss_mask`` on the response, ``domain_id``, ``index``) plus

    round_starts   (R,)    the anchor position of every round (the last committed token when it began)
    rejected       (R, K)  the drafts each round submitted past its accepted ones (target ids; -1 elsewhere)
    rejected_logp  (R, K)  the target's log-probability of each, in the verification forward
    drawn_step     ()      the optimizer step whose drafter decoded it (staleness = step now - drawn_step)

Round r with anchor n_r and a accepted drafts commits x_{n_r+1..n_r+a+1}; the next round starts at n_r + a + 1. A
rejected draft at slot t of round r has offset t - a (1 = the first rejected one). ``collate`` (loaders.py) pads
these to (N, R), (N, R, K).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_spec.decoding.engine import Generation


def prompt_of(example: dict[str, Any]) -> list[int]:
    """A training example's prompt: its tokens before the first supervised (assistant) token, the generation header
    included (the chat template puts it outside the loss mask)."""
    mask = example["loss_mask"]
    first = int(mask.float().argmax()) if bool(mask.any()) else len(mask)
    return example["input_ids"][:first].tolist()


def replay_example(
    prompt: list[int], gen: Generation, block_size: int, all_rejected: bool = True, **fields: Any
) -> dict[str, Any] | None:
    """The training example of one traced ``generate`` call (``trace=True``), None when nothing was generated.

    ``all_rejected`` False keeps only the first rejected draft of each round: the one whose slot the drafter's
    teacher-forced training forward conditions on the same prefix as decoding did. A drafter whose slots read the
    tokens drafted before them (not ``parallel_slots``) saw a wrong prefix at the later ones. ``fields`` (domain,
    domain_id, index, id, drawn_step ...) are copied into the example."""
    if not gen.tokens:
        return None
    ids = torch.tensor(prompt + gen.tokens, dtype=torch.long)  # (S,)
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)
    loss_mask[len(prompt) :] = True
    rounds = gen.rounds
    starts = torch.empty(rounds, dtype=torch.long)  # (R,)
    rejected = torch.full((rounds, block_size), -1, dtype=torch.long)  # (R, K)
    rejected_logp = torch.zeros((rounds, block_size))  # (R, K)
    anchor, committed = len(prompt) - 1, 0
    for r, accepted in enumerate(gen.accept_lengths):
        starts[r] = anchor
        step = min(accepted + 1, len(gen.tokens) - committed)  # the last round may be cut by EOS or the budget
        if gen.drafts and step == accepted + 1:  # a whole round: its drafts past the accepted ones were rejected
            drafted, logp = gen.drafts[r], gen.draft_logp[r]
            last = len(drafted) if all_rejected else min(accepted + 1, len(drafted))
            for t in range(accepted, last):  # slot t + 1, offset t + 1 - accepted
                rejected[r, t] = drafted[t]
                rejected_logp[r, t] = logp[t]
        anchor += step
        committed += step
    return {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "round_starts": starts,
        "rejected": rejected,
        "rejected_logp": rejected_logp,
        **fields,
    }
