"""SpecBlock's rank head and the draft trees it sizes (Shi et al. 2026, "SpecBlock", arXiv 2605.07243): the 15
statistics of a draft distribution the head reads, the rank-bucket labels it is trained on (``objectives.RankOrdinal``),
and the trees grown from its classes: ``rank_tree`` within one block, ``block_tree`` by block expansion. Kept apart
from ``specblock.py`` (the drafter's layers, training forward and decoding state), which calls into it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
@dataclass
class NodeList:
    """A draft tree being grown: node 0 is the anchor; per node its draft index, parent, value (the product of q
    along its root path, EAGLE-2's) and depth."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    values: list[float] = field(default_factory=lambda: [1.0])
    depths: list[int] = field(default_factory=lambda: [0])

    def key(self, i: int) -> tuple[float, int, int]:
        """The order the node budget keeps nodes in: by value, ties to the shallower, then to the earlier."""
        return -self.values[i], self.depths[i], i

    def grow(self, q: Tensor, classes: Tensor, root: int, nodes: int) -> list[int]:
        """SpecBlock's rank-sized widths under ``root`` over one block's distributions ``q`` (D, V) and rank classes
        ``classes`` (D,): depth d below the root holds the top-``TREE_WIDTHS[classes[d]]`` tokens of q_d under every
        node of depth d - 1 (class 3: the branch ends before depth d). Each depth is cut to its ``nodes`` best
        before growing on, which changes nothing: a node outside them has ``nodes`` better ones before it, as do its
        descendants. Returns the nodes of depth D (none when the branch ended earlier)."""
        frontier = [root]
        for d in range(q.shape[0]):
            width = min(TREE_WIDTHS[int(classes[d])], q.shape[1])
            if width == 0 or not frontier:
                return []
            top_p, top_i = q[d].double().topk(width)
            offered = []
            for parent in frontier:
                for p, t in zip(top_p.tolist(), top_i.tolist()):
                    if p <= 0:  # outside the sampling support: never accepted, not worth verifying
                        continue
                    self.tokens.append(t)
                    self.parents.append(parent)
                    self.values.append(self.values[parent] * p)
                    self.depths.append(self.depths[parent] + 1)
                    offered.append(len(self.tokens) - 1)
            frontier = sorted(offered, key=lambda i: (-self.values[i], i))[:nodes]  # the only ones that can count
        return frontier

    def best(self, nodes: int) -> tuple[Tensor, Tensor]:
        """The ``nodes`` most valuable draft nodes, which holds every kept node's parent, in the order they were
        grown (parents first): draft indices (T,) and parents (T,) (0 = the anchor)."""
        kept = sorted(sorted(range(1, len(self.tokens)), key=self.key)[:nodes])
        index = {node: i + 1 for i, node in enumerate(kept)}
        index[0] = 0
        return (torch.tensor([self.tokens[i] for i in kept], dtype=torch.long),
                torch.tensor([index[self.parents[i]] for i in kept], dtype=torch.long))


def rank_tree(q: Tensor, classes: Tensor, nodes: int) -> tuple[Tensor, Tensor]:
    """SpecBlock's tree of one block: per-depth draft distributions ``q`` (D, V), per-depth rank classes ``classes``
    (D,) (``NodeList.grow`` under the anchor), the ``nodes`` most valuable nodes kept. Returns draft indices (T,)
    and parents (T,) (0 = the anchor, parents before children)."""
    tree = NodeList()
    tree.grow(q, classes, 0, nodes)
    return tree.best(nodes)


Blocks = Callable[..., tuple[Tensor, Tensor, Any]]  # -> (q (C, K, V), classes (C, K), the drafter's rows)


def block_tree(first: Blocks, expand: Blocks, blocks: int, depth: int, nodes: int, top_k: int) -> tuple[Tensor, Tensor]:
    """SpecBlock's tree by block expansion. ``first()`` drafts block 1 after the anchor: its distributions q (1, K, V),
    rank classes (1, K) and the drafter's rows. ``expand(rows, which, slots, tokens)`` starts one block per start
    node: the block after slot ``slots[c]`` of row ``which[c]`` of ``rows``, on the draft index ``tokens[c]`` drafted
    there; it returns the new blocks' q (C, K, V), classes (C, K) and rows.

    Level by level (at most ``blocks`` levels): under its start node every block grows its rank-sized widths
    (``NodeList.grow``) up to its first slot whose class is not 0 (where the rank head is unsure: that slot branches,
    or ends the branch) or to its end; the nodes of that slot are the candidate starts of the next level, of which
    the ``top_k`` most valuable that the node budget can still keep are expanded. The last level's blocks grow all
    their slots. Nothing is deeper than ``depth``. The ``nodes`` most valuable nodes are kept (``NodeList.best``).
    Returns draft indices (T,) and parents (T,) (0 = the anchor, parents before children)."""
    tree = NodeList()
    q, classes, rows = first()
    starts = [0]  # the node each row's block hangs under
    k = q.shape[1]
    for level in range(blocks):
        last = level == blocks - 1
        candidates = []  # (node, row, slot): the next level's possible starts
        for row, start in enumerate(starts):
            unsure = (classes[row] != 0).nonzero()
            stop = k if last or not len(unsure) else int(unsure[0]) + 1  # slots this block grows
            room = depth - tree.depths[start]
            ends = tree.grow(q[row, : min(stop, room)], classes[row, : min(stop, room)], start, nodes)
            if not last and stop < room:  # the ends may start blocks: none of them is at the depth limit
                candidates += [(node, row, stop - 1) for node in ends]
        # a start that ``nodes`` nodes come before cannot be kept, nor can its block (values do not grow along a
        # path, and a tie goes to the shallower): no block is drafted for it
        order = sorted(tree.key(i) for i in range(1, len(tree.tokens)))
        candidates = sorted(candidates, key=lambda c: tree.key(c[0]))
        candidates = [c for c in candidates if bisect.bisect_left(order, tree.key(c[0])) < nodes][:top_k]
        if not candidates:
            break
        which, slots = torch.tensor([c[1] for c in candidates]), torch.tensor([c[2] for c in candidates])
        q, classes, rows = expand(rows, which, slots, torch.tensor([tree.tokens[c[0]] for c in candidates]))
        starts = [c[0] for c in candidates]
    return tree.best(nodes)
