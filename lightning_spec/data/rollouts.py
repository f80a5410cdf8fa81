"""Target rollouts: responses sampled from the target itself, stored with what they were drawn under.

They feed the exact offline evaluator (EDR §3.4: the expected rounds of a drafter are exact on target rollouts
that end with EOS, several per prompt, drawn under the SAME sampling config as the evaluation) and
target-regenerated SFT (keep the prompts, regenerate the responses with the target: the drafter then learns
the target's own distribution).

A rollouts folder is ``datasets.Dataset.save_to_disk(folder)`` plus ``folder/rollouts.json``:

    prompt_id: str   sample: int (0..n-1)   domain: str   subdomain: str
    prompt_ids: list[int]     the first turn's chat-templated prompt, generation header included
    response_ids: list[int]   the first turn's generated tokens, EOS included when generated
    finished: bool            the first turn ended with an EOS id (False: stopped at max_new_tokens)
    messages: list[{role, content}]   the conversation with every regenerated assistant turn, as text
    turns: int                the assistant turns regenerated (1 for a single prompt)

``rollouts.json`` records the target spec and its weight fingerprint, the sampling config, the seed, the
tokenizer, the EOS ids, max_new_tokens, n_per_prompt, the engine (``local``, or ``server`` with its URL and served
model), max_turns, the chat-template arguments, the sources and the creation time (``format`` 2; format 1 folders,
first turns without ``messages``, still read).
``rollout_writer.py`` writes such folders (resumably); this file reads them, checks them against a target and
a sampling config, and holds them in memory as a ``RolloutSet``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch

from lightning_spec.data.rollout_archive import is_archive, unpacked
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target

FORMAT = 2
READS = (1, 2)  # format 1: no messages/turns (first turns only)
META_FILE = "rollouts.json"
SHARD_DIR = "shards"
RUN_FILE = "run.json"  # inside shards/: what the run in progress draws under, checked before resuming
COLUMNS = ("prompt_id", "sample", "domain", "subdomain", "prompt_ids", "response_ids", "finished", "messages", "turns")
FEATURES = datasets.Features(
    {
        "prompt_id": datasets.Value("string"),
        "sample": datasets.Value("int64"),
        "domain": datasets.Value("string"),
        "subdomain": datasets.Value("string"),
        "prompt_ids": datasets.List(datasets.Value("int32")),
        "response_ids": datasets.List(datasets.Value("int32")),
        "finished": datasets.Value("bool"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "turns": datasets.Value("int32"),
    }
)
DEFAULT_DOMAIN = "default"  # the domain of rollouts that carry none (a list of pairs)


# ------------------------------------------------------------------------------------------------ metadata


def same_sampling(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal configs; every greedy config (temperature 0) is the same distribution whatever top_p/top_k say."""
    if float(a["temperature"]) == 0 and float(b["temperature"]) == 0:
        return True
    return all(float(a[k]) == float(b[k]) for k in ("temperature", "top_p", "top_k"))


def describe_sampling(s: dict[str, Any]) -> str:
    return f"temperature={s['temperature']}, top_p={s['top_p']}, top_k={s['top_k']}"


def is_rollouts_folder(path: str | os.PathLike) -> bool:
    """A folder written by ``generate_rollouts`` (finished or not), or a finished one packed into an archive
    (``rollout_archive.py``), which reads the same."""
    path = Path(path).expanduser()
    if is_archive(path):
        return True
    return path.is_dir() and ((path / META_FILE).is_file() or (path / SHARD_DIR / RUN_FILE).is_file())


def load_rollouts(folder: str | os.PathLike) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The rollouts dataset of ``folder`` (or of an archive, unpacked once into the cache) and its ``rollouts.json``
    metadata."""
    path = Path(folder).expanduser()
    if is_archive(path):
        path = unpacked(path)
    if not (path / META_FILE).is_file():
        if (path / SHARD_DIR / RUN_FILE).is_file():
            raise UserError(
                f"{folder} holds an unfinished rollouts run (shards, no {META_FILE}); rerun the same "
                "`lightning-spec rollouts` command to finish it."
            )
        raise UserError(
            f"{folder} is not a rollouts folder (no {META_FILE}); make one with `lightning-spec rollouts --out "
            f"{folder} ...`."
        )
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") not in READS:
        raise UserError(
            f"{folder} has rollouts format {meta.get('format')!r}, this version reads formats {READS}; regenerate "
            "them with `lightning-spec rollouts`."
        )
    return datasets.load_from_disk(str(path)), meta


def check_compatible(meta: dict[str, Any], target: Target, sampling: SamplingConfig, folder: str | None = None) -> None:
    """Refuse rollouts drawn from another target (weight fingerprint) or under another sampling config.

    ``target`` is a ``Target`` (its ``fingerprint`` and ``name`` are compared); ``folder`` names the rollouts
    in the message (default: ``meta["folder"]`` when present).
    """
    where = folder or meta.get("folder") or "this rollouts set"
    if meta.get("target_fingerprint") not in target.fingerprints:
        raise UserError(
            f"rollouts in {where} were drawn from target '{meta.get('target')}' (fingerprint "
            f"{meta.get('target_fingerprint')}); this run uses '{target.name}' (fingerprint {target.fingerprint}) — "
            f"regenerate them with `lightning-spec rollouts --target {target.name} ...` or use the target they "
            "were drawn from."
        )
    ours = sampling.to_dict()
    if not same_sampling(meta["sampling"], ours):
        theirs = meta["sampling"]
        raise UserError(
            f"rollouts in {where} were drawn under sampling {describe_sampling(theirs)}; this run uses "
            f"{describe_sampling(ours)} — regenerate them with `lightning-spec rollouts --temperature "
            f"{ours['temperature']} --top_p {ours['top_p']} --top_k {ours['top_k']} ...` or pass the matching "
            f"sampling ({describe_sampling(theirs)})."
        )


def check_rollouts(meta: dict[str, Any] | None, target: Target, sampling: SamplingConfig, source: str = "") -> None:
    """Refuse rollouts drawn from another target or under another sampling config (``check_compatible``);
    rollouts without metadata (a list of pairs, a bare dataset) cannot be checked."""
    if meta is not None:
        check_compatible(meta, target, sampling, folder=source or None)


def rollout_sampling(meta: dict[str, Any] | None) -> SamplingConfig | None:
    """The ``SamplingConfig`` recorded in a rollouts folder's metadata (None without one)."""
    drawn = (meta or {}).get("sampling")
    return SamplingConfig.from_dict(drawn) if drawn is not None else None


