"""Small datasets the tests write or build: JSONL files of chats and tokenised examples."""

import json
from pathlib import Path

import torch


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def conversations(n: int, tag: str = "") -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question {i}{tag}: what is {i} times {i + 3}?"},
                {"role": "assistant", "content": f"{i} times {i + 3} is {i * (i + 3)}.{tag} Anything else?"},
            ]
        }
        for i in range(n)
    ]


def chats(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(n)
    ]


def sequences(n: int = 8, seed: int = 0) -> list[dict]:
    """Examples of different lengths whose loss masks differ, so every micro-batch has its own Σ weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 10 + 3 * i % 11
        ids = torch.randint(0, 256, (length,), generator=g)
        mask = torch.ones(length, dtype=torch.bool)
        mask[: 2 + i % 4] = False  # a "prompt" of varying length
        mask[length // 2 + i % 3] = False  # and a hole
        out.append({"input_ids": ids, "loss_mask": mask, "domain_id": 0, "index": i})
    return out
