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
