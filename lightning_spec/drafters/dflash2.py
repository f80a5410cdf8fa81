"""DFlash2Drafter: DFlash's block-parallel drafter (``block.ParallelBlockDrafter``: Chen, Liang, Liu 2026, arXiv
2602.06036) with two additions (Inco AI's DFlash 2, 2026-08-18; the layout of Z Lab's released checkpoints, as vLLM
#52816, SGLang #35371 and speculators #1006 read it):

1. A two-tap grouped dynamic depthwise convolution around every attention and MLP sublayer, so a slot sees the slot
   before it inside the block without another backbone pass. For a sublayer f with normed input x (N, B, H):

       d = W_d x  -> (B, 2, taps, G)                           one projection of the input, G = H / group channels
       conv_j(y)_i = Σ_s (base_j[s] + d_j[i, s, g(c)]) ⊙ y_{i-s}      s = 0..taps-1, y_{i-s} = 0 before the block
       out = conv_1(f(conv_0(x)))

   ``base_j[0] = 1``, ``base_j[s > 0] = 0`` and ``W_d = 0`` at the start: every convolution is the identity, so a
   fresh DFlash2 computes what its DFlash backbone computes and warm-starts from a DFlash checkpoint.
2. A low-rank path selector. Slot t keeps the k best tokens C_t of its unary logits u_t = head(h_t) and scores each
   candidate c against the token p before it (the anchor at slot 1, then the token drafted at slot t - 1):

       s_t(c | p) = u_t[c] + ⟨A[p] ⊙ P h_t, B[c]⟩,    c in C_t (k = ``selector_top_k``; -inf outside C_t)

   A (V, r) and B (Vd, r) are codebooks over predecessors (any target token) and candidates (the draft
   vocabulary), P (r, H) projects the slot's state, r = ``selector_rank``. Decoding walks one path from the anchor:
   greedy takes argmax_c s_t(c | p), T > 0 draws c from q_t = softmax(s_t / T) over C_t and records q_t, so
   rejection sampling verifies against the distribution the token was drawn from (lossless). ``P = 0`` at the
   start: the walk takes each slot's unary argmax, DFlash's draft.

Training is teacher-forced (``block.ChainedBlockDrafter``): slot t's predecessor is the gold token x_{n+t-1}, which
is the drafted token whenever slots 1..t-1 were accepted, so the training forward's slot distributions are the ones
``propose`` draws from (offline MAL = real MAL). The forward's logits are the selector's, -inf outside C_t
(``DraftOutput.sparse``); the unary head is ``aux["base_logits"]``. ``objectives.SelectorCE`` trains both.

Our ``block_size`` K counts proposals; the release's ``block_size: 16`` counts the anchor too, so it is K = 15 here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.block import ChainedBlockDrafter, previous_tokens
from lightning_spec.drafters.layers import DraftLayer, TargetShape, block_attention, gated_mlp
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target


class BlockConv(nn.Module):
    """DFlash 2's grouped dynamic depthwise convolution around one sublayer: ``prepare`` convolves the sublayer's
    input and returns the dynamic part of the output kernel, ``finish`` convolves the sublayer's output with it.
    Both kernels come from one projection of the input; taps never cross a block (module docstring, item 1)."""

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))  # [input | output kernel, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)  # W_d
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """base[.., 0] = 1, every other tap 0, W_d = 0: both convolutions are the identity."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        nn.init.zeros_(self.kernel_projection.weight)

    def convolve(self, y: Tensor, dynamic: Tensor, base: Tensor, block_len: int) -> Tensor:
        """y (N, Q, H), Q / block_len blocks side by side; dynamic (N, Q, taps, G); base (taps, H) -> (N, Q, H)."""
        n, q, hidden = y.shape
        blocks = y.view(n, q // block_len, block_len, self.groups, self.group)  # (N, A, B, G, group)
        dynamic = dynamic.view(n, q // block_len, block_len, self.taps, self.groups, 1)
        out = torch.zeros_like(blocks)
        for s in range(self.taps):  # y_{i-s}: shifted s positions down the block, zeros entering at its start
            shifted = blocks if s == 0 else F.pad(blocks[:, :, :-s], (0, 0, 0, 0, s, 0))
            kernel = base[s].view(self.groups, self.group).to(y.dtype) + dynamic[:, :, :, s]  # (N, A, B, G, group)
            out = out + kernel * shifted
        return out.view(n, q, hidden)

    def prepare(self, x: Tensor, block_len: int) -> tuple[Tensor, Tensor]:
        """The sublayer's normed input x (N, Q, H) -> conv_0(x) (N, Q, H) and the output kernel's dynamic part."""
        d = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)  # (N, Q, 2, taps, G)
        return self.convolve(x, d[..., 0, :, :], self.base_kernel[0], block_len), d[..., 1, :, :]

    def finish(self, y: Tensor, dynamic: Tensor, block_len: int) -> Tensor:
        """The sublayer's output y (N, Q, H) -> conv_1(y)."""
        return self.convolve(y, dynamic, self.base_kernel[1], block_len)


class ConvDraftLayer(DraftLayer):
    """DFlash's draft layer with a ``BlockConv`` around its attention and its MLP (keys and values of the block
    come from the convolved input; the injected context's do not)."""

    def __init__(self, shape: TargetShape, qk_norm: bool, taps: int, group: int) -> None:
        super().__init__(shape, qk_norm)
        self.attention_conv = BlockConv(shape.hidden, taps, group)
        self.mlp_conv = BlockConv(shape.hidden, taps, group)

    def forward(self, h: Tensor, pos: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_mask: Tensor | None,
                block_len: int, theta: float) -> Tensor:
        """As ``DraftLayer.forward``: h (N, Q, H), Q / block_len blocks side by side -> (N, Q, H)."""
        x, out_kernel = self.attention_conv.prepare(self.input_norm(h), block_len)
        q = self.query(x, pos, theta)  # (N, heads, Q, D)
        k_blk, v_blk = self.kv(x, pos, theta)
        attn = block_attention(q, ctx_k, ctx_v, k_blk, v_blk, ctx_mask, block_len)  # (N, heads, Q, D)
        n, _, t, _ = attn.shape
        h = h + self.attention_conv.finish(self.o_proj(attn.transpose(1, 2).reshape(n, t, -1)), out_kernel, block_len)
        x, out_kernel = self.mlp_conv.prepare(self.post_norm(h), block_len)
        return h + self.mlp_conv.finish(gated_mlp(self, self.fused, x), out_kernel, block_len)


class CandidateSelector(nn.Module):
    """DFlash 2's path selector (module docstring, item 2): s(c | p) = u[c] + ⟨A[p] ⊙ P h, B[c]⟩ over the top-k of u."""

    def __init__(self, hidden: int, vocab: int, draft_vocab: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)  # A, by target id (the anchor may be any token)
        self.successor_codebook = nn.Embedding(draft_vocab, rank)  # B, by draft id
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)  # P, zero at the start

    def candidates(self, unary: Tensor) -> tuple[Tensor, Tensor]:
        """unary (..., Vd) -> the top-k values and draft ids (..., k), best first."""
        return unary.topk(self.top_k, dim=-1)

    def scores(self, top: Tensor, ids: Tensor, projected: Tensor, previous: Tensor) -> Tensor:
        """s(c | p) of the candidates: top, ids (..., k); the slot's projected state P h (..., r); previous (...,)
        target ids -> (..., k)."""
        left = self.predecessor_codebook(previous) * projected  # (..., r)
        pair = (self.successor_codebook(ids) @ left[..., None].to(self.successor_codebook.weight.dtype))[..., 0]
        return top + pair.to(top.dtype)

    def sparse_logits(self, unary: Tensor, hidden: Tensor, previous: Tensor) -> Tensor:
        """The selector's logits over the draft vocabulary, -inf outside the candidates: (..., Vd)."""
        top, ids = self.candidates(unary)
        scores = self.scores(top, ids, self.hidden_projection(hidden), previous)
        return torch.full_like(unary, float("-inf")).scatter(-1, ids, scores)


