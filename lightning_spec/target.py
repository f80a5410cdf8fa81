"""Target: the frozen LLM whose outputs must not change (speculative decoding reproduces them exactly).

It gives a drafter what it asks for — hidden states of chosen layers and the final normed hidden state — and
runs prefill/verify forwards against a KV cache that is cropped after a rejection. Nothing here trains.

Layer convention: ``layers=[l, ...]`` are 0-indexed decoder layers and the feature of layer ``l`` is the
output of that layer, i.e. HF ``hidden_states[l + 1]`` (index 0 is the embedding output). In recent
transformers the entry of the *last* layer is already passed through the final norm.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import inspect
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_spec.errors import UserError
from lightning_spec.fast_forward import FastForward, StaticCache, unsupported

_LIVE: weakref.WeakSet[Target] = weakref.WeakSet()  # every Target of this process, for ``live_target``
DECODE_PATHS = ("fast", "transformers")  # how a target's decoding forwards run (``load_target(decode=)``)


def check_decode(decode: str) -> None:
    if decode not in DECODE_PATHS:
        raise UserError(f"target decode must be one of {', '.join(DECODE_PATHS)}, got {decode!r}.")


def dtype_name(dtype: torch.dtype | str) -> str:
    """``float32`` for ``torch.float32``: how configs, stores and reports name a dtype."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TargetOptions:
    """How a target named by a string is loaded and prompted, beyond its name (``model.target_options``; the data
    module, rollouts and evaluation read the same options, and checkpoints record them).

    Args:
        revision: the hub branch, tag or commit of a hub id (ignored for packaged names and local folders).
        trust_remote_code: run the Python code a model ships in its folder or repository (its config's
            ``auto_map``), as ``transformers`` does with the same flag. Off: such a model is refused in one
            sentence naming this option. Turn it on only for code you trust.
        attn_implementation: ``eager``, ``sdpa``, ``flash_attention_2``, ... (``transformers``' names); null keeps
            transformers' default, with our shared-KV SDPA variant on CPU (same outputs, faster verify forwards).
        chat_template_kwargs: keyword arguments for the chat template wherever it is applied (training
            conversations, eval prompts, rollouts, evaluation), e.g. ``{enable_thinking: false}`` for Qwen3.
    """

    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, options: TargetOptions | dict | None) -> TargetOptions:
        """Options from a ``TargetOptions``, a plain dict (YAML, a checkpoint's record) or None (the defaults)."""
        if options is None or isinstance(options, TargetOptions):
            return options or cls()
        if not isinstance(options, dict):
            raise TypeError(f"model.target_options must be a mapping, got {type(options).__name__}.")
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise UserError(f"model.target_options has unknown keys {unknown}; the keys are "
                            f"{sorted(cls.__dataclass_fields__)}.")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (hyperparameters, checkpoint records); only those that differ from the
        defaults, so a default target records ``{}``."""
        default = TargetOptions()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    def loading(self) -> dict[str, Any]:
        """The keyword arguments of ``from_pretrained`` (model, config and tokenizer) these options set."""
        kwargs: dict[str, Any] = {"trust_remote_code": self.trust_remote_code}
        if self.revision is not None:
            kwargs["revision"] = self.revision
        return kwargs


@dataclass
class TargetOutput:
    """What one target forward returns. ``features`` is None when no layers were asked for."""

    logits: Tensor | None  # (N, T, V) or None when not asked for
    features: Tensor | None  # (N, T, len(layers) * H), concatenated in the order of ``layers``
    last_hidden: Tensor  # (N, T, H) final normed hidden state: logits = lm_head(last_hidden)


class WeightsHash:
    """A target's weights fingerprint, fed one parameter at a time (``Target.fingerprints`` over the loaded model; a
    head-only load over the files, never holding more than one layer tensor): the name and the architecture
    (``model_type``), then each parameter's name, shape and 64 strided values in fp64. Nothing else of the config
    enters it: not the folder it was loaded from (``_name_or_path``), not the attributes a transformers release adds.
    The earlier recipe (the whole config's JSON, then the same values) is kept beside it for files that recorded it."""

    def __init__(self, name: str, config: Any) -> None:
        self.now, self.before = hashlib.sha256(name.encode()), hashlib.sha256(name.encode())
        self.now.update(str(config.model_type).encode())
        self.before.update(config.to_json_string(use_diff=False).encode())

    def add(self, name: str, tensor: Tensor) -> None:
        flat = tensor.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)].double().cpu().numpy().tobytes()
        self.now.update(f"{name}{tuple(tensor.shape)}".encode() + sample)
        self.before.update(sample)

    def digests(self) -> tuple[str, str]:
        """(fingerprint, the earlier one)."""
        return self.now.hexdigest()[:16], self.before.hexdigest()[:16]


