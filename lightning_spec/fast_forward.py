"""The target's decoding forward near its memory floor: a lean Llama-family decoder over a preallocated KV cache.

At one query token a forward should cost about its weights' bytes over the memory bandwidth. transformers' forward
spends as long again outside the matrix products (on a 2-core Xeon with AMX, SmolLM2-135M: 47.3 ms against a
20.2 ms floor in fp32, ``benchmarks/forward_floor.py``): a growing cache concatenated every step, masks built,
outputs captured, keyword plumbing, three projections where one would do. ``FastForward`` runs the same arithmetic
as four products per layer:

- the query, key and value projections are one product, the MLP's gate and up projections another, on weights
  stored once: the HF modules' parameters become views into the fused tensors (no second copy);
- ``StaticCache`` holds every layer's keys and values in one preallocated tensor that grows by doubling, so a round
  writes in place, a rejection is a length change and a tree's compaction one gather for all layers;
- rotary cosines and sines are one table, indexed by position;
- the kernel path per dtype (``kernels``): at one token on CPU, bf16 products run faster through oneDNN on weights
  reordered once (a copy of the projections and the LM head in oneDNN's layout) than through aten's ``F.linear``
  (on an AMX Xeon, the 3072x576 gate-and-up product: 190 against 309 us); fp32 stays on ``F.linear``, faster there.

``torch.compile`` (inductor, CPU) was measured and is not used: compiling the layer made the 1-token forward slower
on an AMX Xeon (fp32 41.8 against 37.3 ms, bf16 38.1 against 32.1 ms) after a 10-16 s warm-up, and recompiled as
the cache grew; compiling the whole forward took 100-180 s and ran at half the speed.

It reads the decoder's own modules (norm weights, rotary embedding, projections), so outputs equal transformers'
to float rounding (``tests/test_fast_forward.py`` checks logits and features, chains and trees). Supported: the
Llama-style decoders (``llama``, ``qwen2`` with projection biases, ``qwen3`` with per-head query/key norms,
``mistral`` without a sliding window) with a position-independent rotary table; every other model runs
transformers' forward (``unsupported`` says why). ``Target.new_cache`` picks it; the engine and every caller are
unchanged. Measured in ``benchmarks/forward_floor.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")  # position-independent tables: precomputable once
KERNELS = ("auto", "aten", "onednn")


def unsupported(model: nn.Module) -> str | None:
    """Why ``FastForward`` cannot run ``model`` (one phrase), or None when it can."""
    config = model.config.to_dict()  # plain values: optional keys read with .get
    kind = config.get("model_type")
    if kind not in _MODEL_TYPES:
        return f"model type {kind!r} (supported: {', '.join(_MODEL_TYPES)})"
    if config.get("sliding_window") and config.get("use_sliding_window", kind == "mistral"):
        return "a sliding attention window"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) not in _ROPE_TYPES:
        return f"rope type {rope.get('rope_type', rope.get('type'))!r}"
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    decoder = model.get_decoder()
    if not all("gate_proj" in layer.mlp._modules and "q_proj" in layer.self_attn._modules for layer in decoder.layers):
        return "a layer without a gated MLP or query/key/value projections (a mixture of experts?)"
    if any(p.is_meta for p in decoder.parameters()):
        return "decoder weights on the meta device"
    return None


class StaticCache:
    """Keys and values of every layer in one tensor (L, 2, Hkv, capacity, D), ``length`` positions filled. Grows by
    doubling when a forward would pass its capacity; ``crop`` and ``keep`` change the length or gather in place."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256) -> None:
        self.kv = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` positions (amortised: the capacity doubles)."""
        capacity = self.kv.shape[3]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        grown = self.kv.new_zeros(*self.kv.shape[:3], capacity, self.kv.shape[4])
        grown[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = grown

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep(self, past: int, path: list[int]) -> None:
        """Keep positions < ``past`` and the verified nodes ``path`` (indices after ``past``), compacted in order."""
        index = torch.tensor(path, device=self.kv.device) + past
        self.kv[:, :, :, past : past + len(path)] = self.kv.index_select(3, index)
        self.length = past + len(path)


@dataclass
class Linear:
    """One product of the decoder: its weight (out, in) and bias, and optionally its oneDNN-reordered weight."""

    weight: Tensor
    bias: Tensor | None = None
    packed: Tensor | None = None  # the weight reordered for oneDNN (a copy in its own layout), or None: aten

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return out if self.bias is None else out + self.bias

    def pack(self) -> None:
        """Reorder the weight for oneDNN's products at one token, once."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)


# ------------------------------------------------------------------------------------------------- the forward
@dataclass(frozen=True)
class Shape:
    """The decoder's attention shape and norm epsilon, read once from its config."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, one fused kernel (fp32: equal to transformers' six ops, bf16: to rounding)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x (1, T, heads, D), cos/sin (T, 1, D)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layer(shape: Shape):
    """The layer function of decoders of this ``shape`` (its numbers are constants of the body)."""
    heads, kv_heads, d, eps, gqa = shape.heads, shape.kv_heads, shape.head_dim, shape.eps, shape.heads != shape.kv_heads

    def layer(x: Tensor, kv: Tensor, past: int, cos: Tensor, sin: Tensor, mask: Tensor | None, w: dict) -> Tensor:
        """One Llama-family decoder layer on x (1, T, H) at cached length ``past``: writes its keys and values into
        ``kv`` (2, Hkv, capacity, D) at past..past + T and returns the layer's output (1, T, H)."""
        t = x.shape[1]
        qkv = w["qkv"](rms_norm(x, w["norm1"], eps)).view(1, t, heads + 2 * kv_heads, d)  # (1, T, heads, D)
        qk, v = qkv.split((heads + kv_heads, kv_heads), dim=2)
        if w["q_norm"] is not None:  # Qwen3: RMSNorm over each head's dims, before the rotation
            q, k = qk.split((heads, kv_heads), dim=2)
            qk = torch.cat((rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)), dim=2)
        q, k = rope(qk, cos, sin).split((heads, kv_heads), dim=2)  # queries and keys rotated together
        q = q.transpose(1, 2)  # (1, Hq, T, D)
        kv[0, :, past : past + t] = k[0].transpose(0, 1)
        kv[1, :, past : past + t] = v[0].transpose(0, 1)
        keys, values = kv[0, None, :, : past + t], kv[1, None, :, : past + t]  # (1, Hkv, past + T, D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=w["scale"],
                                             enable_gqa=gqa)  # (1, Hq, T, D)
        x = x + w["o"](out.transpose(1, 2).reshape(1, t, heads * d))
        gate, up = w["gate_up"](rms_norm(x, w["norm2"], eps)).chunk(2, dim=-1)
        return x + w["down"](F.silu(gate) * up)

    return layer


class FastForward:
    """A Llama-family decoder's forward over a ``StaticCache``, sharing the model's weights (see the module doc).

    ``kernels``: ``aten`` (``F.linear``), ``onednn`` (reordered weights, CPU) or ``auto`` (oneDNN for bf16/fp16 on
    CPU, aten otherwise)."""

    def __init__(self, model: nn.Module, kernels: str = "auto") -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"FastForward cannot run this model: {reason}.")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}.")
        config = model.config.to_dict()
        self.decoder = model.get_decoder()
        heads = config["num_attention_heads"]
        self.shape = Shape(heads, config.get("num_key_value_heads") or heads,
                           config.get("head_dim") or config["hidden_size"] // heads, config["rms_norm_eps"])
        self.layers = [self._fuse(layer) for layer in self.decoder.layers]
        ref = self.layers[0]["qkv"].weight
        if kernels == "auto":
            low = ref.dtype in (torch.bfloat16, torch.float16)
            kernels = "onednn" if low and ref.device.type == "cpu" and torch.backends.mkldnn.is_available() else "aten"
        self.kernels = kernels
        head = model.get_output_embeddings()
        self.head = Linear(head.weight, head.bias)  # the LM head: tied to the embedding in small models
        if kernels == "onednn":
            for linear in [w[name] for w in self.layers for name in ("qkv", "o", "gate_up", "down")] + [self.head]:
                linear.pack()
        self.layer = decoder_layer(self.shape)
        self._table: tuple[Tensor, Tensor] | None = None  # rotary cos, sin (P, D)

    @staticmethod
    def _fused(modules: list[nn.Linear]) -> Linear:
        """One product for several linears reading the same input; their parameters become views of its weight."""
        weight = torch.cat([m.weight.detach() for m in modules])  # (sum out, in)
        bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
        start = 0
        for m in modules:
            end = start + m.out_features
            m.weight = nn.Parameter(weight[start:end], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[start:end], requires_grad=False)
            start = end
        return Linear(weight, bias)

    def _fuse(self, layer: nn.Module) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        o, norms = attn.o_proj, attn._modules  # Qwen3 norms queries and keys per head (q_norm, k_norm)
        return dict(
            norm1=layer.input_layernorm.weight, qkv=self._fused([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=Linear(o.weight, o.bias), norm2=layer.post_attention_layernorm.weight,
            gate_up=self._fused([mlp.gate_proj, mlp.up_proj]), down=Linear(mlp.down_proj.weight),
            q_norm=norms["q_norm"].weight if "q_norm" in norms else None,
            k_norm=norms["k_norm"].weight if "k_norm" in norms else None,
            scale=float(attn.scaling),
        )

    def shares_weights(self) -> bool:
        """Whether the model's projections are still views of this forward's fused weights (``.to`` or a dtype
        change replaces them: the target then builds a new ``FastForward``)."""
        for layer, w in ((self.decoder.layers[i], self.layers[i]) for i in (0, -1)):
            for module, fused in ((layer.self_attn.q_proj, w["qkv"]), (layer.mlp.gate_proj, w["gate_up"])):
                if module.weight.data_ptr() != fused.weight.data_ptr():
                    return False
        return self.decoder.embed_tokens.weight.device == self.head.weight.device

    def logits(self, last: Tensor) -> Tensor:
        """The LM head on the final normed hidden state (1, T, H) -> (1, T, V), on this forward's kernel path."""
        return self.head(last)

    def new_cache(self) -> StaticCache:
        ref = self.layers[0]["qkv"].weight
        return StaticCache(len(self.layers), self.shape.kv_heads, self.shape.head_dim, ref.dtype, ref.device)

    def _rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (T, 1, D) at ``positions`` (T,), from a table the decoder's own rotary embedding computed once."""
        need = int(positions.max()) + 1
        if self._table is None or self._table[0].shape[0] < need:
            size = max(need, 2 * (self._table[0].shape[0] if self._table else 1024))
            ref = self.layers[0]["qkv"].weight
            pos = torch.arange(size, device=ref.device)[None]
            cos, sin = self.decoder.rotary_emb(torch.zeros(1, dtype=ref.dtype, device=ref.device), pos)
            self._table = (cos[0], sin[0])  # (P, D)
        return self._table[0][positions, None], self._table[1][positions, None]  # (T, 1, D)

    def __call__(self, input_ids: Tensor, cache: StaticCache, positions: Tensor, mask: Tensor | None,
                 layers: list[int] | tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """(final normed hidden (1, T, H), the ``layers``' outputs concatenated (1, T, len(layers) * H) or None).

        ``input_ids`` (1, T) continue the cached sequence at absolute ``positions`` (T,); ``mask`` (T, past + T) bool
        (True: may attend) or None for causal attention over the cache and these tokens."""
        t, past = input_ids.shape[1], cache.length
        cache.reserve(past + t)
        cos, sin = self._rotary(positions)
        if mask is None and t > 1:  # causal within the block, the whole prefix visible
            mask = torch.ones(t, past + t, dtype=torch.bool, device=input_ids.device).tril(past)
        attn_mask = None if mask is None else mask[None, None]  # (1, 1, T, past + T)
        x = self.decoder.embed_tokens(input_ids)  # (1, T, H)
        wanted, feats = set(layers), {}
        for i, w in enumerate(self.layers):
            x = self.layer(x, cache.kv[i], past, cos, sin, attn_mask, w)
            if i in wanted:
                feats[i] = x
        cache.length = past + t
        last = rms_norm(x, self.decoder.norm.weight, self.shape.eps)
        if len(self.layers) - 1 in wanted:  # transformers records the last layer's output after the final norm
            feats[len(self.layers) - 1] = last
        features = torch.cat([feats[layer] for layer in layers], dim=-1) if layers else None
        return last, features
