"""PEagleDrafter: P-EAGLE, EAGLE-3 drafting all its slots in one forward (vLLM's ``parallel_drafting``, vllm #32887;
speculators PR #480; NeMo AutoModel, SpecForge).

EAGLE-3 (``eagle3.py``; the body both share is ``eagle.py``) drafts slot t from [e(x_{n+t-1}) ; h_{t-1}]: the
token it drafted and its own hidden state one slot back, so a round is K layer calls in a row (on a 2-core CPU ~40%
of a target forward for K = 8). P-EAGLE replaces what slot t > 1 does not know yet by constants:

1. Slot 1 is EAGLE-3's: [e(x_n) ; g_{n-1}] at the anchor's position n (g = ``fuse`` of the target features).
2. Slots t = 2..K, at positions n + t - 1, read [e(m) ; p]: the target's frozen embedding of ``mask_token_id`` (m,
   a token chat data never uses) and a learned placeholder p = fuse(``mask_hidden``), ``mask_hidden`` (1, F) standing
   in for the target features no position past n has yet (vLLM passes it through the same ``combine_hidden_states``).
3. One layer call over the K slots: slot t attends to the committed entries (positions < n, built from true
   features, as EAGLE-3's) and causally to slots 1..t of its own round; slot t's output, through the final norm and
   the head, is its draft distribution. No slot reads a drafted token, so a round is one call (``parallel_slots``),
   and trees are best-first over the K distributions (``TreeGrowth.BEST_FIRST``), scored exactly offline.
4. Training runs the same round at every anchor with the same inputs (no unroll: the inputs are the data's anchor
   token and constants), all anchors and slots in one layer call; slot t's attention over the committed entries
   <= n and its round's slots 2..t is one ``chain_attention`` per slot.
5. COD (conditional-on-depth) sampling: P-EAGLE keeps a share max(r^d, r_min) of the positions at depth d = t - 1
   (r = ``down_sample_ratio`` 0.7, r_min 0.2) to bound its attention cost over whole sequences. Here anchors are
   already a sample (``num_anchors``), so COD thins the loss instead: in training, slot t of each anchor counts with
   probability max(r^(t-1), r_min), drawn from the anchor seeds (the same draws in any batch layout); evaluation and
   decoding score every slot. ``down_sample_ratio: 1`` turns it off.

EAGLE-3.1's ``norm_before_fc`` and ``fc_norm`` apply (they shape g and p); ``norm_output`` does not: no slot passes its
state to another. Export: the speculators ``peagle`` type (EAGLE-3's layout with ``mask_hidden`` and
``mask_token_id``), which vLLM 0.32 serves with ``speculative_config: {method: eagle3, parallel_drafting: true}``;
``fc_norm`` has no field there (vLLM's peagle reader takes ``norm_before_fc`` only), so its export is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, DraftOutput, seeded_rand
from lightning_spec.drafters.eagle import Eagle3State, EagleDrafter
from lightning_spec.drafters.layers import causal_attention, chain_attention
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


class PEagleDrafter(EagleDrafter):
    """P-EAGLE drafter: EAGLE-3's layer and fusion, every slot of a round in one call.

    Args:
        block_size: K, draft tokens per round (vLLM's ``num_speculative_tokens``; speculators' ``num_depths``).
        target_layers, num_anchors, draft_vocab_size, intermediate_size, own_head, norm_before_fc, fc_norm:
            as ``Eagle3Drafter``.
        mask_token_id: the target token whose (frozen) embedding slots 2..K read; required, one the data never holds
            (SmolLM2: 16, ``<empty_output>``). vLLM reads it from the exported config.
        down_sample_ratio: COD's r: in training slot t counts with probability max(r^(t-1), ``down_sample_ratio_min``).
        down_sample_ratio_min: COD's floor.
    """

    family = "peagle"
    tree_growth = TreeGrowth.BEST_FIRST  # K distributions from one call: best-first trees over them
    parallel_slots = True

    def __init__(
        self,
        block_size: int = 8,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        own_head: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        mask_token_id: int | None = None,
        down_sample_ratio: float = 0.7,
        down_sample_ratio_min: float = 0.2,
    ) -> None:
        super().__init__(block_size=block_size, target_layers=target_layers, num_anchors=num_anchors,
                         draft_vocab_size=draft_vocab_size, intermediate_size=intermediate_size, own_head=own_head,
                         norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=False)
        if not (0 < down_sample_ratio <= 1 and 0 <= down_sample_ratio_min <= 1):
            raise UserError(f"PEagleDrafter.down_sample_ratio ({down_sample_ratio}) must be in (0, 1] and "
                            f"down_sample_ratio_min ({down_sample_ratio_min}) in [0, 1].")
        self.mask_token_id = mask_token_id
        self.down_sample_ratio, self.down_sample_ratio_min = down_sample_ratio, down_sample_ratio_min

    def build(self, target: Target) -> None:
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < target.vocab_size:
            raise UserError(f"PEagleDrafter.mask_token_id={self.mask_token_id!r} must be a token of the target (0.."
                            f"{target.vocab_size - 1}) that the data never holds, e.g. a reserved special token "
                            "(SmolLM2: 16, <empty_output>): slots 2..K read its embedding.")
        super().build(target)
        # the placeholder for the target features of positions past the anchor, in their own space (F), as vLLM keeps it
        self.mask_hidden = nn.Parameter(torch.zeros(1, self.fc.in_features))

    def placeholder(self) -> Tensor:
        """p = fuse(mask_hidden): slots 2..K's hidden input (H,)."""
        return self.fuse(self.mask_hidden[None])[0, 0]

    def slot_inputs(self, anchor_emb: Tensor, u1: Tensor) -> tuple[Tensor, Tensor]:
        """Every slot's (embedding, hidden input) from slot 1's, (..., H) each -> (..., K, H) each: slot 1 as given,
        slots 2..K the mask token's embedding and the placeholder."""
        k = self.block_size
        mask = self.embed(torch.tensor(self.mask_token_id, device=anchor_emb.device))  # (H,)
        emb = torch.cat([anchor_emb[..., None, :], mask.expand(*anchor_emb.shape[:-1], k - 1, -1)], dim=-2)
        u = torch.cat([u1[..., None, :], self.placeholder().expand(*u1.shape[:-1], k - 1, -1)], dim=-2)
        return emb, u

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Every slot of every anchor in one layer call. batch: input_ids (N, S), loss_mask (N, S); features
        (N, S, F) of ``target_layers``; ``anchors`` default to ``sample_anchors(batch)``."""
        ids = batch["input_ids"]
        n, s = ids.shape
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        a, k, layer = starts.shape[1], self.block_size, self.layer
        g = self.fuse(features)  # (N, S, H)
        ctx_k, ctx_v = self._committed_kv(ids, g, g.new_zeros(n, g.shape[-1]), 0)  # (N, Hkv, S, D)
        ctx_ok = torch.arange(s, device=ids.device) <= starts[..., None]  # (N, A, S): slot 1's own entry is at n
        g_prev = F.pad(g, (0, 0, 1, 0))[:, :-1]  # (N, S, H): g_{p-1}
        u1 = g_prev.gather(1, starts[..., None].expand(-1, -1, g.shape[-1]))  # (N, A, H)
        emb, u = self.slot_inputs(self.embed(ids.gather(1, starts)), u1)  # (N, A, K, H) each
        pos = starts[..., None] + torch.arange(k, device=ids.device)  # (N, A, K)
        q, key, value = layer.qkv(emb.flatten(1, 2), u.flatten(1, 2), pos.flatten(1), self.rope_theta)
        q = q.unflatten(2, (a, k))  # (N, Hq, A, K, D)
        key, value = key.unflatten(2, (a, k)), value.unflatten(2, (a, k))  # (N, Hkv, A, K, D)
        attn = torch.stack([chain_attention(q[:, :, :, t], ctx_k, ctx_v, ctx_ok, key[:, :, :, 1 : t + 1],
                                            value[:, :, :, 1 : t + 1]) for t in range(k)], dim=3)  # (N, Hq, A, K, D)
        h = layer.finish(u.flatten(1, 2), attn.flatten(2, 3))  # (N, A*K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        if self.training and self.down_sample_ratio < 1:
            valid = valid & self.cod_keep(batch, anchors)
        hidden = self.norm(h).unflatten(1, (a, k))  # (N, A, K, H)
        return DraftOutput(labels=labels, valid=valid, anchors=starts, hidden=hidden, head=self._slot_logits)

    def cod_keep(self, batch: dict[str, Tensor], anchors: Anchors) -> Tensor:
        """(N, A, K) bool: slot t of each anchor kept with probability max(r^(t-1), r_min) (COD), drawn from the
        examples' anchor seeds (offset from the anchors' own draws) where the batch has them."""
        n, a = anchors.positions.shape
        k = self.block_size
        seeds = batch.get("anchor_seed")
        if seeds is not None:
            draws = seeded_rand(seeds + 7_919, a * k).view(n, a, k).to(anchors.positions.device)
        else:
            draws = torch.rand(n, a, k, device=anchors.positions.device)
        depth = torch.arange(k, device=draws.device, dtype=draws.dtype)
        share = (self.down_sample_ratio ** depth).clamp(min=self.down_sample_ratio_min)  # (K,), 1 at slot 1
        return draws < share

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def position_logits(self, state: Eagle3State, anchor: Tensor) -> Tensor:
        """The K slots after ``anchor`` (at position n = ``state.length``) in one call: draft logits (K, Vd)."""
        token = anchor.reshape(1).to(state.keys.device)
        emb, u = self.slot_inputs(self.embed(token), state.last)  # (1, K, H) each
        pos = torch.arange(state.length, state.length + self.block_size, device=token.device)[None]  # (1, K)
        q, key, value = self.layer.qkv(emb, u, pos, self.rope_theta)  # q (1, Hq, K, D); key, value (1, Hkv, K, D)
        attn = causal_attention(q, torch.cat([state.keys, key], 2), torch.cat([state.values, value], 2))
        return self.head(self.norm(self.layer.finish(u, attn))[0])  # (K, Vd)

    @torch.no_grad()
    def propose(self, state: Eagle3State, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """K drafts, each from its slot's distribution; none depends on another's draw."""
        logits = self.position_logits(state, anchor)  # (K, Vd)
        if sampling.greedy:
            proposal = ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        else:
            q = sampling.probs(logits)  # (K, Vd)
            proposal = ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)),
                                     probs=self.vocab.scatter(q))
        state.nodes = [anchor.reshape(1).to(state.keys.device), *proposal.tokens.reshape(-1, 1)]
        return proposal

    def tree_start(self, state: Eagle3State, anchor: Tensor):
        raise NotImplementedError("PEagleDrafter grows best-first trees over position_logits")

    def tree_step(self, chain, rows: Tensor, tokens: Tensor):
        raise NotImplementedError("PEagleDrafter grows best-first trees over position_logits")
