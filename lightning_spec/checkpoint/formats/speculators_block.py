"""The speculators format's block drafters (``speculators.py`` holds the format's conventions and the rest): DFlash,
DSpark and DFlash2, which share DFlash's backbone, names and mask vector (``mask_embedding.pt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spec.checkpoint.formats.common import (
    ATTN,
    MLP,
    VERSION,
    config_format,
    layer_config,
    proposal_tokens,
    read_json,
    record,
    require_options,
    speculators_config,
    take,
    verifier_of,
    vocab_ids,
    vocab_tensors,
)
from lightning_spec.drafters import DFlash2Drafter, DFlashDrafter, DSparkDrafter
from lightning_spec.errors import UserError


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
