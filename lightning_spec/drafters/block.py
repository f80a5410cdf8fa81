"""BlockDrafter: the DFlash block-parallel drafter (Chen, Liang, Liu 2026, arXiv 2602.06036).

Reads top to bottom:
1. Context: features of chosen target layers, concatenated, fused by ``fc`` + RMSNorm -> H_ctx (N, S, H).
2. Every draft layer injects H_ctx into its keys and values (KV injection): K = [W_K H_ctx ; W_K h],
   V = [W_V H_ctx ; W_V h]; queries come from the block only.
3. A block is ``[anchor, MASK x K]`` (K + 1 positions) embedded with the target's frozen embedding (the mask
   is a learned vector). Attention is bidirectional inside the block; the block sees context strictly before
   the anchor, because at inference the anchor (the bonus token) has no target hidden state yet.
4. Slot t = 1..K predicts x_{n+t} through the target's frozen LM head, optionally restricted to a reduced
   draft vocabulary (as EAGLE-3's, Li et al. 2025, arXiv 2503.01840; the d2t / t2d maps of
   its SpecForge and vLLM speculators checkpoints, target id = draft id + d2t[draft id]).
5. Optional adaptive length head (AdaFlash, Qian et al. 2026, arXiv 2607.19223, its "two_model" head): from the
   block's detached slot states it predicts how much of the block will be accepted, and a chain round submits
   only k = clamp(round(pred * K * length_rate), length_min, K) of the K drafted tokens (``LengthHead``).

Naming: ``block_size`` = K = draft proposals per round, everywhere in this package (README "Conventions").
DFlash papers count the anchor in their block, so their B = 16 is ``block_size: 15`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab, rms_norm
from lightning_spec.sampling import SamplingConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (half-split convention, as HF Llama). x (..., T, D), pos broadcastable to (..., T)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # (D/2,)
    ang = pos.float()[..., None] * inv  # (..., T, D/2)
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
    def of(cls, target: Any, intermediate_size: int | None = None) -> TargetShape:
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
def init_weights(module: nn.Module, depth: int, target: Any, head_norms: list[RMSNorm]) -> None:
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

    def query(self, x: Tensor, pos: Tensor, theta: float) -> Tensor:
        """Rotated queries of ``x`` (N, T, H) (already input-normed) at positions ``pos`` (N, T): (N, heads, T, D)."""
        n, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2))
        return rope(q, pos[:, None], theta)

    def kv(self, x: Tensor, pos: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values of ``x`` (N, T, H) at positions ``pos`` (N, T): each (N, kv_heads, T, D)."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
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
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class LengthHead(nn.Module):
    """AdaFlash's adaptive length head (Qian et al. 2026, arXiv 2607.19223; the "two_model" head with
    ``thresh_head_direct_len``): the states h_1..h_K (..., K, H) of a block's slots -> pred (...,) in [0, 1],

        f = [mean_k h_k ; h_K],  x = SiLU(W_1 f + b_1),  x = x + SiLU(W_2 x + b_2),  pred = σ(w_3ᵀ x + b_3),

    trained (``objectives.LengthMSE``) towards (accepted length + 1) / K. The drafter feeds it detached states, so
    its loss trains the head only. AdaFlash pools the whole block, the anchor position included; here the K slots.
    """

    def __init__(self, hidden: int, width: int = 256) -> None:
        super().__init__()
        self.down = nn.Linear(2 * hidden, width)  # W_1 (AdaFlash's bottleneck: 256)
        self.res = nn.Linear(width, width)  # W_2
        self.out = nn.Linear(width, 1)  # w_3

    def forward(self, slots: Tensor) -> Tensor:
        feat = torch.cat([slots.mean(-2), slots[..., -1, :]], -1)  # (..., 2H)
        x = F.silu(self.down(feat))  # (..., W)
        x = x + F.silu(self.res(x))
        return torch.sigmoid(self.out(x))[..., 0]  # (...,)


@dataclass
class BlockDraftState:
    """Decoding context: per-layer keys/values of the fused features of committed positions 0..length-1."""

    keys: list[Tensor]  # per layer (1, kv_heads, length, D)
    values: list[Tensor]
    length: int
    last: Tensor | None = None  # (1, H) fused feature of position length - 1 (for the context shortcut)


class BlockDrafter(Drafter):
    """DFlash-style block drafter.

    Args:
        block_size: K, draft proposals per round (the block holds the anchor plus K masks).
        num_layers: draft decoder layers.
        target_layers: 0-indexed target layers whose outputs form the context. Default: ``num_layers + 2``
            layers spread uniformly over 1..L-3, plus the last-but-one layer, as DFlash.
        num_anchors: anchors sampled per training sequence (uniformly, without replacement, where a label follows).
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data
            (None = the full target vocabulary). Filled from the data the first time ``fit`` sets up.
        intermediate_size: MLP width; default the target's.
        context_shortcut: also add W [H_ctx[n - 1] ; e(x_n)] — the fused feature of the last committed context
            position and the anchor's embedding, EAGLE's two inputs — to every block slot's input. Not in DFlash,
            which reaches both only through attention; a small drafter trained for minutes learns much faster
            with them in its residual stream (see experiments/quickstart.yaml).
        init_from_target: start draft layer i from the weights of target layer L - num_layers + i (the last
            layers, whose output the frozen final norm and LM head expect) instead of random; needs the
            target's layer shapes (the default ``intermediate_size``). Measured on the quickstart setting: MAL
            -0.029 after 500 steps, so it is off by default (docs/quickstart.md, "What moves MAL at the
            quickstart's scale").
        length_head: add AdaFlash's adaptive length head (``LengthHead``, arXiv 2607.19223): the training forward
            gives its prediction as ``aux["length"]`` (N, A) and the cut as ``drafted``; a chain round submits
            k = clamp(round(pred * K * length_rate), length_min, K) tokens. Train it with
            ``objectives.LengthMSE``. Its weights exist only when on (checkpoints without it load unchanged).
            The attribute ``use_length_head`` (True when the head exists) switches the cut off at run time, to
            decode the same drafter with and without it; trees ignore the head (``position_logits`` is unchanged).
        length_rate: the scale of the cut (AdaFlash: 1.3; > 1 drafts past the predicted length).
        length_min: the fewest tokens a cut round submits, 0..block_size.
        qk_norm: Qwen3's per-head RMSNorm on queries and keys, as DFlash's released drafters (and the layers
            vLLM serves for DFlash); needed to export to the speculators / SGLang DFlash formats.
        mask_token_id: None = one learned mask vector per slot (starts as DFlash, lets each slot know its offset);
            a token id = DFlash's single mask token shared by every slot, its vector learned from that token's
            target embedding (exported as the mask embedding vLLM substitutes for the id). The exported DFlash
            formats need one shared mask, so export needs this set.
    """

    def __init__(
        self,
        block_size: int = 8,
        num_layers: int = 1,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        context_shortcut: bool = False,
        init_from_target: bool = False,
        length_head: bool = False,
        length_rate: float = 1.3,
        length_min: int = 1,
        qk_norm: bool = False,
        mask_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"drafter.block_size must be >= 1, got {block_size}.")
        if num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {num_layers}.")
        if not length_rate > 0:
            raise ValueError(f"drafter.length_rate must be > 0 (the cut's scale, AdaFlash: 1.3), got {length_rate}.")
        if not 0 <= length_min <= block_size:
            raise ValueError(f"drafter.length_min must be in 0..block_size={block_size}, got {length_min}.")
        self.block_size = block_size
        self.num_layers = num_layers
        self.target_layers = list(target_layers) if target_layers is not None else []
        self.num_anchors = num_anchors
        self.draft_vocab_size = draft_vocab_size
        self.intermediate_size = intermediate_size
        self.context_shortcut = context_shortcut
        self.init_from_target = init_from_target
        self.length_head = length_head
        self.length_rate = length_rate
        self.length_min = length_min
        self.qk_norm = qk_norm
        self.mask_token_id = mask_token_id
        self.length: LengthHead | None = None  # built in bind when length_head
        self.use_length_head = length_head  # run-time switch: False decodes full blocks (not saved)
        self.vocab = DraftVocab(draft_vocab_size)
        self.built = False

    @property
    def mask_slots(self) -> int:
        """Mask positions after the anchor in a block: K here (every slot is a mask; DSpark's anchor predicts)."""
        return self.block_size

    # ------------------------------------------------------------------------------------------- building
    def bind(self, target: Any) -> None:
        super().bind(target)
        if not self.target_layers:
            self.target_layers = default_target_layers(target.num_layers, self.num_layers + 2)
        target.check_layers(self.target_layers)
        if self.built:
            return
        shape = TargetShape.of(target, self.intermediate_size)
        hidden, self.rope_theta = shape.hidden, shape.rope_theta
        self.fc = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.ctx_norm = RMSNorm(hidden, shape.eps)
        self.layers = nn.ModuleList(DraftLayer(shape, self.qk_norm) for _ in range(self.num_layers))
        self.norm = RMSNorm(hidden, shape.eps)
        # one learned mask vector per slot (DFlash shares one mask token; identical at init, so this starts
        # as DFlash and lets the residual stream know which offset it predicts), or DFlash's one shared vector
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < target.vocab_size:
            raise ValueError(
                f"drafter.mask_token_id={self.mask_token_id} is not a token of the target "
                f"(0..{target.vocab_size - 1}); "
                "pick a token the data rarely uses, or null for one learned mask vector per slot."
            )
        shared = self.mask_token_id is not None
        self.mask_embedding = nn.Parameter(torch.zeros(1 if shared else self.block_size, hidden))
        self.shortcut = nn.Linear(2 * hidden, hidden, bias=False) if self.context_shortcut else None
        self.vocab.build(target.vocab_size)
        self._init_weights(target)
        if self.length_head:  # after the backbone's init: the same seed gives the same backbone with or without it
            self.length = LengthHead(hidden)
            with torch.no_grad():  # N(0, 0.02) as every matrix here, zero biases: pred ≈ σ(0) = 0.5 at the start
                for layer in (self.length.down, self.length.res, self.length.out):
                    nn.init.normal_(layer.weight, std=0.02)
                    nn.init.zeros_(layer.bias)
        self.to(target.device)
        self.built = True

    @torch.no_grad()
    def _init_weights(self, target: Any) -> None:
        init_weights(self, self.num_layers, target, [self.norm])
        table = target.embed_tokens.weight
        start = table.mean(0) if self.mask_token_id is None else table[self.mask_token_id]
        self.mask_embedding.copy_(start.expand_as(self.mask_embedding))
        if self.init_from_target and target.has_layer_weights:  # a head-only target: the weights come from a file
            self._copy_target_layers(target)

    @torch.no_grad()
    def _copy_target_layers(self, target: Any) -> None:
        """Draft layer i <- target layer L - num_layers + i (HF Llama/Qwen names: q/k/v/o_proj, gate/up/down_proj,
        input_layernorm, post_attention_layernorm)."""
        hf_name = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
        hf_name.update({m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
        hf_name.update({m: f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")})
        for layer, src in zip(self.layers, list(target.base.layers)[-self.num_layers :]):
            src_params = dict(src.named_parameters())
            for name, p in layer.named_parameters():
                module, _, leaf = name.partition(".")
                key = f"{hf_name[module]}.{leaf}"
                if key not in src_params or src_params[key].shape != p.shape:
                    raise ValueError(
                        f"drafter.init_from_target: target parameter {key} is missing or shaped differently from the "
                        f"draft layer's {name} {tuple(p.shape)}; leave drafter.intermediate_size unset or turn it off."
                    )
                p.copy_(src_params[key].detach().to(p.dtype))

    def context(self, features: Tensor) -> Tensor:
        """(N, S, len(target_layers) * H) -> fused context H_ctx (N, S, H)."""
        return self.ctx_norm(self.fc(features.to(self.fc.weight.dtype)))

    def layer_contexts(self, features: Tensor) -> tuple[list[Tensor], Tensor]:
        """(N, S, F) -> the context each draft layer's keys and values read, (N, S, H) per layer, and the shared
        H_ctx (the context shortcut's input). DFlash injects the one H_ctx into every layer."""
        ctx = self.context(features)
        return [ctx] * len(self.layers), ctx

    def embed_block(self, anchor_tokens: Tensor) -> Tensor:
        """(...,) anchor ids -> (..., 1 + M, H): the anchor's frozen embedding, then the M = ``mask_slots`` (K) learned
        mask vectors (M copies of the one shared vector with ``mask_token_id``)."""
        emb = self.target.embed_tokens(anchor_tokens).to(self.mask_embedding.dtype)  # (..., H)
        rows = -1 if self.mask_token_id is None else self.mask_slots  # the per-slot vectors, or copies of one
        masks = self.mask_embedding.expand(*anchor_tokens.shape, rows, -1)  # (..., M, H)
        return torch.cat([emb[..., None, :], masks], dim=-2)

    # ------------------------------------------------------------------------------------------- training
    def backbone(self, ids: Tensor, features: Tensor, starts: Tensor) -> Tensor:
        """The draft layers over every anchor's block at once: ids (N, S), features (N, S, F), anchors ``starts``
        (N, A) -> the final normed states (N, A, B, H) of the B = ``embed_block`` positions of each block (the
        anchor, then the K slots)."""
        n, s = ids.shape
        a = starts.shape[1]
        contexts, ctx = self.layer_contexts(features)  # L x (N, S, H), (N, S, H)
        ctx_pos = torch.arange(s, device=ids.device).expand(n, s)  # (N, S)
        h = self.embed_block(ids.gather(1, starts))  # (N, A, B, H)
        b = h.shape[2]
        blk_pos = (starts[..., None] + torch.arange(b, device=ids.device)).reshape(n, a * b)  # (N, AB)
        if self.shortcut is not None:  # [H_ctx[n - 1] ; e(x_n)] into every slot (H_ctx[-1] = 0 at anchor 0)
            prev = ctx.gather(1, (starts - 1).clamp(min=0)[..., None].expand(-1, -1, ctx.shape[-1]))  # (N, A, H)
            prev = prev * (starts > 0)[..., None]
            h = h + self.shortcut(torch.cat([prev, h[:, :, 0]], dim=-1))[:, :, None]
        h = h.reshape(n, a * b, -1)  # (N, AB, H)
        # each block sees the context strictly before its anchor, and the whole of itself
        q_anchor = starts.repeat_interleave(b, dim=1)  # (N, AB)
        ctx_ok = ctx_pos[:, None, :] < q_anchor[..., None]  # (N, AB, S)
        for layer, context in zip(self.layers, contexts):
            ck, cv = layer.kv(context, ctx_pos, self.rope_theta)
            h = layer(h, blk_pos, ck, cv, ctx_ok, b, self.rope_theta)
        return self.norm(h).view(n, a, b, -1)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Training forward. batch: input_ids (N, S), loss_mask (N, S); features (N, S, F) of the target layers.
        ``anchors`` default to ``sample_anchors(batch)``; the offline evaluator and EDR pass their own."""
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        hidden = self.backbone(batch["input_ids"], features, anchors.positions)[:, :, 1:]  # (N, A, K, H) the slots
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        aux, drafted = {}, None
        if self.length is not None:
            aux["length"] = self.length(hidden.detach())  # (N, A): its loss trains the head only
            if self.use_length_head:
                drafted = self.length_cut(aux["length"].detach())  # (N, A) the slots ``propose`` submits there
        return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=hidden,
                           head=self._slot_logits, aux=aux, drafted=drafted)

    def _slot_logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd): the frozen target head over the draft vocabulary

    def length_cut(self, pred: Tensor) -> Tensor:
        """AdaFlash's cut: the length head's pred (...,) -> k = clamp(round(pred * K * length_rate), length_min, K),
        the tokens a chain round submits (...,) long. The training forward and ``propose`` both call this. A NaN
        prediction (a diverged head) submits the whole block, as without the head."""
        k = torch.round(pred.float() * (self.block_size * self.length_rate)).nan_to_num(nan=float(self.block_size))
        return k.clamp(self.length_min, self.block_size).long()

    @property
    def cuts_blocks(self) -> bool:
        """True when chain rounds submit the length head's cut (the head exists and ``use_length_head``)."""
        return self.length is not None and self.use_length_head

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> BlockDraftState:
        state = BlockDraftState(keys=[torch.empty(0)] * len(self.layers), values=[torch.empty(0)] * len(self.layers),
                                length=0)
        self._append(state, features)
        return state

    @torch.no_grad()
    def extend(self, state: BlockDraftState, features: Tensor, path: list[int]) -> None:
        """The committed nodes' features become context (the anchor and the accepted drafts)."""
        self._append(state, features[:, path])

    def _append(self, state: BlockDraftState, features: Tensor) -> None:
        t = features.shape[1]
        contexts, ctx = self.layer_contexts(features)  # L x (1, T, H), (1, T, H)
        pos = torch.arange(state.length, state.length + t, device=ctx.device)[None]
        for i, (layer, context) in enumerate(zip(self.layers, contexts)):
            k, v = layer.kv(context, pos, self.rope_theta)
            if state.length:
                k, v = torch.cat([state.keys[i], k], 2), torch.cat([state.values[i], v], 2)
            state.keys[i], state.values[i] = k, v
        state.length += t
        if t:
            state.last = ctx[:, -1]

    @torch.no_grad()
    def block_hidden(self, state: BlockDraftState, anchor: Tensor) -> Tensor:
        """The draft layers over one block after ``anchor`` (1,) on the decoding context: the final normed states
        (1, B, H) of its B = ``embed_block`` positions (the anchor, then the K slots)."""
        h = self.embed_block(anchor.reshape(1))  # (1, B, H)
        b = h.shape[1]
        if self.shortcut is not None:
            prev = state.last if state.last is not None else h.new_zeros(1, h.shape[-1])  # (1, H)
            h = h + self.shortcut(torch.cat([prev, h[:, 0]], dim=-1))[:, None]
        pos = torch.arange(state.length, state.length + b, device=h.device)[None]
        for i, layer in enumerate(self.layers):
            if state.length:
                ck, cv = state.keys[i], state.values[i]
            else:  # empty context (a one-token prompt): the block attends to itself only
                ck = cv = h.new_zeros(1, layer.kv_heads, 0, layer.head_dim)
            h = layer(h, pos, ck, cv, None, b, self.rope_theta)
        return self.norm(h)

    parallel_slots = True  # the block's K slots are drafted in one forward, none reads another's token

    @torch.no_grad()
    def position_logits(self, state: BlockDraftState, anchor: Tensor) -> Tensor:
        return self.head(self.block_hidden(state, anchor)[0, 1:])  # (K, Vd): the block's slots, in parallel

    @torch.no_grad()
    def propose(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        if self.cuts_blocks:  # the length head decides k before any token is drawn: verification stays lossless
            hidden = self.block_hidden(state, anchor)[0, 1:]  # (K, H) the slots
            k = int(self.length_cut(self.length(hidden)))
            if k == 0:
                return ChainProposal.empty(anchor.device)
            logits = self.head(hidden[:k])  # (k, Vd): the head of the submitted slots only
        else:
            logits = self.position_logits(state, anchor)  # (K, Vd)
        if sampling.greedy:
            return ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        q = sampling.probs(logits)  # (k, Vd), k = K without the cut
        return ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)), probs=self.vocab.scatter(q))


def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """``count`` layers spread uniformly over 1..L-3 (DFlash: [1, 9, 17, 25, 33] for 36 layers)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if count <= 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})
