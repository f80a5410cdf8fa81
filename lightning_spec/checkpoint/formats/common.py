"""What every serving codec shares: the HF layer config of a drafter's layers, the vocabulary maps, JSON reading, and
the speculators format's common fields (``speculators_config``, its proposal count and verifier), which both its
modules (``speculators.py``, ``speculators_block.py``) and the SGLang codecs built on them read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_spec.drafters import class_path_now
from lightning_spec.drafters.base import Drafter
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target

SIDECAR = "lightning_spec.json"  # our exact record next to a serving layout (class, init arguments, target)


class Codec(Protocol):
    """One family in one serving format."""

    def check(self, drafter: Drafter) -> None:
        """Refuse, in one sentence, a drafter of this family whose options the format cannot express."""

    def write(self, drafter: Drafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        """-> (config.json, safetensors tensors, other files by name)."""

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """-> (record as checkpoint.drafter_record writes it, our drafter's state dict)."""


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{what} '{path}' is not valid JSON ({err.msg} at line {err.lineno}).") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} '{path}' does not hold a JSON object.")
    return data


def layer_config(drafter: Drafter, model_type: str, num_layers: int, intermediate: int) -> dict[str, Any]:
    """The HF config of the drafter's decoder layers: the target's attention shape, ``num_layers`` layers, MLP width
    ``intermediate``, the target's vocabulary (the embedding the serving engine shares with the target)."""
    cfg = drafter.target.config
    heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    out = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 4096)),
        "vocab_size": drafter.target.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(cfg, "bos_token_id", None),
        "eos_token_id": getattr(cfg, "eos_token_id", None),
        "torch_dtype": "float32",
    }
    return out


def vocab_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """EAGLE-3's vocabulary maps: ``d2t`` (Vd,) int64 offsets (target id = i + d2t[i]), ``t2d`` (V,) bool."""
    return {"d2t": drafter.vocab.d2t.long(), "t2d": drafter.vocab.t2d}


def vocab_ids(tensors: dict[str, torch.Tensor], vocab_size: int, draft_size: int, what: str) -> torch.Tensor:
    """Our sorted draft ids (Vd,) from a file's ``d2t`` (or ``hot_token_id``); arange when the file has neither
    (a full-vocabulary drafter)."""
    if "d2t" in tensors:
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    elif "hot_token_id" in tensors:
        ids = tensors["hot_token_id"].long()
    else:
        ids = torch.arange(draft_size)
    if ids.numel() != draft_size or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise UserError(f"{what}: the draft vocabulary map (d2t) is not {draft_size} increasing target ids.")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise UserError(f"{what}: the draft vocabulary map (d2t) names ids outside the target's 0..{vocab_size - 1}.")
    return ids


def take(tensors: dict[str, torch.Tensor], names: dict[str, str], what: str) -> dict[str, torch.Tensor]:
    """Our state-dict entries from a file's tensors: ``names`` maps our key -> the file's key."""
    missing = sorted(theirs for theirs in names.values() if theirs not in tensors)
    if missing:
        raise UserError(f"{what}: the weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''}.")
    return {ours: tensors[theirs].float() for ours, theirs in names.items()}


def record(cls: type, config: dict[str, Any], target: str, vocab_size: int, sidecar: dict | None,
           fmt: str) -> dict[str, Any]:
    """The record ``load_drafter`` binds: the sidecar's when it names the same class (our own export, exact),
    else one built from the folder's config (a folder another tool wrote)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    ours = sidecar.get("drafter_class") if sidecar is not None else None
    if isinstance(ours, str) and class_path_now(ours) == path and isinstance(sidecar.get("drafter_config"), dict):
        return {**sidecar, "drafter_class": path, "format": fmt}
    return {"drafter_class": path, "drafter_config": config, "target": target, "target_vocab_size": vocab_size,
            "target_fingerprint": None, "format": fmt, "parent": None}


# ------------------------------------------------------------------------------- the speculators format's fields
VERSION = "0.9.0"  # the speculators release whose format this writes

MLP = {"gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
ATTN = {m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}


def speculators_config(algorithm: str, tokens: int, verifier: str, target: Target) -> dict[str, Any]:
    archs = list(getattr(target.config, "architectures", None) or [type(target.model).__name__])
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": archs},
    }


def proposal_tokens(config: dict, default: int) -> int:
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
    return int(methods[0].get("speculative_tokens", default)) if methods else default


def verifier_of(config: dict) -> str:
    return str(((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or "")


def require_options(d: Drafter, wanted: dict[str, tuple[bool, str]], family: str, recipe: str) -> None:
    """Refuse, in one sentence, a drafter whose options the family's layout cannot hold: ``wanted`` maps an init
    argument to (whether the drafter has what the layout needs, the value it needs and why)."""
    bad = [f"drafter.{name}: {why}" for name, (ok, why) in wanted.items() if not ok]
    if bad:
        raise UserError(
            f"This {type(d).__name__} cannot be written as {family}: train it with {'; '.join(bad)} ({recipe} sets "
            "them)."
        )


def config_format(config: dict) -> str:
    """Which layout a config.json (or the speculators-shaped view of an SGLang one) came in: the record says."""
    return "speculators" if "speculators_model_type" in config else "sglang"
