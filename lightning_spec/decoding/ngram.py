"""N-gram candidates: drafts looked up in the prompt and the output so far, with no drafter forward at all.

Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; transformers' ``prompt_lookup_num_tokens``) proposes, after
the committed tokens c_1..c_n, what followed an earlier occurrence of their last n-gram: for n from ``max_ngram``
down to ``min_ngram``, every earlier position i with c_{i..i+n-1} = c_{n-n+1..n} offers the continuation
c_{i+n..i+n+L-1}. Where the text repeats (code that restates a signature, math that carries an expression from
line to line, an answer that quotes its question) those continuations are what the target would write next.

Candidates are ranked, not drawn: longer matches first, then the most recent occurrence. So a round's draft is a
function of the committed tokens alone, and verification stays lossless under sampling with the rules we already
have: a chain of chosen tokens is a draft whose q is one-hot (``verify.rejection_accept`` then accepts x with
p(x) and otherwise draws from p without x), and a tree of chosen candidates is verified with the deterministic
candidate rule (``TreeProposal`` with ``probs=None``). Given the output, such a round is deterministic: it accepts
the longest root path the output follows, which is why the offline evaluator replays n-gram rounds exactly under
every sampling config (``decoding.exact.replay_tree_rounds``).

Two uses:
- alone: ``generate(target, ids, n, plan="ngram")`` (the ``Ngram`` plan's fields set its length), as a chain of
  the best continuation or, with ``plan=Ngram(nodes=...)``, a trie of up to ``top_k`` continuations;
- merged into a family's tree: ``TreeConfig(nodes=16, top_k=4, ngram=6)`` offers up to 6 of the 16 nodes to
  n-gram continuations (``merge``): a continuation that the family's tree already drafted costs nothing, new
  nodes displace the family's least valuable ones, so the verify forward stays at 16 + 1 tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.decoding.proposer import Drafting, Proposer, TreeGrowth
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target


def lookup(context: list[int], length: int, count: int = 1, max_ngram: int = 3, min_ngram: int = 1
           ) -> list[list[int]]:
    """Up to ``count`` distinct continuations of at most ``length`` tokens after ``context`` (its last token is the
    anchor): longest suffix match first, then the most recent occurrence; a continuation that is a prefix of one
    already taken adds nothing to a tree and is skipped, one that extends a taken one (a recent match cut short by
    the end of the context) replaces it."""
    out: list[list[int]] = []
    if length < 1 or count < 1 or len(context) < 2:
        return out
    ctx = torch.tensor(context, dtype=torch.long)
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        windows = ctx.unfold(0, n, 1)[:-1]  # (len - n, n) every n-gram but the suffix itself
        hits = (windows == ctx[-n:]).all(-1).nonzero()[:, 0].flip(0).tolist()  # most recent first
        for i in hits:
            cont = context[i + n : i + n + length]
            if any(taken[: len(cont)] == cont for taken in out):
                continue
            # a recent match cut short by the end of the context is a prefix of an older, longer one: extend it
            grown = next((j for j, taken in enumerate(out) if cont[: len(taken)] == taken), None)
            if grown is not None:
                out[grown] = cont
                continue
            out.append(cont)
            if len(out) == count and all(len(taken) == length for taken in out):
                return out
    return out[:count]


def merge(tokens: list[int], parents: list[int], paths: list[list[int]], budget: int, max_new: int | None = None
          ) -> tuple[list[int], list[int]]:
    """A tree (``tokens``, ``parents``: draft nodes in order, parents first, 0 = the anchor) with the root paths
    ``paths`` added, at most ``budget`` draft nodes in all, at most ``max_new`` (default: all) of them new.

    A path follows the tree's nodes while they draft its tokens (those nodes are kept); its other tokens become
    new nodes. The tree's other nodes give way from the last one added (the least valuable for our builders, a
    leaf once the nodes after it are gone). Paths are taken in order while they fit; the rest of a path that does
    not fit is cut."""
    child = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents), start=1)}  # (parent, token) -> node
    kept: set[int] = set()  # the tree's nodes on a path
    new: list[tuple[tuple[str, int], int]] = []  # (parent as ("tree", node) | ("new", index), token)
    new_child: dict[tuple[tuple[str, int], int], int] = {}
    max_new = budget if max_new is None else max_new
    for path in paths:
        node: tuple[str, int] = ("tree", 0)
        for tok in path:
            if node[0] == "tree" and (node[1], tok) in child:
                nxt = child[node[1], tok]
                if nxt not in kept and len(kept) + len(new) >= budget:
                    break
                kept.add(nxt)
                node = ("tree", nxt)
            elif (node, tok) in new_child:
                node = ("new", new_child[node, tok])
            elif len(kept) + len(new) < budget and len(new) < max_new:
                new_child[node, tok] = len(new)
                new.append((node, tok))
                node = ("new", len(new) - 1)
            else:
                break
    spare = budget - len(kept) - len(new)  # the tree's other nodes that still fit, the first ones added
    keep = []
    for i in range(1, len(tokens) + 1):
        if i in kept or spare > 0:
            spare -= i not in kept
            keep.append(i)
    index = {0: 0} | {node: j for j, node in enumerate(keep, start=1)}
    out_tokens = [tokens[i - 1] for i in keep]
    out_parents = [index[parents[i - 1]] for i in keep]
    for (kind, ref), tok in new:
        out_parents.append(index[ref] if kind == "tree" else len(keep) + 1 + ref)
        out_tokens.append(tok)
    return out_tokens, out_parents


def merge_into(proposal: TreeProposal, context: list[int], tree: TreeConfig) -> TreeProposal:
    """A family's tree with up to ``tree.ngram`` nodes of n-gram candidates after ``context`` (anchor last)
    merged in, within ``tree.nodes`` (``merge``). The family's nodes must have been chosen (``probs`` None): a
    drawn tree is verified against the distribution it was drawn from, which n-gram nodes do not have."""
    if proposal.probs is not None:
        raise UserError("tree.ngram merges n-gram candidates into chosen trees only; this drafter draws its tree's "
                        "children, so decode it with tree.ngram = 0.")
    paths = lookup(context, tree.ngram, count=tree.top_k)
    if not paths:
        return proposal
    tokens, parents = merge(proposal.tokens.tolist(), proposal.parents.tolist(), paths, tree.nodes, tree.ngram)
    device = proposal.tokens.device
    return TreeProposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                        parents=torch.tensor(parents, dtype=torch.long, device=device))


@dataclass
class NgramState:
    """The committed tokens before the anchor, and the last proposal's tokens (``extend`` reads its path)."""

    history: list[int]
    anchor: int = -1
    drafted: list[int] = field(default_factory=list)


