"""A round's draft and how it is verified: each proposal kind carries its own verification.

The engine asks a proposal for the tokens the target must run (``verify_inputs``), runs them in one forward,
and asks the proposal which of them are committed (``accept``). Node 0 is always the anchor; the committed
path is a list of node indices starting with 0, and the token after the path (a correction or the bonus) comes
from the target. A chain's nodes follow each other; a tree's (a later kind) carry their parents, an ancestor
mask and depths, so the engine and the target need no per-kind code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_spec.decoding import verify
from lightning_spec.sampling import SamplingConfig


class Proposal:
    """What ``Drafter.propose`` returns and the engine verifies."""

    @property
    def num_drafted(self) -> int:
        """Draft tokens submitted this round (the round's slots)."""
        raise NotImplementedError

    def verify_inputs(self, anchor: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Token ids (T,) to run after the cached prefix, their position offsets (T,) from the anchor's position,
        and a (T, T) bool mask of which nodes each node sees (None: causal, a chain)."""
        raise NotImplementedError

    def accept(
        self, logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[list[int], int]:
        """Given the target's logits (T, V) at the verified nodes: the committed path (node indices, 0 first)
        and the token the target commits after it."""
        raise NotImplementedError


@dataclass
class ChainProposal(Proposal):
    """k draft tokens in a row (k <= K; a prefix scheduler or a length head may submit fewer than K).

    Args:
        tokens: (k,) target-vocabulary ids.
        probs: (k, V) the distribution q each token was drawn from, over the TARGET vocabulary (zeros outside the
            draft vocabulary); None under greedy decoding.
    """

    tokens: Tensor
    probs: Tensor | None = None

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> ChainProposal:
        """No draft: plain decoding, one token per target forward."""
        return cls(torch.zeros(0, dtype=torch.long, device=device), None)

    @property
    def num_drafted(self) -> int:
        return int(self.tokens.shape[0])

    def truncated(self, length: int) -> ChainProposal:
        """The chain's first ``length`` drafts (a plan's shorter chain); the drafts after them are never verified."""
        if self.num_drafted <= length:
            return self
        return ChainProposal(self.tokens[:length], None if self.probs is None else self.probs[:length])

    def children(self) -> list[list[int]]:
        """Per node (the anchor first), its children: a chain is a tree with one child per node."""
        return [[i + 1] for i in range(self.num_drafted)] + [[]]

    def verify_inputs(self, anchor: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ids = torch.cat([anchor.reshape(1), self.tokens.to(anchor.device)])  # (k + 1,)
        return ids, torch.arange(ids.shape[0], device=anchor.device), None

    def accept(
        self, logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[list[int], int]:
        """Leviathan et al. 2023 (arXiv 2211.17192) / Chen et al. 2023 (arXiv 2302.01318): greedy match, or
        lossless rejection sampling against the target's distribution under ``sampling``."""
        draft = self.tokens.to(logits.device)
        if sampling.greedy:
            accepted, nxt = verify.greedy_accept(draft, logits.argmax(-1))
        else:
            if self.probs is None and draft.numel():
                raise ValueError("A chain proposal under sampling needs probs, the distributions its tokens were "
                                 "drawn from (lossless verification compares them with the target's).")
            p = sampling.probs(logits)  # (k + 1, V)
            q = self.probs.to(p.device) if self.probs is not None else p.new_zeros(0, p.shape[-1])
            accepted, nxt = verify.rejection_accept(draft, q, p, generator)
        return list(range(accepted + 1)), nxt


@dataclass
class TreeProposal(Proposal):
    """A token tree after the anchor, verified in one target forward (METHODS §1.2).

    Node 0 is the anchor; draft node i (1-based) holds ``tokens[i - 1]`` and hangs under node ``parents[i - 1]``
    (0 = the anchor), parents before children. The target runs all nodes at once, each at its depth and seeing
    its ancestors only, so every root-to-leaf path gets the logits it would get as a chain.

    Args:
        tokens: (T,) target-vocabulary ids of the draft nodes.
        parents: (T,) each draft node's parent node index, < its own index.
        probs: None under greedy, or for sampled children (T, V): the distribution each draft node was drawn from,
            over the TARGET vocabulary; siblings share it (they are candidates drawn from their parent's q). None
            under sampling means the children were chosen deterministically (e.g. the draft's top-k).
        replacement: sampled siblings were drawn independently (True) or without replacement (False).
    """

    tokens: Tensor
    parents: Tensor
    probs: Tensor | None = None
    replacement: bool = True

    def __post_init__(self) -> None:
        t = self.tokens.shape[0]
        if self.parents.shape != (t,) or self.tokens.dim() != 1:
            raise ValueError(f"TreeProposal needs tokens (T,) and parents (T,); got {tuple(self.tokens.shape)} and "
                             f"{tuple(self.parents.shape)}.")
        own = torch.arange(1, t + 1, device=self.parents.device)
        if t and not bool(((self.parents >= 0) & (self.parents < own)).all()):
            raise ValueError("TreeProposal.parents must name an earlier node (0 = the anchor) for every draft node.")
        if self.probs is not None and self.probs.shape[0] != t:
            raise ValueError(f"TreeProposal.probs must have one row per draft node ({t}); got {self.probs.shape[0]}.")

    @property
    def num_drafted(self) -> int:
        return int(self.tokens.shape[0])

    def children(self) -> list[list[int]]:
        """Per node (the anchor first), its children's node indices in draft order."""
        kids: list[list[int]] = [[] for _ in range(self.num_drafted + 1)]
        for i, parent in enumerate(self.parents.tolist(), start=1):
            kids[parent].append(i)
        return kids

    def ancestors(self) -> Tensor:
        """(T + 1, T + 1) bool: node i sees node j iff j is i or one of its ancestors."""
        n = self.num_drafted + 1
        mask = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist(), start=1):
            mask[i] |= mask[parent]  # parents come first, so their row is complete
        return mask

    def verify_inputs(self, anchor: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        ids = torch.cat([anchor.reshape(1), self.tokens.to(anchor.device)])  # (T + 1,)
        mask = self.ancestors()
        depth = mask.sum(-1) - 1  # (T + 1,) the anchor at 0
        return ids, depth.to(anchor.device), mask.to(anchor.device)

    def accept(
        self, logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[list[int], int]:
        """Greedy: follow the child whose token is the target's argmax while there is one (the longest path that
        greedy decoding would produce). Sampling: at each node ``verify.candidate_accept`` picks a child or draws
        the target's token; either way the committed tokens are distributed as the target's."""
        kids = self.children()
        tokens = self.tokens.tolist()
        path = [0]
        if sampling.greedy:
            best = logits.argmax(-1).tolist()  # (T + 1,)
            while True:
                node = path[-1]
                nxt = next((c for c in kids[node] if tokens[c - 1] == best[node]), None)
                if nxt is None:
                    return path, best[node]
                path.append(nxt)
        p = sampling.probs(logits)  # (T + 1, V)
        while True:
            node = path[-1]
            children = kids[node]
            if not children:
                return path, verify.draw(p[node], generator)
            q = self.probs[children[0] - 1].to(p.device) if self.probs is not None else None
            cand = torch.tensor([tokens[c - 1] for c in children])
            chosen, dist = verify.candidate_accept(p[node], cand, q, self.replacement, generator)
            if chosen is None:
                return path, verify.draw(dist, generator)
            path.append(children[chosen])
