"""Objectives as the CLI builds them from a YAML, and a batch to train them on."""

from pathlib import Path

import torch
import yaml

from lightning_spec.objectives import Objective


def batch_of(target, n: int = 3, s: int = 24, seed: int = 0) -> dict:
    """``n`` (<= 3) random rows of length ``s``; row i is supervised from position 4, 6 or 9 to i before its end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (n, s), generator=g)
    loss_mask = torch.zeros(n, s, dtype=torch.long)
    for i, start in enumerate([4, 6, 9]):
        loss_mask[i, start : s - i] = 1
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids),
            "index": torch.arange(n)}


def instantiate_objective(path: Path) -> Objective:
    """model.objective of a YAML, built the way the CLI builds it (jsonargparse, typed by DraftModule)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--objective", type=Objective)
    cfg = parser.parse_object({"objective": yaml.safe_load(path.read_text())["model"]["objective"]})
    return parser.instantiate_classes(cfg).objective
