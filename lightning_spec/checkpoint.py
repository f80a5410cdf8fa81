"""``load_drafter``: a drafter from a ``fit`` checkpoint (.ckpt) or an exported folder, bound to its target.

A checkpoint stores the drafter's weights, its class and init arguments, and the target it was trained for
(name, weight fingerprint, vocabulary size) — never the target's weights.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from lightning_spec.drafters.base import Drafter
from lightning_spec.target import Target, load_target

CKPT_KEY = "lightning_spec"


def drafter_record(drafter: Drafter, target_spec: str) -> dict[str, Any]:
    """What a checkpoint stores next to the drafter's weights: how to rebuild it and for which target."""
    return {
        "drafter_class": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
        "drafter_config": drafter.config_dict(),
        "target": target_spec,
        "target_fingerprint": drafter.target.fingerprint,
        "target_vocab_size": drafter.target.vocab_size,
    }


def build(spec: Any) -> Any:
    """Instantiate nested ``{class_path, init_args}`` dicts (the inverse of ``describe``)."""
    if isinstance(spec, list):
        return [build(x) for x in spec]
    if isinstance(spec, dict) and "class_path" in spec:
        module, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls(**{k: build(v) for k, v in spec.get("init_args", {}).items()})
    return spec


def describe(obj: Any) -> Any:
    """A plain nested dict of an object's class and init-time attributes, for hyperparameter logging."""
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, (list, tuple)):
        return [describe(x) for x in obj]
    path = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, torch.nn.Module) and hasattr(obj, "config_dict"):
        return {"class_path": path, "init_args": obj.config_dict()}
    fields = {k: describe(v) for k, v in vars(obj).items() if not k.startswith("_")} if hasattr(obj, "__dict__") else {}
    return {"class_path": path, "init_args": fields}


def _build(meta: dict[str, Any], state: dict[str, torch.Tensor], target: Target | None) -> Drafter:
    drafter: Drafter = build({"class_path": meta["drafter_class"], "init_args": meta["drafter_config"]})
    target = load_target(target if target is not None else meta["target"])
    if target.vocab_size != meta["target_vocab_size"]:
        raise ValueError(
            f"The drafter was trained for a target with a {meta['target_vocab_size']}-token vocabulary, but this "
            f"target has {target.vocab_size}; load it with the target it was trained for ({meta['target']!r})."
        )
    drafter.bind(target)
    drafter.load_state_dict(state)
    return drafter.eval()


def load_drafter(path: str | Path, target: Any = None) -> Drafter:
    """Rebuild a drafter from ``path`` (a ``.ckpt`` from ``fit`` or a folder from ``save_drafter``).

    ``target`` (a ``Target``, name, folder or model) defaults to the one recorded in the checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        meta = json.loads((path / "drafter.json").read_text())
        state = torch.load(path / "drafter.pt", map_location="cpu", weights_only=True)
        return _build(meta, state, target)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if CKPT_KEY not in ckpt:
        raise ValueError(f"{path} is not a lightning_spec checkpoint (no '{CKPT_KEY}' entry); pass a fit checkpoint.")
    state = {k[len("drafter.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    return _build(ckpt[CKPT_KEY], state, target)


def save_drafter(drafter: Drafter, folder: str | Path, target_spec: str | None = None) -> Path:
    """Export a drafter as a folder: ``drafter.json`` (class, config, target) + ``drafter.pt`` (weights)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = drafter_record(drafter, target_spec or drafter.target.name)
    (folder / "drafter.json").write_text(json.dumps(meta, indent=2))
    torch.save(drafter.state_dict(), folder / "drafter.pt")
    return folder
