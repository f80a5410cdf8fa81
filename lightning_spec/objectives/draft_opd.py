"""Draft-OPD (Lei et al. 2026, arXiv 2605.29343): on-policy distillation of a drafter at the states its own
speculative decoding exposed to verification.

Rollouts (``callbacks/on_policy.py``) decode training prompts with the live drafter and record every round: where
it started (the anchor) and the drafts the target rejected, with the target's log-probability of each
(``data/replay.py``). This objective replays them:

- anchors = the round starts, so the drafter re-runs from exactly the states decoding visited (the released code's
  "verification-exposed" anchors: the prompt end and every rejection point). The target is frozen and supplies the
  context features in the same forward.
- response stream: at round r (anchor n_r, a_r accepted), slots t = 1..a_r + 1 (the accepted drafts and the
  target's correction), on the committed tokens x: the Bernoulli forward KL of "emits x" between target and draft
  (``BernoulliKL``, the released default), or the sampled reverse-KL estimator k3 = e^d − d − 1, d = log p(x) −
  log q(x) (``response_loss: k3``).
- rejected-draft stream: every rejected draft y at slot t of round r (offset o = t − a_r, 1 = the first rejected),
  k3 with d = log p(y) − log q(y): y was drawn from q, so k3 is an unbiased estimate of KL(q ‖ p) there; weight
  ``rejected_decay``^(o − 1) (released: 0.8). log p(y) is the target's, recorded at verification.
- clamps as released: every log-probability ≥ ``log_floor`` (−10), every per-token loss in [−clip, clip] (10).
- Z = the number of response-stream slots + rejected drafts (both streams weigh 1, as released); the two streams'
  means are logged as ``train/opd_response`` and ``train/opd_rejected``.

``anchors: random`` is the random-anchor ablation: the drafter samples anchors as in SFT (same number per sequence
as ``num_anchors``), the response stream covers whole blocks and the rejected stream is off (rejected drafts
belong to round starts). Batches without rounds (the held-out SFT split that ``val/loss`` reads) are scored the
same way.

Exactness: the rejected stream reads the draft distribution of the teacher-forced forward at the rejected slot. It
is the one decoding drew from at the first rejected slot for every family (its prefix is the accepted drafts, the
trajectory), and at every slot for drafters whose slots do not read earlier drafts (DFlash's block); the rollout
callback keeps only first rejections for the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import PerAnchor, StepContext
from lightning_spec.objectives.losses import BernoulliKL, _draft_logprobs, _target_logprobs
from lightning_spec.objectives.objective import DraftFn, Objective, TargetInfo
from lightning_spec.sampling import SamplingConfig


@dataclass
class ReplayRounds(PerAnchor):
    """The rounds of a batch's rollouts, per anchor (= round), sliced with the anchors by ``StepContext.chunk``."""

    segment: Tensor  # (N, A) slots of the response stream: accepted drafts + 1 (K for the last round)
    rejected: Tensor  # (N, A, K) rejected drafts as draft ids, -1 where none
    rejected_logp: Tensor  # (N, A, K) the target's log-probability of each
    offset: Tensor  # (N, A, K) t - accepted (1 = the first rejected draft)

    def chunk(self, index: Tensor) -> ReplayRounds:
        return ReplayRounds(*(x.index_select(1, index.to(x.device)) for x in
                              (self.segment, self.rejected, self.rejected_logp, self.offset)))


def replay_rounds(batch: dict[str, Tensor], target: TargetInfo) -> tuple[Anchors, ReplayRounds]:
    """Anchors at the round starts (N, R) and the rounds' streams, from a batch of on-policy examples."""
    starts = batch["round_starts"]  # (N, R), -1 padding
    keep = starts >= 0
    k = target.block_size
    rejected = batch["rejected"][..., :k]  # (N, R, K) target ids
    nxt = torch.cat([starts[:, 1:], starts.new_full((starts.shape[0], 1), -1)], 1)  # (N, R) the next round's start
    segment = torch.where(nxt >= 0, nxt - starts, torch.full_like(starts, k)).clamp(0, k)  # (N, R)
    draft_ids, contained = target.vocab.to_draft(rejected.clamp_min(0))
    has = (rejected >= 0) & contained & keep[..., None]
    slot = torch.arange(1, k + 1, device=starts.device)  # (K,)
    offset = slot - (segment - 1)[..., None]  # (N, R, K)
    rounds = ReplayRounds(
        segment=segment.masked_fill(~keep, 0),
        rejected=torch.where(has, draft_ids, torch.full_like(draft_ids, -1)),
        rejected_logp=batch["rejected_logp"][..., :k].float(),
        offset=offset,
    )
    return Anchors(starts.clamp_min(0), keep), rounds


def k3(log_p: Tensor, log_q: Tensor) -> Tensor:
    """The sampled reverse-KL estimator e^d − d − 1, d = log p − log q (≥ 0; its mean under y ~ q is KL(q ‖ p))."""
    d = log_p - log_q
    return d.exp() - d - 1