# ---------------------------------------------------------------------------------------------- in memory


@dataclass
class RolloutSet:
    """Rollouts as plain lists (one entry per rollout) plus the folder's metadata when there is one."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    domains: list[str]
    prompt_keys: list[str]  # the prompt a rollout belongs to: bootstrap clusters (all samples of a prompt)
    finished: list[bool]  # ended with EOS (True when unknown)
    meta: dict[str, Any] | None = None
    source: str = ""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def subset(self, index: Sequence[int]) -> RolloutSet:
        pick = lambda xs: [xs[i] for i in index]  # noqa: E731
        return RolloutSet(
            pick(self.prompt_ids), pick(self.response_ids), pick(self.domains), pick(self.prompt_keys),
            pick(self.finished), self.meta, self.source,
        )


def _prompt_key(prompt: Sequence[int]) -> str:
    return hashlib.sha1(torch.tensor(list(prompt), dtype=torch.int64).numpy().tobytes()).hexdigest()[:12]


_PAIRS = "each rollout is a (prompt_ids, response_ids) pair or a dict with those keys"


def _token_ids(value: Any, where: str) -> list[int]:
    """One sequence of token ids as ints: a list of ints, a 1-D or (1, S) integer tensor or array, or (for a
    prompt) a tokenizer's output, whose ``input_ids`` are taken. Anything else is refused in one sentence."""
    if isinstance(value, Mapping) and "input_ids" in value:  # a tokenizer's BatchEncoding
        value = value["input_ids"]
    ids = None
    if not isinstance(value, (str, bytes)):
        try:
            ids = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            ids = None
    if ids is not None and ids.dim() == 2 and ids.shape[0] == 1:  # a batch of one (return_tensors="pt")
        ids = ids[0]
    if ids is not None and ids.dim() == 1 and ids.numel() == 0:  # an empty response ([] reads as float)
        return []
    if ids is None or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        shown = f"{type(value).__name__} {value!r}"[:80]
        raise UserError(
            f"rollouts: {where} is a {shown}, not one sequence of token ids; pass a list of ints, a 1-D tensor or "
            "a tokenizer's output (tokenizer(text)), one sequence per rollout."
        )
    return ids.tolist()


def _check_vocab(ids: list[int], where: str, vocab_size: int | None) -> None:
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        span = f"0..{vocab_size - 1}" if vocab_size is not None else "(ids are >= 0)"
        raise UserError(
            f"rollouts: {where} holds token id {bad}, outside the target's vocabulary {span}; rollouts must be "
            "token ids of this target's tokenizer (draw them with `lightning-spec rollouts --target ...`)."
        )


def _as_row(i: int, item: Any) -> Mapping[str, Any]:
    if isinstance(item, Mapping):
        missing = [k for k in ("prompt_ids", "response_ids") if k not in item]
        if missing:
            raise UserError(f"rollouts: rollout {i} is a mapping without {' and '.join(missing)}; {_PAIRS}.")
        return item
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        shown = f"{type(item).__name__}" + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
        raise UserError(f"rollouts: rollout {i} is a {shown}; {_PAIRS}.")
    return {"prompt_ids": item[0], "response_ids": item[1]}


