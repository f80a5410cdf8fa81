"""The speculators format (vllm-project/speculators 0.9), which vLLM serves directly: EAGLE-3 and DFlash.

A folder holds ``config.json`` (``speculators_model_type``, ``transformer_layer_config`` — the drafter's decoder
layers as an HF config —, the family's fields and ``speculators_config`` {algorithm, proposal_methods, verifier})
and ``model.safetensors``. Conventions this module maps, each checked by serving the export with vLLM
(``make serve-check``):

* Feature layers. Ours are 0-indexed layer outputs (HF ``hidden_states[l + 1]``); speculators / vLLM number an aux
  hidden state by the layer it enters (vLLM records the residual stream *before* layer i), so id = ours + 1.
* Draft vocabulary. ``d2t`` (Vd,) int64 offsets, target id = i + d2t[i]; ``t2d`` (V,) bool.
* EAGLE-3's layer keeps its residual stream un-normed (``norm_before_residual: false``; vLLM defaults to true when
  the field is absent, so it is always written) and feeds the pre-norm state to the next step (``norm_output:
  false``).
* DFlash counts the anchor in its block (``block_size`` = our K + 1, ``sample_from_anchor: false``); the block is
  bidirectional, and vLLM reads ``sliding_window_non_causal: false`` as "make every layer causal", so true is
  written (speculators applies it to sliding-window layers only, which these drafters have none of). The mask
  vector goes to ``mask_embedding.pt``, which vLLM substitutes for the embedding of ``mask_token_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spec.drafters.base import Drafter
from lightning_spec.drafters.block import BlockDrafter
from lightning_spec.drafters.eagle3 import Eagle3Drafter
from lightning_spec.export.common import layer_config, record, take, vocab_ids, vocab_tensors

VERSION = "0.9.0"  # the speculators release whose format this writes

MLP = {"gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
ATTN = {m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}


def speculators_config(algorithm: str, tokens: int, verifier: str, target: Any) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------------------ EAGLE-3
class Eagle3Codec:
    """Eagle3Drafter <-> speculators ``eagle3`` (vLLM's ``Eagle3LlamaForCausalLM``): one layer, ``layers.0.*``."""

    algorithm = "eagle3"
    layer_prefix = "layers.0."  # SGLang's layout names the same layer ``midlayer.``

    def layer_names(self) -> dict[str, str]:
        """Our layer's state-dict keys -> the format's."""
        p = self.layer_prefix
        names = {"input_norm": "input_layernorm", "hidden_norm": "hidden_norm", "post_norm": "post_attention_layernorm",
                 **ATTN, **MLP}
        return {f"layer.{ours}.weight": f"{p}{theirs}.weight" for ours, theirs in names.items()}

    def check(self, drafter: Drafter) -> None:
        pass  # every Eagle3Drafter option has a field in the format

    def tensors(self, d: Eagle3Drafter) -> dict[str, torch.Tensor]:
        state = d.state_dict()
        out = {theirs: state[ours] for ours, theirs in self.layer_names().items()}
        head = d.lm_head if d.own_head else d.vocab.head_weight(d.target.lm_head)
        out.update({"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"], "lm_head.weight": head,
                    "embed_tokens.weight": d.target.embed_tokens.weight, **vocab_tensors(d)})
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def write(self, d: Eagle3Drafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        config = {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": VERSION,
            "transformer_layer_config": layer_config(d, "llama", 1, d.layer.gate_proj.out_features),
            "draft_vocab_size": d.vocab.ids.numel(),
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "embed_requires_grad": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in d.target_layers],
            "tie_word_embeddings": False,
            "speculators_config": speculators_config("eagle3", d.block_size, verifier, d.target),
        }
        return config, self.tensors(d), {}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        layer = config.get("transformer_layer_config") or {}
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            if config.get(flag):
                raise ValueError(f"{what} is an EAGLE-3 drafter with {flag}: true, which Eagle3Drafter does not have.")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"{what} is an EAGLE-3 drafter with {layer['num_hidden_layers']} layers; Eagle3Drafter has one."
            )
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise ValueError(f"{what} lacks eagle_aux_hidden_state_layer_ids; the feature layers must be named.")
        vocab_size = int(layer.get("vocab_size") or tensors["t2d"].numel())
        draft_size = int(config.get("draft_vocab_size") or vocab_size)
        ids = vocab_ids(tensors, vocab_size, draft_size, what)
        state = take(tensors, {"fc.weight": "fc.weight", "norm.weight": "norm.weight", **self.layer_names()}, what)
        state.update({"vocab.ids": ids, "vocab.ready": torch.tensor(True)})
        ours = {
            "block_size": proposal_tokens(config, 7),
            "target_layers": [int(i) - 1 for i in aux],
            "draft_vocab_size": draft_size if draft_size < vocab_size else None,
            "intermediate_size": int(layer.get("intermediate_size")) if layer.get("intermediate_size") else None,
            "own_head": True,  # a foreign drafter's head is its own (EAGLE-3 trains it)
        }
        rec = record(Eagle3Drafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config))
        if rec["drafter_config"].get("own_head"):
            state["lm_head"] = take(tensors, {"lm_head": "lm_head.weight"}, what)["lm_head"]
        return rec, state


