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

from lightning_spec.checkpoint.formats.common import layer_config, read_json, record, take, vocab_ids, vocab_tensors
from lightning_spec.drafters import (
    DFlash2Drafter,
    DFlashDrafter,
    Drafter,
    DSparkDrafter,
    Eagle3Drafter,
    MTPDrafter,
    PEagleDrafter,
)
from lightning_spec.drafters.eagle import EagleDrafter
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target

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


# ------------------------------------------------------------------------------------------------ DFlash
class DFlashCodec:
    """DFlashDrafter <-> speculators ``dflash`` (vLLM's ``DFlashDraftModel``, Qwen3-style layers)."""

    algorithm = "dflash"
    vllm, serving_note = "dflash", ""
    vllm_options: dict[str, Any] = {}
    family = "DFlash"
    recipe = "experiments/quickstart.yaml's drafter"

    @staticmethod
    def layer_names(num_layers: int) -> dict[str, str]:
        names = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", **ATTN, **MLP,
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        return {f"layers.{i}.{ours}.weight": f"layers.{i}.{theirs}.weight"
                for i in range(num_layers) for ours, theirs in names.items()}

    def check(self, d: DFlashDrafter) -> None:
        wanted = {
            "qk_norm": (d.qk_norm, "true (DFlash's layers norm queries and keys)"),
            "mask_token_id": (d.mask_token_id is not None, "a token id (DFlash shares one mask token over the block)"),
            "context_shortcut": (not d.context_shortcut, "false (DFlash has no shortcut)"),
            "length_head": (d.length is None, "false (serving engines submit the whole block)"),
        }
        require_options(d, wanted, self.family, self.recipe)

    def tensors(self, d: DFlashDrafter) -> dict[str, torch.Tensor]:
        state = d.state_dict()
        out = {theirs: state[ours] for ours, theirs in self.layer_names(d.num_layers).items()}
        out.update({"fc.weight": state["fc.weight"], "hidden_norm.weight": state["ctx_norm.weight"],
                    "norm.weight": state["norm.weight"], "lm_head.weight": d.vocab.head_weight(d.target.lm_head),
                    **vocab_tensors(d)})  # no embed_tokens: the target's, which vLLM shares when the folder has none
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def config(self, d: DFlashDrafter, verifier: str) -> dict[str, Any]:
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

    def write(self, d: DFlashDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        return self.config(d, verifier), self.tensors(d), {"mask_embedding.pt": mask_file(d)}

    def served(self, config: dict) -> dict[str, Any]:
        """What vLLM 0.32 must build from this folder (``update_dflash``): the block's mask token, the target layers
        (0-indexed there), a bidirectional block, drafts after the anchor."""
        block = {"mask_token_id": config["mask_token_id"], "sample_from_anchor": False, "causal": False,
                 "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]]}
        return {"method": "dflash", "num_speculative_tokens": proposal_tokens(config, 0),
                "draft.architectures": ["DFlashDraftModel"], "draft.draft_vocab_size": config["draft_vocab_size"],
                **{f"draft.dflash_config.{k}": v for k, v in block.items()}}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        if config.get("sample_from_anchor"):
            raise UserError(f"{what} is a DFlash drafter that samples from the anchor; DFlashDrafter drafts after it.")
        ours, state, vocab_size = self.backbone(config, tensors, folder, what)
        ours["block_size"] = int(config["block_size"]) - 1
        rec = record(DFlashDrafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config))
        return from_target(rec, state), state

    def backbone(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path,
                 what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
        """The DFlash backbone DSpark shares: (our init arguments but block_size, state, target vocabulary size)."""
        layer = config.get("transformer_layer_config") or {}
        aux, mask_id = config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id")
        if not aux or mask_id is None:
            raise UserError(f"{what} lacks aux_hidden_state_layer_ids or mask_token_id, which DFlash needs.")
        num_layers = int(layer.get("num_hidden_layers", 1))
        vocab_size = int(layer.get("vocab_size") or tensors["t2d"].numel())
        draft_size = int(config.get("draft_vocab_size") or vocab_size)
        ours = {
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
        mask = mask_vector(folder, int(mask_id), tensors, what)
        if mask is not None:
            state["mask_embedding"] = mask[None]  # (1, H)
        return ours, state, vocab_size


# ------------------------------------------------------------------------------------------------ DSpark
class DSparkCodec(DFlashCodec):
    """DSparkDrafter <-> speculators ``dspark`` (vLLM's ``Qwen3DSparkModel``): DFlash's backbone and names, plus
    ``markov_head.*`` and ``confidence_head.proj``."""

    algorithm = "dspark"
    vllm = "dspark"
    vllm_options: dict[str, Any] = {}
    serving_note = ("vLLM 0.32 runs DSpark in its model runner V2 only (a GPU, or a CPU with Triton's CPU backend), "
                    "and serves the vanilla Markov head only.")
    family = "DSpark"
    recipe = "experiments/drafters/dspark_export.yaml"
    calibration = "dspark_calibration.json"  # the STS temperatures, which the format has no field for

    def tensors(self, d: DSparkDrafter) -> dict[str, torch.Tensor]:
        out = super().tensors(d)
        seq = d.sequential
        # W1 has a row per target token: each token's draft row, or the shared row of the tokens outside (V, r)
        every = torch.arange(d.target.vocab_size, device=seq.embed.weight.device)
        out["markov_head.markov_w1.weight"] = seq.embed.weight.detach()[d.rows(every)]
        out["markov_head.markov_w2.weight"] = seq.out.weight.detach()
        if seq.rnn is not None:  # [gate; candidate; output] over [state; W1[x]; h], speculators' joint_proj
            out["markov_head.joint_proj.weight"] = seq.rnn.weight.detach()
            out["markov_head.joint_proj.bias"] = seq.rnn.bias.detach()
        out["confidence_head.proj.weight"] = d.confidence.weight.detach()  # over [h; W1[x]]
        out["confidence_head.proj.bias"] = d.confidence.bias.detach()
        # vLLM's DSpark embeds the masks with the table's row of mask_token_id: that row is the learned vector
        embed = d.target.embed_tokens.weight.detach().clone()  # its own table: the mask row differs from the target's
        embed[d.mask_token_id] = d.mask_embedding.detach()[0]
        out["embed_tokens.weight"] = embed
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def config(self, d: DSparkDrafter, verifier: str) -> dict[str, Any]:
        config = super().config(d, verifier)
        config.update({
            "architectures": ["DSparkDraftModel"],
            "speculators_model_type": "dspark",
            "block_size": d.block_size,  # the anchor's slot is the first of the K predictions
            "sample_from_anchor": True,
            "markov_rank": d.markov_rank,
            "markov_head_type": d.markov,
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            "speculators_config": speculators_config("dspark", d.block_size, verifier, d.target),
        })
        return config

    def write(self, d: DSparkDrafter, verifier: str) -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
        temps = {"confidence_temperature": d.confidence_temperature.detach().float().cpu().tolist()}
        return self.config(d, verifier), self.tensors(d), {"mask_embedding.pt": mask_file(d), self.calibration: temps}

    def served(self, config: dict) -> dict[str, Any]:
        """What vLLM 0.32 must build from this folder (``update_dspark``): its fields on the draft config itself."""
        fields = ("draft_vocab_size", "mask_token_id", "markov_rank", "markov_head_type", "block_size",
                  "sample_from_anchor", "enable_confidence_head", "confidence_head_with_markov")
        return {"method": "dspark", "num_speculative_tokens": proposal_tokens(config, 0),
                "draft.architectures": ["Qwen3DSparkModel"],
                "draft.target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]],
                **{f"draft.{k}": config[k] for k in fields}}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        if config.get("sample_from_anchor") is False:
            raise UserError(f"{what} is a DSpark drafter whose anchor does not predict (sample_from_anchor: false); "
                            "DSparkDrafter's anchor slot is its first prediction.")
        kind, rank = config.get("markov_head_type", "vanilla"), int(config.get("markov_rank", 256))
        if kind not in ("vanilla", "rnn") or rank < 1:
            raise UserError(f"{what} has markov_head_type {kind!r} with markov_rank {rank}; DSparkDrafter has the "
                            "vanilla and rnn heads with rank >= 1.")
        ours, state, vocab_size = self.backbone(config, tensors, folder, what)
        k = int(config["block_size"])
        ours.update(block_size=k, markov=kind, markov_rank=rank)
        ids = state["vocab.ids"]
        w1 = take(tensors, {"w1": "markov_head.markov_w1.weight"}, what)["w1"]  # (V, r)
        outside = torch.ones(vocab_size, dtype=torch.bool)
        outside[ids] = False
        shared = w1[outside]
        if shared.shape[0] and not bool((shared == shared[:1]).all()):
            raise UserError(f"{what} has its own markov_w1 row for tokens outside its {ids.numel()}-token draft "
                            "vocabulary; DSparkDrafter shares one row among them, so it cannot hold this drafter.")
        rest = shared[:1] if shared.shape[0] else w1.new_zeros(1, rank)  # unused with the full vocabulary
        state["sequential.embed.weight"] = torch.cat([w1[ids], rest])  # (Vd + 1, r)
        names = {"sequential.out.weight": "markov_head.markov_w2.weight"}
        if kind == "rnn":
            names.update({"sequential.rnn.weight": "markov_head.joint_proj.weight",
                          "sequential.rnn.bias": "markov_head.joint_proj.bias"})
        state.update(take(tensors, names, what))
        hidden = state["norm.weight"].numel()
        if config.get("enable_confidence_head", True) and "confidence_head.proj.weight" in tensors:
            w = tensors["confidence_head.proj.weight"].float().reshape(1, -1)
            if not config.get("confidence_head_with_markov", True):  # [h] only: W1's columns weigh 0
                w = torch.cat([w, w.new_zeros(1, rank)], 1)
            bias = tensors.get("confidence_head.proj.bias", torch.zeros(1)).float().reshape(1)
        else:  # no confidence head: nothing to schedule with, every round submits the whole block
            w, bias = torch.zeros(1, hidden + rank), torch.zeros(1)
            ours["prefix_scheduler"] = False
        state.update({"confidence.weight": w, "confidence.bias": bias})
        state["confidence_temperature"] = self.temperatures(folder, k, what)
        rec = record(DSparkDrafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config))
        return from_target(rec, state), state

    def temperatures(self, folder: Path, k: int, what: str) -> torch.Tensor:
        """(K,) the STS temperatures of ``dspark_calibration.json``, or ones (uncalibrated) without the file."""
        path = folder / self.calibration
        if not path.is_file():
            return torch.ones(k)
        temps = read_json(path, what).get("confidence_temperature")
        if not isinstance(temps, list) or len(temps) != k or not all(
                isinstance(t, (int, float)) and t > 0 for t in temps):
            raise UserError(f"{what}: {self.calibration} must hold confidence_temperature, {k} numbers > 0.")
        return torch.tensor(temps, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ DFlash2
SELECTOR_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # config.json's own


class DFlash2Codec(DFlashCodec):
    """DFlash2Drafter <-> speculators ``dflash2`` (vLLM's ``DFlash2DraftModel``, method ``dflash``): DFlash's backbone
    and names, plus each layer's ``attention_conv`` / ``mlp_conv`` (``base_kernel``, ``kernel_projection``) and the
    ``candidate_selector``'s two codebooks and projection, over the target's full vocabulary."""

    algorithm = "dflash2"
    vllm = "dflash"
    serving_note = ("vLLM 0.32 runs DFlash2 in its model runner V2 only (a GPU, or a CPU with Triton's CPU backend); "
                    "its V1 runner refuses it ('Model Runner V1 does not support: DFlash candidate-head drafts').")
    family = "DFlash2"
    recipe = "experiments/drafters/dflash2.yaml with drafter.draft_vocab_size: null"
    CONVS = ("attention_conv", "mlp_conv")

    def check(self, d) -> None:
        super().check(d)
        require_options(d, {"draft_vocab_size": (d.draft_vocab_size is None, "null (vLLM's selector codebooks and "
                                                 "candidates cover the target's whole vocabulary)")},
                        self.family, self.recipe)

    def extra_names(self, num_layers: int) -> dict[str, str]:
        """Our convolution and selector keys -> the format's."""
        names = {f"layers.{i}.{conv}.{p}": f"layers.{i}.{conv}.{p}" for i in range(num_layers) for conv in self.CONVS
                 for p in ("base_kernel", "kernel_projection.weight")}
        names.update({f"selector.{c}.weight": f"candidate_selector.{c}"
                      for c in ("predecessor_codebook", "successor_codebook")})
        names["selector.hidden_projection.weight"] = "candidate_selector.hidden_projection.weight"
        return names

    def tensors(self, d) -> dict[str, torch.Tensor]:
        state = d.state_dict()
        out = {k: v for k, v in super().tensors(d).items() if k not in ("d2t", "t2d")}  # the full vocabulary: no map
        return {**out, **{theirs: state[ours].float() for ours, theirs in self.extra_names(d.num_layers).items()}}

    def config(self, d, verifier: str) -> dict[str, Any]:
        config = super().config(d, verifier)
        config.update({
            "architectures": ["DFlash2DraftModel"],
            "speculators_model_type": "dflash2",
            "conv_kernel_size": d.conv_kernel_size,
            "conv_group_size": d.conv_group_size,
            "selector_rank": d.selector_rank,
            "selector_top_k": d.selector_top_k,
            "speculators_config": speculators_config("dflash2", d.block_size, verifier, d.target),
        })
        return config

    def served(self, config: dict) -> dict[str, Any]:
        """DFlash's, under the ``DFlash2DraftModel`` architecture, with the four fields ``update_dflash2`` copies into
        ``dflash_config`` (a server that drops one serves DFlash2's backbone without its selector or convolutions)."""
        fields = {f"draft.dflash_config.{k}": config[k] for k in SELECTOR_FIELDS}
        return {**super().served(config), "draft.architectures": ["DFlash2DraftModel"], **fields}

    def read(self, config: dict, tensors: dict[str, torch.Tensor], folder: Path, sidecar: dict | None,
             what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        what = f"{what} '{folder}'"
        missing = [k for k in SELECTOR_FIELDS if config.get(k) is None]
        if missing:
            raise UserError(f"{what} is a DFlash2 folder without {', '.join(missing)} in config.json; a server would "
                            "fall back to its defaults or drop the selector: write them.")
        if config.get("sample_from_anchor"):
            raise UserError(f"{what} is a DFlash2 drafter that samples from the anchor; DFlash2Drafter drafts after "
                            "it.")
        ours, state, vocab_size = self.backbone(config, tensors, folder, what)
        ours.update(block_size=int(config["block_size"]) - 1, **{k: int(config[k]) for k in SELECTOR_FIELDS})
        state.update(take(tensors, self.extra_names(ours["num_layers"]), what))
        rec = record(DFlash2Drafter, ours, verifier_of(config), vocab_size, sidecar, config_format(config))
        return from_target(rec, state), state


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


def mask_file(d: DFlashDrafter) -> dict[str, Any]:
    """``mask_embedding.pt``: the shared mask vector (H,) and its token, as vLLM's DFlash loader reads it."""
    return {"mask_token_id": d.mask_token_id, "embedding": d.mask_embedding.detach()[0].float().cpu().clone()}


def from_target(rec: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A folder without the mask vector (the speculators library ships neither the embedding nor
    ``mask_embedding.pt``) uses the target's embedding of the mask token, which is what ``bind`` starts the vector
    from: the record lists it as a weight the loader takes from the bound drafter."""
    return {**rec, "from_target": [] if "mask_embedding" in state else ["mask_embedding"]}


def mask_vector(folder: Path, mask_id: int, tensors: dict[str, torch.Tensor], what: str) -> torch.Tensor | None:
    """DFlash's mask vector (H,): ``mask_embedding.pt`` when shipped, else the file's embedding of the mask token,
    else None (the target's embedding of it, which the folder does not hold)."""
    path = folder / "mask_embedding.pt"
    if path.is_file():
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 (any unreadable file gets the same sentence)
            raise UserError(f"{what}: mask_embedding.pt is not a readable tensor file ({err}).") from None
        if isinstance(obj, dict):
            if obj.get("mask_token_id", mask_id) != mask_id:
                raise UserError(f"{what}: mask_embedding.pt is for token {obj.get('mask_token_id')}, not {mask_id}.")
            obj = obj.get("embedding")
        if not isinstance(obj, torch.Tensor):
            raise UserError(f"{what}: mask_embedding.pt holds no tensor.")
        return obj.reshape(-1).float()
    if "embed_tokens.weight" in tensors:
        return tensors["embed_tokens.weight"][mask_id].float()
    return None


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
