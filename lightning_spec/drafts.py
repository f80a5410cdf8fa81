"""What a drafter takes and gives in training, as plain data: its reduced vocabulary (``DraftVocab``), the anchors a
training forward drafts from (``Anchors``) and its teacher-forced output (``DraftOutput``).

They sit below ``drafters/`` and ``decoding/`` because the code that reads them does too: the exact rounds of known
outputs (``decoding/rounds.py``), the metrics and the objectives read a ``DraftOutput`` without knowing any drafter.
``drafters/base.py`` re-exports them with the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_spec.errors import UserError


# ------------------------------------------------------------------------------------------ draft vocabulary
class DraftVocab(nn.Module):
    """The draft vocabulary Vd ⊆ V: the most frequent target tokens (EAGLE-3's reduced vocabulary, Li et al. 2025,
    arXiv 2503.01840), or the whole target vocabulary when ``size`` is None.

    ``ids`` (Vd,) holds the sorted target ids (EAGLE-3's ``d2t[i] = ids[i] - i``, ``t2d`` = membership); the
    head is the target's frozen LM head restricted to those rows. ``ready`` is False until ``set_from_counts``
    chose the ids (``fit`` does it from the training data the first time it sets up).
    """

    def __init__(self, size: int | None = None) -> None:
        super().__init__()
        self.size_wanted = size
        self.register_buffer("ids", torch.zeros(0, dtype=torch.long), persistent=True)
        self.register_buffer("ready", torch.tensor(size is None), persistent=True)
        self._rows: tuple[tuple, Tensor] | None = None  # head_weight's gathered rows and what they were taken from

    def build(self, vocab_size: int) -> None:
        """Size the buffers for a target of ``vocab_size`` tokens (the ids of a reduced vocabulary come later)."""
        if self.size_wanted is not None and not 0 < self.size_wanted <= vocab_size:
            raise UserError(
                f"drafter.draft_vocab_size={self.size_wanted} must be in 1..{vocab_size} (the target vocabulary)."
            )
        self.ids = torch.arange(self.size_wanted or vocab_size, device=self.ids.device)
        self.vocab_size = vocab_size

    @property
    def full(self) -> bool:
        return self.ids.numel() == self.vocab_size

    @torch.no_grad()
    def set_from_counts(self, token_counts: Tensor) -> None:
        """Keep the ``Vd`` most frequent target tokens of ``token_counts`` (V,)."""
        top = token_counts.float().topk(self.ids.numel()).indices.sort().values
        self.ids.copy_(top.to(self.ids.device))
        self.ready.fill_(True)

    def to_draft(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Target ids -> (draft ids, contained); ids the draft vocabulary lacks map to 0 with contained False."""
        if self.full:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        vocab = self.ids.to(ids.device)
        pos = torch.searchsorted(vocab, ids.clamp(min=0)).clamp(max=vocab.numel() - 1)
        contained = vocab[pos] == ids
        return torch.where(contained, pos, torch.zeros_like(pos)), contained

    def to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.full else self.ids.to(draft_ids.device)[draft_ids]

    def head_weight(self, lm_head: nn.Module) -> Tensor:
        """The frozen LM head rows of the draft vocabulary: (Vd, H). Gathered once and kept while neither the head
        nor the ids change (a decoding slot would otherwise copy Vd x H values to read them once: 17% of an
        EAGLE-3 chain on the CPU); gathered afresh where a gradient must reach the head."""
        w = lm_head.weight
        if self.full:
            return w
        if w.requires_grad and torch.is_grad_enabled():
            return w.index_select(0, self.ids.to(w.device))
        key = (w.data_ptr(), w._version, w.dtype, w.device, self.ids.data_ptr(), self.ids._version)
        if self._rows is None or self._rows[0] != key:
            self._rows = (key, w.detach().index_select(0, self.ids.to(w.device)))
        return self._rows[1]

    def logits(self, hidden: Tensor, lm_head: nn.Module) -> Tensor:
        """(..., H) -> (..., Vd) through the frozen head; used for draft and target logits alike."""
        w = self.head_weight(lm_head)
        return hidden.to(w.dtype) @ w.t()

    def scatter(self, q: Tensor) -> Tensor:
        """A distribution over Vd (..., Vd) as one over the target vocabulary (..., V), zeros outside Vd."""
        if self.full:
            return q
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids.to(q.device), q)

    @property
    def t2d(self) -> Tensor:
        """bool (V,): which target tokens the draft vocabulary contains (EAGLE-3's ``t2d``)."""
        return torch.zeros(self.vocab_size, dtype=torch.bool, device=self.ids.device).index_fill_(0, self.ids, True)

    @property
    def d2t(self) -> Tensor:
        """(Vd,): target_id = draft_id + d2t[draft_id] (EAGLE-3's ``d2t``)."""
        return self.ids - torch.arange(self.ids.numel(), device=self.ids.device)