class DraftOPD(Objective):
    """Draft-OPD's two-stream loss on the rounds of on-policy rollouts (needs ``OnPolicyRollouts``).

    Args:
        response_loss: ``bernoulli_kl`` (released default) or ``k3`` for the committed tokens.
        rejected_weight: weight of the rejected-draft stream (released: 1; 0 turns it off).
        rejected_decay: the rejected stream's weight per offset, decay^(offset − 1) (released: 0.8).
        anchors: ``replay`` (the round starts) or ``random`` (the random-anchor ablation).
        sampling: how the target's p is formed from its logits on the response stream (the drafter uses the same
            temperature); keep it the rollouts' config (greedy rollouts: temperature 1 here, the plain softmax).
        log_floor: lower clamp of log-probabilities (released: −10).
        clip: per-token losses are clamped to [−clip, clip] (released: 10).
    """

    needs_target = True
    needs_rollouts = True  # DraftModule refuses a fit without the OnPolicyRollouts callback

    def __init__(
        self,
        response_loss: Literal["bernoulli_kl", "k3"] = "bernoulli_kl",
        rejected_weight: float = 1.0,
        rejected_decay: float = 0.8,
        anchors: Literal["replay", "random"] = "replay",
        sampling: SamplingConfig = SamplingConfig(temperature=1.0),
        log_floor: float = -10.0,
        clip: float = 10.0,
    ) -> None:
        if response_loss not in ("bernoulli_kl", "k3"):
            raise UserError(f"objective.response_loss must be 'bernoulli_kl' or 'k3', got {response_loss!r}.")
        if anchors not in ("replay", "random"):
            raise UserError(f"objective.anchors must be 'replay' or 'random', got {anchors!r}.")
        if rejected_weight < 0 or not 0 < rejected_decay <= 1:
            raise UserError("objective.rejected_weight must be >= 0 and objective.rejected_decay in (0, 1].")
        super().__init__(BernoulliKL(sampling, log_floor, clip), normalize="slots")
        self.response_loss = response_loss
        self.rejected_weight = rejected_weight
        self.rejected_decay = rejected_decay
        self.anchors = anchors
        self.sampling = sampling
        self.log_floor = log_floor
        self.clip = clip

    def select_anchors(
        self, batch: dict[str, Tensor], draft_fn: DraftFn, target: TargetInfo
    ) -> tuple[Anchors, dict[str, Any]] | None:
        if self.anchors == "random" or "round_starts" not in batch:
            return None  # the drafter's own anchors: the ablation, or data that was not rolled out
        anchors, rounds = replay_rounds(batch, target)
        return anchors, {"rounds": rounds}

    def _rounds(self, ctx: StepContext) -> ReplayRounds | None:
        return ctx.extra.get("rounds")

    def slot_mask(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        rounds = self._rounds(ctx)
        if rounds is None:
            return draft.valid
        slot = torch.arange(1, draft.block_size + 1, device=draft.valid.device)
        return draft.valid & (slot <= rounds.segment[..., None])  # accepted drafts + the correction

    def sums(self, draft: DraftOutput, ctx: StepContext) -> list[tuple[Tensor, Tensor]]:
        mask = self.slot_mask(draft, ctx)  # (N, A, K)
        if self.response_loss == "bernoulli_kl":
            ell = self.loss(draft, ctx)  # (N, A, K)
        else:
            gold = draft.labels[..., None]
            log_p = _target_logprobs(ctx, self.sampling).gather(-1, gold)[..., 0].clamp_min(self.log_floor)
            log_q = _draft_logprobs(draft, self.sampling.temperature).gather(-1, gold)[..., 0]
            ell = k3(log_p, log_q.clamp_min(self.log_floor)).clamp(-self.clip, self.clip)
        response = (torch.where(mask, ell, torch.zeros_like(ell)).sum(), mask.sum().to(ell.dtype))
        rounds = self._rounds(ctx)
        if rounds is None or self.rejected_weight == 0:
            zero = ell.sum() * 0
            return [response, (zero, zero.detach())]
        has = rounds.rejected >= 0  # (N, A, K)
        log_q = _draft_logprobs(draft).gather(-1, rounds.rejected.clamp_min(0)[..., None])[..., 0]
        ell_r = k3(rounds.rejected_logp.to(log_q).clamp_min(self.log_floor), log_q.clamp_min(self.log_floor))
        weight = self.rejected_decay ** (rounds.offset.clamp_min(1) - 1).to(log_q)  # (N, A, K)
        ell_r = (weight * ell_r.clamp(-self.clip, self.clip)).masked_fill(~has, 0)
        return [response, (ell_r.sum(), has.sum().to(ell_r.dtype))]

    def sequence_dens(self, draft: DraftOutput, ctx: StepContext) -> list[Tensor | None]:
        return [None, None]

    @property
    def num_pairs(self) -> int:
        return 2

    def combine(self, pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        (num_s, den_s), (num_r, den_r) = pairs
        metrics = {"opd_response": num_s.detach() / den_s.clamp_min(1),
                   "opd_rejected": num_r.detach() / den_r.clamp_min(1)}
        return num_s + self.rejected_weight * num_r, den_s + den_r, metrics
