"""Target rollouts: responses sampled from the target itself, stored with what they were drawn under.

They feed the exact offline evaluator (METHODS.md §3.2, "Offline evaluator (§3.4)": τ_off needs target
rollouts that end with EOS, several per prompt, drawn under the SAME sampling config as evaluation) and
target-regenerated SFT (METHODS.md §4.1: keep the prompts, regenerate the responses with the target).

A rollouts folder is ``datasets.Dataset.save_to_disk(folder)`` plus ``folder/rollouts.json``:

    prompt_id: str   sample: int (0..n-1)   domain: str   subdomain: str
    prompt_ids: list[int]     the chat-templated prompt, generation header included
    response_ids: list[int]   the generated tokens, EOS included when generated
    finished: bool            ended with an EOS id (False: stopped at max_new_tokens)

``rollouts.json`` records the target spec and its weight fingerprint, the sampling config, the seed, the
tokenizer, the EOS ids, max_new_tokens, n_per_prompt, the sources and the creation time (``format`` 1).

Reproducible by construction: rollout (prompt_id, sample) draws from its own generator seeded from
``(seed, prompt_id, sample)``, so its tokens do not depend on which other rows share its batch, on the batch
size, or on where a killed run stopped. (Bit for bit as long as the logits are: exact on CPU in fp32, tested; in
bf16 on GPUs a kernel may round differently for another batch shape, and a near-tie may then go the other way —
still a correct draw from the target.) Work is written batch by batch to ``folder/shards/NNNNN.jsonl``
(atomically: tmp file + rename); a rerun skips the (prompt_id, sample) pairs already there and finally
consolidates the shards into the dataset. The shards stay, so a later run with more prompts or samples only
draws the new ones (delete ``shards/`` to save space once done).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import Tensor

from lightning_spec.data.sources import Source
from lightning_spec.sampling import SamplingConfig

FORMAT = 1
META_FILE = "rollouts.json"
SHARD_DIR = "shards"
RUN_FILE = "run.json"  # inside shards/: what the run in progress draws under, checked before resuming
COLUMNS = ("prompt_id", "sample", "domain", "subdomain", "prompt_ids", "response_ids", "finished")
FEATURES = datasets.Features(
    {
        "prompt_id": datasets.Value("string"),
        "sample": datasets.Value("int64"),
        "domain": datasets.Value("string"),
        "subdomain": datasets.Value("string"),
        "prompt_ids": datasets.List(datasets.Value("int32")),
        "response_ids": datasets.List(datasets.Value("int32")),
        "finished": datasets.Value("bool"),
    }
)
# Fields that must agree before a run resumes into a folder: anything that changes the tokens drawn.
_RESUME_KEYS = ("target_fingerprint", "sampling", "seed", "max_new_tokens", "format")


# ------------------------------------------------------------------------------------------------ metadata


def sampling_dict(sampling: SamplingConfig) -> dict[str, Any]:
    return {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p), "top_k": int(sampling.top_k)}


def _same_sampling(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal configs; every greedy config (temperature 0) is the same distribution whatever top_p/top_k say."""
    if float(a["temperature"]) == 0 and float(b["temperature"]) == 0:
        return True
    return all(float(a[k]) == float(b[k]) for k in ("temperature", "top_p", "top_k"))


def _describe_sampling(s: dict[str, Any]) -> str:
    return f"temperature={s['temperature']}, top_p={s['top_p']}, top_k={s['top_k']}"


def is_rollouts_folder(path: str | os.PathLike) -> bool:
    """A folder written by ``generate_rollouts`` (finished or not)."""
    path = Path(path).expanduser()
    return path.is_dir() and ((path / META_FILE).is_file() or (path / SHARD_DIR / RUN_FILE).is_file())


