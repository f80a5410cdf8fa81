"""The plans decoding auto compares (``candidates``) and plain decoding, the one every other is judged against."""

from __future__ import annotations

from lightning_spec.decoding.plans import Chain, Ngram, Plain, Plan, Tree
from lightning_spec.decoding.proposer import Proposer, TreeGrowth

PLAIN = Plain()


def candidates(drafter: Proposer | None = None) -> list[Plan]:
    """The plans ``choose_decoding`` compares by default: plain; n-gram chains of 4 and 10 tokens and n-gram tries
    of 8 and 16 nodes; with a drafter its chain, its chain cut to half its slots (K >= 4), and, where the chain is
    a one-child tree (tree growth best-first or dynamic), chains that stop where the drafter's confidence falls below
    0.3 or 0.1; and if it grows trees, trees of 4..32 nodes, top 2 or 4, each without and with a quarter of the
    nodes offered to n-gram candidates."""
    out: list[Plan] = [PLAIN, Ngram(length=4), Ngram(length=10), Ngram(length=10, nodes=8, top_k=3),
                       Ngram(length=10, nodes=16, top_k=4)]
    if drafter is None:
        return out
    out.append(Chain())
    if drafter.block_size >= 4:
        out.append(Chain(length=drafter.block_size // 2))
    if drafter.tree_growth in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC):
        out += [Chain(stop_below=0.3), Chain(stop_below=0.1)]
    if not drafter.grows_trees:  # a chain-only family
        return out
    for nodes in (4, 8, 16, 32):
        for top_k in (2, 4) if nodes >= 8 else (2,):
            for ngram in (0, max(2, nodes // 4)):
                out.append(Tree(nodes=nodes, top_k=top_k, ngram=ngram))
    return out