class DFlash2Drafter(ChainedBlockDrafter):
    """DFlash 2: DFlash with block-local dynamic convolutions in every layer and a path selector over each slot's
    top-k tokens, drafted left to right (see the module docstring).

    Args (besides ``ParallelBlockDrafter``'s):
        conv_kernel_size: taps of each convolution (2 released: a slot and the one before it).
        conv_group_size: channels that share one dynamic tap (16 released); must divide the hidden size.
        selector_rank: r, the width of the selector's codebooks (256 released).
        selector_top_k: k, the candidates kept per slot (16 released); at most the draft vocabulary.
    """

    family = "dflash2"
    sparse_logits = True  # the forward's logits are -inf outside each slot's candidates (``DraftOutput.sparse``)

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
        qk_norm: bool = False,
        mask_token_id: int | None = None,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
        selector_top_k: int = 16,
    ) -> None:
        super().__init__(block_size, num_layers, target_layers, num_anchors, draft_vocab_size, intermediate_size,
                         context_shortcut, init_from_target, qk_norm=qk_norm, mask_token_id=mask_token_id)
        if not 1 <= conv_kernel_size <= block_size + 1:
            raise UserError(f"drafter.conv_kernel_size must be in 1..block_size + 1 = {block_size + 1} (taps inside "
                            f"one block; 2 released), got {conv_kernel_size}.")
        for name, value in (("conv_group_size", conv_group_size), ("selector_rank", selector_rank),
                            ("selector_top_k", selector_top_k)):
            if value < 1:
                raise UserError(f"drafter.{name} must be >= 1, got {value}.")
        if draft_vocab_size is not None and selector_top_k > draft_vocab_size:
            raise UserError(f"drafter.selector_top_k={selector_top_k} exceeds drafter.draft_vocab_size="
                            f"{draft_vocab_size}; keep at most the draft vocabulary's tokens per slot.")
        self.conv_kernel_size = conv_kernel_size
        self.conv_group_size = conv_group_size
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k

    def make_layer(self, shape: TargetShape) -> DraftLayer:
        if shape.hidden % self.conv_group_size:
            raise UserError(f"drafter.conv_group_size={self.conv_group_size} does not divide the target's hidden size "
                            f"{shape.hidden}; pick a divisor (16 released).")
        return ConvDraftLayer(shape, self.qk_norm, self.conv_kernel_size, self.conv_group_size)

    def build(self, target: Target) -> None:
        super().build(target)  # the DFlash layers, each a ConvDraftLayer (``make_layer``)
        draft_vocab = self.vocab.ids.numel()
        if self.selector_top_k > draft_vocab:
            raise UserError(f"drafter.selector_top_k={self.selector_top_k} exceeds the draft vocabulary "
                            f"({draft_vocab} tokens); keep at most that many per slot.")
        self.selector = CandidateSelector(target.hidden_size, target.vocab_size, draft_vocab, self.selector_rank,
                                          self.selector_top_k)
        with torch.no_grad():
            for layer in self.layers:  # init_weights drew W_d like every matrix: back to the identity
                layer.attention_conv.reset_to_identity()
                layer.mlp_conv.reset_to_identity()
            nn.init.normal_(self.selector.predecessor_codebook.weight, std=0.02)
            nn.init.normal_(self.selector.successor_codebook.weight, std=0.02)
            nn.init.zeros_(self.selector.hidden_projection.weight)  # the walk starts as each slot's unary argmax

    #: a fit may start from a DFlash checkpoint (``model.init_from``); the weights DFlash lacks (names containing
    #: these) keep their start: identity convolutions and a selector that walks each slot's unary argmax
    warm_start_from = ("lightning_spec.drafters.dflash.DFlashDrafter",)
    warm_start_fresh = ("attention_conv.", "mlp_conv.", "selector.")

    def selected(self, hidden: Tensor, previous: Tensor) -> Tensor:
        """The selector's logits: slot states (..., H) and the tokens before them (...,) -> (..., Vd)."""
        return self.selector.sparse_logits(self.head(hidden), hidden, previous)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """The DFlash forward through the convolved layers; the logits are the selector's with the gold token before
        each slot as its predecessor (teacher forcing), the unary head's are ``aux["base_logits"]``."""
        out = super().forward(batch, features, anchors)  # hidden (N, A, K, H)
        previous = previous_tokens(batch["input_ids"], out.anchors, self.block_size)  # (N, A, K) target ids

        def selected(hidden: Tensor, index: Tensor) -> Tensor:  # (N, a, K, H), (a,) -> (N, a, K, Vd)
            return self.selected(hidden, previous.index_select(1, index.to(previous.device)))

        out.head = selected
        out.aux["base_logits"] = self._slot_logits  # (N, a, K, Vd): u, the unary head
        out.sparse = True
        return out

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        """Slot t + 1's selector logits (1, Vd) after the token ``previous`` (1,). The block's unary candidates and
        projected states are computed once, at slot 1, and carried."""
        if carry is None:
            unary = self.head(hidden)  # (K, Vd)
            top, ids = self.selector.candidates(unary)  # (K, k)
            carry = (unary, top, ids, self.selector.hidden_projection(hidden))  # ..., P h (K, r)
        unary, top, ids, projected = carry
        scores = self.selector.scores(top[t : t + 1], ids[t : t + 1], projected[t : t + 1], previous)  # (1, k)
        return torch.full_like(unary[t : t + 1], float("-inf")).scatter(-1, ids[t : t + 1], scores), carry
