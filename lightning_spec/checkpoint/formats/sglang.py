"""SGLang's layouts: EAGLE-3 as SpecForge writes it for SGLang, and DFlash as its release checkpoints.

Written from the format descriptions (SGLang's ``LlamaForCausalLMEagle3`` and ``DFlashDraftModel`` loaders), and
read back here; unlike the speculators format they have not been served on this machine (SGLang has no CPU
backend), so treat a first serve as the check.

* EAGLE-3: a plain Llama config (``architectures: [LlamaForCausalLMEagle3]``, ``num_hidden_layers: 1``,
  ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` numbered as vLLM's, our layer + 1); the
  layer's weights under ``midlayer.*``; ``d2t`` / ``t2d`` and ``hot_token_id`` (the draft vocabulary's target ids,
  SGLang's frequency-ranked head), ``fc``, ``norm``, ``lm_head``.
* DFlash: a Qwen3 config of the draft layers with ``architectures: [DFlashDraftModel]``, ``block_size`` (= our
  K + 1, the anchor counted) and ``dflash_config`` {``mask_token_id``, ``target_layer_ids``: 0-indexed layer
  outputs, our own numbering}; weights as the speculators layout, the mask vector in ``mask_embedding.pt``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spec.checkpoint.formats.common import layer_config
from lightning_spec.checkpoint.formats.speculators import Eagle3Codec
from lightning_spec.checkpoint.formats.speculators_block import DFlashCodec
from lightning_spec.drafters import DFlashDrafter, Drafter, Eagle3Drafter
from lightning_spec.errors import UserError


class SGLangEagle3Codec(Eagle3Codec):
    layer_prefix = "midlayer."

    def check(self, drafter: Drafter) -> None:
        assert isinstance(drafter, Eagle3Drafter)
        flags = {"norm_before_fc": drafter.norm_before_fc, "fc_norm": drafter.fc_norm,
                 "norm_output": drafter.norm_output}
        on = [flag for flag, value in flags.items() if value]
        if on:  # this layout is written from SGLang's loader of EAGLE-3 as published, which has no such fields
            raise UserError(f"the SGLang layout holds EAGLE-3 as published, and this drafter has EAGLE-3.1's "
                            f"{', '.join(on)}: export it in the speculators format (--format speculators).")

    def write(self, d: Eagle3Drafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        config = layer_config(d, "llama", 1, d.layer.gate_proj.out_features)
        config.update({
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": d.vocab.ids.numel(),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in d.target_layers],
                             "use_aux_hidden_state": True},
            "speculative_num_steps": d.block_size,
            "verifier": verifier,
        })
        tensors = self.tensors(d)  # no embed_tokens: SGLang shares the target's embedding too
        tensors["hot_token_id"] = d.vocab.ids.long()
        return config, tensors, {}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        eagle = config.get("eagle_config") or {}
        as_speculators = {
            "transformer_layer_config": config,
            "draft_vocab_size": config.get("draft_vocab_size"),
            "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
            "speculators_config": {"proposal_methods": [{"speculative_tokens": config.get("speculative_num_steps", 7)}],
                                   "verifier": {"name_or_path": config.get("verifier", "")}},
        }
        return super().read(as_speculators, tensors, folder, sidecar, what)


class SGLangDFlashCodec(DFlashCodec):
    def write(self, d: DFlashDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        spec = self.config(d, verifier)
        config = dict(spec["transformer_layer_config"])
        config.update({
            "architectures": ["DFlashDraftModel"],
            "block_size": d.block_size + 1,
            "draft_vocab_size": spec["draft_vocab_size"],
            "num_target_layers": d.target.num_layers,
            "dflash_config": {"mask_token_id": d.mask_token_id, "target_layer_ids": list(d.target_layers)},
            "verifier": verifier,
        })
        _, tensors, extra = super().write(d, verifier)
        return config, tensors, extra

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        dflash = config.get("dflash_config") or {}
        as_speculators = {
            "transformer_layer_config": config,
            "draft_vocab_size": config.get("draft_vocab_size"),
            "block_size": config.get("block_size"),
            "aux_hidden_state_layer_ids": [int(i) + 1 for i in dflash.get("target_layer_ids") or []],
            "mask_token_id": dflash.get("mask_token_id"),
            "speculators_config": {"verifier": {"name_or_path": config.get("verifier", "")}},
        }
        if as_speculators["block_size"] is None:
            raise UserError(f"{what} '{folder}' is a DFlash config without block_size.")
        return super().read(as_speculators, tensors, folder, sidecar, what)


# family name (``drafters.FAMILIES``) -> its codec
CODECS: dict[str, Any] = {"eagle3": SGLangEagle3Codec(), "dflash": SGLangDFlashCodec()}


def codec_of_config(config: dict) -> Any | None:
    """The codec for a config.json in these layouts, by its declared architecture (None: not SGLang's)."""
    if "speculators_model_type" in config:
        return None
    archs = config.get("architectures") or []
    if "LlamaForCausalLMEagle3" in archs:
        return CODECS["eagle3"]
    if "DFlashDraftModel" in archs and "dflash_config" in config:
        return CODECS["dflash"]
    return None
