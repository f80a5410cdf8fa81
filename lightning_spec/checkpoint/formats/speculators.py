"""The speculators format (vllm-project/speculators 0.9): EAGLE-3, P-EAGLE, DFlash, DFlash2, DSpark and MTP. vLLM
serves all but MTP from it (DSpark and DFlash2 only in its model runner V2); it has no loader for the format's MTP.

A folder holds ``config.json`` (``speculators_model_type``, ``transformer_layer_config`` — the drafter's decoder
layers as an HF config —, the family's fields and ``speculators_config`` {algorithm, proposal_methods, verifier})
and ``model.safetensors``. Conventions this module maps, EAGLE-3's and DFlash's checked by serving the export with
vLLM (``make serve-check``), DSpark's and MTP's against the speculators library's own modules
(tests/export/test_export.py):

* The target's embedding is not shipped for EAGLE-3 and DFlash: they borrow it unchanged, and vLLM 0.32 shares the
  target's when the draft checkpoint has none (``has_own_embed_tokens``; 113 MB of fp32 for SmolLM2, most of the
  folder). DSpark ships its own table, whose ``mask_token_id`` row is learned (below).
* Feature layers. Ours are 0-indexed layer outputs (HF ``hidden_states[l + 1]``); speculators / vLLM number an aux
  hidden state by the layer it enters (vLLM records the residual stream *before* layer i), so id = ours + 1.
* Draft vocabulary. ``d2t`` (Vd,) int64 offsets, target id = i + d2t[i]; ``t2d`` (V,) bool.
* EAGLE-3's layer keeps its residual stream un-normed (``norm_before_residual: false``; vLLM defaults to true when
  the field is absent, so it is always written). EAGLE-3.1's three options are written as they are set, each with
  the keys vLLM 0.32 loads for it: ``norm_before_fc`` (``input_norm.weight``, over the concatenated features),
  ``fc_norm`` (``fc_norm.<i>.weight``, one per feature layer) and ``norm_output`` (the next step reads the normed
  state; no weights). vLLM drops ``input_norm.*`` silently when ``norm_before_fc`` is false, so a mismatch between
  flag and keys is refused on read.
* DFlash counts the anchor in its block (``block_size`` = our K + 1, ``sample_from_anchor: false``); the block is
  bidirectional, and vLLM reads ``sliding_window_non_causal: false`` as "make every layer causal", so true is
  written (speculators applies it to sliding-window layers only, which these drafters have none of). The mask
  vector goes to ``mask_embedding.pt``, which vLLM substitutes for the embedding of ``mask_token_id``.
* DSpark is DFlash's backbone whose anchor slot predicts (``sample_from_anchor: true``, ``block_size`` = our K).
  vLLM's DSpark embeds the masks with the embedding table's row of ``mask_token_id`` and ignores
  ``mask_embedding.pt``, so the learned mask vector is also written into that row of the shipped ``embed_tokens``
  (which vLLM then keeps as the drafter's own). ``markov_w1`` has a row per target token; ours has one per draft
  token and one shared by the rest, which the export repeats. The confidence head has no per-slot temperatures in
  the format: the raw head is written and the STS temperatures go to ``dspark_calibration.json``. (The speculators
  library itself loads the verifier's embedding over the shipped one: there the mask is the token's embedding.)
* DFlash2 is DFlash's folder plus ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and
  ``selector_top_k`` (vLLM's ``update_dflash2`` copies the four into ``dflash_config``), each layer's
  ``attention_conv`` / ``mlp_conv`` tensors and ``candidate_selector.{predecessor,successor}_codebook`` (V, r) with
  ``candidate_selector.hidden_projection.weight``; vLLM serves it with method ``dflash``, choosing the selector's walk
  by the ``DFlash2DraftModel`` architecture. Its candidates index the target's vocabulary, so the draft vocabulary
  must be the whole of it, and the folder has no ``d2t`` / ``t2d`` (the speculators library's DFlash2 has none).
* MTP is one Qwen3 layer (``mtp_layers.0.*``) over the target's final-normed last hidden state, full vocabulary,
  its input projection over [RMSNorm(embedding); RMSNorm(state)] (ours is [state; embedding]: the two column
  halves swap), each step reading the previous step's normed output (``normed_chain``). Our stream also holds an
  entry at position 0 from a zero state and x_0; the library's first entry pairs h_0 with x_1 (one entry fewer).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_spec.checkpoint.formats.common import (
    ATTN,
    MLP,
    VERSION,
    config_format,
    layer_config,
    proposal_tokens,
    record,
    require_options,
    speculators_config,
    take,
    verifier_of,
    vocab_ids,
    vocab_tensors,
)
from lightning_spec.checkpoint.formats.speculators_block import DFlash2Codec, DFlashCodec, DSparkCodec
from lightning_spec.drafters import Drafter, Eagle3Drafter, MTPDrafter, PEagleDrafter
from lightning_spec.drafters.eagle import EagleDrafter
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    pass
# ------------------------------------------------------------------------------------------------ EAGLE-3
class Eagle3Codec:
    """Eagle3Drafter <-> speculators ``eagle3`` (vLLM's ``Eagle3LlamaForCausalLM``): one layer, ``layers.0.*``."""

    algorithm = "eagle3"
    vllm, serving_note = "eagle3", ""  # vLLM's speculative method for the folder (None: none), what to know
    vllm_options: dict[str, Any] = {}  # what else vLLM's speculative_config needs for the folder
    layer_prefix = "layers.0."  # SGLang's layout names the same layer ``midlayer.``

    def layer_names(self) -> dict[str, str]:
        """Our layer's state-dict keys -> the format's."""
        p = self.layer_prefix
        names = {"input_norm": "input_layernorm", "hidden_norm": "hidden_norm", "post_norm": "post_attention_layernorm",
                 **ATTN, **MLP}
        return {f"layer.{ours}.weight": f"{p}{theirs}.weight" for ours, theirs in names.items()}

    def check(self, drafter: Drafter) -> None:
        pass  # every Eagle3Drafter option has a field in the format

    def option_names(self, d: EagleDrafter) -> dict[str, str]:
        """EAGLE-3.1's norms, where on: our keys -> the format's."""
        names = {"input_norm.weight": "input_norm.weight"} if d.norm_before_fc else {}
        if d.fc_norm:
            names.update({f"fc_norms.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(d.target_layers))})
        return names

    def tensors(self, d: EagleDrafter) -> dict[str, torch.Tensor]:
        state = d.state_dict()
        out = {theirs: state[ours] for ours, theirs in {**self.layer_names(), **self.option_names(d)}.items()}
        head = d.lm_head if d.own_head else d.vocab.head_weight(d.target.lm_head)
        out.update({"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"], "lm_head.weight": head,
                    **vocab_tensors(d)})  # no embed_tokens: the target's, which vLLM shares when the folder has none
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def write(self, d: EagleDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        config = {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": VERSION,
            "transformer_layer_config": layer_config(d, "llama", 1, d.layer.gate_proj.out_features),
            "draft_vocab_size": d.vocab.ids.numel(),
            "norm_before_residual": False,
            "norm_before_fc": d.norm_before_fc,
            "fc_norm": d.fc_norm,
            "norm_output": d.norm_output,
            "embed_requires_grad": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in d.target_layers],
            "tie_word_embeddings": False,
            "speculators_config": speculators_config("eagle3", d.block_size, verifier, d.target),
        }
        return config, self.tensors(d), {}

    def served(self, config: dict) -> dict[str, Any]:
        """What vLLM 0.32 must build from this folder's ``config`` (``update_eagle3``): its speculative config's
        fields and, under ``draft.``, the draft model config's, as dotted paths -> values."""
        return {"method": "eagle3", "num_speculative_tokens": proposal_tokens(config, 0),
                "draft.architectures": ["Eagle3LlamaForCausalLM"], "draft.draft_vocab_size": config["draft_vocab_size"],
                "draft.eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
                **{f"draft.{flag}": config[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                              "norm_output")}}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        layer = config.get("transformer_layer_config") or {}
        if config.get("norm_before_residual"):
            raise UserError(f"{what} is an EAGLE-3 drafter with norm_before_residual: true, which Eagle3Drafter does "
                            "not have.")
        options = {flag: bool(config.get(flag)) for flag in ("norm_before_fc", "fc_norm", "norm_output")}
        for flag, key in (("norm_before_fc", "input_norm.weight"), ("fc_norm", "fc_norm.0.weight")):
            if options[flag] != (key in tensors):
                has = "has" if key in tensors else "lacks"
                raise UserError(f"{what} says {flag}: {str(options[flag]).lower()} and {has} {key}; a server would "
                                f"{'drop' if key in tensors else 'miss'} those weights: fix config.json's {flag}.")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise UserError(
                f"{what} is an EAGLE-3 drafter with {layer['num_hidden_layers']} layers; Eagle3Drafter has one."
            )
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise UserError(f"{what} lacks eagle_aux_hidden_state_layer_ids; the feature layers must be named.")
        vocab_size = int(layer.get("vocab_size") or tensors["t2d"].numel())
        draft_size = int(config.get("draft_vocab_size") or vocab_size)
        ids = vocab_ids(tensors, vocab_size, draft_size, what)
        ours = {
            "block_size": proposal_tokens(config, 7),
            "target_layers": [int(i) - 1 for i in aux],
            "draft_vocab_size": draft_size if draft_size < vocab_size else None,
            "intermediate_size": int(layer.get("intermediate_size")) if layer.get("intermediate_size") else None,
            "own_head": True,  # a foreign drafter's head is its own (EAGLE-3 trains it)
            **options,
        }
        names = {**self.layer_names(), **self.option_names(Eagle3Drafter(target_layers=ours["target_layers"],
                                                                           **options))}
        state = take(tensors, {"fc.weight": "fc.weight", "norm.weight": "norm.weight", **names}, what)
        state.update({"vocab.ids": ids, "vocab.ready": torch.tensor(True)})
        rec = record(Eagle3Drafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config))
        if rec["drafter_config"].get("own_head"):
            state["lm_head"] = take(tensors, {"lm_head": "lm_head.weight"}, what)["lm_head"]
        return rec, state


class PEagleCodec(Eagle3Codec):
    """PEagleDrafter <-> the speculators ``peagle`` layout, as vLLM 0.32 serves it (``speculators_model_type:
    peagle``: EAGLE-3's method with ``parallel_drafting``, its ``PeagleLlamaForCausalLM``): EAGLE-3's tensors plus
    ``mask_token_id`` in config.json (the masked slots' token, vLLM's ``pard_token``) and ``mask_hidden`` (1, F) in
    the weights (the placeholder features, which vLLM passes through ``combine_hidden_states``). Folders written
    before as ``eagle3`` with ``parallel_drafting: true`` still read (vLLM 0.32 finds no mask token in those)."""

    algorithm = "peagle"
    vllm, serving_note = "eagle3", "serve with speculative_config parallel_drafting: true (one draft call per round)"
    vllm_options = {"parallel_drafting": True}

    def check(self, drafter: Drafter) -> None:
        if drafter.fc_norm:  # vLLM 0.32's peagle reader takes norm_before_fc, not fc_norm: it would drop the norms
            raise UserError("PEagleDrafter(fc_norm=True) has no field in the speculators peagle format (vLLM 0.32 "
                            "reads norm_before_fc only and would serve it without its norms); train it with "
                            "norm_before_fc instead, or keep it in lightning_spec's own folder (save_drafter).")

    def tensors(self, d: EagleDrafter) -> dict[str, torch.Tensor]:
        return {**super().tensors(d), "mask_hidden": d.mask_hidden.detach().float()}

    def write(self, d: EagleDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        config, tensors, extra = super().write(d, verifier)
        config.update({"speculators_model_type": "peagle", "mask_token_id": d.mask_token_id, "parallel_drafting": True,
                       "down_sample_ratio": d.down_sample_ratio, "down_sample_ratio_min": d.down_sample_ratio_min,
                       "speculators_config": {**config["speculators_config"], "algorithm": "peagle"}})
        for name in ("fc_norm", "norm_output"):  # not P-EAGLE fields in the format (check refuses them on)
            config.pop(name)
        return config, tensors, extra

    def served(self, config: dict) -> dict[str, Any]:
        """As EAGLE-3's (``update_peagle``): parallel drafting on, the mask token as vLLM's ``pard_token``."""
        return {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": proposal_tokens(config, 0),
                "draft.architectures": ["PeagleLlamaForCausalLM"], "draft.draft_vocab_size": config["draft_vocab_size"],
                "draft.eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
                "draft.pard_token": config["mask_token_id"], "draft.norm_before_fc": config["norm_before_fc"],
                "draft.norm_before_residual": config["norm_before_residual"]}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if config.get("mask_token_id") is None or "mask_hidden" not in tensors:
            raise UserError(f"{what} '{folder}' says parallel_drafting but lacks mask_token_id or mask_hidden; a "
                            "P-EAGLE folder needs both.")
        if config.get("norm_output"):
            raise UserError(f"{what} '{folder}' is a P-EAGLE drafter with norm_output: true, which no slot of a "
                            "parallel round reads; PEagleDrafter has no such option.")
        eagle, state = super().read(config, tensors, folder, None, what)  # EAGLE-3's part, as a foreign folder's
        ours = {k: v for k, v in eagle["drafter_config"].items() if k != "norm_output"}
        ours.update({"mask_token_id": int(config["mask_token_id"]),
                     "down_sample_ratio": float(config.get("down_sample_ratio", 0.7)),
                     "down_sample_ratio_min": float(config.get("down_sample_ratio_min", 0.2))})
        rec = record(PEagleDrafter, ours, verifier_of(config), eagle["target_vocab_size"], sidecar,
                     config_format(config))
        if not rec["drafter_config"].get("own_head"):  # our own export of a drafter on the target's head
            state.pop("lm_head", None)
        state["mask_hidden"] = tensors["mask_hidden"].reshape(1, -1).float()
        return rec, state


# ------------------------------------------------------------------------------------------------ MTP
class MTPCodec:
    """MTPDrafter <-> speculators ``mtp``: one Qwen3 MTP layer, ``mtp_layers.0.*``; the embedding and the head are
    the target's (the format ships neither)."""

    algorithm = "mtp"
    vllm = None
    vllm_options: dict[str, Any] = {}
    serving_note = ("vLLM 0.32 has no loader for the speculators MTP format (it serves MTP layers shipped inside a "
                "target checkpoint); the speculators library reads it (SpeculatorModel.from_pretrained).")
    prefix = "mtp_layers.0."

    def layer_names(self) -> dict[str, str]:
        p = self.prefix
        block = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", **ATTN, **MLP,
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        names = {f"mtp.0.block.{ours}.weight": f"{p}{theirs}.weight" for ours, theirs in block.items()}
        norms = {"hnorm": "hidden_layernorm", "enorm": "token_layernorm", "out_norm": "final_layernorm"}
        names.update({f"mtp.0.{ours}.weight": f"{p}{theirs}.weight" for ours, theirs in norms.items()})
        return names

    def check(self, d: MTPDrafter) -> None:
        wanted = {
            "num_modules": (d.num_modules == 1, "1 (the format holds one MTP layer)"),
            "qk_norm": (d.qk_norm, "true (its layer is a Qwen3 layer)"),
            "normed_chain": (d.normed_chain, "true (each step reads the previous step's normed output)"),
            "draft_vocab_size": (d.vocab.full, "null (its head is the target's whole vocabulary)"),
        }
        require_options(d, wanted, "speculators MTP", "experiments/drafters/mtp_export.yaml")

    def write(self, d: MTPDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        state = d.state_dict()
        out = {theirs: state[ours] for ours, theirs in self.layer_names().items()}
        h = d.target.hidden_size
        proj = state["mtp.0.proj.weight"]  # (H, 2H) over [state; embedding]; the format's is over [embedding; state]
        out[f"{self.prefix}input_proj.weight"] = torch.cat([proj[:, h:], proj[:, :h]], 1)
        layer = layer_config(d, "qwen3", d.target.num_layers, d.mtp[0].block.gate_proj.out_features)
        config = {
            "architectures": ["MTPDraftModel"],
            "speculators_model_type": "mtp",
            "speculators_version": VERSION,
            "transformer_layer_config": layer,  # the verifier's shape: its last layer's state is the input
            "num_nextn_predict_layers": 1,
            "speculators_config": speculators_config("mtp", d.block_size, verifier, d.target),
        }
        return config, {k: v.detach().float() for k, v in out.items()}, {}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        layer = config.get("transformer_layer_config") or {}
        if int(config.get("num_nextn_predict_layers", 1)) != 1:
            raise UserError(f"{what} has {config['num_nextn_predict_layers']} MTP layers; the format (and this "
                            "reader) holds one.")
        vocab_size = int(layer.get("vocab_size") or 0)
        state = take(tensors, self.layer_names(), what)
        proj = take(tensors, {"p": f"{self.prefix}input_proj.weight"}, what)["p"]  # (H, 2H) over [embedding; state]
        h = proj.shape[0]
        state["mtp.0.proj.weight"] = torch.cat([proj[:, h:], proj[:, :h]], 1)
        state.update({"vocab.ids": torch.arange(vocab_size), "vocab.ready": torch.tensor(True)})
        ours = {
            "block_size": proposal_tokens(config, 3),
            "num_modules": 1,
            "intermediate_size": int(layer.get("intermediate_size")) if layer.get("intermediate_size") else None,
            "qk_norm": True,
            "normed_chain": True,
        }
        return record(MTPDrafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config)), state


# family name (``drafters.FAMILIES``) -> its codec
CODECS: dict[str, Any] = {"eagle3": Eagle3Codec(), "peagle": PEagleCodec(), "dflash": DFlashCodec(),
                          "dflash2": DFlash2Codec(), "dspark": DSparkCodec(), "mtp": MTPCodec()}


def codec_of_config(config: dict) -> Any | None:
    """The codec for a config.json in this format, by its declared type (None: not this format's); an EAGLE-3 folder
    that says ``parallel_drafting`` is P-EAGLE's."""
    kind = config.get("speculators_model_type")
    if kind == "eagle3" and config.get("parallel_drafting"):
        return CODECS["peagle"]
    return next((c for c in CODECS.values() if c.algorithm == kind), None) if kind else None
