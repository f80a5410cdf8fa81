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

from collections.abc import Iterator
from typing import Any

import torch

from lightning_spec.decoding.engine import Generation


class ReplayBuffer(torch.utils.data.Dataset):
    """The training set of an on-policy fit: ``size`` replay examples (``replay_example``), renewed oldest first.

    ``OnPolicyRollouts`` (``callbacks/on_policy.py``) owns it: it ``fill``s it before training and ``put``s fresh
    rollouts in place of the oldest ones (a ring); ``SpecDataModule.train_on`` makes it the data module's training
    set. Its length stays ``size`` once filled, so Lightning's epoch length is fixed, and the loader reads the
    entries as they are when it draws them (a refresh mid-epoch is trained on from the next batch on).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.examples: list[dict[str, Any]] = []
        self.cursor = 0  # the ring position the next example replaces

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.examples)

    @property
    def full(self) -> bool:
        return len(self.examples) == self.size

    @property
    def domains(self) -> list[str]:
        """The domain of every entry, in order (domain weighting samples by them)."""
        return [e["domain"] for e in self.examples]

    def fill(self, examples: list[dict[str, Any]]) -> None:
        """Replace the whole buffer with ``size`` examples."""
        if len(examples) != self.size:
            raise RuntimeError(f"ReplayBuffer.fill got {len(examples)} examples for a buffer of {self.size}.")
        self.examples, self.cursor = list(examples), 0

    def put(self, examples: list[dict[str, Any]]) -> None:
        """Put ``examples`` in place of the oldest entries, in order."""
        for example in examples:
            self.examples[self.cursor] = example
            self.cursor = (self.cursor + 1) % self.size

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self.examples, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples = list(state.get("buffer", []))
        self.cursor = int(state.get("cursor", 0))


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