class NgramDrafter(Proposer):
    """Prompt-and-output lookup as a proposer (``decoding/proposer.py``): no weights, no target features, any
    target. Its drafts are chosen, never drawn, and its trees are tries of continuations.

    Args:
        block_size: the longest continuation drafted per round (a chain's K; a tree's depth bound).
        max_ngram: the longest suffix matched; shorter ones are tried down to ``min_ngram`` when it finds nothing.
        min_ngram: the shortest suffix matched.
    """

    tree_growth = TreeGrowth.OWN  # a trie of up to top_k continuations (``propose_tree``)
    drafting = Drafting.CHOSEN  # the offline replay is exact under every sampling config

    def __init__(self, block_size: int = 10, max_ngram: int = 3, min_ngram: int = 1) -> None:
        for name, value in (("block_size", block_size), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"NgramDrafter {name} must be an int >= 1, got {value!r}.")
        if min_ngram > max_ngram:
            raise UserError(f"NgramDrafter min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram}).")
        self.block_size, self.max_ngram, self.min_ngram = block_size, max_ngram, min_ngram
        self.target_layers: list[int] = []  # reads no features
        self.target_vocab = 0  # the target's vocabulary size: the width of a chain's one-hot q under sampling

    def __repr__(self) -> str:
        return f"NgramDrafter(block_size={self.block_size}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def use_target(self, target: Target) -> None:
        self.target_vocab = target.vocab_size

    def begin(self, features: Tensor | None, input_ids: Tensor) -> NgramState:
        return NgramState(history=input_ids[0].tolist())

    def _lookup(self, state: NgramState, anchor: Tensor, length: int, count: int) -> list[list[int]]:
        state.anchor = int(anchor.reshape(-1)[0])
        return lookup(state.history + [state.anchor], length, count, self.max_ngram, self.min_ngram)

    def propose(self, state: NgramState, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """The best continuation as a chain; under sampling its q is one-hot at the chosen tokens."""
        paths = self._lookup(state, anchor, self.block_size, 1)
        state.drafted = paths[0] if paths else []
        tokens = torch.tensor(state.drafted, dtype=torch.long, device=anchor.device)
        probs = None
        if not sampling.greedy:
            probs = torch.zeros(len(state.drafted), self.target_vocab, device=anchor.device)
            probs[torch.arange(len(state.drafted)), tokens] = 1.0
        return ChainProposal(tokens, probs)

    def propose_tree(self, state: NgramState, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig,
                     generator=None) -> TreeProposal:
        """A trie of up to ``tree.top_k`` continuations, at most ``tree.nodes`` nodes, ``tree.depth`` (default
        ``block_size``) deep."""
        paths = self._lookup(state, anchor, tree.depth or self.block_size, tree.top_k)
        tokens, parents = merge([], [], paths, tree.nodes)
        state.drafted = tokens
        device = anchor.device
        return TreeProposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                            parents=torch.tensor(parents, dtype=torch.long, device=device))

    def adopt(self, state: NgramState, anchor: Tensor, proposal: TreeProposal) -> None:
        """The verified tree, when n-gram candidates were merged into this trie: ``extend`` reads its tokens."""
        state.drafted = proposal.tokens.tolist()

    def extend(self, state: NgramState, features: Tensor | None, path: list[int]) -> None:
        state.history.append(state.anchor)
        state.history.extend(state.drafted[i - 1] for i in path[1:])