def load_rollout_set(rollouts: Any, vocab_size: int | None = None) -> RolloutSet:
    """A ``RolloutSet`` from a rollouts folder, a ``datasets.Dataset`` (the rollouts columns), a list of
    ``(prompt_ids, response_ids)`` pairs or of dicts with those keys, or a ``RolloutSet``.

    Token ids are checked: a prompt may be a tokenizer's output (its ``input_ids``); strings, floats, nested
    batches and negative ids are refused. With ``vocab_size`` (the target's) ids beyond it are refused too,
    for rollouts without metadata: a folder's were drawn by the target its fingerprint names (``check_rollouts``).
    """
    if isinstance(rollouts, RolloutSet):
        if vocab_size is not None and rollouts.meta is None:
            for i, (p, r) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids)):
                _check_vocab(p, f"rollout {i}'s prompt", vocab_size)
                _check_vocab(r, f"rollout {i}'s response", vocab_size)
        return rollouts
    meta, source = None, ""
    if isinstance(rollouts, (str, os.PathLike)):
        source = str(rollouts)
        rollouts, meta = load_rollouts(rollouts)
    if isinstance(rollouts, datasets.Dataset):
        cols = set(rollouts.column_names)
        if not {"prompt_ids", "response_ids"} <= cols:
            raise UserError(
                f"rollouts: a rollouts dataset needs the columns prompt_ids and response_ids; it has {sorted(cols)}."
            )
        keep = [c for c in ("prompt_ids", "response_ids", "domain", "prompt_id", "finished") if c in cols]
        rows = rollouts.select_columns(keep).to_list()
    elif isinstance(rollouts, (Mapping, bytes)) or not hasattr(rollouts, "__iter__"):
        raise UserError(
            f"rollouts is a {type(rollouts).__name__}; pass a rollouts folder, a datasets.Dataset or a list in "
            f"which {_PAIRS}."
        )
    else:
        rows = [_as_row(i, item) for i, item in enumerate(rollouts)]
    prompts, responses, domains, keys, finished = [], [], [], [], []
    checked_vocab = vocab_size if meta is None else None
    for i, row in enumerate(rows):
        prompt = _token_ids(row["prompt_ids"], f"rollout {i}'s prompt")
        response = _token_ids(row["response_ids"], f"rollout {i}'s response")
        if not prompt:
            raise UserError(f"rollouts: rollout {i} has an empty prompt; every rollout needs a prompt token.")
        _check_vocab(prompt, f"rollout {i}'s prompt", checked_vocab)
        _check_vocab(response, f"rollout {i}'s response", checked_vocab)
        prompts.append(prompt)
        responses.append(response)
        domains.append(str(row.get("domain") or DEFAULT_DOMAIN))
        keys.append(str(row["prompt_id"]) if row.get("prompt_id") is not None else _prompt_key(prompt))
        finished.append(bool(row.get("finished", True)))
    if not prompts:
        raise UserError(f"rollouts: no rollouts in {source or 'the given rollouts'}; nothing to evaluate.")
    return RolloutSet(prompts, responses, domains, keys, finished, meta, source)


def spread(rollouts: RolloutSet, count: int | None) -> RolloutSet:
    """At most ``count`` rollouts, deterministic and spread out: round-robin over domains, and within a domain
    the first sample of every prompt before any second sample (more prompts = smaller bootstrap intervals)."""
    if count is None or count >= len(rollouts):
        return rollouts
    by_domain: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    rank = []
    for key in rollouts.prompt_keys:
        rank.append(seen.get(key, 0))
        seen[key] = rank[-1] + 1
    for i in sorted(range(len(rollouts)), key=lambda i: (rank[i], i)):
        by_domain.setdefault(rollouts.domains[i], []).append(i)
    queues = [by_domain[d] for d in sorted(by_domain)]
    picked: list[int] = []
    while len(picked) < count:
        for q in queues:
            if q and len(picked) < count:
                picked.append(q.pop(0))
    return rollouts.subset(sorted(picked))


def sft_examples(
    dataset: datasets.Dataset, max_length: int, held_out: set[tuple[int, ...]], limit: int | None = None,
    tokenizer: Any = None, chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict]:
    """Target-regenerated SFT examples of a rollouts dataset, ``{"id", "domain", "enc", "key"}``, at most ``limit``.

    A one-turn rollout is prompt + response, exactly the ids the target saw and drew, truncated to ``max_length``,
    the loss on the response (EOS included when generated). A multi-turn one is its regenerated conversation
    (``messages``) through the chat template with ``chat_template_kwargs`` (those it was regenerated with), the loss
    on every assistant turn (``tokenize_conversation``; needs ``tokenizer``). Rollouts whose prompt is in
    ``held_out`` (eval prompts, token for token) or whose response is empty are skipped. ``key`` groups the samples
    of one prompt, so they stay on one side of a train/val split."""
    from lightning_spec.data.chat import tokenize_conversation

    out = []
    for r in dataset:
        if limit is not None and len(out) >= limit:
            break
        if tuple(r["prompt_ids"]) in held_out or not r["response_ids"]:
            continue
        if (r.get("turns") or 1) > 1 and tokenizer is not None:
            enc = tokenize_conversation(tokenizer, r["messages"], max_length, **(chat_template_kwargs or {}))
        else:
            ids = list(r["prompt_ids"]) + list(r["response_ids"])
            mask = [0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"])
            enc = {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}
        out.append(
            {
                "id": f"{r['prompt_id']}#{r['sample']}",
                "domain": r["domain"],
                "enc": enc,
                "key": f"rollout-prompt:{r['prompt_id']}",
            }
        )
    return out
