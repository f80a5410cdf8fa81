"""Prompt selection: which conversations' openings are decoded, by validation, evaluation and rollouts.

A prompt is ``{"id", "domain", "subdomain", "prompt_ids"}``: the conversation up to its first assistant turn,
chat-templated with the generation header (the input the target answers). A selection is deterministic and
spread out: a seeded shuffle, then rows taken in turn from each subdomain, so MT-Bench's 8 categories all
appear among 8 prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from lightning_spec.data.chat import prompt_ids
from lightning_spec.data.sources import as_source, load_source, normalize_text
from lightning_spec.errors import UserError


def opening(row: dict) -> list[dict]:
    """The messages before the first assistant turn: the prompt of a conversation."""
    messages = []
    for m in row["messages"]:
        if m["role"] == "assistant":
            break
        messages.append(m)
    return messages


def first_user(row: dict) -> str:
    """The whitespace-normalised first user message: conversations that share it share a prompt."""
    return normalize_text(next((m["content"] for m in row["messages"] if m["role"] == "user"), ""))


SHUFFLE_BLOCK = 1000  # rollout prompts are shuffled within blocks of this many source rows


def blockwise_shuffle(rows: Sequence[dict], seed: int) -> list[dict]:
    """``rows`` shuffled within consecutive blocks of ``SHUFFLE_BLOCK`` (block 0 seeded with ``seed``, as a set of
    at most 1000 rows always was; block b with ``"seed:b"``): rows read in whole blocks from a source come out in
    the same order whatever the number of blocks read, so a larger selection keeps a smaller one as its prefix."""
    out: list[dict] = []
    for b, lo in enumerate(range(0, len(rows), SHUFFLE_BLOCK)):
        block = list(rows[lo : lo + SHUFFLE_BLOCK])
        random.Random(seed if b == 0 else f"{seed}:{b}").shuffle(block)
        out += block
    return out


def round_robin(rows: Sequence[dict], count: int, seed: int | None) -> list[dict]:
    """The first ``count`` rows after a seeded shuffle (none with ``seed=None``), taken in turn from each
    subdomain."""
    rows = list(rows)
    if seed is not None:
        random.Random(seed).shuffle(rows)
    queues: dict[str, list[dict]] = {}
    for row in rows:
        queues.setdefault(row["subdomain"], []).append(row)
    order = sorted(queues)
    picked: list[dict] = []
    depth = 0
    while len(picked) < count and any(depth < len(q) for q in queues.values()):
        for sub in order:
            if depth < len(queues[sub]) and len(picked) < count:
                picked.append(queues[sub][depth])
        depth += 1
    return picked


def domain_prompts(
    tokenizer: Any, rows: Sequence[dict], per_domain: int, seed: int, chat_template_kwargs: dict | None = None
) -> list[dict]:
    """``per_domain`` prompts of every domain of ``rows`` (domains sorted), round-robin over subdomains: the
    held-out prompts validation decodes (``SpecDataModule.eval_prompts``); ``chat_template_kwargs`` reach the
    template."""
    by_domain: dict[str, list[dict]] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row)
    prompts = []
    for domain in sorted(by_domain):
        for row in round_robin(by_domain[domain], per_domain, seed):
            prompts.append(
                {
                    "id": row["id"],
                    "domain": domain,
                    "subdomain": row["subdomain"],
                    "prompt_ids": prompt_ids(tokenizer, opening(row), **(chat_template_kwargs or {})),
                }
            )
    return prompts


def select_prompts(
    tokenizer: Any,
    sources: Sequence[Any],
    prompts_per_source: int | None,
    seed: int,
    max_prompt_tokens: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict]:
    """Prompts from each source: the conversation up to its first assistant turn, chat-templated with the
    generation header (as ``SpecDataModule.eval_prompts``), ``prompts_per_source`` per source spread over its
    subdomains (a seeded shuffle within blocks of 1000 source rows, then round-robin: MT-Bench's 8 categories all
    appear in 8 prompts). A larger ``prompts_per_source`` keeps the smaller selection as its prefix (wherever no
    subdomain runs out of prompts first), so extending a rollouts run only adds. ``max(1000, 10 ×
    prompts_per_source)`` conversations, rounded up to whole blocks, are read per source unless it sets ``limit``.
    ``max_prompt_tokens`` skips longer prompts before the selection (ShareGPT openings run to thousands of
    tokens; batched decoding pads every row to the longest prompt of its batch). Each prompt also carries the source
    conversation's ``messages`` (its later user turns, for multi-turn regeneration); ``chat_template_kwargs`` reach
    the chat template.
    """
    prompts: list[dict] = []
    seen: set[str] = set()
    ids: dict[tuple[int, str], list[int]] = {}  # (source, row id) -> chat-templated prompt, tokenized once

    def tokens(k: int, row: dict) -> list[int]:
        if (k, row["id"]) not in ids:
            ids[k, row["id"]] = prompt_ids(tokenizer, opening(row), **(chat_template_kwargs or {}))
        return ids[k, row["id"]]

    for k, source in enumerate(as_source(s) for s in sources):
        pool = None if prompts_per_source is None else -(-max(1000, 10 * prompts_per_source) // SHUFFLE_BLOCK)
        rows = load_source(source, limit=None if pool is None else pool * SHUFFLE_BLOCK).to_list()
        if prompts_per_source is not None:
            rows = blockwise_shuffle(rows, seed)  # before the length filter: the blocks are the source's rows
        if not rows:
            raise UserError(f"--sources[{k}] ('{source.name}') gave no usable prompts; check the name or path.")
        if max_prompt_tokens is not None:
            rows = [row for row in rows if len(tokens(k, row)) <= max_prompt_tokens]
            if not rows:
                raise UserError(
                    f"--sources[{k}] ('{source.name}') has no prompt of at most --max_prompt_tokens="
                    f"{max_prompt_tokens} tokens; raise it."
                )
        picked = rows if prompts_per_source is None else round_robin(rows, prompts_per_source, None)
        for row in picked:
            if row["id"] in seen:  # the same conversation twice (ShareGPT repeats some ids)
                continue
            seen.add(row["id"])
            prompts.append(
                {
                    "id": row["id"],
                    "domain": row["domain"],
                    "subdomain": row["subdomain"],
                    "prompt_ids": tokens(k, row),
                    "messages": row["messages"],
                }
            )
    return prompts
