"""Tree builders: which draft tokens a round verifies when it verifies a tree instead of a chain.

On a CPU a target forward over 9 or 17 query tokens costs little more than over 2 (``benchmarks/README.md``), while
a chain's later slots are rarely reached: spending the same verify width on alternatives for the first slots
commits more tokens per forward. ``generate(..., plan=TreeConfig(...))`` asks the drafter for a ``TreeProposal``
(``Drafter.propose_tree``); a chain plan (the default) keeps the chain.

Two builders, by what the drafter can give in one call:

Best-first top-k tree (``best_first_tree``, for drafters whose slots do not read each other's tokens: DFlash's
block, Medusa's heads): one drafter call gives a distribution q_d per depth d = 1..D. A node's value is the product
of q along its root path (the chance that a draft sampled from q would follow it; EAGLE-2's value, Li et al. 2024,
arXiv 2406.16858, §4); the tree grows by always adding the most valuable node not yet in it among the top-k children
of the nodes in it, until it holds ``nodes`` draft nodes. Values fall along a path, so a node's parent is always
added before it. The tree is a function of q alone, not drawn from it: under sampling its children are verified with
the deterministic candidate rule (``verify.candidate_rule`` with q None), which is lossless for any such tree.

Dynamic tree (``dynamic_tree``, for autoregressive drafters: EAGLE-3, MTP): EAGLE-2's expansion and rerank, one
drafter call per depth over the k nodes expanded there. Its nodes are chosen from q as well (top-k), so the same
rule verifies it. Offline scoring needs the drafter's distributions off the output's path, which a teacher-forced
forward does not give: under greedy decoding the offline evaluator replays each round's tree with the drafter
(``decoding.exact.replay_tree_rounds``); under sampling it refuses and points to real decoding.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig


@dataclass(frozen=True)
class TreeConfig:
    """How a round's draft tree is built.

    Args:
        nodes: draft nodes verified per round (the anchor comes on top): the verify forward runs nodes + 1 tokens.
        top_k: children considered per node (the k of the top-k).
        depth: the deepest slot used; None: the drafter's ``block_size``.
        ngram: up to this many of the ``nodes`` go to n-gram candidates (prompt-and-output lookup, up to ``top_k``
            continuations of up to ``ngram`` tokens) merged into the drafter's tree (``decoding/ngram.py``); 0: none.
        stop_below: a node joins the tree only while its value (the product of the draft probabilities along its
            root path, the chance a draft from q follows it) is at least this; the tree then stops growing, and a
            dynamic tree runs no drafter step past its last such depth. 0: every node up to ``nodes``. With
            ``top_k: 1`` it is a chain that stops when the drafter's running confidence falls below it.
    """

    nodes: int = 16
    top_k: int = 4
    depth: int | None = None
    ngram: int = 0
    stop_below: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"tree.{name} must be an int >= 1, got {value!r}.")
        if self.depth is not None and (isinstance(self.depth, bool) or not isinstance(self.depth, int)
                                       or self.depth < 1):
            raise UserError(f"tree.depth must be an int >= 1 or None (the drafter's block_size), got {self.depth!r}.")
        if isinstance(self.ngram, bool) or not isinstance(self.ngram, int) or not 0 <= self.ngram <= self.nodes:
            raise UserError(f"tree.ngram must be an int in 0..tree.nodes ({self.nodes}), got {self.ngram!r}.")
        if isinstance(self.stop_below, bool) or not isinstance(self.stop_below, (int, float)) \
                or not 0 <= self.stop_below < 1:
            raise UserError(f"tree.stop_below must be a number in [0, 1) (a path value: a product of draft "
                            f"probabilities), got {self.stop_below!r}.")

    @classmethod
    def coerce(cls, value: TreeConfig | dict | None) -> TreeConfig | None:
        """A ``TreeConfig``, a dict of its fields (YAML), or None (chain decoding)."""
        if value is None or isinstance(value, TreeConfig):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"nodes", "top_k", "depth", "ngram", "stop_below"}
            if unknown:
                raise UserError(f"tree has no field {sorted(unknown)[0]!r}; its fields are nodes, top_k, depth, "
                                "ngram and stop_below.")
            return cls(**value)
        raise UserError(f"tree must be a TreeConfig, a dict of its fields or None, got {type(value).__name__}.")


def tree_probs(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """The draft distributions (..., V) a tree is chosen from: ``sampling.probs`` of the draft logits, and under
    greedy decoding their plain softmax (greedy's one-hot would leave nothing to rank the top-k by). One rule for
    every builder and for the offline scorer, so offline and real trees are the same trees."""
    return logits.softmax(-1) if sampling.greedy else sampling.probs(logits)


def best_first_tree(q: Tensor, config: TreeConfig) -> tuple[Tensor, Tensor]:
    """The best-first top-k tree over per-depth distributions ``q`` (D, V) (rows need not be normalised the same
    way: only the order of values matters). Returns the draft nodes' token indices into V (T,) and their parents
    (T,) (0 = the anchor, node i = the i-th added), T = min(config.nodes, what D and top_k allow), fewer where the
    next node's value falls below ``config.stop_below`` (the most valuable left: the tree stops there)."""
    depth = min(q.shape[0], config.depth or q.shape[0])
    k = min(config.top_k, q.shape[1])
    top_p, top_i = q[:depth].double().topk(k, dim=-1)  # (D, k) each depth's k best tokens, best first
    top_p, top_i = top_p.tolist(), top_i.tolist()
    # frontier entries: (-value, order, parent node, depth of the child, rank among the parent's candidates)
    frontier = [(-top_p[0][0], 0, 0, 0, 0)]
    tokens: list[int] = []
    parents: list[int] = []
    values = [1.0]  # per node, the anchor's value 1
    order = 1
    while frontier and len(tokens) < config.nodes and -frontier[0][0] >= config.stop_below:
        neg, _, parent, d, rank = heapq.heappop(frontier)
        tokens.append(top_i[d][rank])
        parents.append(parent)
        values.append(-neg)
        node = len(tokens)
        if rank + 1 < k:  # the parent's next-best candidate
            heapq.heappush(frontier, (-values[parent] * top_p[d][rank + 1], order, parent, d, rank + 1))
            order += 1
        if d + 1 < depth:  # this node's best child
            heapq.heappush(frontier, (-values[node] * top_p[d + 1][0], order, node, d + 1, 0))
            order += 1
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def dynamic_tree(
    start: Callable[[], tuple[Any, Tensor]],
    step: Callable[[Any, Tensor, Tensor], tuple[Any, Tensor]],
    depth: int,
    config: TreeConfig,
) -> tuple[Tensor, Tensor]:
    """EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858, §4) for drafters whose slots read the tokens drafted
    before them (EAGLE-3, MTP): grown depth by depth, then reranked.

    ``start()`` runs slot 1 after the anchor and returns the drafter's chain state over one row and the row's draft
    distribution (1, V). ``step(chain, rows, tokens)`` continues the chain rows ``rows`` (A,) by the draft indices
    ``tokens`` (A,) (one slot each) and returns the new chain over A rows and their distributions (A, V).

    Expansion: at every depth each expanded node offers its top-k tokens as children, valued at the parent's value
    times their probability; the k most valuable children of the depth are expanded next (one ``step`` call for all
    of them). Rerank: the ``nodes`` most valuable nodes of everything offered (ties to the shallower), which holds
    every kept node's parent (values do not grow along a path). Nodes valued below ``config.stop_below`` are neither
    kept nor expanded, and the growth stops at the first depth with none to expand. Returns draft indices (T,) and
    parents (T,) in the order of ``best_first_tree``'s result (parents first; 0 = the anchor)."""
    k = config.top_k
    chain, q = start()  # q (1, V)
    tokens, parents, values, depths = [-1], [-1], [1.0], [0]  # node 0: the anchor
    rows = [0]  # the node each chain row continues
    for d in range(1, depth + 1):
        top_p, top_i = q.double().topk(min(k, q.shape[-1]), dim=-1)  # (A, k)
        offered = []
        for row, parent in enumerate(rows):
            for p, t in zip(top_p[row].tolist(), top_i[row].tolist()):
                tokens.append(t)
                parents.append(parent)
                values.append(values[parent] * p)
                depths.append(d)
                offered.append(len(tokens) - 1)
        # below the threshold a node is never kept, nor is anything under it: no drafter step for it
        expand = [i for i in sorted(offered, key=lambda i: (-values[i], i))[:k] if values[i] >= config.stop_below]
        if d == depth or not expand:
            break
        chain, q = step(chain, torch.tensor([rows.index(parents[i]) for i in expand]),
                        torch.tensor([tokens[i] for i in expand]))
        rows = expand
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-values[i], depths[i], i))
    kept = sorted([i for i in ranked if values[i] >= config.stop_below][: config.nodes])
    index = {node: i + 1 for i, node in enumerate(kept)}  # node id -> position in the proposal (0: the anchor)
    index[0] = 0
    return (torch.tensor([tokens[i] for i in kept], dtype=torch.long),
            torch.tensor([index[parents[i]] for i in kept], dtype=torch.long))
