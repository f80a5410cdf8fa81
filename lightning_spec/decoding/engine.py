"""The decoding loop: one engine for plain and speculative decoding, every drafter (DESIGN.md "Data flow").

Convention: the prefill covers the prompt *except its last token*; that token is the anchor of the first
round. So every new token is committed by some round, rounds = target verification forwards, and
MAL = len(tokens) / rounds exactly (bonus included) — the same accounting as EDR's offline evaluator.
Plain decoding is the same loop with an empty draft (K = 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding import verify
from lightning_spec.sampling import SamplingConfig


@dataclass
class Generation:
    """The result of one ``generate`` call."""

    tokens: list[int]  # new tokens only (EOS included when generated)
    accept_lengths: list[int]  # accepted draft tokens per round, bonus excluded
    rounds: int  # target verification forwards
    seconds: float  # wall time of the whole call (prefill included)
    draft_seconds: float = 0.0  # time inside drafter.propose
    verify_seconds: float = 0.0  # time inside the target verify forwards
    block_size: int = 0  # K used (0 for plain decoding)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mal(self) -> float:
        """Tokens committed per round, bonus included."""
        return len(self.tokens) / max(self.rounds, 1)


def _as_ids(input_ids: Any, device: torch.device) -> Tensor:
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
        input_ids = input_ids["input_ids"]
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate takes one prompt; input_ids has batch size {ids.shape[0]}.")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("input_ids must be a non-empty list of ints, a 1-D tensor, or a (1, S) tensor.")
    return ids[None]  # (1, S)


@torch.no_grad()
def generate(
    target: Any,
    input_ids: Any,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    drafter: Any = None,
    seed: int | None = None,
) -> Generation:
    """Decode one prompt with the target, speculatively when a drafter is given. See DESIGN.md "Public API"."""
    sampling = sampling or SamplingConfig()
    device = target.device
    ids = _as_ids(input_ids, device)
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    elif not sampling.greedy:
        generator = torch.Generator().manual_seed(torch.seed() % (2**63))
    eos = set(target.eos_token_ids)
    layers = list(drafter.target_layers) if drafter is not None else []
    k = drafter.block_size if drafter is not None else 0
    if drafter is not None and drafter.target is not target and drafter.target.model is not target.model:
        raise ValueError("The drafter is bound to a different target than the one passed to generate.")

    start = time.perf_counter()
    cache = target.new_cache()
    state = None
    if ids.shape[1] > 1:
        out = target(ids[:, :-1], layers=layers, cache=cache, logits=False)  # prefill, no logits needed
        if drafter is not None:
            state = drafter.begin(out.features)
    elif drafter is not None:
        state = drafter.begin(torch.zeros(1, 0, len(layers) * target.hidden_size, device=device))
    anchor = ids[0, -1:]  # (1,)
    tokens: list[int] = []
    accept_lengths: list[int] = []
    t_draft = t_verify = 0.0
    while len(tokens) < max_new_tokens:
        t0 = time.perf_counter()
        proposal = drafter.propose(state, anchor, sampling, generator) if drafter is not None else None
        t1 = time.perf_counter()
        block = anchor if proposal is None else torch.cat([anchor, proposal.tokens])  # (K + 1,)
        past = cache.get_seq_length()
        out = target(block[None], layers=layers, cache=cache)
        t_verify += time.perf_counter() - t1
        t_draft += t1 - t0
        logits = out.logits[0]  # (K + 1, V)
        draft = block[1:]
        if sampling.greedy:
            accepted, nxt = verify.greedy_accept(draft, logits.argmax(-1))
        else:
            p = sampling.probs(logits)  # (K + 1, V)
            q = proposal.probs if proposal is not None else p.new_zeros(0, p.shape[-1])
            accepted, nxt = verify.rejection_accept(draft, q, p, generator)
        new = draft[:accepted].tolist() + [nxt]
        # commit up to EOS and the token budget
        for i, tok in enumerate(new):
            if tok in eos:
                new = new[: i + 1]
                break
        new = new[: max_new_tokens - len(tokens)]
        tokens.extend(new)
        accept_lengths.append(min(accepted, len(new)))
        if new[-1] in eos or len(tokens) >= max_new_tokens:
            break
        # keep the anchor and the accepted drafts in the caches; the committed next token is the new anchor
        target.crop(cache, past + 1 + accepted)
        if drafter is not None:
            drafter.extend(state, out.features[:, : 1 + accepted])
        anchor = torch.tensor([nxt], device=device)
    return Generation(
        tokens=tokens,
        accept_lengths=accept_lengths,
        rounds=len(accept_lengths),
        seconds=time.perf_counter() - start,
        draft_seconds=t_draft,
        verify_seconds=t_verify,
        block_size=k,
    )