# ---------------------------------------------------------------------------------------------- training I/O
@dataclass
class Anchors:
    """Where the blocks of a training forward start: ``positions`` (N, A), ``keep`` (N, A) bool (False: padding)."""

    positions: Tensor
    keep: Tensor

    @classmethod
    def all(cls, positions: Tensor) -> Anchors:
        return cls(positions, torch.ones_like(positions, dtype=torch.bool))


Head = Callable[[Tensor, Tensor], Tensor]  # (hidden (N, a, K, H), anchor index (a,)) -> logits (N, a, K, Vd)


class DraftOutput:
    """One teacher-forced forward of a drafter over a batch: ``K`` slots per anchor; slot t (1..K) of anchor n
    predicts the token at position n + t.

    Written by the drafter that builds it, and by nobody else: what a training step adds (the target's side of every
    slot, a reference drafter's logits, the objective's scratch) travels in the objective's own ``StepContext``
    (``objectives/context.py``).

    Logits can be given as a tensor or lazily as ``hidden`` + ``head``: the objective then evaluates them in
    chunks of anchors (``chunk``), so memory does not grow with N x A x K x Vd.

    Args:
        logits: (N, A, K, Vd) draft logits over the draft vocabulary (or None with ``hidden`` and ``head``).
        labels: (N, A, K) gold tokens as draft-vocabulary ids (0 where invalid).
        valid: (N, A, K) bool: a supervised label that the draft vocabulary contains.
        anchors: (N, A) anchor positions n (0 where the anchor slot is unused).
        hidden: (N, A, K, H) the drafter's last states per slot, turned into logits by ``head``.
        head: ``head(hidden[:, index], index)`` -> logits of those anchors; a family whose logits are more than
            its head of ``hidden`` (a Markov or correction head) closes over its own per-anchor inputs.
        aux: the drafter's own extra heads, per anchor: tensors (N, A, ...) (DSpark's confidence, a length head),
            or, for large ones, a ``Head`` evaluated per chunk like the logits (a second branch's logits).
        drafted: (N, A) slots the drafter submits from that anchor at decode time (a prefix scheduler or length
            head cuts blocks); None: all K.
        sparse: the logits are -inf outside a per-slot candidate set (DFlash2's selector draws from its top-k):
            a loss that needs every token's probability (CE on a gold token outside the set, KL) is infinite there,
            so only losses that declare ``reads_candidates`` train such a drafter (``objectives.SelectorCE``).
    """

    def __init__(
        self,
        logits: Tensor | None = None,
        labels: Tensor | None = None,
        valid: Tensor | None = None,
        anchors: Tensor | None = None,
        *,
        hidden: Tensor | None = None,
        head: Head | None = None,
        aux: dict[str, Tensor] | None = None,
        drafted: Tensor | None = None,
        sparse: bool = False,
    ) -> None:
        if logits is None and (hidden is None or head is None):
            raise ValueError("DraftOutput needs logits, or hidden and head.")
        self._logits, self.hidden, self.head = logits, hidden, head
        self.labels, self.valid, self.anchors = labels, valid, anchors
        self.aux = aux if aux is not None else {}
        self.drafted = drafted
        self.sparse = sparse

    @property
    def logits(self) -> Tensor:
        """(N, A, K, Vd), materialised (once) from ``hidden`` when given lazily."""
        if self._logits is None:
            index = torch.arange(self.hidden.shape[1], device=self.hidden.device)
            self._logits = self.head(self.hidden, index)
        return self._logits

    @property
    def block_size(self) -> int:
        return self.valid.shape[-1]

    @property
    def num_anchors(self) -> int:
        return self.valid.shape[1]

    def materialize(self) -> DraftOutput:
        """Every lazy part computed over all anchors (and kept): the logits, the aux heads."""
        index = torch.arange(self.num_anchors, device=self.valid.device)
        _ = self.logits
        self.aux = {k: v(self.hidden, index) if callable(v) else v for k, v in self.aux.items()}
        return self

    def chunk(self, index: Tensor) -> DraftOutput:
        """The anchors ``index`` (a,) only, logits and aux heads materialised for them alone."""

        def take(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(1, index.to(x.device))

        hidden = take(self.hidden)
        if self._logits is not None:
            logits = take(self._logits)
        else:
            logits = self.head(hidden, index)
        aux = {k: v(hidden, index) if callable(v) else take(v) for k, v in self.aux.items()}
        return DraftOutput(logits, take(self.labels), take(self.valid), take(self.anchors), hidden=hidden, aux=aux,
                           drafted=take(self.drafted), sparse=self.sparse)

    @torch.no_grad()
    def slot_hits(self, chunk: int | None = None) -> Tensor:
        """(N, A, K) bool: the slot's argmax is its label; ``chunk`` anchors at a time when the logits are lazy."""
        if chunk is None or self.num_anchors <= chunk:
            return self.logits.argmax(-1) == self.labels
        device = self.valid.device
        parts = [self.chunk(torch.arange(lo, min(lo + chunk, self.num_anchors), device=device))
                 for lo in range(0, self.num_anchors, chunk)]
        return torch.cat([part.logits.argmax(-1) == part.labels for part in parts], dim=1)
