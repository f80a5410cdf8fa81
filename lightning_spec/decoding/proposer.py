"""The proposal contract: what every proposer implements and declares, trained drafters and n-gram lookup alike.

A proposer drafts the tokens a round verifies. The engine (``engine.generate``), the offline evaluator
(``evaluation/offline.py``), decoding auto (``decoding/auto/``) and deploy-time adaptation call the methods
below and read two declarations, never a family's class or an exception, to learn what a proposer can do:

- ``tree_growth`` (``TreeGrowth``): how ``propose_tree`` grows a token tree, which decides how the offline
  evaluator scores it: none (chains only), best-first over one anchor's slot distributions (scored exactly from
  one forward, under sampling too), EAGLE-2's dynamic tree, or a tree of the proposer's own (both replayed round
  by round).
- ``drafting`` (``Drafting``): whether its drafts are drawn from distributions the proposal records (lossless
  rejection sampling verifies them) or chosen from the committed tokens (n-gram lookup: given the output a round
  is deterministic, so the offline replay is exact under every sampling config).

``Drafter`` (``drafters/base.py``, an ``nn.Module``) and ``NgramDrafter`` (``decoding/ngram.py``) both subclass
``Proposer``; the transformers analogue is ``CandidateGenerator``, which ``PromptLookupCandidateGenerator``
subclasses.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target


class TreeGrowth(enum.Enum):
    """How a proposer's ``propose_tree`` grows the token tree a round verifies (``decoding/trees.py``)."""

    NONE = "none"  # chains only: each slot reads the token drafted before it and there is no tree builder
    BEST_FIRST = "best_first"  # the best-first top-k tree over ``position_logits``, one anchor's slot distributions
    DYNAMIC = "dynamic"  # EAGLE-2's dynamic tree, grown slot by slot through ``tree_start`` / ``tree_step``
    OWN = "own"  # a tree of the proposer's own (D²SD's shared prefix, SpecBlock's blocks, an n-gram trie)


class Drafting(enum.Enum):
    """Where a proposer's draft tokens come from."""

    DRAWN = "drawn"  # drawn from the distributions the proposal records (every trained family)
    CHOSEN = "chosen"  # chosen from the committed tokens, never drawn (n-gram lookup)


class Proposer:
    """The contract every proposer implements. Decoding calls ``use_target`` once, ``begin`` after the prefill,
    then per round ``propose`` (a chain) or ``propose_tree``, ``adopt`` when the engine verifies another tree than
    the proposed one, and ``extend`` with the committed path.

    Attributes:
        block_size: K, the most tokens proposed per round (a chain's length, a tree's depth bound).
        target_layers: the target layers whose features ``begin`` and ``extend`` read; empty: none (the engine then
            passes ``None``).
        tree_growth: how ``propose_tree`` grows a tree (``TreeGrowth``).
        drafting: whether drafts are drawn or chosen (``Drafting``).
    """

    block_size: int
    target_layers: list[int]
    tree_growth: TreeGrowth = TreeGrowth.NONE
    drafting: Drafting = Drafting.DRAWN

    def use_target(self, target: Target) -> None:
        """Bind the proposer to the target it drafts for (vocabulary, features, the embedding it shares)."""
        raise NotImplementedError(f"{type(self).__name__} must implement use_target")

    def begin(self, features: Tensor | None, input_ids: Tensor) -> Any:
        """Decoding state from the prefill: the features (1, S, F) of positions 0..S-1 (None when
        ``target_layers`` is empty) and their tokens (1, S)."""
        raise NotImplementedError(f"{type(self).__name__} must implement begin")

    def propose(self, state: Any, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """A chain after ``anchor`` (1,), the committed token at the state's length: at most ``block_size`` tokens,
        with the distributions they were drawn from when ``drafting`` is DRAWN and sampling is on."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    def propose_tree(self, state: Any, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig,
                     generator=None) -> TreeProposal:
        """A ``TreeProposal`` after ``anchor`` under the ``TreeConfig`` ``tree``, grown as ``tree_growth`` says."""
        self.check_tree()
        raise NotImplementedError(f"{type(self).__name__} declares tree_growth={self.tree_growth.value} but does not "
                                  "implement propose_tree")

    def adopt(self, state: Any, anchor: Tensor, proposal: TreeProposal) -> None:
        """The round verifies ``proposal`` (n-gram nodes merged into this proposer's tree, nodes renumbered)
        instead of the tree it proposed; a proposer whose ``extend`` reads its own tree re-reads it here."""

    def extend(self, state: Any, features: Tensor | None, path: list[int]) -> None:
        """Commit the round: ``path`` are the accepted node indices (0 = the anchor) and ``features`` (1, T, F)
        the target's features at the verified nodes (None when ``target_layers`` is empty)."""
        raise NotImplementedError(f"{type(self).__name__} must implement extend")

    @property
    def grows_trees(self) -> bool:
        """Whether ``propose_tree`` can be called at all."""
        return self.tree_growth is not TreeGrowth.NONE

    def check_tree(self) -> None:
        """Refuse, in one sentence, a tree this proposer cannot grow (``tree_growth`` NONE)."""
        if not self.grows_trees:
            raise UserError(
                f"{type(self).__name__} drafts each slot from the tokens drafted before it and has no tree builder; "
                "decode it as a chain (tree=None)."
            )


def chosen_rounds(proposer: Proposer, tree: TreeConfig | None) -> bool:
    """Whether every node of a round is chosen, not drawn: n-gram drafts, or a best-first tree (its top-k nodes
    are verified with the deterministic candidate rule). Given the output such a round is deterministic under
    every sampling config, so a replay of it is exact."""
    if proposer.drafting is Drafting.CHOSEN:
        return True
    return tree is not None and proposer.tree_growth is TreeGrowth.BEST_FIRST


@contextlib.contextmanager
def evaluating(proposer: Proposer) -> Iterator[Proposer]:
    """The proposer in eval mode for the block (dropout off), its training mode restored after; a proposer with
    no weights (n-gram lookup) is used as it is."""
    if not isinstance(proposer, nn.Module):
        yield proposer
        return
    was_training = proposer.training
    proposer.eval()
    try:
        yield proposer
    finally:
        proposer.train(was_training)
