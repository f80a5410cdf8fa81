"""The DFlash family's two-branch drafters: DFly and Domino. Both keep DFlash's block-parallel backbone
(``BlockDrafter``: Chen, Liang, Liu 2026, arXiv 2602.06036) and add a path that reads the block left to right.

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
``BlockDrafter``, slot t = 1..K predicts x_{n+t} and the anchor slot is the input, so its slot t is theirs t - 1.

Both are ``BlockDrafter``s (its layers, context, anchors, vocabulary and decoding state); what they add reads top
to bottom below, after the left-to-right chain they share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.block import BlockDrafter, BlockDraftState, RMSNorm, TargetShape
from lightning_spec.sampling import SamplingConfig


def previous_tokens(ids: Tensor, starts: Tensor, k: int) -> Tensor:
    """x_{n+t-1} for slots t = 1..K of every anchor n: the anchor, then the gold tokens. (N, S), (N, A) -> (N, A, K);
    positions past the sequence repeat its last token (their slots are not valid)."""
    n, s = ids.shape
    pos = (starts[..., None] + torch.arange(k, device=ids.device)).clamp(max=s - 1)  # (N, A, K)
    return ids.gather(1, pos.reshape(n, -1)).view(n, -1, k)


# ------------------------------------------------------------------------------------ the left-to-right chain
class ChainedBlockDrafter(BlockDrafter):
    """A DFlash block whose slot t also reads the token at slot t - 1: the backbone runs once per round, then the
    slots are drawn in order, each from ``slot_logits(h, t, previous token, carry)``.

    The training forward computes the same logits teacher-forced (previous token = gold), so when slots 1..t-1
    were accepted (drafted = gold) slot t's distribution is the one ``forward`` gives.
    """

    left_to_right: bool = True  # False: the slots are independent and BlockDrafter.propose drafts them

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        """Logits (1, Vd) of slot t + 1 (0-based ``t``) from the block's states ``hidden`` (K, H) and the token
        ``previous`` (1,) before it (target id), and what the next slot needs (``carry``, None at slot 1)."""
        raise NotImplementedError

    @property
    def parallel_slots(self) -> bool:  # slot t reads the token drafted at t - 1 unless the chain is off
        return not self.left_to_right

    @torch.no_grad()
    def propose(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        if not self.left_to_right:
            return super().propose(state, anchor, sampling, generator)
        hidden = self.block_hidden(state, anchor)[0, 1:]  # (K, H) the slots' states
        previous, carry = anchor.reshape(1), None
        tokens, probs = [], []
        for t in range(self.block_size):
            logits, carry = self.slot_logits(hidden, t, previous, carry)  # (1, Vd)
            if sampling.greedy:
                draft = logits.argmax(-1)  # (1,)
            else:
                q = sampling.probs(logits)  # (1, Vd)
                draft = sampling.sample(q, generator)
                probs.append(q)
            previous = self.vocab.to_target(draft)  # (1,) the next slot reads the drafted token
            tokens.append(previous)
        if sampling.greedy:
            return ChainProposal(tokens=torch.cat(tokens))
        return ChainProposal(tokens=torch.cat(tokens), probs=self.vocab.scatter(torch.cat(probs)))  # (K,), (K, V)


# ---------------------------------------------------------------------------------------------------- DFly
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

    Args (besides ``BlockDrafter``'s):
        hidden_correction: add the correction head (AngelSpec's DFly config turns it on); off, the slots are
            independent and drafted in one pass, as DFlash.
        correction_size: the correction's SwiGLU width; default the target's hidden size (AngelSpec's default).
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
        hidden_correction: bool = True,
        correction_size: int | None = None,
    ) -> None:
        super().__init__(block_size, num_layers, target_layers, num_anchors, draft_vocab_size, intermediate_size,
                         context_shortcut, init_from_target)
        if correction_size is not None and correction_size < 1:
            raise ValueError(f"drafter.correction_size must be >= 1 (or null: the hidden size), got {correction_size}.")
        self.hidden_correction = hidden_correction
        self.correction_size = correction_size
        self.left_to_right = hidden_correction

    def bind(self, target: Any) -> None:
        first = not self.built
        super().bind(target)
        if not first:
            return
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
        self.to(target.device)

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
        """BlockDrafter's forward (on the per-layer contexts), then the correction teacher-forced on gold tokens."""
        out = super().forward(batch, features, anchors)  # hidden (N, A, K, H)
        if self.correction is not None:  # slot t reads x_{n+t-1}: the gold token (teacher forcing)
            prev_emb = self.target.embed_tokens(previous_tokens(batch["input_ids"], out.anchors, self.block_size))
            out.hidden = self.correction(out.hidden, prev_emb)  # (N, A, K, H)
        return out

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        h = self.correction(hidden[t : t + 1], self.target.embed_tokens(previous))  # (1, H)
        return self.head(h), None  # (1, Vd)


# -------------------------------------------------------------------------------------------------- Domino
class DominoDrafter(ChainedBlockDrafter):
    """Domino: DFlash base logits plus a GRU-driven low-rank correction, drafted left to right (see the module
    docstring).

    Args (besides ``BlockDrafter``'s):
        gru_size: the GRU's state width; default a quarter of the target's hidden size (the released config:
            1024 for Qwen3-8B's 4096).
        correction_rank: the width of the correction MLP between [z ; g] and the draft vocabulary (256 released).
        pure_draft_prefix_len: leading slots that keep the base logits (1 released: the first prediction's GRU
            state has seen only the anchor, which the backbone sees too).
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
        gru_size: int | None = None,
        correction_rank: int = 256,
        pure_draft_prefix_len: int = 1,
    ) -> None:
        super().__init__(block_size, num_layers, target_layers, num_anchors, draft_vocab_size, intermediate_size,
                         context_shortcut, init_from_target)
        if gru_size is not None and gru_size < 1:
            raise ValueError(f"drafter.gru_size must be >= 1 (or null: a quarter of the hidden size), got {gru_size}.")
        if correction_rank < 1:
            raise ValueError(f"drafter.correction_rank must be >= 1, got {correction_rank}.")
        if not 0 <= pure_draft_prefix_len < block_size:
            raise ValueError(
                f"drafter.pure_draft_prefix_len must be in 0..block_size - 1 = {block_size - 1} (slots that keep the "
                f"base logits; at least one slot gets the correction), got {pure_draft_prefix_len}."
            )
        self.gru_size = gru_size
        self.correction_rank = correction_rank
        self.pure_draft_prefix_len = pure_draft_prefix_len

    def bind(self, target: Any) -> None:
        first = not self.built
        super().bind(target)
        if not first:
            return
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
        self.to(target.device)

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
