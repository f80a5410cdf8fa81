"""Conversation sources: the packaged offline data sets and ordinary ``datasets`` sources, one row format.

Every source becomes a ``datasets.Dataset`` with the columns

    id: str   messages: list[{role, content}]   domain: str   subdomain: str

so the rest of the package never cares where a conversation came from. Packaged names (``sharegpt``,
``mt-bench``, ``humaneval``, ``mmath``) read files shipped in pip packages (``lightning_spec.assets``);
anything else is a local JSONL/JSON/Parquet file or folder, or a hub data set id (only touched when the user
names one).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from lightning_spec import assets
from lightning_spec.errors import UserError

COLUMNS = ("id", "messages", "domain", "subdomain")
DEFAULT_DOMAIN = "chat"

# ShareGPT speaker names -> chat roles. Anything else (rare) drops the message.
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}

# How code and math tasks are posed to a chat model. Kept as constants so held-out matching can unwrap them.
HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"
MATH_INSTRUCTION = "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
MMATH_SUBSETS = ("MATH500", "AIME2024", "AIME2025")


@dataclass
class Source:
    """One conversation source, as written in YAML.

    Args:
        name: a packaged name (``sharegpt``, ``mt-bench``, ``humaneval``, ``mmath``), a local
            ``.jsonl``/``.json``/``.parquet`` file or folder, or a hub data set id. Local and hub sources need a
            ``messages`` column (list of ``{role, content}``) or a ShareGPT-style ``conversations`` column
            (list of ``{from, value}``).
        domain: the domain label of rows that have no ``domain`` column (default: the packaged source's
            domain, else ``chat``). For packaged sources it overrides the built-in domain.
        limit: read at most this many usable conversations (the first ones, in file order); None = the
            data module's default.
        split: the split to read from a hub data set or a folder.
        streaming: read a hub data set (or a local file) row by row instead of downloading (preparing) it whole: only
            the first ``limit`` usable conversations are ever fetched, for sets larger than the disk or memory.
    """

    name: str
    domain: str | None = None
    limit: int | None = None
    split: str = "train"
    streaming: bool = False


def as_source(source: Source | str | dict) -> Source:
    """A ``Source`` from a plain string, a dict (YAML without ``class_path``) or a ``Source``."""
    if isinstance(source, Source):
        return source
    if isinstance(source, str):
        return Source(name=source)
    if isinstance(source, dict):
        return Source(**source)
    if hasattr(source, "name"):  # a jsonargparse Namespace that was not instantiated
        return Source(**{k: v for k, v in vars(source).items() if k in Source.__dataclass_fields__})
    raise TypeError(f"A data source must be a name, a path or a Source, not {type(source).__name__}.")


# ---------------------------------------------------------------------------------------------- cleaning


def _text(content: Any) -> str:
    """Message content as text; multi-part content (``[{type: text, text}]``) keeps its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def clean_messages(messages: Iterable[dict], *, role_key: str = "role", content_key: str = "content") -> list[dict]:
    """Map roles, strip contents, drop empty messages; [] if the conversation does not open with a user turn.

    A conversation may start with one system message; after it the first message must be the user's (ShareGPT
    splits long chats into parts, and the later parts start with the assistant: those are unusable).
    """
    out = []
    for message in messages or ():
        if not isinstance(message, dict):
            continue
        role = _ROLES.get(str(message.get(role_key, "")).lower())
        content = _text(message.get(content_key)).strip()
        if role is None or not content:
            continue
        out.append({"role": role, "content": content})
    start = 1 if out and out[0]["role"] == "system" else 0
    if len(out) <= start or out[start]["role"] != "user":
        return []
    return out


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: the key that decides whether a training prompt is an eval prompt."""
    return " ".join(text.split())


def held_out_keys(messages: list[dict]) -> set[str]:
    """Keys of a conversation's first user message: the message itself and, for the packaged code and math
    prompts, the raw task without our instruction wrapper (a training set may contain the bare task)."""
    user = next((m["content"] for m in messages if m["role"] == "user"), None)
    if user is None:
        return set()
    keys = {normalize_text(user)}
    head, _, tail = HUMANEVAL_INSTRUCTION.partition("{prompt}")
    if user.startswith(head) and user.endswith(tail):
        keys.add(normalize_text(user[len(head) : len(user) - len(tail)]))
    suffix = MATH_INSTRUCTION.partition("{question}")[2].replace("{{}}", "{}")
    if user.endswith(suffix):
        keys.add(normalize_text(user[: -len(suffix)]))
    return keys - {""}


# ---------------------------------------------------------------------------------------------- packaged


def iter_json_list(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Records of a (possibly truncated) top-level JSON list, one at a time, reading ``chunk_chars`` at a time.

    The packaged ShareGPT file is cut off mid-record, so ``json.load`` fails on it; we ``raw_decode`` record by
    record and stop cleanly at an incomplete tail. Only as much of the file as the consumer asks for is read.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buffer = f.read(chunk_chars)
        pos = buffer.find("[")
        if pos < 0:
            raise UserError(f"{path} is not a JSON list (no opening '[').")
        pos += 1
        eof = False
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:  # a truncated tail: every complete record has been yielded
                    return
                more = f.read(chunk_chars)
                eof = not more
                buffer = buffer[pos:] + more
                pos = 0
                continue
            if end == len(buffer) and not eof:  # a number or literal may continue in the next chunk
                more = f.read(chunk_chars)
                eof = not more
                if more:
                    buffer = buffer[pos:] + more
                    pos = 0
                    continue
            yield record
            pos = end


def _sharegpt_rows() -> Iterator[dict]:
    for record in iter_json_list(assets.sharegpt_file()):
        if not isinstance(record, dict):
            continue
        messages = clean_messages(record.get("conversations") or [], role_key="from", content_key="value")
        if messages:
            yield {"id": str(record.get("id", "")), "messages": messages, "domain": "chat", "subdomain": "sharegpt"}


def _mtbench_rows() -> Iterator[dict]:
    """MT-Bench questions as prompts: the first turn only (the second refers to the model's own answer)."""
    with open(assets.mtbench_file(), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            messages = clean_messages([{"role": "user", "content": row["turns"][0]}])
            if messages:
                yield {
                    "id": f"mt-bench/{row['question_id']}",
                    "messages": messages,
                    "domain": "chat",
                    "subdomain": row["category"],
                }


def _humaneval_rows() -> Iterator[dict]:
    with gzip.open(assets.humaneval_file(), "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            content = HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])
            yield {
                "id": row["task_id"],
                "messages": [{"role": "user", "content": content}],
                "domain": "code",
                "subdomain": "humaneval",
            }


def _mmath_rows() -> Iterator[dict]:
    """MMATH English, MATH500 and AIME 2024/2025 only (the CNMO items are translated competition problems)."""
    rows = json.loads(assets.mmath_file("en").read_text(encoding="utf-8"))
    for row in rows:
        subset = row.get("data_source", "")
        if subset not in MMATH_SUBSETS:
            continue
        content = MATH_INSTRUCTION.format(question=row["question"].strip())
        yield {
            "id": f"mmath/{subset}/{row.get('data_source_id', row.get('gid'))}",
            "messages": [{"role": "user", "content": content}],
            "domain": "math",
            "subdomain": subset,
        }


# name -> (rows, domain)
PACKAGED = {
    "sharegpt": (_sharegpt_rows, "chat"),
    "mt-bench": (_mtbench_rows, "chat"),
    "humaneval": (_humaneval_rows, "code"),
    "mmath": (_mmath_rows, "math"),
}


# ---------------------------------------------------------------------------------------------- ordinary


def _is_blank(path: Path, head: int = 1 << 16) -> bool:
    """An empty or whitespace-only file (only the first ``head`` bytes are read)."""
    with open(path, "rb") as f:
        data = f.read(head)
    return len(data) < head and not data.strip()


def _load_ordinary(source: Source) -> datasets.Dataset | datasets.IterableDataset:
    """A local file/folder or a hub data set, through ``datasets`` (the hub only when the name is no path)."""
    path = Path(source.name).expanduser()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if path.is_file():
        builder = builders.get(path.suffix.lower())
        if builder is None:
            raise UserError(
                f"data source '{source.name}' is a {path.suffix or 'suffix-less'} file; use a .jsonl, .json or "
                ".parquet file (or a folder of them)."
            )
        if builder == "json" and _is_blank(path):
            # datasets' JSON builder dies with a bare StopIteration on an empty file: treat it as zero rows,
            # so the data module reports "gave no usable conversations" and names the source.
            return datasets.Dataset.from_dict({"messages": []})
        return _read_local(source, [path], lambda: datasets.load_dataset(builder, data_files=str(path), split="train",
                                                                         streaming=source.streaming))
    if path.is_dir():
        if (path / "rollouts.json").is_file() or (path / "shards" / "run.json").is_file():
            raise UserError(
                f"data source '{source.name}' is a rollouts folder, which holds token ids, not conversations; use it "
                "as a data.train_sources entry or as the rollouts of offline evaluation."
            )
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".json", ".jsonl"))
        return _read_local(source, files, lambda: datasets.load_dataset(str(path), split=source.split,
                                                                        streaming=source.streaming))
    looks_like_path = source.name.startswith((".", "/", "~")) or path.suffix.lower() in builders
    if looks_like_path or source.name.count("/") > 1 or not source.name.strip():
        raise UserError(
            f"data source '{source.name}' is neither a packaged name ({', '.join(PACKAGED)}) nor an existing "
            "file or folder; fix the name or the path."
        )
    try:
        return datasets.load_dataset(source.name, split=source.split, streaming=source.streaming)
    except Exception as err:  # offline, unknown id, no such split: one sentence, with the cause attached
        raise UserError(
            f"data source '{source.name}' is not a packaged name ({', '.join(PACKAGED)}), not an existing file or "
            f"folder, and could not be loaded from the hub ({type(err).__name__}: {err}); fix the name or the path."
        ) from err


def _read_local(source: Source, files: list[Path], read: Callable[[], datasets.Dataset]) -> datasets.Dataset:
    """``read()``; when ``datasets`` fails on a local file, one sentence naming the file and the line at fault
    (its own error is a 100-line traceback from inside the JSON builder, "in row 1" of a chunk at best)."""
    try:
        return read()
    except Exception as err:
        for path in files:
            where = _bad_json_line(path)
            if where is not None:
                raise UserError(
                    f"data source '{source.name}': {path} line {where[0]} is not valid JSON ({where[1]}); fix or "
                    "remove that line (JSON Lines: one JSON object per line)."
                ) from None
        raise UserError(
            f"data source '{source.name}' could not be read by datasets ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else 'no message'}); check the file's format."
        ) from err


def _bad_json_line(path: Path) -> tuple[int, str] | None:
    """(line number, reason) where a JSON Lines file stops parsing, None where it parses. A file whose first line
    is no record of its own is one JSON document (a pretty-printed list) and is judged as a whole."""
    if path.suffix.lower() not in (".json", ".jsonl"):
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    records = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    for k, (number, line) in enumerate(records):
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            if k > 0:
                return number, err.msg
            try:
                json.loads(text)
                return None
            except json.JSONDecodeError as whole:
                return whole.lineno, whole.msg
    return None


def _ordinary_rows(source: Source, dataset: datasets.Dataset | datasets.IterableDataset) -> Iterator[dict]:
    names = dataset.column_names
    if names is None:  # a stream whose columns are only known from its first row
        names = list(next(iter(dataset), {}).keys())
    columns = set(names)
    if "messages" in columns:
        key, role_key, content_key = "messages", "role", "content"
    elif "conversations" in columns:
        key, role_key, content_key = "conversations", "from", "value"
    else:
        raise UserError(
            f"data source '{source.name}' has neither a 'messages' column (list of {{role, content}}) nor a "
            f"'conversations' column (list of {{from, value}}); its columns are {sorted(columns)}. Rename the "
            "conversation column to 'messages'."
        )
    default_domain = source.domain or DEFAULT_DOMAIN
    short = Path(source.name).stem if Path(source.name).suffix else Path(source.name).name or source.name
    for index, row in enumerate(dataset):
        messages = clean_messages(row[key], role_key=role_key, content_key=content_key)
        if not messages:
            continue
        rid = row.get("id")
        yield {
            "id": str(rid) if rid is not None else f"{short}/{index}",
            "messages": messages,
            "domain": str(row.get("domain") or default_domain),
            "subdomain": str(row.get("subdomain") or short),
        }


# -------------------------------------------------------------------------------------------------- entry


def load_source(source: Source | str, *, limit: int | None = None) -> datasets.Dataset:
    """Load one source as a ``datasets.Dataset`` with columns ``id, messages, domain, subdomain``.

    Rows keep file order, so ``limit`` is a stable prefix; shuffling happens where prompts or batches are drawn.

    Args:
        source: a ``Source`` or a plain name/path (see ``Source.name``).
        limit: keep the first ``limit`` usable conversations (file order, so the result is deterministic and
            reading stops early); ``Source.limit`` wins when set. None = all.
    """
    source = as_source(source)
    limit = source.limit if source.limit is not None else limit
    if limit is not None and limit < 0:
        raise UserError(f"data source '{source.name}': limit={limit} must be >= 0 (or null for all rows).")
    if source.name in PACKAGED:
        make_rows, _ = PACKAGED[source.name]
        rows_iter: Iterator[dict] = make_rows()
        if source.domain:
            rows_iter = ({**row, "domain": source.domain} for row in rows_iter)
    else:
        rows_iter = _ordinary_rows(source, _load_ordinary(source))
    rows = []
    for row in rows_iter:
        if limit is not None and len(rows) >= limit:
            break
        rows.append(row)
    return _to_dataset(rows)


def _to_dataset(rows: list[dict]) -> datasets.Dataset:
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            "domain": datasets.Value("string"),
            "subdomain": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict({c: [row[c] for row in rows] for c in COLUMNS}, features=features)
