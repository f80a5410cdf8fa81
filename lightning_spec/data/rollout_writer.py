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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import datasets
from torch import Tensor

from lightning_spec.data.engines import Conversation, Engine, LocalEngine, Regenerated, ServerEngine, Turns
from lightning_spec.data.prompts import select_prompts
from lightning_spec.data.rollout_archive import SUFFIX as ARCHIVE_SUFFIX
from lightning_spec.data.rollout_archive import write_archive
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
from lightning_spec.errors import UserError
from lightning_spec.files import atomic_write, atomic_write_json, writable_dir
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import TargetOptions
from lightning_spec.target_loading import load_target

if TYPE_CHECKING:
    from lightning_spec.target import Target

SHARD_SECONDS = 30.0  # the longest finished conversations wait in memory before a shard holds them

# Fields that must agree before a run resumes into a folder: anything that changes the tokens drawn.
_RESUME_KEYS = ("target_fingerprint", "sampling", "seed", "max_new_tokens", "format", "engine", "max_turns",
                "chat_template_kwargs")


def rollout_seed(seed: int, prompt_id: str, sample: int) -> int:
    """The seed of rollout (prompt_id, sample): a stable 63-bit hash, the same on every machine and run."""
    digest = hashlib.sha256(f"{int(seed)}\x1f{prompt_id}\x1f{int(sample)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class Draw:
    """How every rollout of a run is drawn: a folder's rollouts share it (its tokens' settings are what a resumed
    run must match, ``_RESUME_KEYS``), so ``generate_rollouts`` takes it as one object.

    Args:
        sampling: the distribution tokens are drawn from; use the serving/evaluation config (the offline
            evaluator is exact only under the config the rollouts were drawn with).
        n_per_prompt: responses per prompt (samples 0..n-1).
        max_new_tokens: the budget of each turn; a turn that reaches it without EOS ends its conversation there
            (the first turn's ``finished`` is False).
        seed: with (prompt_id, sample) it seeds each rollout (``rollout_seed``; turn t draws from that seed + t).
        max_turns: regenerate at most this many assistant turns per conversation; None = all.
        max_prompt_tokens: a later turn whose prompt (history included) is longer ends its conversation.
        chat_template_kwargs: keyword arguments for the chat template of later turns' prompts (first turns come
            templated in the prompts), e.g. ``{"enable_thinking": false}``; recorded in ``rollouts.json``.
    """

    sampling: SamplingConfig
    n_per_prompt: int
    max_new_tokens: int
    seed: int = 0
    max_turns: int | None = None
    max_prompt_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """Refuse counts that draw nothing, before anything is opened."""
        if self.n_per_prompt < 1:
            raise UserError(f"n_per_prompt={self.n_per_prompt} must be at least 1.")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be at least 1.")
        if self.max_turns is not None and self.max_turns < 1:
            raise UserError(f"max_turns={self.max_turns} must be at least 1, or null for every turn.")

    def turns(self, conversation: Conversation, tokenizer: Any) -> Turns:
        """The walk over ``conversation``'s turns that the engine regenerates."""
        return Turns(conversation, tokenizer, self.max_turns, self.max_prompt_tokens, self.chat_template_kwargs)


# ---------------------------------------------------------------------------------------- resume or start


def _run_meta(target: Target, draw: Draw, engine: Engine) -> dict[str, Any]:
    """What a folder's run records in ``shards/run.json``: what a resumed run must match (``_RESUME_KEYS``)."""
    return {
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "sampling": draw.sampling.to_dict(),
        "seed": int(draw.seed),
        "max_new_tokens": int(draw.max_new_tokens),
        "format": FORMAT,
        "max_turns": draw.max_turns,
        "chat_template_kwargs": dict(draw.chat_template_kwargs or {}),
        **engine.describe(),
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
            f"max_new_tokens {meta.get('max_new_tokens')}, the {meta.get('engine', 'local')} engine, max_turns "
            f"{meta.get('max_turns')}, chat_template_kwargs {meta.get('chat_template_kwargs') or {}}"
        )

    raise UserError(
        f"--out {out} holds rollouts drawn with {show(found)}; this run asks for {show(wanted)} ({', '.join(differ)} "
        "differ) — choose another --out folder, or delete that one to start over."
    )


def _check_out(out_dir: str | os.PathLike) -> Path:
    """``--out`` is a new or empty folder, or one of our rollouts folders, and can be written: checked before the
    target is loaded or anything is decoded."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; name a folder for the rollouts.")
    if out.is_dir() and any(out.iterdir()) and not is_rollouts_folder(out):
        raise UserError(
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


class Shards:
    """A run's ``shards/`` folder: opened (resumed, or started with its ``run.json``), the rows stored there, and
    the finished conversations not yet in a shard (what a kill now would redo), written together once the engine's
    ``shard_rows`` are in or ``SHARD_SECONDS`` have passed."""

    def __init__(self, out: Path, wanted: dict[str, Any]) -> None:
        """Resume or start: ``out`` must be empty, or hold rollouts drawn under the same settings (``wanted``)."""
        self.folder = out / SHARD_DIR
        if (self.folder / RUN_FILE).is_file():
            _check_resume(out, json.loads((self.folder / RUN_FILE).read_text()), wanted)
        elif (out / META_FILE).is_file():
            _check_resume(out, json.loads((out / META_FILE).read_text()), wanted)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("*.tmp*"):  # a write that was killed half-way: its rows are redone
            stale.unlink()
        if not (self.folder / RUN_FILE).is_file():
            atomic_write_json(self.folder / RUN_FILE, wanted)
        self.done, self.next_shard = _read_shards(self.folder)
        self.buffer: list[dict] = []
        self.last_write = time.perf_counter()

    def is_done(self, prompt: dict, sample: int) -> bool:
        """Whether (prompt, sample) is stored, drawn from this very prompt."""
        row = self.done.get((prompt["id"], sample))
        return row is not None and row["prompt_ids"] == prompt["prompt_ids"]  # a changed prompt is redrawn

    def todo(self, prompts: list[dict], draw: Draw) -> list[Conversation]:
        """The (prompt, sample) conversations not stored yet, each with its own seed."""
        return [
            Conversation(p["id"], s, rollout_seed(draw.seed, p["id"], s), p["domain"], p["subdomain"],
                         p["prompt_ids"], p.get("messages") or [])
            for p in prompts for s in range(draw.n_per_prompt) if not self.is_done(p, s)
        ]

    def add(self, rows: list[dict], shard_rows: int) -> None:
        """Buffer finished rows; write a shard when enough are in or the last one is ``SHARD_SECONDS`` old."""
        self.buffer.extend(rows)
        if len(self.buffer) >= shard_rows or time.perf_counter() - self.last_write > SHARD_SECONDS:
            self.write()

    def write(self) -> None:
        """The buffered rows as the next shard; from now on they count as stored."""
        _write_shard(self.folder, self.next_shard, self.buffer)
        self.next_shard += 1
        for row in self.buffer:
            self.done[(row["prompt_id"], row["sample"])] = row
        self.buffer.clear()
        self.last_write = time.perf_counter()

    def table(self, prompts: list[dict], n_per_prompt: int) -> dict[str, list]:
        """Consolidate: exactly the requested (prompt_id, sample) pairs, in prompt order, as columns."""
        table: dict[str, list] = {c: [] for c in COLUMNS}
        for p in prompts:
            for s in range(n_per_prompt):
                row = self.done[(p["id"], s)]
                for c in COLUMNS:
                    table[c].append(row[c])
        return table


# ---------------------------------------------------------------------------------------------- the run


def _as_prompts(prompts: Sequence[Any]) -> list[dict]:
    """``{"id", "domain", "subdomain", "prompt_ids"}`` dicts (``SpecDataModule.eval_prompts`` rows; with the source
    conversation's ``messages`` when ``select_prompts`` made them) or plain token-id lists (ids ``"0"``, ``"1"``, …,
    domain ``chat``)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            ids = p.get("prompt_ids")
            row = {
                "id": str(p.get("id", i)),
                "domain": str(p.get("domain") or "chat"),
                "subdomain": str(p.get("subdomain") or ""),
                "messages": list(p.get("messages") or []),
            }
        else:
            ids, row = p, {"id": str(i), "domain": "chat", "subdomain": "", "messages": []}
        ids = [int(t) for t in (ids.tolist() if isinstance(ids, Tensor) else ids or [])]
        if not ids:
            raise UserError(f"prompt {i} ({row['id']}) has no prompt_ids; every prompt needs at least one token.")
        out.append({**row, "prompt_ids": ids})
    seen: set[str] = set()
    for row in out:
        if row["id"] in seen:
            raise UserError(
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
    target: Target,
    prompts: Sequence[Any],
    draw: Draw,
    out_dir: str | os.PathLike,
    *,
    engine: Engine | None = None,
    batch_size: int = 8,
    sources: Sequence[Any] | None = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Sample ``draw.n_per_prompt`` responses per prompt from ``target`` and store them as a rollouts folder.

    Args:
        target: a ``Target`` (``load_target``): its name, weight fingerprint, tokenizer and EOS ids are recorded;
            the in-process engine decodes with it (plain decoding, no drafter).
        prompts: ``{"id", "domain", "subdomain", "prompt_ids", "messages"}`` dicts (chat-templated prompts with the
            generation header, as ``select_prompts`` gives; ``messages``, the source conversation, makes every
            assistant turn regenerated) or token-id lists (one turn).
        draw: how every rollout is drawn (``Draw``: sampling, samples per prompt, the turn budget, seed, turns).
        out_dir: the rollouts folder; a folder of an interrupted (or finished) run with the same target,
            sampling, seed, max_new_tokens, engine, turns and template arguments is resumed (extended), anything
            else is refused.
        engine: where the answers are drawn (``data/engines.py``): None = ``LocalEngine(target, batch_size)``, or a
            ``ServerEngine`` (vLLM, SGLang).
        batch_size: conversations the in-process engine decodes together (left padding); speed only.
        sources: what the prompts came from, recorded in ``rollouts.json``.
        progress: show the work ahead, an estimate, and a rich progress bar (conversations done / total, tokens/s).

    Returns the dataset (rows in prompt order, then sample), also saved in ``out_dir``.
    """
    draw.check()
    engine = engine if engine is not None else LocalEngine(target, batch_size)
    prompts = _as_prompts(prompts)
    if not prompts:
        raise UserError("no prompts to roll out; check the sources (and prompts_per_source).")
    wanted = _run_meta(target, draw, engine)
    out = _check_out(out_dir)
    shards = Shards(out, wanted)
    todo = shards.todo(prompts, draw)
    tokenizer = target.tokenizer  # None for a target built without one (Target declares it)
    eos = target.eos_token_ids
    walk = lambda c: draw.turns(c, tokenizer)  # noqa: E731
    total = len(prompts) * draw.n_per_prompt
    if progress:
        announce(engine, todo, total, walk, draw.sampling, draw.max_new_tokens, eos)

    tokens, start = 0, time.perf_counter()
    shards.last_write = start
    with progress_bar("rollouts", total, progress, {"rate": "- tokens/s"}) as bar:
        bar.advance(total - len(todo))
        for finished in engine.run(todo, draw.sampling, draw.max_new_tokens, walk, eos):
            shards.add([_row(r) for r in finished], engine.shard_rows)
            tokens += sum(sum(len(x) for x in r.responses) for r in finished)
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.advance(len(finished), rate=f"{rate:.1f} tokens/s")
        if shards.buffer:
            shards.write()

    table = shards.table(prompts, draw.n_per_prompt)
    dataset = _save_dataset(out, table)
    atomic_write_json(out / META_FILE, _folder_meta(target, wanted, draw.n_per_prompt, sources))
    if progress:
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        _print_done(out, table, tokens, rate, draw.max_new_tokens)
    return dataset


def _save_dataset(out: Path, table: dict[str, list]) -> datasets.Dataset:
    """The consolidated rows as the folder's dataset files (``rollouts.json`` absent meanwhile)."""
    dataset = datasets.Dataset.from_dict(table, features=FEATURES)
    (out / META_FILE).unlink(missing_ok=True)  # absent while the dataset files are rewritten
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # one bar per command: ours
    try:
        dataset.save_to_disk(str(out))
    finally:
        if bars_were_on:
            datasets.utils.enable_progress_bars()
    return dataset


def _folder_meta(target: Target, wanted: dict[str, Any], n_per_prompt: int,
                 sources: Sequence[Any] | None) -> dict[str, Any]:
    """``rollouts.json``: the run's settings, the target's tokenizer and vocabulary, the sources, when."""
    tokenizer = target.tokenizer
    return {
        **wanted,
        "tokenizer": getattr(tokenizer, "name_or_path", None),  # an HF tokenizer's; None without one
        "tokenizer_size": len(tokenizer) if tokenizer is not None else None,
        "vocab_size": int(target.vocab_size),
        "eos_token_ids": [int(t) for t in target.eos_token_ids],
        "n_per_prompt": int(n_per_prompt),
        "sources": [_source_label(s) for s in (sources or [])],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _print_done(out: Path, table: dict[str, list], tokens: int, rate: float, max_new_tokens: int) -> None:
    """The run's last line, what the folder holds: rollouts, first turns ended by EOS (their share) or the budget,
    the first answers' mean length, turns; and the tokens drawn this run and their rate."""
    from rich.console import Console

    n_rows, n_done = len(table["finished"]), sum(table["finished"])
    mean = sum(map(len, table["response_ids"])) / max(n_rows, 1)
    Console(stderr=True, soft_wrap=True).print(
        f"rollouts: {n_rows} in {out} ({n_done} first turns ended with EOS ({n_done / max(n_rows, 1):.0%}), "
        f"{n_rows - n_done} hit max_new_tokens={max_new_tokens}; first answers {mean:.1f} tokens on average; "
        f"{sum(table['turns'])} turns in all); {tokens} tokens drawn this run at {rate:.1f} tokens/s"
    )


def _row(r: Regenerated) -> dict[str, Any]:
    """A finished conversation as a rollouts row: the first turn's ids (what offline evaluation scores) and the
    whole regenerated conversation as text (what multi-turn training reads)."""
    c = r.conversation
    return {
        "prompt_id": c.id, "sample": c.sample, "domain": c.domain, "subdomain": c.subdomain,
        "prompt_ids": r.prompts[0], "response_ids": r.responses[0], "finished": r.finished[0],
        "messages": r.messages, "turns": len(r.responses),
    }


def announce(engine: Engine, todo: list[Conversation], total: int, walk: Any, sampling: SamplingConfig,
             max_new_tokens: int, eos: list[int]) -> None:
    """Print the work ahead (conversations, first prompts' tokens, the most tokens to generate) and an estimate
    from a short probe of the engine, before hours of decoding start."""
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    prompt_tokens = sum(len(c.prompt_ids) for c in todo)
    turns = sum(len(walk(c).parts) for c in todo)
    most = turns * max_new_tokens
    line = (f"rollouts: {len(todo)} of {total} conversations to draw with the {engine.name} engine "
            f"({total - len(todo)} stored); {turns} turns, {prompt_tokens:,} first-turn prompt tokens, at most "
            f"{most:,} tokens to generate")
    if not todo:
        console.print(line)
        return
    longest = sorted(todo, key=lambda c: -len(c.prompt_ids))
    prefill, per_token = engine.probe([c.prompt_ids for c in longest], sampling, eos)
    seconds = prompt_tokens * prefill + most * per_token
    console.print(f"{line}; at the probe's pace (prefill {1 / max(prefill, 1e-9):,.0f} tokens/s, generation "
                  f"{1 / max(per_token, 1e-9):,.1f} tokens/s) at most ~{seconds / 60:.0f} min")


# -------------------------------------------------------------------------------------------------- CLI


@dataclass
class Rollouts:
    """Sample responses from the target for prompts of any source and store them as a rollouts folder.

    Rerunning the same command resumes a killed run (same tokens as an uninterrupted one with the local backend);
    the same command with more prompts or samples extends a finished one. Every assistant turn of a source
    conversation is regenerated given the regenerated history (``--max_turns`` caps them).

    Args:
        out: the rollouts folder to write (resumed when it holds a run with the same settings).
        target: packaged name (smollm2-135m-instruct, tiny-random), HF hub id or local folder: its tokenizer builds the
            prompts, and its weight fingerprint is recorded (training refuses rollouts of other weights). With
            --backend server it must be the model the server serves.
        sources: prompt sources: packaged names (sharegpt, mt-bench, humaneval, mmath), local
            .jsonl/.json/.parquet files or folders, hub ids, or {name, domain, limit, split} entries.
        prompts_per_source: prompts taken from each source, spread over its subdomains; null = all.
        max_prompt_tokens: skip prompts longer than this many tokens (chat template included), and end a
            conversation at a turn whose prompt grows past it: one pasted document must not stall a batch; null =
            keep all.
        max_turns: regenerate at most this many assistant turns per conversation; null = all of them.
        n_per_prompt: responses sampled per prompt.
        temperature: sampling temperature; 0 = greedy. Use the configuration you will evaluate or serve with.
        top_p: nucleus filtering (1 = off).
        top_k: top-k filtering (0 = off).
        max_new_tokens: budget of each turn; a first turn that reaches it without EOS is flagged finished=false.
        seed: seeds each rollout (with its prompt id and sample index) and the prompt selection.
        backend: local = our target in this process, batched; server = any OpenAI-compatible server (vLLM, SGLang)
            at --server_url, --concurrency conversations in flight (`make serve-target` starts vLLM for the
            packaged target).
        batch_size: conversations the local backend decodes together (speed only: every rollout draws from its own
            seeded generator, so the tokens do not depend on the batch).
        server_url: the server's base URL (backend server).
        server_model: the model name the server serves; null = its only one.
        concurrency: conversations in flight at once (backend server).
        target_options: how the target is loaded (revision, trust_remote_code, attn_implementation) and prompted
            (chat_template_kwargs, e.g. {enable_thinking: false} for Qwen3, for every prompt and later turn): the
            fit's model.target_options.
        target_dtype: dtype of the local target: float32 on CPU, bfloat16 on GPUs, auto: bf16 where native.
        device: where the local target runs (cpu, cuda, cuda:1, ...).
        progress: print the work ahead and an estimate, and show the progress bar.
        archive: also pack the finished folder into this ``.rollouts.jsonl.gz`` file (token ids, text and record,
            gzip-compressed: a few MB per thousand answers), which fit, evaluate and the testbed read in the
            folder's place, so a regeneration can be kept in a repository instead of redrawn.
    """

    out: str
    target: str = "smollm2-135m-instruct"
    sources: list[Source | str] = field(default_factory=lambda: ["mt-bench", "humaneval", "mmath"])
    prompts_per_source: int | None = 20
    max_prompt_tokens: int | None = 1024
    max_turns: int | None = None
    n_per_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    backend: Literal["local", "server"] = "local"
    batch_size: int = 8
    server_url: str = "http://127.0.0.1:8000"
    server_model: str | None = None
    concurrency: int = 64
    target_options: TargetOptions | None = None
    target_dtype: str = "float32"
    device: str = "cpu"
    progress: bool = True
    archive: str | None = None

    # The fields above are the command's flags and YAML keys (``lightning-spec rollouts``, ``cli.run_command``);
    # the methods below group them: the prompt source, the engine, and how the rollouts are drawn.
    def run(self) -> datasets.Dataset:
        """Check the options and ``--out``, load the target, select the prompts, draw them into ``--out``."""
        sampling = SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        self.check()
        _check_out(self.out)  # before the target is loaded and hours of decoding start
        server = self.server()
        model = load_target(self.target, dtype=self.target_dtype, device=self.device, options=self.target_options)
        if model.tokenizer is None:
            raise UserError(f"--target {self.target} has no tokenizer; rollouts need one to build chat prompts.")
        sources = self.source()
        prompts = select_prompts(model.tokenizer, sources, self.prompts_per_source, self.seed, self.max_prompt_tokens,
                                 chat_template_kwargs=model.chat_template_kwargs)
        engine = server if server is not None else LocalEngine(model, self.batch_size)
        drawn = generate_rollouts(model, prompts, self.draw(sampling, model.chat_template_kwargs), self.out,
                                  engine=engine, batch_size=self.batch_size, sources=sources, progress=self.progress)
        if self.archive:
            print(f"rollouts: packed into {write_archive(self.out, self.archive, target=model)}")
        return drawn

    def check(self) -> None:
        """Refuse a prompt selection that cannot be made, before anything is loaded."""
        if self.prompts_per_source is not None and self.prompts_per_source < 1:
            raise UserError(f"--prompts_per_source={self.prompts_per_source} must be at least 1, or null for all.")
        if not self.sources:
            raise UserError("--sources is empty; name at least one, e.g. '[mt-bench, humaneval, mmath]'.")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise UserError(f"--max_prompt_tokens={self.max_prompt_tokens} must be at least 1, or null for no limit.")
        if self.archive and not self.archive.endswith(ARCHIVE_SUFFIX):
            raise UserError(f"--archive {self.archive} must end with {ARCHIVE_SUFFIX}; rename it.")

    def source(self) -> list[Source]:
        """The prompt sources (``--sources``), as ``Source`` entries."""
        return [as_source(s) for s in self.sources]

    def server(self) -> ServerEngine | None:
        """The server engine with ``--backend server`` (its URL and model checked now); None: the local engine."""
        if self.backend != "server":
            return None
        return ServerEngine(self.server_url, self.server_model, self.concurrency)

    def draw(self, sampling: SamplingConfig, chat_template_kwargs: dict[str, Any] | None) -> Draw:
        """How every rollout is drawn (``chat_template_kwargs``: the loaded target's, from ``--target_options``)."""
        return Draw(sampling, self.n_per_prompt, self.max_new_tokens, seed=self.seed, max_turns=self.max_turns,
                    max_prompt_tokens=self.max_prompt_tokens, chat_template_kwargs=chat_template_kwargs)
