"""The decoding loop: one engine for plain and speculative decoding, every drafter.

A round: the drafter proposes a block, one target forward verifies anchor + block, the rules of ``verify.py``
accept a prefix (greedy match or lossless rejection sampling), the accepted tokens and the bonus are committed,
the target cache is cropped and the drafter's context extended with the committed features.

Convention: the prefill covers the prompt *except its last token*; that token is the anchor of the first
round. So every new token is committed by some round, rounds = target verification forwards, and
MAL = len(tokens) / rounds exactly (bonus included) — the same accounting as EDR's offline evaluator.
Plain decoding is the same loop with an empty draft (K = 0).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
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

    @property
    def mal(self) -> float:
        """Tokens committed per round, bonus included."""
        return len(self.tokens) / max(self.rounds, 1)


def _as_ids(input_ids: Any, vocab_size: int, device: torch.device) -> Tensor:
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
        input_ids = input_ids["input_ids"]
    try:
        ids = torch.as_tensor(input_ids, device=device)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError("input_ids must be token ids: a non-empty list of ints, a 1-D tensor, or a (1, S) tensor.")
    ids = ids.long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"generate takes one prompt; input_ids has batch size {ids.shape[0]}.")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError("input_ids must be a non-empty list of ints, a 1-D tensor, or a (1, S) tensor.")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(
            f"input_ids holds token id {int(bad[0])}, outside the target's vocabulary 0..{vocab_size - 1}; "
            "tokenize the prompt with the target's own tokenizer (target.tokenizer)."
        )
    return ids[None]  # (1, S)


def _check_drafter(target: Any, drafter: Any) -> None:
    """The drafter must be bound to ``target`` or to another copy of the same weights (``load_drafter`` without a
    target may have loaded one); then it is re-bound to ``target``, whose embedding and LM head it borrows."""
    if drafter.target is target or drafter.target.model is target.model:
        return
    if drafter.target.fingerprint != target.fingerprint:
        raise ValueError(
            f"The drafter is bound to a different target ({drafter.target.name!r}, weights fingerprint "
            f"{drafter.target.fingerprint}) than the one passed to generate ({target.name!r}, {target.fingerprint}); "
            "load it with load_drafter(path, target=target) for the target it was trained for."
        )
    drafter.bind(target)


@torch.no_grad()
def generate(
    target: Any,
    input_ids: Any,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    drafter: Any = None,
    seed: int | None = None,
) -> Generation:
    """Decode one prompt with the target, speculatively when a drafter is given.

    ``input_ids``: one prompt (list of ints, 1-D or (1, S) tensor, or a tokenizer's output); ``sampling``: a
    ``SamplingConfig`` or a dict of its fields (None: greedy); ``drafter=None`` decodes plainly with the same code
    path; ``seed`` makes sampled decoding reproducible. Stops after ``max_new_tokens`` or the target's EOS."""
    sampling = SamplingConfig.coerce(sampling)
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")
    device = target.device
    ids = _as_ids(input_ids, target.vocab_size, device)
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    elif not sampling.greedy:
        generator = torch.Generator().manual_seed(torch.seed() % (2**63))
    eos = set(target.eos_token_ids)
    layers = list(drafter.target_layers) if drafter is not None else []
    k = drafter.block_size if drafter is not None else 0
    if drafter is not None:
        _check_drafter(target, drafter)

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
