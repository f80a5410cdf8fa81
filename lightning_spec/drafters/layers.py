"""What the drafter families share: layers, attention patterns, how a drafter is sized from its target, and the
target layers it reads by default. No family is defined here, and no family file imports another's: a family
imports ``base.py`` (the contract), this file, and ``block.py`` when it extends DFlash's block-parallel body.

- ``RMSNorm``, ``rope``: the target's own normalisation and rotary embedding (HF Llama conventions).
- ``TargetShape``: the target's layer shapes, read once from its config; every family sizes its layers by it.
- ``init_weights``: every family's start (N(0, 0.02), GPT-2's residual scaling, head norms at the target's).
- ``DraftLayer``: a Llama-style decoder layer whose keys and values also cover an injected context (DFlash's KV
  injection; SpecBlock and MTP reuse it).
- ``block_attention``, ``chain_attention``, ``causal_attention``: the three attention patterns drafters use (blocks
  side by side over a shared context; chains over committed entries plus their own; a causal stream).
- ``spread_layers``, ``low_mid_high_layers``: the two default choices of target layers (DFlash's spread, EAGLE-3's
  low / middle / high); a family names its choice in ``Drafter.default_target_layers``.
- ``LastHiddenDrafter``: what Medusa and MTP share (the target's last layer as their only feature).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.drafters.base import Drafter

if TYPE_CHECKING:
    from lightning_spec.target import Target


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def fused_weight(cache: dict[str, tuple[tuple, Tensor]], name: str, *linears: nn.Linear) -> Tensor | None:
    """The weights of ``linears`` stacked along their outputs (Σ out, in), built once into ``cache[name]`` and kept
    while none of them changes, so that a decoding step runs one product where it ran several (one dispatch, one
    pass over the input); None where a gradient must reach them (training keeps the separate products)."""
    weights = [linear.weight for linear in linears]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
    held = cache.get(name)
    if held is None or held[0] != key:
        held = cache[name] = (key, torch.cat([w.detach() for w in weights]))
    return held[1]


def gated_mlp(layer: nn.Module, cache: dict[str, tuple[tuple, Tensor]], x: Tensor) -> Tensor:
    """Llama's MLP, down(silu(gate(x)) * up(x)), with gate and up as one product where no gradient is needed."""
    w = fused_weight(cache, "gate_up", layer.gate_proj, layer.up_proj)
    if w is None:
        return layer.down_proj(F.silu(layer.gate_proj(x)) * layer.up_proj(x))
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    return layer.down_proj(F.silu(gate) * up)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(d: int, theta: float, device: torch.device) -> Tensor:
    """theta^(-2i/D), i < D/2 (D/2,) float32: computed once per head size, base and device."""
    return 1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (half-split convention, as HF Llama). x (..., T, D), pos broadcastable to (..., T)."""
    d = x.shape[-1]
    ang = pos.float()[..., None] * _inverse_frequencies(d, theta, x.device)  # (..., T, D/2)
    cos, sin = ang.cos(), ang.sin()
    cos, sin = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass(frozen=True)
class TargetShape:
    """The target's layer shapes, read from its HF config: what every family sizes its draft layers by."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the draft layers' MLP width: the family's ``intermediate_size``, else the target's
    eps: float
    rope_theta: float

    @classmethod
    def of(cls, target: Target, intermediate_size: int | None = None) -> TargetShape:
        cfg = target.config
        heads = cfg.num_attention_heads
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        return cls(
            hidden=target.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or target.hidden_size // heads,
            intermediate=intermediate_size or cfg.intermediate_size,
            eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        )


@torch.no_grad()
def init_weights(module: nn.Module, depth: int, target: Target, head_norms: list[RMSNorm]) -> None:
    """Every family's start: N(0, 0.02) for each matrix of ``module``, the residual outputs (o_proj, down_proj)
    divided by sqrt(2 * depth) (GPT-2's scaling for ``depth`` layers), and each norm in ``head_norms`` (those that
    feed the frozen LM head) at the target's own final norm scale."""
    for name, p in module.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.div_(math.sqrt(2 * depth))
    final_norm = getattr(target.base, "norm", None)
    if final_norm is not None and getattr(final_norm, "weight", None) is not None:
        for norm in head_norms:
            norm.weight.copy_(final_norm.weight.detach().to(norm.weight.dtype))


