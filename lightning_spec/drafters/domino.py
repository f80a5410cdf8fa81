"""DominoDrafter: DFlash's block-parallel backbone (``block.ParallelBlockDrafter``: Chen, Liang, Liu 2026, arXiv
2602.06036) plus a GRU-driven low-rank correction drafted left to right (``block.ChainedBlockDrafter``, the
chain it shares with DFly).

Domino (SpecForge #571, ported to NeMo AutoModel ``speculative/dflash/domino_core.py``; config
``SpecForge configs/qwen3-8b-domino.json``):
1. The backbone gives base logits U_t = head(z_t) for every slot t = 1..K (z_t the backbone's last state).
2. A GRU over the embeddings of the block's previous tokens, x_n (the anchor), x_{n+1}, ..., x_{n+t-1}, gives a
   causal state g_t; gold tokens in training (teacher forcing), the drafted ones at decode time.
3. Final logits U_t + Δ_t with Δ_t = W_2 silu(W_1 [z_t ; g_t]) (in -> ``correction_rank`` -> Vd, no biases), for
   the slots after the first ``pure_draft_prefix_len``; those keep U_t (the GRU has seen only the anchor there).
4. The forward returns the final logits lazily as ``hidden`` + ``head`` and the base logits as the head
   ``aux["base_logits"]``; the λ-scheduled loss (1 - λ)·CE(final) + λ·CE(base) is the objective part
   ``objectives.TwoBranchCE``. W_2 starts at zero (the released code draws it like every linear), so an untrained
   Domino drafts exactly what its DFlash backbone drafts.
Domino's released config predicts x_{n+1} from the anchor slot itself (``shift_label``); here, as in every
``ParallelBlockDrafter``, slot t = 1..K predicts x_{n+t} and the anchor slot is the input, so its slot t is theirs
t - 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.block import ChainedBlockDrafter, previous_tokens
from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.target import Target


class DominoDrafter(ChainedBlockDrafter):
    """Domino: DFlash base logits plus a GRU-driven low-rank correction, drafted left to right (see the module
    docstring).

    Args (besides ``ParallelBlockDrafter``'s):
        gru_size: the GRU's state width; default a quarter of the target's hidden size (the released config:
            1024 for Qwen3-8B's 4096).
        correction_rank: the width of the correction MLP between [z ; g] and the draft vocabulary (256 released).
        pure_draft_prefix_len: leading slots that keep the base logits (1 released: the first prediction's GRU
            state has seen only the anchor, which the backbone sees too).
    """

    family = "domino"

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
        gru_size: int | None = None,
        correction_rank: int = 256,
        pure_draft_prefix_len: int = 1,
    ) -> None:
        super().__init__(block_size, num_layers, target_layers, num_anchors, draft_vocab_size, intermediate_size,
                         context_shortcut, init_from_target)
        if gru_size is not None and gru_size < 1:
            raise UserError(f"drafter.gru_size must be >= 1 (or null: a quarter of the hidden size), got {gru_size}.")
        if correction_rank < 1:
            raise UserError(f"drafter.correction_rank must be >= 1, got {correction_rank}.")
        if not 0 <= pure_draft_prefix_len < block_size:
            raise UserError(
                f"drafter.pure_draft_prefix_len must be in 0..block_size - 1 = {block_size - 1} (slots that keep the "
                f"base logits; at least one slot gets the correction), got {pure_draft_prefix_len}."
            )
        self.gru_size = gru_size
        self.correction_rank = correction_rank
        self.pure_draft_prefix_len = pure_draft_prefix_len

    def build(self, target: Target) -> None:
        super().build(target)
        hidden = target.hidden_size
        gru = self.gru_size or max(1, hidden // 4)
        self.gru = nn.GRU(hidden, gru, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden + gru, self.correction_rank, bias=False),
            nn.SiLU(),
            nn.Linear(self.correction_rank, self.vocab.ids.numel(), bias=False),  # over the draft vocabulary
        )
        with torch.no_grad():
            nn.init.normal_(self.embed_proj[0].weight, std=0.02)
            nn.init.zeros_(self.embed_proj[2].weight)  # Δ = 0 at init: the drafter starts as its DFlash backbone

    def prefix_states(self, tokens: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """g after each of ``tokens`` (..., T) target ids -> (..., T, G), and the GRU's last state (1, B, G)."""
        emb = self.target.embed_tokens(tokens).to(self.gru.weight_ih_l0.dtype)  # (..., T, H)
        out, last = self.gru(emb.reshape(-1, *emb.shape[-2:]), state)  # (B, T, G)
        return out.view(*tokens.shape, -1), last

    def delta(self, hidden: Tensor, g: Tensor) -> Tensor:
        """Δ = W_2 silu(W_1 [z ; g]): hidden (..., H), g (..., G) -> (..., Vd)."""
        return self.embed_proj(torch.cat([hidden, g.to(hidden.dtype)], dim=-1))

    def correct(self, base: Tensor, hidden: Tensor, g: Tensor) -> Tensor:
        """Final logits: U + Δ on the slots after the pure prefix. base (..., K, Vd), hidden (..., K, H),
        g (..., K, G) -> (..., K, Vd)."""
        p = self.pure_draft_prefix_len
        suffix = base[..., p:, :] + self.delta(hidden[..., p:, :], g[..., p:, :]).to(base.dtype)  # (..., K-p, Vd)
        return torch.cat([base[..., :p, :], suffix], dim=-2)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """The DFlash forward (base logits as ``aux["base_logits"]``), the GRU over the gold tokens x_n..x_{n+K-1},
        and the final logits through ``head``; both heads are evaluated per chunk of anchors."""
        out = super().forward(batch, features, anchors)  # hidden (N, A, K, H), the base branch
        g, _ = self.prefix_states(previous_tokens(batch["input_ids"], out.anchors, self.block_size))  # (N, A, K, G)

        def final(hidden: Tensor, index: Tensor) -> Tensor:  # (N, a, K, H), (a,) -> (N, a, K, Vd)
            return self.correct(self.head(hidden), hidden, g.index_select(1, index.to(g.device)))

        out.head = final
        out.aux["base_logits"] = self._slot_logits  # (N, a, K, Vd): U, the backbone's own logits
        return out

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        g, carry = self.prefix_states(previous[None], carry)  # (1, 1, G): the GRU reads one more token
        h = hidden[t : t + 1]  # (1, H)
        base = self.head(h)  # (1, Vd)
        if t < self.pure_draft_prefix_len:
            return base, carry
        return base + self.delta(h, g[0]).to(base.dtype), carry  # (1, Vd)