# ------------------------------------------------------------------------------------------------ DFlash
class DFlashCodec:
    """BlockDrafter <-> speculators ``dflash`` (vLLM's ``DFlashDraftModel``, Qwen3-style layers)."""

    algorithm = "dflash"

    @staticmethod
    def layer_names(num_layers: int) -> dict[str, str]:
        names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", **ATTN, **MLP,
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        return {f"layers.{i}.{ours}.weight": f"layers.{i}.{theirs}.weight"
                for i in range(num_layers) for ours, theirs in names.items()}

    def check(self, d: BlockDrafter) -> None:
        wanted = {
            "qk_norm": (d.qk_norm, "true (DFlash's layers norm queries and keys)"),
            "mask_token_id": (d.mask_token_id is not None, "a token id (DFlash shares one mask token over the block)"),
            "context_shortcut": (not d.context_shortcut, "false (DFlash has no shortcut)"),
            "length_head": (d.length is None, "false (serving engines submit the whole block)"),
        }
        bad = [f"drafter.{name}: {why}" for name, (ok, why) in wanted.items() if not ok]
        if bad:
            raise ValueError(
                f"This BlockDrafter cannot be written as DFlash: train it with {'; '.join(bad)} "
                "(experiments/drafters/dflash_export.yaml sets them)."
            )

    def tensors(self, d: BlockDrafter) -> dict[str, torch.Tensor]:
        state = d.state_dict()
        out = {theirs: state[ours] for ours, theirs in self.layer_names(d.num_layers).items()}
        out.update({"fc.weight": state["fc.weight"], "hidden_norm.weight": state["ctx_norm.weight"],
                    "norm.weight": state["norm.weight"], "lm_head.weight": d.vocab.head_weight(d.target.lm_head),
                    "embed_tokens.weight": d.target.embed_tokens.weight, **vocab_tensors(d)})
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def config(self, d: BlockDrafter, verifier: str) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_version": VERSION,
            "transformer_layer_config": layer_config(d, "qwen3", d.num_layers, d.layers[0].gate_proj.out_features),
            "draft_vocab_size": d.vocab.ids.numel(),
            "block_size": d.block_size + 1,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": [layer + 1 for layer in d.target_layers],
            "mask_token_id": d.mask_token_id,
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "speculators_config": speculators_config("dflash", d.block_size, verifier, d.target),
        }

    def write(self, d: BlockDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        mask = {"mask_token_id": d.mask_token_id, "embedding": d.mask_embedding.detach()[0].float().cpu().clone()}
        return self.config(d, verifier), self.tensors(d), {"mask_embedding.pt": mask}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        layer = config.get("transformer_layer_config") or {}
        if config.get("sample_from_anchor"):
            raise ValueError(f"{what} is a DFlash drafter that samples from the anchor; BlockDrafter drafts after it.")
        aux, mask_id = config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id")
        if not aux or mask_id is None:
            raise ValueError(f"{what} lacks aux_hidden_state_layer_ids or mask_token_id, which DFlash needs.")
        num_layers = int(layer.get("num_hidden_layers", 1))
        vocab_size = int(layer.get("vocab_size") or tensors["t2d"].numel())
        draft_size = int(config.get("draft_vocab_size") or vocab_size)
        ours = {
            "block_size": int(config["block_size"]) - 1,
            "num_layers": num_layers,
            "target_layers": [int(i) - 1 for i in aux],
            "draft_vocab_size": draft_size if draft_size < vocab_size else None,
            "intermediate_size": int(layer.get("intermediate_size")) if layer.get("intermediate_size") else None,
            "qk_norm": True,
            "mask_token_id": int(mask_id),
        }
        state = take(tensors, {"fc.weight": "fc.weight", "ctx_norm.weight": "hidden_norm.weight",
                               "norm.weight": "norm.weight", **self.layer_names(num_layers)}, what)
        state.update({"vocab.ids": vocab_ids(tensors, vocab_size, draft_size, what), "vocab.ready": torch.tensor(True)})
        state["mask_embedding"] = mask_vector(folder, int(mask_id), tensors, what)[None]  # (1, H)
        return record(BlockDrafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config)), state


def config_format(config: dict) -> str:
    """Which layout a config.json (or the speculators-shaped view of an SGLang one) came in: the record says."""
    return "speculators" if "speculators_model_type" in config else "sglang"


def mask_vector(folder: Path, mask_id: int, tensors: dict[str, torch.Tensor], what: str) -> torch.Tensor:
    """DFlash's mask vector (H,): ``mask_embedding.pt`` when shipped, else the file's embedding of the mask token."""
    path = folder / "mask_embedding.pt"
    if path.is_file():
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 (any unreadable file gets the same sentence)
            raise ValueError(f"{what}: mask_embedding.pt is not a readable tensor file ({err}).") from None
        if isinstance(obj, dict):
            if obj.get("mask_token_id", mask_id) != mask_id:
                raise ValueError(f"{what}: mask_embedding.pt is for token {obj.get('mask_token_id')}, not {mask_id}.")
            obj = obj.get("embedding")
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{what}: mask_embedding.pt holds no tensor.")
        return obj.reshape(-1).float()
    if "embed_tokens.weight" in tensors:
        return tensors["embed_tokens.weight"][mask_id].float()
    raise ValueError(
        f"{what} has neither mask_embedding.pt nor embed_tokens.weight, so its mask vector is unknown; add the "
        "target's embedding of mask_token_id as mask_embedding.pt."
    )


CODECS: dict[type, Any] = {Eagle3Drafter: Eagle3Codec(), BlockDrafter: DFlashCodec()}


def codec_of_config(config: dict) -> Any | None:
    """The codec for a config.json in this format, by its declared type (None: not this format's)."""
    kind = config.get("speculators_model_type")
    return {"eagle3": CODECS[Eagle3Drafter], "dflash": CODECS[BlockDrafter]}.get(kind) if kind else None
