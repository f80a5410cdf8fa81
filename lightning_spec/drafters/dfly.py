"""DFlyDrafter: DFlash's block-parallel backbone (``block.ParallelBlockDrafter``: Chen, Liang, Liu 2026, arXiv
2602.06036) with per-layer context fusion and a hidden-state correction that reads the block left to right
(``block.ChainedBlockDrafter``, the chain it shares with Domino).

DFly (AngelSlim's "DFlareV2"; AngelSpec ``angelspec/models/draft/dfly.py`` and ``docs/concepts/dfly.md``):
1. Context per draft layer i: C_i = RMSNorm(fc([h^(l)]_l) + Σ_l softmax(w_i)_l h^(l)). DFlash's shared fc
   context stays the base; DFlare's learnable per-layer fusion of the target layers (one softmax over the target
   layers per draft layer) is added to it as a residual. Layer i injects C_i into its keys and values.
2. Optional hidden-state correction (TreeFlash's, as AngelSpec's DSpark file carries it):
   h'_t = h_t + W_down(silu(W_gate x) * W_up x), x = [RMSNorm(h_t) ; RMSNorm(e(x_{n+t-1}))], W_down zero at
   init, so slot t also reads the token before it: teacher-forced (gold) in training, the drafted token at
   decode time, so the proposals are drawn left to right.
No paper states these equations; they follow AngelSpec's public code, read for this file, with these choices where
it leaves room: the residual goes into each layer's context (what its keys and values read), not its hidden
stream; one RMSNorm is shared by all layers' contexts (as there); the fusion mixes the same target layers the fc
reads (AngelSpec's DFly config uses DFlash's 5; pass a broader ``target_layers`` for more); its logits start at
DFlare's distance prior, -2|l - l*| around the target layer at the draft layer's relative depth; the correction
acts on the final normed state the head reads, and e is the target's frozen embedding. AngelSlim's "Block8"
(the anchor's query slot + 7 proposals) is ``block_size: 7`` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.block import ChainedBlockDrafter, previous_tokens
from lightning_spec.drafters.layers import RMSNorm, TargetShape
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target


class HiddenCorrection(nn.Module):
    """TreeFlash's hidden-state correction: h' = h + W_down(silu(W_gate x) * W_up x), x = [RMSNorm(h) ; RMSNorm(e)],
    e the embedding of the token before the slot. W_down starts at zero: the correction starts as the identity."""

    def __init__(self, hidden: int, inter: int, eps: float) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(hidden, eps)
        self.embed_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(2 * hidden, inter, bias=False)
        self.up_proj = nn.Linear(2 * hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, h: Tensor, prev_embedding: Tensor) -> Tensor:
        """h (..., H), prev_embedding (..., H) -> (..., H)."""
        x = torch.cat([self.hidden_norm(h), self.embed_norm(prev_embedding.to(h.dtype))], dim=-1)  # (..., 2H)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlyDrafter(ChainedBlockDrafter):
    """DFly: DFlash with a per-draft-layer learnable fusion of the target layers added to the shared context, and
    an optional hidden-state correction that drafts left to right (see the module docstring).

    Args (besides ``ParallelBlockDrafter``'s):
        hidden_correction: add the correction head (AngelSpec's DFly config turns it on); off, the slots are
            independent and drafted in one pass, as DFlash.
        correction_size: the correction's SwiGLU width; default the target's hidden size (AngelSpec's default).
    """

    family = "dfly"

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
        hidden_correction: bool = True,
        correction_size: int | None = None,
    ) -> None:
        super().__init__(block_size, num_layers, target_layers, num_anchors, draft_vocab_size, intermediate_size,
                         context_shortcut, init_from_target)
        if correction_size is not None and correction_size < 1:
            raise UserError(f"drafter.correction_size must be >= 1 (or null: the hidden size), got {correction_size}.")
        self.hidden_correction = hidden_correction
        self.correction_size = correction_size
        self.left_to_right = hidden_correction

    def build(self, target: Target) -> None:
        super().build(target)
        shape = TargetShape.of(target)
        # fusion logits (draft layers, target layers) at DFlare's distance prior: draft layer d prefers the target
        # layer at the same relative depth, its neighbours less (softmax of -2|l - l*|)
        d, t = self.num_layers, len(self.target_layers)
        prefer = [round(i / max(d - 1, 1) * (t - 1)) for i in range(d)]
        dist = (torch.arange(t, dtype=torch.float32)[None] - torch.tensor(prefer, dtype=torch.float32)[:, None]).abs()
        self.fusion = nn.Parameter(-2.0 * dist)  # (L, T)
        self.correction = None
        if self.hidden_correction:
            self.correction = HiddenCorrection(shape.hidden, self.correction_size or shape.hidden, shape.eps)
            with torch.no_grad():
                nn.init.normal_(self.correction.gate_proj.weight, std=0.02)
                nn.init.normal_(self.correction.up_proj.weight, std=0.02)
                nn.init.zeros_(self.correction.down_proj.weight)

    def layer_contexts(self, features: Tensor) -> tuple[list[Tensor], Tensor]:
        """(N, S, T*H) -> the context C_i (N, S, H) of every draft layer i, and the shared one RMSNorm(fc(...))
        (the context shortcut's input)."""
        n, s, _ = features.shape
        x = features.to(self.fc.weight.dtype)
        base = self.fc(x)  # (N, S, H) DFlash's shared projection, before its norm
        layers = x.view(n, s, len(self.target_layers), self.fc.out_features)  # (N, S, T, H)
        mix = self.fusion.softmax(-1)  # (L, T)
        fused = torch.einsum("lt,nsth->lnsh", mix, layers)  # (L, N, S, H) each draft layer's own mix
        return [self.ctx_norm(base + f) for f in fused], self.ctx_norm(base)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """The block body's forward (on the per-layer contexts), then the correction teacher-forced on gold tokens."""
        out = super().forward(batch, features, anchors)  # hidden (N, A, K, H)
        if self.correction is not None:  # slot t reads x_{n+t-1}: the gold token (teacher forcing)
            prev_emb = self.target.embed_tokens(previous_tokens(batch["input_ids"], out.anchors, self.block_size))
            out.hidden = self.correction(out.hidden, prev_emb)  # (N, A, K, H)
        return out

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        h = self.correction(hidden[t : t + 1], self.target.embed_tokens(previous))  # (1, H)
        return self.head(h), None  # (1, Vd)
