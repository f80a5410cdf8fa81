"""Writing a rollouts folder (format: ``rollouts.py``), resumably, and the ``lightning-spec rollouts`` command.

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
from torch import Tensor

from lightning_spec.data.prompts import select_prompts
from lightning_spec.data.rollouts import (
    COLUMNS,
    FEATURES,
    FORMAT,
    META_FILE,
    RUN_FILE,
    SHARD_DIR,
    describe_sampling,
    is_rollouts_folder,
    same_sampling,
)
from lightning_spec.data.sources import Source, as_source
from lightning_spec.decoding.batched import sample_batch
from lightning_spec.files import atomic_write, atomic_write_json, writable_dir
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import load_target

# Fields that must agree before a run resumes into a folder: anything that changes the tokens drawn.
_RESUME_KEYS = ("target_fingerprint", "sampling", "seed", "max_new_tokens", "format")


def rollout_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of rollout (prompt_id, sample): a stable 63-bit hash, the same on every machine and run."""
    digest = hashlib.sha256(f"{int(seed)}\x1f{prompt_id}\x1f{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------------------------------- resume or start


def _run_meta(target: Any, sampling: SamplingConfig, seed: int, max_new_tokens: int) -> dict[str, Any]:
    return {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "sampling": sampling.to_dict(),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "format": FORMAT,
    }


def _check_resume(out: Path, found: dict[str, Any], wanted: dict[str, Any]) -> None:
    differ = [k for k in _RESUME_KEYS if k != "sampling" and found.get(k) != wanted[k]]
    if "sampling" in found and not same_sampling(found["sampling"], wanted["sampling"]):
        differ.insert(0, "sampling")
    if not differ:
        return

    def show(meta: dict[str, Any]) -> str:
        s = meta.get("sampling")
        return (
            f"target '{meta.get('target')}' (fingerprint {meta.get('target_fingerprint')}), "
            f"sampling {describe_sampling(s) if s else None}, seed {meta.get('seed')}, "
            f"max_new_tokens {meta.get('max_new_tokens')}"
        )

    raise ValueError(
        f"--out {out} holds rollouts drawn with {show(found)}; this run asks for {show(wanted)} ({', '.join(differ)} "
        "differ) — choose another --out folder, or delete that one to start over."
    )


def _check_out(out_dir: str | os.PathLike) -> Path:
    """``--out`` is a new or empty folder, or one of our rollouts folders, and can be written: checked before the
    target is loaded or anything is decoded."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder for the rollouts.")
    if out.is_dir() and any(out.iterdir()) and not is_rollouts_folder(out):
        raise ValueError(
            f"--out {out} exists and is not a rollouts folder (no {META_FILE} or {SHARD_DIR}/{RUN_FILE}); choose "
            "an empty or new folder."
        )
    return writable_dir(out, "--out")


# ------------------------------------------------------------------------------------------------- shards


def _write_shard(folder: Path, index: int, rows: list[dict]) -> Path:
    """One batch of finished rollouts as ``NNNNN.jsonl``, atomically (a killed write leaves only a .tmp)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(folder / f"{index:05d}.jsonl", write)


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
        sampling: the distribution tokens are drawn from; use the serving/evaluation config (the offline
            evaluator is exact only under the config the rollouts were drawn with).
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
    wanted = _run_meta(target, sampling, seed, max_new_tokens)

    # ---- resume or start: the folder must be empty, or hold rollouts drawn under the same settings
    out = _check_out(out_dir)
    shard_dir = out / SHARD_DIR
    if (shard_dir / RUN_FILE).is_file():
        _check_resume(out, json.loads((shard_dir / RUN_FILE).read_text()), wanted)
    elif (out / META_FILE).is_file():
        _check_resume(out, json.loads((out / META_FILE).read_text()), wanted)
    shard_dir.mkdir(parents=True, exist_ok=True)
    for stale in shard_dir.glob("*.tmp*"):  # a write that was killed half-way: its rows are redone
        stale.unlink()
    if not (shard_dir / RUN_FILE).is_file():
        atomic_write_json(shard_dir / RUN_FILE, wanted)
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

    tokens, start = 0, time.perf_counter()
    prompts_done = sum(r == 0 for r in remaining)
    columns = {"prompts": f"prompts {prompts_done}/{len(prompts)}", "rate": "- tokens/s"}
    with progress_bar("rollouts", len(prompts) * n_per_prompt, progress, columns) as bar:
        bar.advance(len(prompts) * n_per_prompt - len(todo))
        for lo in range(0, len(todo), batch_size):
            batch = todo[lo : lo + batch_size]
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
            for i, _ in batch:
                remaining[i] -= 1
                prompts_done += remaining[i] == 0
            tokens += sum(len(r["response_ids"]) for r in rows)
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.advance(len(batch), prompts=f"prompts {prompts_done}/{len(prompts)}", rate=f"{rate:.1f} tokens/s")

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
        **wanted,
        "tokenizer": getattr(tokenizer, "name_or_path", None),
        "tokenizer_size": len(tokenizer) if tokenizer is not None else None,
        "vocab_size": int(target.vocab_size),
        "eos_token_ids": [int(t) for t in target.eos_token_ids],
        "n_per_prompt": int(n_per_prompt),
        "sources": [_source_label(s) for s in (sources or [])],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(out / META_FILE, meta)
    if progress:
        from rich.console import Console

        n_done = sum(table["finished"])
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        Console(stderr=True, soft_wrap=True).print(
            f"rollouts: {len(dataset)} in {out} ({n_done} ended with EOS, {len(dataset) - n_done} hit "
            f"max_new_tokens={max_new_tokens}); {tokens} tokens drawn this run at {rate:.1f} tokens/s"
        )
    return dataset


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
        target_dtype: dtype of the target: float32 on CPU, bfloat16 on GPUs, auto: bf16 where native.
        device: where the target runs (cpu, cuda, cuda:1, ...).
        progress: show the progress bar.
    """
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    if prompts_per_source is not None and prompts_per_source < 1:
        raise ValueError(f"--prompts_per_source={prompts_per_source} must be at least 1, or null for all.")
    if not sources:
        raise ValueError("--sources is empty; name at least one, e.g. '[mt-bench, humaneval, mmath]'.")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"--max_prompt_tokens={max_prompt_tokens} must be at least 1, or null for no limit.")
    _check_out(out)  # before the target is loaded and hours of decoding start
    model = load_target(target, dtype=target_dtype, device=device)
    if model.tokenizer is None:
        raise ValueError(f"--target {target} has no tokenizer; rollouts need one to build chat prompts.")
    source_list = [as_source(s) for s in sources]
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