class DraftLayer(nn.Module):
    """A Llama-style decoder layer of the target's shape whose keys/values also cover the injected context.
    ``qk_norm``: Qwen3's per-head RMSNorm on queries and keys before the rotation (DFlash's released layers)."""

    def __init__(self, shape: TargetShape, qk_norm: bool = False) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_norm = RMSNorm(head_dim, shape.eps) if qk_norm else nn.Identity()  # on (N, heads, T, D)
        self.k_norm = RMSNorm(head_dim, shape.eps) if qk_norm else nn.Identity()
        self.input_norm = RMSNorm(hidden, shape.eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_norm = RMSNorm(hidden, shape.eps)
        self.gate_proj = nn.Linear(hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, hidden, bias=False)
        self.fused: dict[str, tuple[tuple, Tensor]] = {}  # decoding's stacked projections (``fused_weight``)

    def query(self, x: Tensor, pos: Tensor, theta: float) -> Tensor:
        """Rotated queries of ``x`` (N, T, H) (already input-normed) at positions ``pos`` (N, T): (N, heads, T, D)."""
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2))
        return rope(q, pos[:, None], theta)

    def kv(self, x: Tensor, pos: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values of ``x`` (N, T, H) at positions ``pos`` (N, T): each (N, kv_heads, T, D)."""
        n, t, _ = x.shape
        w = fused_weight(self.fused, "kv", self.k_proj, self.v_proj)
        k, v = (self.k_proj(x), self.v_proj(x)) if w is None else (x @ w.t()).chunk(2, dim=-1)
        k = self.k_norm(k.view(n, t, self.kv_heads, self.head_dim).transpose(1, 2))
        v = v.view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, pos[:, None], theta), v

    def forward(
        self,
        h: Tensor,
        pos: Tensor,
        ctx_k: Tensor,
        ctx_v: Tensor,
        ctx_mask: Tensor | None,
        block_len: int,
        theta: float,
    ) -> Tensor:
        """h (N, Q, H): Q / block_len blocks side by side at positions pos (N, Q); ctx_k/v (N, kv_heads, S, D);
        ctx_mask (N, Q, S) bool: the context positions each query sees (None: all). Each block attends to the
        context and, bidirectionally, to itself only."""
        x = self.input_norm(h)
        q = self.query(x, pos, theta)  # (N, heads, Q, D)
        k_blk, v_blk = self.kv(x, pos, theta)
        return self.finish(h, block_attention(q, ctx_k, ctx_v, k_blk, v_blk, ctx_mask, block_len))

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:
        """The residual stream h (N, T, H) and its attention output (N, heads, T, D) -> the layer's output (N, T, H)."""
        n, _, t, _ = attn.shape
        h = h + self.o_proj(attn.transpose(1, 2).reshape(n, t, -1))
        return h + gated_mlp(self, self.fused, self.post_norm(h))


def block_attention(
    q: Tensor, ctx_k: Tensor, ctx_v: Tensor, k_blk: Tensor, v_blk: Tensor, ctx_mask: Tensor | None, block_len: int
) -> Tensor:
    """Attention of A side-by-side blocks over a shared context plus each block's own keys.

    q (N, Hq, A*B, D); ctx_k/v (N, Hkv, S, D); k_blk/v_blk (N, Hkv, A*B, D); ctx_mask (N, A*B, S) bool or None;
    B = block_len. Returns (N, Hq, A*B, D). One block (the decoding case) is plain SDPA over [context; block].
    Several blocks are scored against the context and against their own block separately, then share one
    softmax: cost grows as A*B*(S + B) rather than the dense A*B*(S + A*B) of one big masked attention. A
    SmolLM2 training step with 128 anchors per sequence took 6.6x the time of one with 32 when dense, 4.6x
    split (2-core CPU; 4x is the extra work elsewhere in the step).
    """
    n, hq, q_len, d = q.shape
    hkv, s = ctx_k.shape[1], ctx_k.shape[2]
    if q_len == block_len:
        k = torch.cat([ctx_k, k_blk], dim=2).repeat_interleave(hq // hkv, dim=1)  # (N, Hq, S + B, D)
        v = torch.cat([ctx_v, v_blk], dim=2).repeat_interleave(hq // hkv, dim=1)
        mask = None if ctx_mask is None else F.pad(ctx_mask, (0, block_len), value=True)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    a, r = q_len // block_len, hq // hkv
    q = q.view(n, hkv, r, q_len, d) * d**-0.5  # grouped-query: head h uses kv head h // r
    scores_ctx = q @ ctx_k[:, :, None].transpose(-1, -2)  # (N, Hkv, r, Q, S)
    if ctx_mask is not None:
        scores_ctx = scores_ctx.masked_fill(~ctx_mask[:, None, None], float("-inf"))
    qb = q.view(n, hkv, r, a, block_len, d)
    kb = k_blk.view(n, hkv, 1, a, block_len, d)
    scores_blk = qb @ kb.transpose(-1, -2)  # (N, Hkv, r, A, B, B)
    probs = torch.cat([scores_ctx.view(n, hkv, r, a, block_len, s), scores_blk], dim=-1).softmax(-1)
    out = probs[..., :s].reshape(n, hkv, r, q_len, s) @ ctx_v[:, :, None]  # (N, Hkv, r, Q, D)
    out = out + (probs[..., s:] @ v_blk.view(n, hkv, 1, a, block_len, d)).view(n, hkv, r, q_len, d)
    return out.view(n, hq, q_len, d)


def chain_attention(
    q: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_mask: Tensor | None, own_k: Tensor, own_v: Tensor
) -> Tensor:
    """One query per chain over shared committed entries plus the chain's own entries, one softmax.

    q (N, Hq, A, D): the current slot of A chains; ctx_k/v (N, Hkv, S, D) the committed entries; ctx_mask
    (N, A, S) bool, the committed entries each chain sees (None: all); own_k/v (N, Hkv, A, J, D) each chain's own
    entries (J >= 0). Returns (N, Hq, A, D). Cost A * (S + J) per step: the chains never see each other's keys.
    """
    n, hq, a, d = q.shape
    hkv, s = ctx_k.shape[1], ctx_k.shape[2]
    r = hq // hkv
    q = q.reshape(n, hkv, r, a, d) * d**-0.5  # grouped-query: head h reads kv head h // r
    scores_ctx = q @ ctx_k[:, :, None].transpose(-1, -2)  # (N, Hkv, r, A, S)
    if ctx_mask is not None:
        scores_ctx = scores_ctx.masked_fill(~ctx_mask[:, None, None], float("-inf"))
    scores_own = torch.einsum("nhrad,nhajd->nhraj", q, own_k)  # (N, Hkv, r, A, J)
    probs = torch.cat([scores_ctx, scores_own], dim=-1).softmax(-1)
    out = probs[..., :s] @ ctx_v[:, :, None]  # (N, Hkv, r, A, D)
    out = out + torch.einsum("nhraj,nhajd->nhrad", probs[..., s:], own_v)
    return out.reshape(n, hq, a, d)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """T new entries' queries q (B, Hq, T, D) over keys and values (B, Hkv, L + T, D) whose last T are theirs: entry
    j sees positions <= L + j. Returns (B, Hq, T, D)."""
    t, total = q.shape[2], k.shape[2]
    r = q.shape[1] // k.shape[1]  # grouped-query: head h reads kv head h // r
    mask = torch.ones(t, total, dtype=torch.bool, device=q.device).tril(total - t)  # (T, L + T)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), attn_mask=mask)


# ------------------------------------------------------------------------------------------ target layers
def spread_layers(num_target_layers: int, count: int) -> list[int]:
    """``count`` layers spread uniformly over 1..L-3 (DFlash: [1, 9, 17, 25, 33] for 36 layers)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if count <= 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def low_mid_high_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers, [1, L/2 - 1, L - 4] (0-indexed; SpecForge's choice), clipped to the
    target's layers and deduplicated for very shallow targets: [1, 14, 26] for SmolLM2-135M (30 layers)."""
    last = num_target_layers - 1
    wanted = (1, num_target_layers // 2 - 1, num_target_layers - 4)
    return sorted({min(max(layer, 0), last) for layer in wanted})


# --------------------------------------------------------------------------------------- shared: h_{n-1}
class LastHiddenDrafter(Drafter):
    """What Medusa and MTP share: the last target layer as their only feature, and h_{n-1} per anchor (zero at
    n = 0, where no position precedes the anchor, in training and decoding alike).

    A round is anchored at n, the last committed token (the bonus); the target has run positions < n only, so the
    anchor has no target hidden state yet. Both families read h_{n-1}: the last layer's state at n - 1, whose LM
    head predicted x_n (the anchor), as the target feature layer ``target_layers = [L - 1]``. The HF hidden state
    of the last layer is already final-normed (``target.py``), i.e. the state the LM head reads, which is Medusa's
    h_t exactly; MTP normalises its input with its own RMSNorm anyway."""

    def __init__(self, block_size: int, num_anchors: int, draft_vocab_size: int | None) -> None:
        super().__init__(block_size, None, num_anchors, draft_vocab_size)  # target_layers: [L - 1], chosen at bind

    def default_target_layers(self, num_target_layers: int) -> list[int]:
        return [num_target_layers - 1]  # final-normed: the state the LM head reads

    def previous_hidden(self, features: Tensor, anchors: Tensor) -> Tensor:
        """h_{n-1} for every anchor n: features (N, S, H), anchors (N, A) -> (N, A, H), zero where n = 0."""
        prev = features.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, features.shape[-1]))
        return prev * (anchors > 0)[..., None]  # (N, A, H)
