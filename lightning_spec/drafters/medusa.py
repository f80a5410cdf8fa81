"""MedusaDrafter: Medusa heads on the target's last hidden state, chain-drafted.

Medusa (Cai et al. 2024, arXiv 2401.10774, §2.1.1): K heads on the target's last hidden state h_t. Head k is a
residual block and the LM head, p^(k)_t = softmax(W_2 (SiLU(W_1^(k) h_t) + h_t)), and predicts x_{t+k+1}. The
heads run side by side and see nothing but h_t; W_1 starts at zero and W_2 is the LM head, so each head starts
as the target's own next-token head.

Our convention: a round is anchored at n, the last committed token, and the family reads h_{n-1}, the target's
last-layer state before it (``layers.LastHiddenDrafter``, shared with MTP, says why).

- Medusa: head k reads h_{n-1} and predicts x_{n+k}, k = 1..K (the paper's t = n - 1). The heads never see the
  anchor token x_n: where the target sampled x_n, they still spread their mass over every x_n it might have
  drawn. That, and that no slot sees the drafted tokens before it, is why Medusa accepts less than the drafters
  that read the anchor (DFlash, EAGLE, MTP). ``propose`` ignores the anchor.

Losses are objective parts (the family owns none): Medusa's Σ_k 0.8^k CE_k is ``CE`` + ``Geometric(0.8)``
(``normalize: weight`` cancels its factor 0.8 against our t - 1 exponent); see experiments/drafters/medusa.yaml.

Trees: ``MedusaDrafter.position_logits`` gives every head's logits at once, so ``Drafter.propose_tree`` grows a
best-first tree over their top-k (Medusa's tree is a product of the heads' top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.layers import LastHiddenDrafter
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


@dataclass
class LastHiddenState:
    """Medusa's decoding state: the target's last-layer state h_{n-1} before the next anchor n."""

    last: Tensor  # (1, H)


class ResBlock(nn.Module):
    """x + SiLU(W x + b) (Medusa §2.1.1; the authors' code has the bias). W and b start at zero: the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaDrafter(LastHiddenDrafter):
    """Medusa-1 heads on the frozen target (Cai et al. 2024, arXiv 2401.10774): head k = ``num_layers`` residual
    blocks, then the target's frozen LM head over the draft vocabulary; head k predicts x_{n+k} from h_{n-1}.

    The paper trains a separate W_2 per head, initialised from the LM head; here every head shares the frozen LM
    head (over the draft vocabulary), as every other family of this package does.

    Args:
        block_size: K, the number of heads (the paper uses 4-5).
        num_layers: residual blocks per head (Medusa's ``medusa_num_layers``, 1 in the paper).
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data (None = the
            full target vocabulary).
    """

    family = "medusa"
    parallel_slots = True  # the heads read h_{n-1} only
    tree_growth = TreeGrowth.BEST_FIRST  # so best-first trees over ``position_logits``

    def __init__(
        self,
        block_size: int = 5,
        num_layers: int = 1,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__(block_size, num_anchors, draft_vocab_size)
        if num_layers < 1:
            raise UserError(f"drafter.num_layers must be >= 1, got {num_layers}.")
        self.num_layers = num_layers

    def build(self, target: Target) -> None:
        hidden = target.hidden_size
        self.medusa = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(self.num_layers))) for _ in range(self.block_size)
        )

    def heads_hidden(self, h: Tensor) -> Tensor:
        """(..., H) h_{n-1} -> (..., K, H): every head's state before the shared LM head."""
        h = h.to(self.medusa[0][0].linear.weight.dtype)
        return torch.stack([head(h) for head in self.medusa], dim=-2)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Every head of every anchor; the heads do not depend on the tokens, so nothing is teacher-forced."""
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        hidden = self.heads_hidden(self.previous_hidden(features, anchors.positions))  # (N, A, K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=hidden, head=self._logits)

    def _logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd)

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> LastHiddenState:
        """The prefill covers the prompt but its last token (the first anchor): h_{n-1} is the last feature.
        The prompt's tokens are not read."""
        if features.shape[1] == 0:  # a one-token prompt: nothing precedes the anchor
            return LastHiddenState(last=features.new_zeros(1, features.shape[-1]))
        return LastHiddenState(last=features[:, -1])

    @torch.no_grad()
    def extend(self, state: LastHiddenState, features: Tensor, path: list[int]) -> None:
        """The last committed node sits just before the next anchor (the token the target commits after it)."""
        state.last = features[:, path[-1]]  # (1, H)

    @torch.no_grad()
    def position_logits(self, state: LastHiddenState, anchor: Tensor | None = None) -> Tensor:
        """Every head's logits over the draft vocabulary, (K, Vd): independent of the anchor and of each other
        (a Medusa tree is grown over them, ``Drafter.propose_tree``)."""
        return self.head(self.heads_hidden(state.last[0]))

    @torch.no_grad()
    def propose(
        self, state: LastHiddenState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        """Head k's top token (greedy) or a draw from it (sampling) at slot k; the anchor is not read."""
        logits = self.position_logits(state)  # (K, Vd)
        if sampling.greedy:
            return ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        q = sampling.probs(logits)  # (K, Vd)
        return ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)), probs=self.vocab.scatter(q))