def load_rollouts(folder: str | os.PathLike) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The rollouts dataset of ``folder`` and its ``rollouts.json`` metadata."""
    path = Path(folder).expanduser()
    if not (path / META_FILE).is_file():
        if (path / SHARD_DIR / RUN_FILE).is_file():
            raise ValueError(
                f"{folder} holds an unfinished rollouts run (shards, no {META_FILE}); rerun the same "
                "`lightning-spec rollouts` command to finish it."
            )
        raise ValueError(
            f"{folder} is not a rollouts folder (no {META_FILE}); make one with `lightning-spec rollouts --out "
            f"{folder} ...`."
        )
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{folder} has rollouts format {meta.get('format')!r}, this version reads format {FORMAT}; regenerate "
            "them with `lightning-spec rollouts`."
        )
    return datasets.load_from_disk(str(path)), meta


def check_compatible(meta: dict[str, Any], target: Any, sampling: SamplingConfig, folder: str | None = None) -> None:
    """Refuse rollouts drawn from another target (weight fingerprint) or under another sampling config.

    ``target`` is a ``Target`` (its ``fingerprint`` and ``name`` are compared); ``folder`` names the rollouts
    in the message (default: ``meta["folder"]`` when present).
    """
    where = folder or meta.get("folder") or "this rollouts set"
    if meta.get("target_fingerprint") != target.fingerprint:
        raise ValueError(
            f"rollouts in {where} were drawn from target '{meta.get('target')}' (fingerprint "
            f"{meta.get('target_fingerprint')}); this run uses '{target.name}' (fingerprint {target.fingerprint}) — "
            f"regenerate them with `lightning-spec rollouts --target {target.name} ...` or use the target they "
            "were drawn from."
        )
    ours = sampling_dict(sampling)
    if not _same_sampling(meta["sampling"], ours):
        theirs = meta["sampling"]
        raise ValueError(
            f"rollouts in {where} were drawn under sampling {_describe_sampling(theirs)}; this run uses "
            f"{_describe_sampling(ours)} — regenerate them with `lightning-spec rollouts --temperature "
            f"{ours['temperature']} --top_p {ours['top_p']} --top_k {ours['top_k']} ...` or pass the matching "
            f"sampling ({_describe_sampling(theirs)})."
        )


def _run_meta(target: Any, sampling: SamplingConfig, seed: int, max_new_tokens: int) -> dict[str, Any]:
    return {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "sampling": sampling_dict(sampling),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "format": FORMAT,
    }


def _check_resume(out: Path, found: dict[str, Any], wanted: dict[str, Any]) -> None:
    differ = [k for k in _RESUME_KEYS if k != "sampling" and found.get(k) != wanted[k]]
    if "sampling" in found and not _same_sampling(found["sampling"], wanted["sampling"]):
        differ.insert(0, "sampling")
    if not differ:
        return

    def show(meta: dict[str, Any]) -> str:
        s = meta.get("sampling")
        return (
            f"target '{meta.get('target')}' (fingerprint {meta.get('target_fingerprint')}), "
            f"sampling {_describe_sampling(s) if s else None}, seed {meta.get('seed')}, "
            f"max_new_tokens {meta.get('max_new_tokens')}"
        )

    raise ValueError(
        f"--out {out} holds rollouts drawn with {show(found)}; this run asks for {show(wanted)} ({', '.join(differ)} "
        "differ) — choose another --out folder, or delete that one to start over."
    )


def rollout_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of rollout (prompt_id, sample): a stable 63-bit hash, the same on every machine and run."""
    digest = hashlib.sha256(f"{int(seed)}\x1f{prompt_id}\x1f{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ----------------------------------------------------------------------------------------------- decoding


@torch.no_grad()
def sample_batch(
    target: Any,
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
    same logits up to float rounding).
    """
    n, device = len(prompts), target.device
    eos = torch.tensor(sorted(set(target.eos_token_ids)), dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (N,)
    width = int(lengths.max())
    pad = _pad_id(target)
    ids = torch.full((n, width), pad, dtype=torch.long, device=device)  # (N, S)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long, device=device)
    mask = (torch.arange(width, device=device)[None] >= (width - lengths)[:, None]).long()  # (N, S)
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # (N, S) 0 at the first real token; pads get 0 (masked)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds] if not sampling.greedy else None

    cache = target.new_cache()
    cache_kw = getattr(target, "_cache_kw", "past_key_values")
    if width > 1:
        target.base(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            **{cache_kw: cache},
        )
    rows = torch.arange(n, device=device)  # (n_active,) original row of each active batch row
    anchor, position, attention = ids[:, -1:], positions[:, -1:], mask  # (n, 1), (n, 1), (n, S)
    responses: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    for step in range(max_new_tokens):
        hidden = target.base(
            input_ids=anchor, attention_mask=attention, position_ids=position, use_cache=True, **{cache_kw: cache}
        ).last_hidden_state[:, -1]  # (n_active, H)
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


def _pad_id(target: Any) -> int:
    tok = getattr(target, "tokenizer", None)
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


# ------------------------------------------------------------------------------------------------- shards


def _write_shard(folder: Path, index: int, rows: list[dict]) -> Path:
    """One batch of finished rollouts as ``NNNNN.jsonl``, atomically (a killed write leaves only a .tmp)."""
    path = folder / f"{index:05d}.jsonl"
    tmp = folder / f"{index:05d}.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _read_shards(folder: Path) -> tuple[dict[tuple[str, int], dict], int]:
    """Rows of every complete shard keyed by (prompt_id, sample) — later shards win — and the next index."""
    rows: dict[tuple[str, int], dict] = {}
    last = -1
    shards = sorted((p for p in folder.glob("*.jsonl") if p.stem.isdigit()), key=lambda p: int(p.stem))
    for path in shards:
        last = max(last, int(path.stem))
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    rows[(row["prompt_id"], int(row["sample"]))] = row
    return rows, last + 1


# ---------------------------------------------------------------------------------------------- the run


def _as_prompts(prompts: Sequence[Any]) -> list[dict]:
    """``{"id", "domain", "subdomain", "prompt_ids"}`` dicts (``SpecDataModule.eval_prompts`` rows) or plain
    token-id lists (ids ``"0"``, ``"1"``, …, domain ``chat``)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            ids = p.get("prompt_ids")
            row = {
                "id": str(p.get("id", i)),
                "domain": str(p.get("domain") or "chat"),
                "subdomain": str(p.get("subdomain") or ""),
            }
        else:
            ids, row = p, {"id": str(i), "domain": "chat", "subdomain": ""}
        ids = [int(t) for t in (ids.tolist() if isinstance(ids, Tensor) else ids or [])]
        if not ids:
            raise ValueError(f"prompt {i} ({row['id']}) has no prompt_ids; every prompt needs at least one token.")
        out.append({**row, "prompt_ids": ids})
    seen: set[str] = set()
    for row in out:
        if row["id"] in seen:
            raise ValueError(
                f"prompt id '{row['id']}' occurs twice; rollouts are keyed by (prompt_id, sample), give every "
                "prompt a distinct id."
            )
        seen.add(row["id"])
    return out


def _source_label(source: Any) -> Any:
    """A source as JSON: its name, or the fields set away from their defaults."""
    if isinstance(source, Source):
        fields = {k: v for k, v in vars(source).items() if k == "name" or v != Source.__dataclass_fields__[k].default}
        return source.name if len(fields) == 1 else fields
    return source if isinstance(source, (str, dict)) else str(source)


def generate_rollouts(
    target: Any,
    prompts: Sequence[Any],
    sampling: SamplingConfig,
    n_per_prompt: int,
    max_new_tokens: int,
    out_dir: str | os.PathLike,
    seed: int = 0,
    batch_size: int = 8,
    sources: Sequence[Any] | None = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Sample ``n_per_prompt`` responses per prompt from ``target`` and store them as a rollouts folder.

    Args:
        target: a ``Target`` (``load_target``); plain decoding, no drafter.
        prompts: ``{"id", "domain", "subdomain", "prompt_ids"}`` dicts (chat-templated prompts with the
            generation header, as ``select_prompts`` or ``SpecDataModule.eval_prompts`` give) or token-id lists.
        sampling: the distribution tokens are drawn from; use the serving/evaluation config (METHODS.md §1.1).
        n_per_prompt: responses per prompt (samples 0..n-1).
        max_new_tokens: the response budget; a rollout that reaches it without EOS has ``finished=False``.
        out_dir: the rollouts folder; a folder of an interrupted (or finished) run with the same target,
            sampling, seed and max_new_tokens is resumed (extended), anything else is refused.
        seed: with (prompt_id, sample) it seeds each rollout's generator (``rollout_seed``).
        batch_size: rollouts decoded together (left padding); changes speed, not tokens.
        sources: what the prompts came from, recorded in ``rollouts.json``.
        progress: show a rich progress bar (prompts done / total, tokens/s).

    Returns the dataset (rows in prompt order, then sample), also saved in ``out_dir``.
    """
    if n_per_prompt < 1:
        raise ValueError(f"n_per_prompt={n_per_prompt} must be at least 1.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1.")
    prompts = _as_prompts(prompts)
    if not prompts:
        raise ValueError("no prompts to roll out; check the sources (and prompts_per_source).")
    out = Path(out_dir).expanduser()
    shard_dir = out / SHARD_DIR
    wanted = _run_meta(target, sampling, seed, max_new_tokens)

    # ---- resume or start: the folder must be empty, or hold rollouts drawn under the same settings
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder for the rollouts.")
    if (shard_dir / RUN_FILE).is_file():
        _check_resume(out, json.loads((shard_dir / RUN_FILE).read_text()), wanted)
    elif (out / META_FILE).is_file():
        _check_resume(out, json.loads((out / META_FILE).read_text()), wanted)
    elif out.is_dir() and any(out.iterdir()):
        raise ValueError(
            f"--out {out} exists and is not a rollouts folder (no {META_FILE} or {SHARD_DIR}/{RUN_FILE}); choose "
            "an empty or new folder."
        )
    shard_dir.mkdir(parents=True, exist_ok=True)
    for stale in shard_dir.glob("*.tmp"):  # a write that was killed half-way: its rows are redone
        stale.unlink()
    if not (shard_dir / RUN_FILE).is_file():
        _write_json(shard_dir / RUN_FILE, wanted)
    done, next_shard = _read_shards(shard_dir)

    def is_done(prompt: dict, sample: int) -> bool:
        row = done.get((prompt["id"], sample))
        return row is not None and row["prompt_ids"] == prompt["prompt_ids"]  # a changed prompt is redrawn

    todo = [(i, s) for i, p in enumerate(prompts) for s in range(n_per_prompt) if not is_done(p, s)]
    remaining = [0] * len(prompts)  # samples still to draw, per prompt
    for i, _ in todo:
        remaining[i] += 1
    # longest prompts first and similar lengths together: less padding; the order changes no token
    todo.sort(key=lambda pair: (-len(prompts[pair[0]]["prompt_ids"]), pair))

    with _Progress(progress, total=len(prompts) * n_per_prompt, prompts=len(prompts)) as bar:
        bar.advance(len(prompts) * n_per_prompt - len(todo), sum(r == 0 for r in remaining), 0)
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            results = sample_batch(
                target,
                [prompts[i]["prompt_ids"] for i, _ in batch],
                [rollout_seed(seed, prompts[i]["id"], s) for i, s in batch],
                sampling,
                max_new_tokens,
            )
            rows = []
            for (i, s), (response, finished) in zip(batch, results):
                p = prompts[i]
                rows.append(
                    {
                        "prompt_id": p["id"],
                        "sample": s,
                        "domain": p["domain"],
                        "subdomain": p["subdomain"],
                        "prompt_ids": p["prompt_ids"],
                        "response_ids": response,
                        "finished": finished,
                    }
                )
            _write_shard(shard_dir, next_shard, rows)
            next_shard += 1
            for row in rows:
                done[(row["prompt_id"], row["sample"])] = row
            newly = 0
            for i, _ in batch:
                remaining[i] -= 1
                newly += remaining[i] == 0
            bar.advance(len(batch), newly, sum(len(r["response_ids"]) for r in rows))

    # ---- consolidate: exactly the requested (prompt_id, sample) pairs, in prompt order
    table = {c: [] for c in COLUMNS}
    for p in prompts:
        for s in range(n_per_prompt):
            row = done[(p["id"], s)]
            for c in COLUMNS:
                table[c].append(row[c])
    dataset = datasets.Dataset.from_dict(table, features=FEATURES)
    (out / META_FILE).unlink(missing_ok=True)  # absent while the dataset files are rewritten
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # one bar per command: ours
    try:
        dataset.save_to_disk(str(out))
    finally:
        if bars_were_on:
            datasets.utils.enable_progress_bars()
    tokenizer = getattr(target, "tokenizer", None)
    meta = {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "sampling": sampling_dict(sampling),
        "seed": int(seed),
        "tokenizer": getattr(tokenizer, "name_or_path", None),
        "tokenizer_size": len(tokenizer) if tokenizer is not None else None,
        "vocab_size": int(target.vocab_size),
        "eos_token_ids": [int(t) for t in target.eos_token_ids],
        "max_new_tokens": int(max_new_tokens),
        "n_per_prompt": int(n_per_prompt),
        "sources": [_source_label(s) for s in (sources or [])],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "format": FORMAT,
    }
    _write_json(out / META_FILE, meta)
    if progress:
        from rich.console import Console

        n_done = sum(table["finished"])
        Console(stderr=True, soft_wrap=True).print(
            f"rollouts: {len(dataset)} in {out} ({n_done} ended with EOS, {len(dataset) - n_done} hit "
            f"max_new_tokens={max_new_tokens}); {bar.tokens} tokens drawn this run at {bar.rate:.1f} tokens/s"
        )
    return dataset


def _write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class _Progress:
    """A rich bar over rollouts with prompts done / total and tokens/s; inert when ``enabled`` is False."""

    def __init__(self, enabled: bool, total: int, prompts: int) -> None:
        self.enabled, self.total, self.prompts = enabled, total, prompts
        self.tokens, self.prompts_done, self._start = 0, 0, time.perf_counter()
        self._bar: Any = None

    @property
    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self._start, 1e-9)

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("rollouts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("prompts {task.fields[prompts]}"),
                TextColumn("{task.fields[rate]} tokens/s"),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("rollouts", total=self.total, prompts=self._prompts(), rate="-")
        return self

    def _prompts(self) -> str:
        return f"{self.prompts_done}/{self.prompts}"

    def advance(self, rollouts: int, prompts: int, tokens: int) -> None:
        self.prompts_done += prompts
        self.tokens += tokens
        if self._bar is not None:
            rate = f"{self.rate:.1f}" if self.tokens else "-"
            self._bar.update(self._task, advance=rollouts, prompts=self._prompts(), rate=rate)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


# ------------------------------------------------------------------------------------------------ prompts


def select_prompts(
    tokenizer: Any,
    sources: Sequence[Any],
    prompts_per_source: int | None,
    seed: int,
    max_prompt_tokens: int | None = None,
) -> list[dict]:
    """Prompts from each source: the conversation up to its first assistant turn, chat-templated with the
    generation header (as ``SpecDataModule.eval_prompts``), ``prompts_per_source`` per source spread over its
    subdomains (seeded shuffle, then round-robin: MT-Bench's 8 categories all appear in 8 prompts). A larger
    ``prompts_per_source`` keeps the smaller selection as its prefix, so extending a rollouts run only adds.
    At most ``max(1000, 10 × prompts_per_source)`` conversations are read per source unless it sets ``limit``.
    ``max_prompt_tokens`` skips longer prompts before the selection (ShareGPT openings run to thousands of
    tokens; batched decoding pads every row to the longest prompt of its batch).
    """
    from lightning_spec.data.chat import prompt_ids
    from lightning_spec.data.datamodule import _opening, _round_robin
    from lightning_spec.data.sources import as_source, load_source

    prompts: list[dict] = []
    seen: set[str] = set()
    ids: dict[tuple[int, str], list[int]] = {}  # (source, row id) -> chat-templated prompt, tokenized once

    def tokens(k: int, row: dict) -> list[int]:
        if (k, row["id"]) not in ids:
            ids[k, row["id"]] = prompt_ids(tokenizer, _opening(row))
        return ids[k, row["id"]]

    for k, source in enumerate(as_source(s) for s in sources):
        pool = None if prompts_per_source is None else max(1000, 10 * prompts_per_source)
        rows = load_source(source, limit=pool).to_list()
        if not rows:
            raise ValueError(f"--sources[{k}] ('{source.name}') gave no usable prompts; check the name or path.")
        if max_prompt_tokens is not None:
            rows = [row for row in rows if len(tokens(k, row)) <= max_prompt_tokens]
            if not rows:
                raise ValueError(
                    f"--sources[{k}] ('{source.name}') has no prompt of at most --max_prompt_tokens="
                    f"{max_prompt_tokens} tokens; raise it."
                )
        picked = rows if prompts_per_source is None else _round_robin(rows, prompts_per_source, seed)
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
                }
            )
    return prompts


# -------------------------------------------------------------------------------------------------- CLI


def rollouts(
    out: str,
    target: str = "smollm2-135m-instruct",
    sources: list[Source | str] = ["mt-bench", "humaneval", "mmath"],  # noqa: B006 (never mutated; a list shows in --help)
    prompts_per_source: int | None = 20,
    max_prompt_tokens: int | None = None,
    n_per_prompt: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
    seed: int = 0,
    batch_size: int = 8,
    target_dtype: str = "float32",
    device: str = "cpu",
    progress: bool = True,
) -> datasets.Dataset:
    """Sample responses from the target for prompts of any source and store them as a rollouts folder.

    Rerunning the same command resumes a killed run (same tokens as an uninterrupted one); the same command
    with more prompts or samples extends a finished one.

    Args:
        out: the rollouts folder to write (resumed when it holds a run with the same settings).
        target: packaged name (smollm2-135m-instruct, tiny-random), HF hub id or local folder.
        sources: prompt sources: packaged names (sharegpt, mt-bench, humaneval, mmath), local
            .jsonl/.json/.parquet files or folders, hub ids, or {name, domain, limit, split} entries.
        prompts_per_source: prompts taken from each source, spread over its subdomains; null = all.
        max_prompt_tokens: skip prompts longer than this many tokens (chat template included); null = keep all.
        n_per_prompt: responses sampled per prompt.
        temperature: sampling temperature; 0 = greedy. Use the configuration you will evaluate or serve with.
        top_p: nucleus filtering (1 = off).
        top_k: top-k filtering (0 = off).
        max_new_tokens: response budget; rollouts that reach it without EOS are flagged finished=false.
        seed: seeds each rollout (with its prompt id and sample index) and the prompt selection.
        batch_size: rollouts decoded together with left padding (speed only: every rollout draws from its own
            seeded generator, so the tokens do not depend on the batch).
        target_dtype: dtype of the target: float32 on CPU, bfloat16 on GPUs.
        device: where the target runs (cpu, cuda, cuda:1, ...).
        progress: show the progress bar.
    """
    from lightning_spec.data.sources import as_source
    from lightning_spec.target import load_target

    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    if prompts_per_source is not None and prompts_per_source < 1:
        raise ValueError(f"--prompts_per_source={prompts_per_source} must be at least 1, or null for all.")
    if not sources:
        raise ValueError("--sources is empty; name at least one, e.g. '[mt-bench, humaneval, mmath]'.")
    model = load_target(target, dtype=target_dtype, device=device)
    if model.tokenizer is None:
        raise ValueError(f"--target {target} has no tokenizer; rollouts need one to build chat prompts.")
    source_list = [as_source(s) for s in sources]
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"--max_prompt_tokens={max_prompt_tokens} must be at least 1, or null for no limit.")
    prompts = select_prompts(model.tokenizer, source_list, prompts_per_source, seed, max_prompt_tokens)
    return generate_rollouts(
        model,
        prompts,
        sampling,
        n_per_prompt=n_per_prompt,
        max_new_tokens=max_new_tokens,
        out_dir=out,
        seed=seed,
        batch_size=batch_size,
        sources=source_list,
        progress=progress,
    )
