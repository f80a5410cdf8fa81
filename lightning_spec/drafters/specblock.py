"""SpecBlockDrafter: K query slots per position, a layer-wise slot shift, and a rank head that sizes a draft tree
(Shi et al. 2026, "SpecBlock", arXiv 2605.07243; code shiweijiezero/SpecBlock).

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
   argmax in q_k. Its loss is ``objectives.RankOrdinal``.
6. Decoding. A round anchored at n (the committed token whose own target feature does not exist yet) is the
   block at position n: it needs g_{n-1} and x_n only, both committed. The committed positions' blocks are built
   from the target's true features and kept as a KV cache (all K slots of every committed position, as training
   sees them). A chain proposes the K slots (argmax, or each slot sampled from its q_k); a tree grows from the
   same K distributions with per-depth widths from the rank head (``rank_tree``).

Choices where the paper leaves room (tested in tests/test_drafter_specblock.py):
- Block TTT is not implemented: training runs block 1 only (every slot conditioned on the target feature),
  which is exactly what ``propose`` draws from. The paper's blocks 2..3 start at slot M of the previous block from
  its draft hidden state; decoding here never continues a block, so those blocks would train slots that are never
  drafted (the contract: the training forward returns every slot ``propose`` draws from, nothing else).
- Which (feature, token) pair a position holds: SpecForge's EAGLE-3 lineage pairs the target state at i with the
  token x_{i+1}; indexing by the token, that is (g_{i-1}, x_i) here, which makes the anchor's block computable.
- Every position is a block in one forward (one masked attention over all of them), so the training forward costs S x K
  tokens per sequence whatever ``num_anchors`` is; ``num_anchors`` only picks which blocks the loss reads.
- W_l starts as [I, 0] (the shift adds nothing at initialisation), so an untrained stack is a plain one.
- Rank features: log-probs at T = 1, clamped at -30 (and padded with -30 when Vd < 20); the entropy is that of the
  top-20 probabilities renormalised; the label's reference token is the target's argmax over the draft vocabulary.
- Tree widths: the class of slot d gives the width of depth d (class 0 -> 1 child per node, 1 -> 4, 2 -> 10,
  3 -> the tree stops before depth d). Within one block slot d's distribution and class are the same for every
  node at depth d (no slot reads a drafted token), so "per node" widths are per depth here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.decoding.trees import tree_probs
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab
from lightning_spec.drafters.block import DraftLayer, RMSNorm, TargetShape, init_weights
from lightning_spec.drafters.eagle3 import default_target_layers
from lightning_spec.sampling import SamplingConfig

RANK_BUCKETS = (1, 4, 10)  # rank <= 1 -> class 0, <= 4 -> 1, <= 10 -> 2, else 3
TREE_WIDTHS = (1, 4, 10, 0)  # children per node for rank classes 0..3 (0: stop the branch)
RANK_FEATURES = 15
LOGP_FLOOR = -30.0


# ------------------------------------------------------------------------------------------------ rank head
def rank_features(logits: Tensor) -> Tensor:
    """The 15 statistics of a draft distribution that the rank head reads: (..., Vd) -> (..., 15) =
    [top-10 log-probs, top1-top2, top1-top3, top1-top5 (log-prob gaps), top-1 prob, entropy of the top-20]."""
    logp = logits.float().log_softmax(-1).clamp(min=LOGP_FLOOR)
    top = logp.topk(min(20, logp.shape[-1]), dim=-1).values  # (..., <=20) best first
    top = F.pad(top, (0, 20 - top.shape[-1]), value=LOGP_FLOOR)  # (..., 20) a small vocabulary padded
    gaps = top[..., :1] - top[..., [1, 2, 4]]  # (..., 3)
    p20 = top.exp() / top.exp().sum(-1, keepdim=True)  # (..., 20) the top-20 renormalised
    entropy = -(p20 * p20.log()).sum(-1, keepdim=True)  # (..., 1)
    return torch.cat([top[..., :10], gaps, top[..., :1].exp(), entropy], -1)  # (..., 15)


def rank_labels(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """The bucket (0..3) of the rank of the target's argmax in the draft distribution: rank 1 -> 0, 2-4 -> 1,
    5-10 -> 2, > 10 -> 3. (..., Vd), (..., Vd) -> (...,) long."""
    star = target_logits.argmax(-1, keepdim=True)  # (..., 1)
    rank = 1 + (draft_logits > draft_logits.gather(-1, star)).sum(-1)  # (...,) 1 = the draft's top-1
    return torch.bucketize(rank, torch.tensor(RANK_BUCKETS, device=rank.device))  # (...,)


class RankHead(nn.Module):
    """MLP (H + 15) -> 256 -> 4 over [detached normed state ; rank_features(draft logits)]: class logits."""

    def __init__(self, hidden: int, width: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(hidden + RANK_FEATURES, width)
        self.out = nn.Linear(width, len(TREE_WIDTHS))

    def forward(self, hidden: Tensor, logits: Tensor) -> Tensor:
        # detached: the rank head reads the drafter, it does not train it (its loss never shapes q)
        x = torch.cat([hidden.detach().float(), rank_features(logits.detach())], -1)  # (..., H + 15)
        return self.out(F.silu(self.up(x.to(self.up.weight.dtype))))  # (..., 4)


# ------------------------------------------------------------------------------------------------ the tree
def rank_tree(q: Tensor, classes: Tensor, nodes: int) -> tuple[Tensor, Tensor]:
    """SpecBlock's tree over per-depth draft distributions ``q`` (D, V) with per-depth rank classes ``classes``
    (D,): depth d's nodes are the top-``TREE_WIDTHS[classes[d]]`` tokens of q_d under every node of depth d - 1
    (class 3: the tree ends before depth d). A node's value is the product of q along its path (EAGLE-2's); the
    ``nodes`` most valuable nodes are kept (ties to the shallower, then to the earlier), which keeps every kept
    node's parent (values do not grow along a path). Each depth is cut to its ``nodes`` best before growing on, which
    changes nothing: a node outside its depth's best ``nodes`` has ``nodes`` better ones before it, as do its
    descendants. Returns draft indices (T,) and parents (T,) (0 = the anchor, parents before children)."""
    tokens, parents, values, depths = [-1], [-1], [1.0], [0]  # node 0: the anchor
    frontier = [0]
    for d in range(q.shape[0]):
        width = min(TREE_WIDTHS[int(classes[d])], q.shape[1])
        if width == 0 or not frontier:
            break
        top_p, top_i = q[d].double().topk(width)
        offered = []
        for parent in frontier:
            for p, t in zip(top_p.tolist(), top_i.tolist()):
                if p <= 0:  # outside the sampling support: never accepted, not worth verifying
                    continue
                tokens.append(t)
                parents.append(parent)
                values.append(values[parent] * p)
                depths.append(d + 1)
                offered.append(len(tokens) - 1)
        frontier = sorted(offered, key=lambda i: (-values[i], i))[:nodes]  # the only ones whose children can count
    kept = sorted(sorted(range(1, len(tokens)), key=lambda i: (-values[i], depths[i], i))[:nodes])
    index = {node: i + 1 for i, node in enumerate(kept)}
    index[0] = 0
    return (torch.tensor([tokens[i] for i in kept], dtype=torch.long),
            torch.tensor([index[parents[i]] for i in kept], dtype=torch.long))


# ---------------------------------------------------------------------------------------------------- state
@dataclass
class SpecBlockState:
    """Decoding state: per layer the keys/values of every slot of the committed positions 0..length-1."""

    keys: list[Tensor]  # per layer (1, kv_heads, length * K, D)
    values: list[Tensor]
    length: int  # committed positions with a block; the next anchor sits at ``length``
    last: Tensor  # (1, F) the target features of position length - 1 (zeros when length == 0)
    nodes: list[Tensor] = field(default_factory=list)  # this round's tokens: the anchor, then the drafts, (1,) each


class SpecBlockDrafter(Drafter):
    """SpecBlock: K learned query slots per position over fused target features, a layer-wise slot shift, the
    target's frozen head, and a rank head whose classes size the draft tree.

    Args:
        block_size: K, query slots per position = draft proposals per round (the paper: 4 for Qwen3-8B).
        num_layers: draft decoder layers (the paper: 2).
        target_layers: 0-indexed target layers fused by ``condition_proj``. Default EAGLE-3's low / middle / high
            layers, [1, L/2 - 1, L - 4] (the paper's 3H feature).
        num_anchors: blocks per training sequence the loss reads (every position's block is computed anyway).
        draft_vocab_size: restrict the LM head to the most frequent target tokens (None = the full vocabulary;
            the paper: 32k).
        intermediate_size: MLP width; default the target's.
        rank_width: the rank head's hidden width (the paper: 256).
    """

    def __init__(
        self,
        block_size: int = 4,
        num_layers: int = 2,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        rank_width: int = 256,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("num_layers", num_layers), ("num_anchors", num_anchors),
                            ("rank_width", rank_width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter.{name} must be an int >= 1, got {value!r}.")
        self.block_size = block_size
        self.num_layers = num_layers
        self.target_layers = list(target_layers) if target_layers is not None else []
        self.num_anchors = num_anchors
        self.draft_vocab_size = draft_vocab_size
        self.intermediate_size = intermediate_size
        self.rank_width = rank_width
        self.vocab = DraftVocab(draft_vocab_size)
        self.built = False

    # ------------------------------------------------------------------------------------------- building
    def bind(self, target: Any) -> None:
        super().bind(target)
        if not self.target_layers:
            self.target_layers = default_target_layers(target.num_layers)
        target.check_layers(self.target_layers)
        if self.built:
            return
        shape = TargetShape.of(target, self.intermediate_size)
        hidden, self.rope_theta = shape.hidden, shape.rope_theta
        self.condition_proj = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.condition_norm = RMSNorm(hidden, shape.eps)
        self.embed_norm = RMSNorm(hidden, shape.eps)
        self.query_norm = RMSNorm(hidden, shape.eps)
        self.query = nn.Parameter(torch.zeros(self.block_size, hidden))  # (K, H) query_k
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(DraftLayer(shape) for _ in range(self.num_layers))
        self.shifts = nn.ModuleList(nn.Linear(2 * hidden, hidden, bias=False) for _ in range(self.num_layers - 1))
        self.norm = RMSNorm(hidden, shape.eps)
        self.rank_head = RankHead(hidden, self.rank_width)
        self.vocab.build(target.vocab_size)
        init_weights(self, self.num_layers, target, [self.norm])
        with torch.no_grad():
            nn.init.normal_(self.query, std=0.02)  # distinct per slot; RMSNorm makes the scale irrelevant
            nn.init.zeros_(self.rank_head.up.bias)
            nn.init.zeros_(self.rank_head.out.bias)
            for w in self.shifts:  # W_l = [I, 0]: no shift at initialisation
                w.weight.zero_()
                w.weight[:, :hidden].copy_(torch.eye(hidden))
        self.to(target.device)
        self.built = True

    # -------------------------------------------------------------------------------------------- the stack
    def inputs(self, features_before: Tensor, tokens: Tensor) -> Tensor:
        """Blocks of positions holding ``tokens`` (N, P) whose previous position's target features are
        ``features_before`` (N, P, F): the fused slot inputs (N, P, K, H)."""
        dtype = self.fuse.weight.dtype
        cond = self.condition_norm(self.condition_proj(features_before.to(dtype)))  # (N, P, H)
        emb = self.embed_norm(self.target.embed_tokens(tokens).to(dtype))  # (N, P, H)
        query = self.query_norm(self.query)  # (K, H)
        n, p, h = cond.shape
        k = self.block_size
        parts = [cond[:, :, None].expand(n, p, k, h), emb[:, :, None].expand(n, p, k, h), query.expand(n, p, k, h)]
        return self.fuse(torch.cat(parts, -1))  # (N, P, K, H)

    def shift(self, i: int, h: Tensor) -> Tensor:
        """h <- W_i [h ; shift(h)] on (N, P, K, H): slot k also reads slot k - 1's state (slot 0 its own)."""
        shifted = torch.cat([h[:, :, :1], h[:, :, :-1]], dim=2)  # (N, P, K, H)
        return self.shifts[i - 1](torch.cat([h, shifted], -1))

    def stack(
        self, h: Tensor, first: int | Tensor, cache: tuple[list[Tensor], list[Tensor]] | None = None
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The draft layers over blocks ``h`` (N, P, K, H) of consecutive positions first..first+P-1 (``first`` an
        int or (N,)), after ``cache`` (per layer keys/values (N, kv_heads, C * K, D) of every slot of the C
        positions before, in (position, slot) order, or None). Slot k of position i sees slot k' of position j iff
        j <= i and k' <= k. Returns the final normed states (N, P, K, H) and each layer's keys and values of the new
        entries (N, kv_heads, P * K, D)."""
        n, p, k, _ = h.shape
        dev = h.device
        first = torch.as_tensor(first, device=dev).reshape(-1, 1)  # (N or 1, 1)
        slot_pos = torch.arange(p, device=dev)[:, None] + 1 + torch.arange(k, device=dev)  # (P, K)
        pos = (first + slot_pos.reshape(1, -1)).expand(n, -1)  # (N, PK) i + 1 + k
        t = p * k
        position = torch.arange(p, device=dev).repeat_interleave(k)  # (PK,) each entry's position in the blocks
        slot = torch.arange(k, device=dev).repeat(p)  # (PK,) each entry's slot
        own = (position[None] <= position[:, None]) & (slot[None] <= slot[:, None])  # (PK, PK) query x key
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
            mask = own
            if cache is not None and cache[0][i].shape[2]:
                kk, vv = torch.cat([cache[0][i], kk], 2), torch.cat([cache[1][i], vv], 2)
                cache_slot = torch.arange(k, device=dev).repeat(cache[0][i].shape[2] // k)  # (CK,)
                mask = torch.cat([cache_slot[None] <= slot[:, None], own], 1)  # (PK, CK + PK) earlier positions
            r = layer.heads // layer.kv_heads
            attn = F.scaled_dot_product_attention(
                q, kk.repeat_interleave(r, dim=1), vv.repeat_interleave(r, dim=1), attn_mask=mask
            )  # (N, Hq, PK, D)
            h = layer.finish(flat, attn).view(n, p, k, -1)
        return self.norm(h), keys, values

    def rank_logits(self, hidden: Tensor, logits: Tensor) -> Tensor:
        """Rank-class logits (..., 4) from normed states (..., H) and their draft logits (..., Vd)."""
        return self.rank_head(hidden, logits)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Every position's block in one causal pass, read at the anchors. batch: input_ids (N, S), loss_mask
        (N, S); features (N, S, F) of ``target_layers``. Slot t = k + 1 of anchor n predicts x_{n+t}: the block
        ``propose`` drafts at n, given the committed positions before it."""
        ids = batch["input_ids"]
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        before = F.pad(features, (0, 0, 1, 0))[:, :-1]  # (N, S, F): g_{i-1}, zeros at i = 0
        hidden, _, _ = self.stack(self.inputs(before, ids), 0)  # (N, S, K, H)
        index = anchors.positions[..., None, None].expand(-1, -1, *hidden.shape[2:])  # (N, A, K, H)
        hidden = hidden.gather(1, index)  # (N, A, K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=hidden,
                           head=self._slot_logits, aux={"rank": self._rank_aux})

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
        _, keys, values = self.stack(self.inputs(before, ids), state.length, (state.keys, state.values))
        state.keys = [torch.cat([a, b], 2) for a, b in zip(state.keys, keys)]
        state.values = [torch.cat([a, b], 2) for a, b in zip(state.values, values)]
        state.length += p
        state.last = features[:, -1]

    @torch.no_grad()
    def block(self, state: SpecBlockState, anchor: Tensor) -> Tensor:
        """The anchor's block on the committed cache: normed states (K, H) of its slots."""
        token = anchor.reshape(1, 1).to(self.fuse.weight.device)
        hidden, _, _ = self.stack(self.inputs(state.last[:, None], token), state.length, (state.keys, state.values))
        return hidden[0, 0]  # (K, H)

    @torch.no_grad()
    def propose(self, state: SpecBlockState, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """The K slots of the anchor's block as a chain (no slot reads another's drafted token)."""
        logits = self.head(self.block(state, anchor))  # (K, Vd)
        if sampling.greedy:
            proposal = ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        else:
            q = sampling.probs(logits)  # (K, Vd)
            proposal = ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)),
                                     probs=self.vocab.scatter(q))
        self._remember(state, anchor, proposal.tokens)
        return proposal

    @staticmethod
    def _remember(state: SpecBlockState, anchor: Tensor, tokens: Tensor) -> None:
        """The round's node tokens (the anchor, then the drafts): ``extend`` embeds the committed ones."""
        state.nodes = [anchor.reshape(1), *tokens.reshape(-1, 1)]

    @torch.no_grad()
    def propose_tree(
        self, state: SpecBlockState, anchor: Tensor, sampling: SamplingConfig, tree: Any, generator=None
    ) -> TreeProposal:
        """SpecBlock's rank-sized tree after ``anchor`` (``rank_tree``): at most ``tree.nodes`` draft nodes,
        depth ``tree.depth`` (None: K); ``tree.top_k`` is not used (the rank head sets each depth's width). Nodes
        are chosen, not drawn (``probs`` None): the deterministic candidate rule verifies them losslessly."""
        hidden = self.block(state, anchor)  # (K, H)
        logits = self.head(hidden)  # (K, Vd)
        classes = self.rank_logits(hidden, logits).argmax(-1)  # (K,)
        q = tree_probs(logits, sampling)  # (K, Vd)
        depth = min(tree.depth or self.block_size, self.block_size)
        index, parents = rank_tree(q[:depth], classes[:depth], tree.nodes)
        device = anchor.device
        proposal = TreeProposal(tokens=self.vocab.to_target(index.to(device)), parents=parents.to(device))
        self._remember(state, anchor, proposal.tokens)
        return proposal

    def check_tree(self, offline: bool = False) -> None:
        if offline:
            raise ValueError(
                f"{type(self).__name__}'s tree takes its widths from the rank head at every round, which the offline "
                "evaluator does not score; measure it with real decoding (evaluate --mode online)."
            )

    @torch.no_grad()
    def extend(self, state: SpecBlockState, features: Tensor, path: list[int]) -> None:
        """The committed nodes (the anchor and the accepted drafts) become committed blocks built from their true
        features (1, T, F) at the committed node indices ``path``."""
        ids = torch.cat([state.nodes[i] for i in path]).to(self.fuse.weight.device)[None]  # (1, P)
        self._commit(state, ids, features[:, path])
        state.nodes = []