def from_name(spec: str) -> NgramDrafter | None:
    """N-gram lookup named as a drafter: ``"ngram"`` (its defaults) or ``"ngram:K"`` (chains of up to K tokens, trees
    of depth K), as ``evaluate --drafters`` and ``generate`` take it; None for anything else (a checkpoint path)."""
    name, _, k = str(spec).partition(":")
    if name != "ngram":
        return None
    if not k:
        return NgramDrafter()
    if not k.isdigit() or int(k) < 1:
        raise UserError(f"{spec!r} names n-gram lookup with a bad length; write ngram:K with K >= 1, e.g. ngram:4.")
    return NgramDrafter(block_size=int(k))


def as_proposer(value: Any) -> Proposer | None:
    """What ``generate`` and the offline evaluator take as a drafter: a ``Proposer`` (a loaded drafter, an
    ``NgramDrafter``), ``"ngram"`` or ``"ngram:K"`` (n-gram lookup, ``from_name``) or None (plain decoding)."""
    if value is None or isinstance(value, Proposer):
        return value
    if isinstance(value, str) and (ngram := from_name(value)) is not None:
        return ngram
    if isinstance(value, (str, os.PathLike)):
        raise UserError(f"drafter takes a loaded drafter, 'ngram' (prompt lookup) or None, not {str(value)!r}; for a "
                        f"checkpoint pass load_drafter({str(value)!r}, target=target) instead.")
    raise UserError(f"drafter must be a drafter (load_drafter), 'ngram' (prompt lookup) or None, got {value!r}.")