class Target(nn.Module):
    """A frozen HF causal LM. Eval mode, grads off, never saved in a drafter checkpoint."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str | None = None,
                 options: TargetOptions | None = None, fingerprints: tuple[str, str] | None = None,
                 decode: str = "fast", folder: str | None = None) -> None:
        super().__init__()
        check_decode(decode)
        self.decode = decode  # how decoding forwards run (``DECODE_PATHS``); assign another to switch
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.options = options or TargetOptions()
        self.folder = folder  # what it was loaded from (a local folder or a hub id); None: a model built in Python
        self._cache_kw = "cache" if "cache" in inspect.signature(self.base.forward).parameters else "past_key_values"
        self._fingerprints = fingerprints  # ``fingerprints``, computed on first use (given by a head-only load)
        self.origin: str | None = None  # ``converted``: the fingerprint of the weights this copy was cast from
        self._casts: dict[torch.dtype, Target] = {}  # ``cast``: its copies in other dtypes
        self._layers_loaded = not any(p.is_meta for p in self.base.parameters())  # False: head-only (export)
        self._sharded = False  # shard_layers: each rank holds a shard of the decoder layers
        self._fast: FastForward | None = None  # built by the first new_cache on the fast path
        self.train(False)  # frozen from the start: a model summary taken before fit's first train() shows it so
        _LIVE.add(self)

    def train(self, mode: bool = True) -> Target:
        """The target is frozen: it stays in eval mode whatever Lightning asks of the enclosing module."""
        return super().train(False)

    # ------------------------------------------------------------------------------------------ structure
    @property
    def config(self):
        return self.model.config

    @property
    def base(self) -> nn.Module:
        """The decoder stack without the LM head (``model.model`` for Llama/Qwen-style models)."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def precision(self) -> str:
        """What greedy speculative decoding guarantees in this dtype, for every speed table to state. In float32 its
        output is plain greedy decoding's, token for token. In bf16/fp16 a row's product depends on how many rows a
        kernel multiplies at once, so a verify forward over K + 1 tokens may round a position differently from the
        1-token forward and the two greedy outputs can part where the target's top two logits nearly tie (sampling
        stays lossless relative to the verify forward's own distributions)."""
        name = dtype_name(self.dtype)
        if self.dtype in (torch.float32, torch.float64):
            return f"{name}: greedy identity guaranteed"
        return f"{name}: greedy identity NOT guaranteed (batch-variant low-precision kernels)"

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for this target's chat template (``TargetOptions.chat_template_kwargs``)."""
        return dict(self.options.chat_template_kwargs)

    @property
    def has_layer_weights(self) -> bool:
        """False for a target loaded with ``layers=False`` (export, reattaching a drafter): its decoder layers sit on
        the meta device, only the embedding, final norm and LM head hold weights, and it cannot run a forward."""
        return self._layers_loaded

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def converted(self, dtype: torch.dtype) -> Target:
        """A frozen copy of this target with its weights in ``dtype`` (its own weights: this one is unchanged), e.g.
        bf16 training features beside an fp32 target that decodes exactly."""
        model = copy.deepcopy(self.model).to(dtype)
        twin = Target(model, tokenizer=self.tokenizer, name=self.name, options=self.options, decode=self.decode,
                      folder=self.folder)
        twin.origin = self.origin or self.fingerprint  # its own fingerprint differs (cast weights): what it came from
        return twin

    def cast(self, dtype: torch.dtype | str) -> Target:
        """This target in ``dtype``: itself, or its ``converted`` copy, made once and kept (decoding auto's search and
        every decoding in that dtype share it)."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if dtype == self.dtype:
            return self
        if dtype not in self._casts or self._casts[dtype].device != self.device:  # made here, or moved since
            self._casts[dtype] = self.converted(dtype)
        return self._casts[dtype]

    def same_weights(self, other: Target) -> bool:
        """Whether ``other`` holds these weights, in this dtype or cast to another (``converted``): a drafter
        trained for one decodes with either. Feature caches and rollouts key on ``fingerprint`` alone."""
        if other is self or other.model is self.model:
            return True
        return bool({self.fingerprint, self.origin} & {other.fingerprint, other.origin} - {None})

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: the generation config's and the tokenizer's EOS."""
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    @property
    def fingerprint(self) -> str:
        """The target's name, architecture and a checksum of its weights (``WeightsHash``): keys feature caches,
        rollouts and drafters to these exact weights, the same on every machine and after a transformers upgrade."""
        return self.fingerprints[0]

    @property
    def fingerprints(self) -> tuple[str, str]:
        """``fingerprint`` and the one versions before 2026-12 recorded, which hashed the whole config, its folder path
        included (a rollouts folder, store or checkpoint of that age matches it where it was made)."""
        if self._fingerprints is None:
            weights = WeightsHash(self.name, self.config)
            for name, p in self.model.named_parameters():
                weights.add(name, p.detach())
            self._fingerprints = weights.digests()
        return self._fingerprints

    def check_layers(self, layers: list[int]) -> None:
        bad = [layer for layer in layers if not 0 <= layer < self.num_layers]
        if bad:
            raise UserError(
                f"drafter.target_layers {bad} are outside the target's layers 0..{self.num_layers - 1}; "
                "pick 0-indexed decoder layers of this target."
            )

    # ------------------------------------------------------------------------------------------- forwards
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # (N, T)
        layers: list[int] | tuple[int, ...] = (),
        attention_mask: Tensor | None = None,  # (N, T) 1 = real token; only for right-padded batches
        cache: Any = None,
        logits: bool = True,
        positions: Tensor | None = None,  # (T,) offsets of the tokens from the first one's position
        tree_mask: Tensor | None = None,  # (T, T) bool: the tokens each token sees (None: causal)
    ) -> TargetOutput:
        """One frozen forward. With ``cache`` the tokens continue the cached sequence: positions follow it, offset
        by ``positions`` when given (a proposal's nodes, ``decoding/proposals.py``). A ``tree_mask`` runs the T
        tokens as a token tree (METHODS §1.2): token i sees the whole cached prefix and the tokens j with
        tree_mask[i, j] (its ancestors and itself), so each root-to-leaf path computes what it would as a chain."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "output_hidden_states": bool(layers)}
        if not self._layers_loaded:
            raise UserError(f"target '{self.name}' was loaded without its layer weights (load_target(..., "
                            "layers=False), for export); load it with load_target(spec) to run it.")
        if isinstance(cache, StaticCache):
            return self._fast_forward(input_ids, layers, attention_mask, cache, logits, positions, tree_mask)
        if tree_mask is not None:
            if cache is None or attention_mask is not None or input_ids.shape[0] != 1:
                raise ValueError("Target.forward runs a tree_mask for one sequence over a KV cache (cache=...), "
                                 "without an attention_mask.")
            kwargs["attention_mask"] = self._tree_attention(tree_mask, cache.get_seq_length())
        if cache is not None:
            past = cache.get_seq_length()
            kwargs[self._cache_kw] = cache
            kwargs["use_cache"] = True
            offsets = positions if positions is not None else torch.arange(input_ids.shape[1])
            kwargs["position_ids"] = (past + offsets.to(input_ids.device))[None]
        else:
            kwargs["use_cache"] = False
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        out = self.base(**kwargs)
        last = out.last_hidden_state  # (N, T, H)
        feats = torch.cat([out.hidden_states[layer + 1] for layer in layers], dim=-1) if layers else None
        return TargetOutput(logits=self.lm_head(last) if logits else None, features=feats, last_hidden=last)

    def _fast_forward(self, input_ids: Tensor, layers: list[int] | tuple[int, ...], attention_mask: Tensor | None,
                      cache: StaticCache, logits: bool, positions: Tensor | None,
                      tree_mask: Tensor | None) -> TargetOutput:
        """``forward`` on a ``StaticCache``: the lean decoder of ``fast_forward.py``, one sequence, same outputs."""
        if input_ids.shape[0] != 1 or attention_mask is not None:
            raise ValueError("Target.forward on a StaticCache runs one sequence without an attention_mask.")
        past, t = cache.length, input_ids.shape[1]
        offsets = positions.to(input_ids.device) if positions is not None else torch.arange(t, device=input_ids.device)
        mask = None
        if tree_mask is not None:
            if tree_mask.shape != (t, t) or not bool(tree_mask.diagonal().all()):
                raise ValueError(f"tree_mask must be a (T, T) bool mask in which every token sees itself; got shape "
                                 f"{tuple(tree_mask.shape)}.")
            mask = torch.cat([tree_mask.new_ones(t, past), tree_mask], dim=1).to(input_ids.device)  # (T, past + T)
        fast = self._fast_path()
        last, features = fast(input_ids, cache, past + offsets, mask, layers)
        return TargetOutput(logits=fast.logits(last) if logits else None, features=features, last_hidden=last)

    def _fast_path(self) -> FastForward:
        """The ``FastForward`` over this model's current weights (rebuilt if they moved: ``.to``, a dtype change)."""
        fast = self._fast
        if fast is None or not fast.shares_weights():
            self._fast = fast = FastForward(self.model)
        return fast

    @property
    def fast_decoding(self) -> str | None:
        """Why decoding forwards run transformers' forward instead of ``FastForward`` (one phrase), or None."""
        if self.decode == "transformers":
            return "decode='transformers'"
        if self._sharded:
            return "a sharded target"
        return unsupported(self.model)

    def _tree_attention(self, tree_mask: Tensor, past: int) -> Tensor:
        """The additive 4-D mask (1, 1, T, past + T) of a token tree over ``past`` cached positions: 0 where a token
        may attend (the prefix, its ancestors, itself), the dtype's minimum elsewhere. Additive, not boolean, so the
        eager attention (which adds the mask to the scores) and SDPA read it alike; transformers passes a 4-D mask
        through unchanged."""
        t = tree_mask.shape[0]
        if tree_mask.shape != (t, t) or not bool(tree_mask.diagonal().all()):
            raise ValueError(f"tree_mask must be a (T, T) bool mask in which every token sees itself; got shape "
                             f"{tuple(tree_mask.shape)}.")
        dtype = self.lm_head.weight.dtype
        seen = torch.cat([tree_mask.new_ones(t, past), tree_mask], dim=1).to(self.device)  # (T, past + T)
        mask = torch.zeros(t, past + t, dtype=dtype, device=self.device)
        return mask.masked_fill(~seen, torch.finfo(dtype).min)[None, None]  # (1, 1, T, past + T)

    def shard_layers(self) -> Target:
        """Shard the decoder layers' weights across the ranks of the default process group (FSDP2 ``fully_shard``,
        one unit per layer): each rank keeps 1/world of them, and a forward gathers one layer at a time and frees
        it again after that layer (a hook reshards it: a layer alone is an FSDP root, which FSDP2 otherwise keeps
        gathered). The embedding, final norm and LM head stay whole on every rank (drafters read them outside the
        target's forward). Every rank must then run every target forward together, in the same order: training
        steps do; decoding one rank's own prompts would not (``DraftModule(shard_target=True)`` refuses it).
        Outputs are unchanged (the same products on gathered weights). In place; returns the target."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_available() or not dist.is_initialized():
            raise UserError("shard_target needs the ranks' process group (trainer.strategy: ddp, several devices).")
        _ = self.fingerprint  # of the whole weights, before each rank holds a shard
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for layer in self.base.layers:
            fully_shard(layer, mesh=mesh)
            layer.register_forward_hook(lambda module, args, out: module.reshard())
        self._sharded = True
        return self

    def place_for(self, strategy: Any, shard_over: int = 1) -> list[str]:
        """Place this frozen target for a fit's Lightning ``strategy``; returns the names of its parameters and
        buffers DDP must not broadcast (its shards differ per rank; empty when not sharded).

        ``shard_over`` > 1 ranks (``model.shard_target``, DDP): the decoder layers sharded across them
        (``shard_layers``): each rank holds 1/world of their weights, the drafter is replicated. Under FSDP the
        target stays whole on every device and FSDP ignores it, sharding the drafter only: the drafter reads the
        target's embedding and LM head outside the target's own forward (and decoding runs outside any FSDP
        forward), and one FSDP flat parameter cannot mix a bf16 target with the fp32 drafter. FSDP does not move
        ignored modules, so the target goes to the device here."""
        from lightning.pytorch.strategies import FSDPStrategy
        from lightning.pytorch.utilities import rank_zero_info

        shard = shard_over > 1
        if isinstance(strategy, FSDPStrategy):
            if shard:
                raise UserError("model.shard_target shards the target under trainer.strategy: ddp (the drafter is "
                                "replicated); under fsdp the target stays whole. Use ddp, or shard_target: false.")
            strategy.kwargs.setdefault("ignored_modules", [self])
            self.to(strategy.root_device)
            return []
        if not shard:
            return []
        if not self.sharded:
            self.to(strategy.root_device).shard_layers()
            layers = sum(p.numel() for p in self.base.layers.parameters())
            rank_zero_info(f"target: decoder layers sharded over {shard_over} ranks, {layers / shard_over / 1e6:.1f}M "
                           f"of their {layers / 1e6:.1f}M parameters on each (model.shard_target)")
        return [name for name, _ in self.named_parameters()] + [name for name, _ in self.named_buffers()]

    @property
    def sharded(self) -> bool:
        """Whether ``shard_layers`` spread the decoder layers over the ranks (forwards are then collective)."""
        return self._sharded

    def new_cache(self, dynamic: bool = False) -> Any:
        """An empty KV cache for decoding: a ``StaticCache`` that ``forward`` runs through ``FastForward`` (one
        sequence; ``fast_decoding`` says why not where it cannot), else transformers' ``DynamicCache``, which
        ``dynamic=True`` asks for (batched decoding of left-padded rows, ``forward_left_padded``), and which runs
        transformers' forward."""
        if not dynamic and self.fast_decoding is None:
            return self._fast_path().new_cache()
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @staticmethod
    def crop(cache: Any, length: int) -> None:
        """Drop cached positions >= ``length`` (the rejected part of a verified block)."""
        if isinstance(cache, StaticCache):
            cache.crop(length)
            return
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    @classmethod
    def keep(cls, cache: Any, past: int, path: list[int]) -> None:
        """After a verify forward of T nodes over ``past`` cached positions, keep the prefix and the committed
        ``path`` (node indices, the anchor first). A chain's path is a prefix of its nodes: a crop. Otherwise the
        kept nodes' keys and values are gathered into place (compaction): the cache then reads as if the path had
        been run as a chain."""
        if path == list(range(len(path))):
            cls.crop(cache, past + len(path))
            return
        if isinstance(cache, StaticCache):
            cache.keep(past, path)
            return
        for layer in cache.layers:
            index = torch.tensor([*range(past), *(past + i for i in path)], device=layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)

    @torch.no_grad()
    def forward_left_padded(
        self,
        input_ids: Tensor,  # (N, T)
        attention_mask: Tensor,  # (N, past + T) 1 = real token, over the cached positions and these
        position_ids: Tensor,  # (N, T) each row's own positions: 0 at its first real token
        cache: Any,
    ) -> Tensor:
        """Final normed hidden state (N, T, H) of a left-padded batch that extends ``cache`` (batched plain
        decoding, ``decoding/batched.py``): each row sees only its own tokens, at its own positions."""
        out = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        return out.last_hidden_state


def live_target(fingerprint: str | None) -> Target | None:
    """A target already loaded in this process with this weight fingerprint, or None (``load_drafter`` binds a
    drafter to the user's own target instead of loading a second copy)."""
    if fingerprint is None:
        return None
    gc.collect()  # a dropped target kept only by a reference cycle (a finished Trainer's module) is not the user's
    return next((t for t in list(_LIVE) if fingerprint in t.fingerprints), None)
