"""Plain decoding of many prompts at once with the target alone: the loop that draws target rollouts.

``generate`` decodes one prompt, speculatively or not; drawing thousands of target responses (the rollouts of
the offline evaluator and of target-regenerated SFT) needs the target alone over a batch. Rows are left-padded
so that every row's next token sits in the last column; an attention mask and per-row position ids make each
row see exactly its own prompt at its own positions, so row ``i`` decodes what ``generate`` decodes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lightning_spec.decoding.engine import generate
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


@torch.no_grad()
def sample_batch(
    target: Target,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    sampling: SamplingConfig,
    max_new_tokens: int,
) -> list[tuple[list[int], bool]]:
    """Plain decoding of a batch of prompts with the target: ``[(response_ids, finished), ...]``.

    Left padding with an attention mask and per-row position ids, so a row's positions and visible keys are
    those of its prompt alone; a KV cache; a row leaves the batch at its EOS (its cache rows are dropped) and
    the others go on. Like ``generate``, the prefill covers each prompt but its last token, which is then the
    first decoding input. Row ``i`` samples with its own generator seeded with ``seeds[i]``, drawing what
    ``generate(target, prompts[i], max_new_tokens, sampling, seed=seeds[i])`` draws (same generator stream,
    same logits up to float rounding). ``finished`` is True when the response ends with an EOS id. A batch of one
    is ``generate`` itself: one sequence needs no padding, and runs the target's fast path (``FastForward``).
    """
    n, device = len(prompts), target.device
    if n == 1 and target.fast_decoding is None:
        out = generate(target, list(prompts[0]), max_new_tokens, sampling, seed=int(seeds[0]))
        return [(out.tokens, bool(out.tokens) and out.tokens[-1] in set(target.eos_token_ids))]
    eos = torch.tensor(sorted(set(target.eos_token_ids)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (N,)
    width = int(lengths.max())
    ids = torch.full((n, width), _pad_id(target), dtype=torch.long, device=device)  # (N, S)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long, device=device)
    mask = (torch.arange(width, device=device)[None] >= (width - lengths)[:, None]).long()  # (N, S)
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # (N, S) 0 at the first real token; pads get 0 (masked)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds] if not sampling.greedy else None

    cache = target.new_cache(dynamic=True)
    if width > 1:
        target.forward_left_padded(ids[:, :-1], mask[:, :-1], positions[:, :-1], cache)  # prefill
    rows = torch.arange(n, device=device)  # (n_active,) original row of each active batch row
    anchor, position, attention = ids[:, -1:], positions[:, -1:], mask  # (n, 1), (n, 1), (n, S)
    responses: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    for step in range(max_new_tokens):
        hidden = target.forward_left_padded(anchor, attention, position, cache)[:, -1]  # (n_active, H)
        logits = target.lm_head(hidden)  # (n_active, V)
        if sampling.greedy:
            nxt = logits.argmax(-1)  # (n_active,)
        else:
            probs = sampling.probs(logits).float().cpu()  # (n_active, V); CPU: the generators are CPU ones
            nxt = torch.stack([sampling.sample(probs[i], generators[int(r)]) for i, r in enumerate(rows.tolist())])
            nxt = nxt.to(device)
        stop = torch.isin(nxt, eos)  # (n_active,)
        for i, r in enumerate(rows.tolist()):
            responses[r].append(int(nxt[i]))
            finished[r] = bool(stop[i])
        keep = (~stop).nonzero()[:, 0]  # (n_keep,)
        if keep.numel() == 0 or step + 1 == max_new_tokens:
            break
        if keep.numel() < rows.numel():  # finished rows leave the batch
            cache.batch_select_indices(keep)
            rows, nxt, position, attention = rows[keep], nxt[keep], position[keep], attention[keep]
        anchor, position = nxt[:, None], position + 1
        attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
    return [(responses[r], finished[r]) for r in range(n)]


def _pad_id(target: Target) -> int:
    """The id left padding uses (masked, so any id would do): the tokenizer's pad token, else its EOS, else 0
    (``Target.tokenizer`` is None for a target built without one)."""
    tok = target.tokenizer
    for candidate in ((tok.pad_token_id, tok.eos_token_id) if tok is not None else ()):
        if candidate is not None:
            return int(candidate)
    return 0
