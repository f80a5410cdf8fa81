"""SpecBlockDrafter: K query slots per position, a layer-wise slot shift, a rank head that sizes a draft tree, and
blocks that continue blocks (block TTT) (Shi et al. 2026, "SpecBlock", arXiv 2605.07243; code shiweijiezero/SpecBlock).

Reads top to bottom:
1. Fused inputs. Every position i of the sequence carries a block of K slots. Slot k (0-based) of position i is
   fuse([RMSNorm(condition_proj(g_{i-1})) ; RMSNorm(e(x_i)) ; RMSNorm(query_k)]): the fused target feature g_{i-1}
   (the concatenated outputs of ``target_layers`` at position i - 1, the state that predicted x_i; zeros at i = 0),
   the target's frozen embedding of x_i, and a learned vector per slot. ``fuse`` maps 3H -> H. Slot k predicts
   x_{i+1+k} and sits at rotary position i + 1 + k.
2. Attention is causal across positions and across slots: slot k of position i sees slot k' of position j iff
   j <= i and k' <= k. Within a position that is the paper's "slot k sees slots <= k"; across positions the same
   rule keeps slot k a function of slots 0..k alone, everywhere, so no slot ever reads a later slot.
3. Layer-wise shift. Before every draft layer l > 0 the residual stream is mixed with its own slot-shifted copy,
   h <- W_l [h ; shift(h)], shift(h)[:, :, k] = h[:, :, k - 1], slot 0 mapped to itself, W_l in R^{H x 2H}: slot k
   reads slot k - 1's state directly, not only through attention.
4. The final norm and the target's frozen LM head over the draft vocabulary (``DraftVocab``) give q_k.
5. Rank head (an aux head, ``DraftOutput.aux["rank"]``): from the detached normed state and 15 statistics of q_k
   (top-10 log-probs, the log-prob gaps top1-top2, top1-top3, top1-top5, the top-1 probability, the entropy of the
   top-20) an MLP H + 15 -> 256 -> 4 predicts the bucket {1}, {2-4}, {5-10}, {>10} of the rank of the target's
   argmax in q_k. Its loss is ``objectives.RankOrdinal``. The head and the trees its classes size (7.) live in
   ``specblock_rank.py``.
6. Block TTT (``blocks`` = B > 1; the paper trains 3). Block 1 of an anchor n is the block at position n above.
   Block b + 1 starts at slot M of block b: it is the block at position n + o + M (o: where block b starts, 0 for
   block 1), conditioned on block b's own state at slot M - 1 (its last layer's output before the final norm, in
   place of the target feature; it enters through ``condition_norm``, not ``condition_proj``, as in the paper's
   code) and on the token x_{n+o+M} that slot M - 1 drafts. Its slot k predicts x_{n+o+M+1+k} at rotary position
   n + o + M + 1 + k. What a slot k of block b >= 2 attends to (the same sets in training and decoding):
   - the committed blocks, positions j < n, at slots <= k (the rule of block 1);
   - every earlier block of its anchor at the slots before that block's M (block 1 at slots < M_1, block 2 at
     slots < M_2, ...): the slots that drafted the tokens x_{n+1..n+o+M} before its start, whatever their slot;
   - its own block's slots <= k.
   Training samples M ~ U{1..K} per anchor and block (the paper), teacher-forced (the start token is the data's)
   and with no filter between blocks (the paper trains every later block, whether or not the earlier one was
   right). A drafter in eval mode (``self.training`` False) uses M = K for every block instead: that is the chain
   ``propose`` drafts (each block continues where the previous one ends), so the offline evaluator and validation,
   which score a drafter through ``forward`` in eval mode, score what decoding draws.
7. Decoding. A round anchored at n (the committed token whose own target feature does not exist yet) is the
   block at position n: it needs g_{n-1} and x_n only, both committed. The committed positions' blocks are built
   from the target's true features and kept as a KV cache (all K slots of every committed position, as training
   sees them); later blocks of a round never enter it. A chain proposes the B x K slots of blocks 1..B (argmax, or
   each slot sampled from its q_k; block b + 1 reads the token drafted at block b's last slot). A tree grows by
   block expansion (``block_tree``): the rank head sizes each depth's width (``rank_tree``), and a block that is
   not the last stops at its first slot that branches (or at its end); each of the most valuable nodes there
   starts the next block.

What the training forward returns, per mode (the contract: every slot ``propose`` draws from, given acceptance):
- eval mode: per anchor the B x K slots of the chain (N, A, B*K), slot t predicting x_{n+t};
- training mode with B > 1: one row per block (N, A*B, K), anchored at the block's start n + o (row b of anchor a
  at index a * B + b), so that slot t of every row predicts the token t after its row's anchor, the target's logits
  are read there by the module, and the objective's per-row parts (the 0.8^k decay, the valid-prefix mask, the rank
  loss's first-mistake cut) apply within each block, as the paper's loss does. A block's row counts only where its
  start token is a valid label of the previous block (a supervised token of the draft vocabulary: a state decoding
  can reach); the data's tokens are used whether or not the previous block drafted them.

Choices where the paper leaves room (tested in tests/drafters/test_specblock*.py):
- ``block_size`` is what every family's is, the most tokens a round proposes: B x K. The slots per block, K, are
  ``block_size / blocks`` (``slots``); B = 1 is the single-block drafter of before, weights and all.
- Which (feature, token) pair a position holds: SpecForge's EAGLE-3 lineage pairs the target state at i with the
  token x_{i+1}; indexing by the token, that is (g_{i-1}, x_i) here, which makes the anchor's block computable.
- Every position is a block in one forward (one masked attention over all of them), so the training forward costs S x K
  tokens per sequence whatever ``num_anchors`` is; ``num_anchors`` only picks which blocks the loss reads. Blocks
  2..B run at the anchors only (A x K tokens each).
- Later blocks sit at their own rotary positions (n + o + M + 1 + k); the paper's code reuses block 1's positions
  (n + 1 + k) for every block. Here a block is the block at its start position whichever block it is.
- The paper's code lets a later block of anchor n also see the later blocks of the anchors before n, which do not
  exist when decoding; here it does not (see 6.).
- M in training is drawn per anchor and block from the example's own seed (``anchor_seed``): an example's blocks
  do not depend on its batch, its padding or its DDP rank.
- W_l starts as [I, 0] (the shift adds nothing at initialisation), so an untrained stack is a plain one.
- Rank features: log-probs at T = 1, clamped at -30 (and padded with -30 when Vd < 20); the entropy is that of the
  top-20 probabilities renormalised; the label's reference token is the target's argmax over the draft vocabulary.
- Tree widths: the class of slot d gives the width of depth d (class 0 -> 1 child per node, 1 -> 4, 2 -> 10,
  3 -> the branch stops before depth d). Within one block slot d's distribution and class are the same for every
  node at depth d (no slot reads a drafted token), so "per node" widths are per block depth here. Block expansion
  is where drafted tokens matter: a later block reads its start token, so the children of a branching slot each
  get a continuation of their own (the paper: the next block starts where the rank head is unsure). ``tree.top_k``
  caps the blocks started per level (the most valuable start nodes, EAGLE-2's k expanded nodes per depth).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.decoding.trees import tree_probs
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, seeded_rand
from lightning_spec.drafters.layers import DraftLayer, RMSNorm, TargetShape, init_weights, low_mid_high_layers
from lightning_spec.drafters.specblock_rank import RankHead, block_tree
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target

TTT_SALT = 0x2545F4914F6CDD1D  # anchor_seed ^ TTT_SALT seeds an example's block starts, apart from its anchors


# ---------------------------------------------------------------------------------------------------- state
@dataclass
class SpecBlockState:
    """Decoding state: per layer the keys/values of every slot of the committed positions 0..length-1."""

    keys: list[Tensor]  # per layer (1, kv_heads, length * K, D)
    values: list[Tensor]
    length: int  # committed positions with a block; the next anchor sits at ``length``
    last: Tensor  # (1, F) the target features of position length - 1 (zeros when length == 0)
    nodes: list[Tensor] = field(default_factory=list)  # this round's tokens: the anchor, then the drafts, (1,) each


@dataclass
class BlockRows:
    """C blocks of one round side by side (a chain: one row; a tree: one per start node), each after its own path
    of earlier blocks of the round."""

    normed: Tensor  # (C, K, H) final normed states: the head and the rank head read them
    hidden: Tensor  # (C, K, H) the last layer's output before the final norm: a next block's condition
    keys: list[Tensor]  # per layer (C, kv_heads, J + K, D): the path's blocks' entries, then the row's own
    values: list[Tensor]
    visible: Tensor  # (C, J) bool: the path entries the row's block saw (each earlier block's slots before its M)
    offset: Tensor  # (C,) the start node's depth: the block sits at position anchor + offset


class SpecBlockDrafter(Drafter):
    """SpecBlock: K learned query slots per position over fused target features, a layer-wise slot shift, the
    target's frozen head, a rank head whose classes size the draft tree, and blocks that continue blocks.

    Args:
        block_size: the most draft tokens per round, ``blocks`` x K: K query slots per block (the paper: K = 4 for
            Qwen3-8B), times the blocks a round chains.
        num_layers: draft decoder layers (the paper: 2).
        target_layers: 0-indexed target layers fused by ``condition_proj``. Default EAGLE-3's low / middle / high
            layers, [1, L/2 - 1, L - 4] (the paper's 3H feature).
        num_anchors: anchors per training sequence the loss reads (every position's block 1 is computed anyway).
        draft_vocab_size: restrict the LM head to the most frequent target tokens (None = the full vocabulary;
            the paper: 32k).
        intermediate_size: MLP width; default the target's.
        rank_width: the rank head's hidden width (the paper: 256).
        blocks: B, blocks per round: block b + 1 continues block b from its draft state (block TTT; the paper
            trains 3). 1 = the single-block drafter. ``block_size`` must be a multiple of it.
    """

    family = "specblock"
    tree_growth = TreeGrowth.OWN  # propose_tree: block expansion over the rank head

    def __init__(
        self,
        block_size: int = 4,
        num_layers: int = 2,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        rank_width: int = 256,
        blocks: int = 1,
    ) -> None:
        super().__init__(block_size, target_layers, num_anchors, draft_vocab_size)
        for name, value in (("num_layers", num_layers), ("rank_width", rank_width), ("blocks", blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"drafter.{name} must be an int >= 1, got {value!r}.")
        if block_size % blocks:
            raise UserError(
                f"drafter.block_size={block_size} must be a multiple of drafter.blocks={blocks} (a round drafts "
                f"blocks x K slots); set block_size to blocks x K, e.g. {blocks * max(1, block_size // blocks)}."
            )
        self.blocks = blocks
        self.slots = block_size // blocks  # K, query slots per block
        self.num_layers = num_layers
        self.intermediate_size = intermediate_size
        self.rank_width = rank_width

    # ------------------------------------------------------------------------------------------- building
    def default_target_layers(self, num_target_layers: int) -> list[int]:
        return low_mid_high_layers(num_target_layers)  # EAGLE-3's low / middle / high layers

    def adaptation_scopes(self) -> dict[str, list[str]]:
        return {"head": ["norm", "rank_head"], "last": [f"layers.{self.num_layers - 1}", "norm"]}

    def build(self, target: Target) -> None:
        shape = TargetShape.of(target, self.intermediate_size)
        hidden, self.rope_theta = shape.hidden, shape.rope_theta
        self.condition_proj = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.condition_norm = RMSNorm(hidden, shape.eps)
        self.embed_norm = RMSNorm(hidden, shape.eps)
        self.query_norm = RMSNorm(hidden, shape.eps)
        self.query = nn.Parameter(torch.zeros(self.slots, hidden))  # (K, H) query_k
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(DraftLayer(shape) for _ in range(self.num_layers))
        self.shifts = nn.ModuleList(nn.Linear(2 * hidden, hidden, bias=False) for _ in range(self.num_layers - 1))
        self.norm = RMSNorm(hidden, shape.eps)
        self.rank_head = RankHead(hidden, self.rank_width)
        init_weights(self, self.num_layers, target, [self.norm])
        with torch.no_grad():
            nn.init.normal_(self.query, std=0.02)  # distinct per slot; RMSNorm makes the scale irrelevant
            nn.init.zeros_(self.rank_head.up.bias)
            nn.init.zeros_(self.rank_head.out.bias)
            for w in self.shifts:  # W_l = [I, 0]: no shift at initialisation
                w.weight.zero_()
                w.weight[:, :hidden].copy_(torch.eye(hidden))

    # -------------------------------------------------------------------------------------------- the stack
    def fused(self, condition: Tensor, tokens: Tensor) -> Tensor:
        """Blocks of positions holding ``tokens`` (N, P) under ``condition`` (N, P, H) (condition_proj of a target
        feature, or a previous block's state): the fused slot inputs (N, P, K, H)."""
        dtype = self.fuse.weight.dtype
        cond = self.condition_norm(condition.to(dtype))  # (N, P, H)
        emb = self.embed_norm(self.target.embed_tokens(tokens).to(dtype))  # (N, P, H)
        query = self.query_norm(self.query)  # (K, H)
        n, p, h = cond.shape
        k = self.slots
        parts = [cond[:, :, None].expand(n, p, k, h), emb[:, :, None].expand(n, p, k, h), query.expand(n, p, k, h)]
        return self.fuse(torch.cat(parts, -1))  # (N, P, K, H)

    def inputs(self, features_before: Tensor, tokens: Tensor) -> Tensor:
        """Block 1 of positions holding ``tokens`` (N, P) whose previous position's target features are
        ``features_before`` (N, P, F): the fused slot inputs (N, P, K, H)."""
        return self.fused(self.condition_proj(features_before.to(self.fuse.weight.dtype)), tokens)

    def shift(self, i: int, h: Tensor) -> Tensor:
        """h <- W_i [h ; shift(h)] on (N, P, K, H): slot k also reads slot k - 1's state (slot 0 its own)."""
        shifted = torch.cat([h[:, :, :1], h[:, :, :-1]], dim=2)  # (N, P, K, H)
        return self.shifts[i - 1](torch.cat([h, shifted], -1))

    def run(
        self, h: Tensor, pos: Tensor, mask: Tensor, cache: tuple[list[Tensor], list[Tensor]] | None = None
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
        """The draft layers over blocks ``h`` (N, P, K, H) at rotary positions ``pos`` (N, P*K), each query seeing
        the entries ``mask`` (N or 1, P*K, C + P*K) bool allows of [the ``cache`` ; the new entries] (per layer keys
        and values (N or 1, kv_heads, C, D), or None: C = 0). Returns the last layer's output (N, P, K, H), the
        same after the final norm, and each layer's keys and values of the new entries (N, kv_heads, P*K, D)."""
        n, p, k, _ = h.shape
        t = p * k
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            if i > 0:
                h = self.shift(i, h)
            flat = h.reshape(n, t, -1)  # (N, PK, H)
            x = layer.input_norm(flat)
            q = layer.query(x, pos, self.rope_theta)  # (N, Hq, PK, D)
            kk, vv = layer.kv(x, pos, self.rope_theta)  # (N, Hkv, PK, D)
            keys.append(kk)
            values.append(vv)
            if cache is not None and cache[0][i].shape[2]:
                kk = torch.cat([cache[0][i].expand(n, -1, -1, -1), kk], 2)  # (N, Hkv, C + PK, D)
                vv = torch.cat([cache[1][i].expand(n, -1, -1, -1), vv], 2)
            r = layer.heads // layer.kv_heads
            attn = F.scaled_dot_product_attention(
                q, kk.repeat_interleave(r, dim=1), vv.repeat_interleave(r, dim=1), attn_mask=mask[:, None]
            )  # (N, Hq, PK, D)
            h = layer.finish(flat, attn).view(n, p, k, -1)
        return h, self.norm(h), keys, values

    def stack(
        self, h: Tensor, first: int | Tensor, cache: tuple[list[Tensor], list[Tensor]] | None = None
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
        """Block 1 of consecutive positions first..first+P-1 (``first`` an int or (N,)): ``run`` over ``h``
        (N, P, K, H) after ``cache`` (every slot of the C positions before, in (position, slot) order, or None).
        Slot k of position i sees slot k' of position j iff j <= i and k' <= k."""
        n, p, k, _ = h.shape
        dev = h.device
        first = torch.as_tensor(first, device=dev).reshape(-1, 1)  # (N or 1, 1)
        slot_pos = torch.arange(p, device=dev)[:, None] + 1 + torch.arange(k, device=dev)  # (P, K)
        pos = (first + slot_pos.reshape(1, -1)).expand(n, -1)  # (N, PK) i + 1 + k
        position = torch.arange(p, device=dev).repeat_interleave(k)  # (PK,) each entry's position in the blocks
        slot = torch.arange(k, device=dev).repeat(p)  # (PK,) each entry's slot
        mask = (position[None] <= position[:, None]) & (slot[None] <= slot[:, None])  # (PK, PK) query x key
        if cache is not None and cache[0][0].shape[2]:
            cache_slot = torch.arange(k, device=dev).repeat(cache[0][0].shape[2] // k)  # (CK,)
            mask = torch.cat([cache_slot[None] <= slot[:, None], mask], 1)  # (PK, CK + PK) earlier positions
        return self.run(h, pos, mask[None], cache)

    def rank_logits(self, hidden: Tensor, logits: Tensor) -> Tensor:
        """Rank-class logits (..., 4) from normed states (..., H) and their draft logits (..., Vd)."""
        return self.rank_head(hidden, logits)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Every position's block 1 in one causal pass, read at the anchors, then blocks 2..B at the anchors.
        batch: input_ids (N, S), loss_mask (N, S); features (N, S, F) of ``target_layers``. In eval mode: the
        chain ``propose`` drafts at n given the committed positions before it, (N, A, B*K), slot t predicting
        x_{n+t}; in training mode with B > 1: one row per block, (N, A*B, K), M ~ U{1..K} (module docstring)."""
        ids = batch["input_ids"]
        n, s = ids.shape
        k, b = self.slots, self.blocks
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        a = anchors.positions.shape[1]
        before = F.pad(features, (0, 0, 1, 0))[:, :-1]  # (N, S, F): g_{i-1}, zeros at i = 0
        hidden, normed, keys, values = self.stack(self.inputs(before, ids), 0)  # (N, S, K, H), per layer (N, ., SK, D)

        def at_anchors(x: Tensor) -> Tensor:
            return x.gather(1, anchors.positions[..., None, None].expand(-1, -1, *x.shape[2:]))  # (N, A, K, H)

        states = [at_anchors(normed)]  # per block (N, A, K, H)
        m = self.block_starts(batch, a)  # (N, A, B - 1)
        if b > 1:
            states += self.later_blocks(ids, anchors.positions, at_anchors(hidden), keys, values, m)
        if not self.training or b == 1:  # the chain: block b + 1 at the end of block b (M = K)
            labels, valid = self.labels(batch, anchors)  # (N, A, B*K)
            return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=torch.cat(states, 2),
                               head=self._slot_logits, aux={"rank": self._rank_aux})
        offsets = F.pad(m.cumsum(-1), (1, 0))  # (N, A, B): where each block starts after the anchor
        rows = Anchors((anchors.positions[..., None] + offsets).flatten(1), anchors.keep.repeat_interleave(b, 1))
        labels, valid = self.labels(batch, rows)
        labels, valid = labels[..., :k], valid[..., :k].reshape(n, a, b, k).clone()  # (N, A*B, K), (N, A, B, K)
        for j in range(1, b):  # block j + 1 starts on the token block j's slot M - 1 drafts: it must be a label
            valid[:, :, j] &= valid[:, :, j - 1].gather(-1, m[..., j - 1 : j] - 1)
        return DraftOutput(labels=labels, valid=valid.flatten(1, 2), anchors=rows.positions,
                           hidden=torch.stack(states, 2).flatten(1, 2), head=self._slot_logits,
                           aux={"rank": self._rank_aux})

    def block_starts(self, batch: dict[str, Tensor], a: int) -> Tensor:
        """M (N, A, B - 1) long: where block b + 1 starts in block b, per anchor. K in eval mode (the chain
        ``propose`` drafts); uniform on 1..K in training mode (the paper), row i from its own generator seeded with
        ``anchor_seed[i] ^ TTT_SALT`` when the batch has it, so an example gets the same M in any batch."""
        ids = batch["input_ids"]
        n, k, later = ids.shape[0], self.slots, self.blocks - 1
        if not self.training or later == 0:
            return torch.full((n, a, later), k, dtype=torch.long, device=ids.device)
        seeds = batch.get("anchor_seed")
        # a row's j-th value is the same whatever the draw count: the j-th anchor's M does not depend on A
        u = seeded_rand(seeds ^ TTT_SALT, a * later) if seeds is not None else torch.rand(n, a * later)
        return (u * k).long().clamp(max=k - 1).add(1).view(n, a, later).to(ids.device)

    def later_blocks(
        self, ids: Tensor, anchors: Tensor, hidden: Tensor, keys: list[Tensor], values: list[Tensor], m: Tensor
    ) -> list[Tensor]:
        """Blocks 2..B of every anchor, teacher-forced: block j + 1 conditioned on block j's ``hidden`` (N, A, K, H)
        at slot M_j - 1 and on the data's token there. ``keys``/``values``: per layer the sequence pass's entries
        (N, kv_heads, S*K, D); ``m`` (N, A, B - 1). Returns each block's normed states (N, A, K, H)."""
        n, s = ids.shape
        a, k = anchors.shape[1], self.slots
        dev = ids.device
        slot = torch.arange(k, device=dev)
        # the sequence pass, seen by every later block: committed positions j < n at slots <= its own, and block 1
        # (position n itself) at its slots before M_1
        j_pos = torch.arange(s, device=dev).repeat_interleave(k)  # (SK,)
        j_slot = slot.repeat(s)  # (SK,)
        n_a = anchors[..., None, None]  # (N, A, 1, 1)
        seen = ((j_pos < n_a) & (j_slot <= slot[:, None])) | ((j_pos == n_a) & (j_slot < m[..., :1, None]))
        masks = [seen.reshape(n, a * k, s * k)]  # (N, AK, SK)
        same = torch.eye(a, dtype=torch.bool, device=dev)[:, None, :, None]  # (A, 1, A, 1) the same anchor
        own = (same & (slot[None, None, None] <= slot[None, :, None, None])).reshape(1, a * k, a * k)  # slots <= k
        cache_k, cache_v = list(keys), list(values)
        offset = torch.zeros_like(anchors)
        states = []
        for j in range(1, self.blocks):
            start = m[..., j - 1]  # (N, A): M_j
            offset = offset + start
            cond = hidden.gather(2, (start - 1)[..., None, None].expand(-1, -1, 1, hidden.shape[-1]))[:, :, 0]
            token = ids.gather(1, (anchors + offset).clamp(max=s - 1))  # (N, A): x_{n+o}, teacher-forced
            pos = ((anchors + offset)[..., None] + 1 + slot).reshape(n, a * k)  # (N, AK)
            mask = torch.cat([*masks, own.expand(n, -1, -1)], -1)  # (N, AK, C + AK)
            hidden, normed, new_k, new_v = self.run(self.fused(cond, token), pos, mask, (cache_k, cache_v))
            states.append(normed)
            if j < self.blocks - 1:  # the next blocks see this one at its slots before their own start
                cache_k = [torch.cat([c, x], 2) for c, x in zip(cache_k, new_k)]
                cache_v = [torch.cat([c, x], 2) for c, x in zip(cache_v, new_v)]
                before = slot[None, None, None, None] < m[..., j, None, None, None]  # (N, A, 1, 1, K)
                masks.append((same[None] & before).expand(n, a, k, a, k).reshape(n, a * k, a * k))
        return states

    def _slot_logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd): the frozen target head over the draft vocabulary

    def _rank_aux(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.rank_logits(hidden, self.head(hidden))  # (N, a, K, 4), per chunk of anchors like the logits

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> SpecBlockState:
        """The blocks of the prefill's positions 0..S-1 from their features (1, S, F) and tokens (1, S)."""
        if input_ids is None or input_ids.shape[-1] != features.shape[1]:
            raise ValueError(
                "SpecBlockDrafter.begin needs the prefill's token ids (input_ids, one per feature position): every "
                "committed block embeds its token; pass begin(features, input_ids)."
            )
        layer = self.layers[0]
        dev, dtype = self.fuse.weight.device, self.fuse.weight.dtype
        empty = torch.zeros(1, layer.kv_heads, 0, layer.head_dim, device=dev, dtype=dtype)
        state = SpecBlockState(keys=[empty] * self.num_layers, values=[empty] * self.num_layers, length=0,
                               last=torch.zeros(1, self.condition_proj.in_features, device=dev, dtype=dtype))
        self._commit(state, input_ids.reshape(1, -1).to(dev), features.to(dev))
        return state

    def _commit(self, state: SpecBlockState, ids: Tensor, features: Tensor) -> None:
        """Append the blocks of tokens ids (1, P) at positions length.. whose own features are ``features``."""
        p = ids.shape[1]
        if p == 0:
            return
        before = torch.cat([state.last[:, None].to(features.dtype), features[:, :-1]], 1)  # (1, P, F)
        _, _, keys, values = self.stack(self.inputs(before, ids), state.length, (state.keys, state.values))
        state.keys = [torch.cat([a, b], 2) for a, b in zip(state.keys, keys)]
        state.values = [torch.cat([a, b], 2) for a, b in zip(state.values, values)]
        state.length += p
        state.last = features[:, -1]

    def _blocks(self, state: SpecBlockState, condition: Tensor, tokens: Tensor, offset: Tensor,
                path: tuple[list[Tensor], list[Tensor]], visible: Tensor) -> BlockRows:
        """C blocks on the committed cache: block c under ``condition[c]`` (H-wide) on token ``tokens[c]`` (a target
        id) at position length + offset[c], after its ``path`` entries (per layer (C, kv_heads, J, D)) of which it
        sees ``visible`` (C, J). A slot k sees the committed slots <= k, the visible path entries, its slots <= k."""
        c, k = tokens.shape[0], self.slots
        dev = tokens.device
        slot = torch.arange(k, device=dev)
        pos = state.length + offset[:, None] + 1 + slot  # (C, K)
        committed = (slot.repeat(state.length)[None] <= slot[:, None]).expand(c, k, -1)  # (C, K, LK)
        own = (slot[None] <= slot[:, None]).expand(c, k, k)  # (C, K, K)
        mask = torch.cat([committed, visible[:, None].expand(c, k, -1), own], -1)  # (C, K, LK + J + K)
        cache = tuple([torch.cat([x.expand(c, -1, -1, -1), y], 2) for x, y in zip(mine, theirs)]
                      for mine, theirs in ((state.keys, path[0]), (state.values, path[1])))
        hidden, normed, keys, values = self.run(self.fused(condition[:, None], tokens[:, None]), pos, mask, cache)
        return BlockRows(normed=normed[:, 0], hidden=hidden[:, 0], visible=visible, offset=offset,
                         keys=[torch.cat([x, y], 2) for x, y in zip(path[0], keys)],
                         values=[torch.cat([x, y], 2) for x, y in zip(path[1], values)])

    @torch.no_grad()
    def first_block(self, state: SpecBlockState, anchor: Tensor) -> BlockRows:
        """Block 1 of the anchor x_n at position n = ``state.length``, one row."""
        token = anchor.reshape(1).to(self.fuse.weight.device)
        layer = self.layers[0]
        none = state.keys[0].new_zeros(1, layer.kv_heads, 0, layer.head_dim)
        condition = self.condition_proj(state.last.to(self.fuse.weight.dtype))  # (1, H)
        return self._blocks(state, condition, token, torch.zeros_like(token),
                            ([none] * self.num_layers, [none] * self.num_layers),
                            torch.zeros(1, 0, dtype=torch.bool, device=token.device))

    @torch.no_grad()
    def next_blocks(self, state: SpecBlockState, rows: BlockRows, which: Tensor, slots: Tensor,
                    tokens: Tensor) -> BlockRows:
        """Blocks that continue ``rows``: block c starts after slot ``slots[c]`` of row ``which[c]``, conditioned on
        that slot's state, on the token ``tokens[c]`` (a target id) drafted there; it sees the row's path and the
        row's slots <= slots[c]."""
        dev = rows.hidden.device
        which, slots, tokens = which.to(dev), slots.to(dev), tokens.to(dev)
        before = torch.arange(self.slots, device=dev) <= slots[:, None]  # (C, K)
        return self._blocks(state, rows.hidden[which, slots], tokens, rows.offset[which] + slots + 1,
                            ([x[which] for x in rows.keys], [x[which] for x in rows.values]),
                            torch.cat([rows.visible[which], before], 1))

    @torch.no_grad()
    def propose(self, state: SpecBlockState, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """The chain of blocks 1..B, B x K slots: each block's slots drawn at once (no slot of a block reads another's
        drafted token), block b + 1 started on the token drafted at block b's last slot."""
        rows = self.first_block(state, anchor)
        last = torch.tensor([self.slots - 1])
        tokens, probs = [], []
        for b in range(self.blocks):
            if b:
                rows = self.next_blocks(state, rows, torch.zeros_like(last), last, tokens[-1][-1:])
            logits = self.head(rows.normed[0])  # (K, Vd)
            if sampling.greedy:
                tokens.append(self.vocab.to_target(logits.argmax(-1)))
            else:
                q = sampling.probs(logits)  # (K, Vd)
                tokens.append(self.vocab.to_target(sampling.sample(q, generator)))
                probs.append(self.vocab.scatter(q))
        proposal = ChainProposal(tokens=torch.cat(tokens), probs=torch.cat(probs) if probs else None)
        self.adopt(state, anchor, proposal)
        return proposal

    def adopt(self, state: SpecBlockState, anchor: Tensor, proposal: ChainProposal | TreeProposal) -> None:
        """The round's node tokens (the anchor, then the drafts): ``extend`` embeds the committed ones."""
        state.nodes = [anchor.reshape(1), *proposal.tokens.reshape(-1, 1)]

    @torch.no_grad()
    def propose_tree(
        self, state: SpecBlockState, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig, generator=None
    ) -> TreeProposal:
        """SpecBlock's tree after ``anchor`` by block expansion (``block_tree``; B = 1: ``rank_tree``): at most
        ``tree.nodes`` draft nodes, depth ``tree.depth`` (None: ``block_size``), ``tree.top_k`` blocks started per
        level. Nodes are chosen, not drawn (``probs`` None): the deterministic candidate rule verifies them
        losslessly."""

        def drafted(rows: BlockRows) -> tuple[Tensor, Tensor, BlockRows]:
            logits = self.head(rows.normed)  # (C, K, Vd)
            classes = self.rank_logits(rows.normed, logits).argmax(-1)  # (C, K)
            return tree_probs(logits, sampling), classes, rows

        def expand(rows: BlockRows, which: Tensor, slots: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, BlockRows]:
            return drafted(self.next_blocks(state, rows, which, slots, self.vocab.to_target(tokens)))

        depth = min(tree.depth or self.block_size, self.block_size)
        index, parents = block_tree(lambda: drafted(self.first_block(state, anchor)), expand, self.blocks, depth,
                                    tree.nodes, tree.top_k)
        device = anchor.device
        proposal = TreeProposal(tokens=self.vocab.to_target(index.to(device)), parents=parents.to(device))
        self.adopt(state, anchor, proposal)
        return proposal


    @torch.no_grad()
    def extend(self, state: SpecBlockState, features: Tensor, path: list[int]) -> None:
        """The committed nodes (the anchor and the accepted drafts) become committed blocks built from their true
        features (1, T, F) at the committed node indices ``path``; later blocks' drafts never enter the cache."""
        ids = torch.cat([state.nodes[i] for i in path]).to(self.fuse.weight.device)[None]  # (1, P)
        self._commit(state, ids, features[:, path])
        state.nodes = []
