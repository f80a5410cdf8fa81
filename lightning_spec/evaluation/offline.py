"""Exact expected decoding rounds from target rollouts, without a decoding loop (EDR: Zhao & Cai 2026, arXiv
2610.10411, §3 and the offline evaluator of §3.4).

Condition on a target rollout x = prompt + response. Speculative decoding of x is a Markov chain over round
states (``lightning_spec/decoding/rounds.py``, the same code EDR trains with); the expected number of rounds given x is
τ(x) = Σ_t ω_{t,t+1}, the occupancies of the round starts (EDR Prop. 1). Because lossless decoding outputs x
with the target's probability, the mean of τ over target rollouts is the expected round count of real
speculative decoding, with less noise: the acceptance coin flips are integrated out, and every drafter is scored
on the *same* rollouts (paired comparisons, ``paired.py``).

Conventions, the engine's exactly (``decoding/engine.py``):
- The first round is anchored at the LAST PROMPT TOKEN, so every response token is committed by some round and
  MAL = Σ len(response) / Σ rounds, bonus included. ``len(response)`` counts the EOS when it was generated; EDR
  writes the same count as L + 1 (x_{1:L} plus EOS), so this MAL is EDR's MAL = E[L + 1] / E[𝒯] (eq. 1).
- The response's last token ends generation (EOS, or the ``max_new_tokens`` budget for a rollout that was cut):
  the slot that verifies it ends the round whatever its verdict, as the engine stops there.
- p is the target's distribution under ``sampling`` (the engine's verification) from one teacher-forced forward;
  q is ``sampling.probs`` of the drafter's logits over its draft vocabulary (what ``propose`` draws from), 0
  outside it. Greedy: both are one-hot, so A = 1[draft argmax == x_t] (and x_t = target argmax on a greedy
  rollout), and τ(x) is the engine's round count exactly.
- The drafter is run from every anchor through its training forward (``Drafter.forward`` with explicit
  anchors), whose slot distributions are, by the drafter contract, those ``propose`` draws from when the earlier
  slots were accepted; slots a variable-length drafter does not submit (``DraftOutput.drafted``) are never
  accepted, and the next slot is the round's bonus.
- Trees (``tree=``): a best-first tree is a function of one anchor's slot distributions and is scored from the
  same forward (``rounds.tree_accept``); a tree grown from the drafter's own drafts (dynamic, D²SD, SpecBlock) is
  replayed round by round along greedy rollouts (``replay_tree_rounds``).
- N-gram candidates (``drafter="ngram"``, or ``tree.ngram`` merged into a tree) are chosen from the committed
  tokens, never drawn: their rounds are replayed, exactly under every sampling config (for a merged tree, when the
  family's own tree is best-first too), and n-gram lookup alone needs no target forward.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from lightning_spec.data.rollouts import RolloutSet, load_rollout_set
from lightning_spec.decoding.exact import replayed, score_outputs
from lightning_spec.decoding.ngram import as_proposer
from lightning_spec.decoding.proposer import Proposer, chosen_rounds, evaluating
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.errors import UserError
from lightning_spec.evaluation.inputs import Rollouts, open_rollouts, refuse_paths
from lightning_spec.progress import advancer, progress_bar
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


# -------------------------------------------------------------------------------------------------- report
@dataclass
class OfflineReport:
    """Per-rollout expected rounds and the pooled figures (MAL = Σ tokens / Σ rounds, bonus included)."""

    rounds: Tensor  # (R,) float64 τ(x): exact expected rounds to decode rollout x speculatively
    tokens: Tensor  # (R,) int64 response tokens (EOS included when generated) = committed tokens
    domains: list[str]
    prompt_keys: list[str]  # clusters for the bootstrap
    finished: list[bool]
    slot_reached: Tensor  # (K,) float64 Σ_x E[rounds that verify slot k | x]
    slot_accepted: Tensor  # (K,) float64 Σ_x E[rounds that accept slot k | x]
    seconds: dict[str, float] = field(default_factory=dict)  # target, drafter, dp, total

    @property
    def mal(self) -> float:
        return float(self.tokens.sum()) / max(float(self.rounds.sum()), 1e-12)

    @property
    def accept_rate(self) -> Tensor:
        """AR_k = E[rounds accepting slot k] / E[rounds verifying slot k] (EDR eq. 19), k = 1..K."""
        return self.slot_accepted / self.slot_reached.clamp_min(1e-12)

    def domain_sums(self) -> dict[str, tuple[float, float]]:
        """{domain: (Σ tokens, Σ rounds)}, domains sorted."""
        out: dict[str, list[float]] = {}
        for d, t, r in zip(self.domains, self.tokens.tolist(), self.rounds.tolist()):
            acc = out.setdefault(d, [0.0, 0.0])
            acc[0] += t
            acc[1] += r
        return {d: (out[d][0], out[d][1]) for d in sorted(out)}

    @property
    def mal_by_domain(self) -> dict[str, float]:
        return {d: t / max(r, 1e-12) for d, (t, r) in self.domain_sums().items()}

    def metrics(self, prefix: str = "offline") -> dict[str, float]:
        """Flat metrics: ``<prefix>/mal``, ``<prefix>/mal/<domain>``, ``<prefix>/accept_rate/t<k>``."""
        out = {f"{prefix}/mal": self.mal}
        out.update({f"{prefix}/mal/{d}": v for d, v in self.mal_by_domain.items()})
        out.update({f"{prefix}/accept_rate/t{k}": float(v) for k, v in enumerate(self.accept_rate.tolist(), 1)})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mal": self.mal,
            "mal_by_domain": self.mal_by_domain,
            "accept_rate": self.accept_rate.tolist(),
            "rollouts": len(self.domains),
            "tokens": int(self.tokens.sum()),
            "expected_rounds": float(self.rounds.sum()),
            "unfinished": sum(not f for f in self.finished),
            "seconds": self.seconds,
        }


def _check_scorable(drafter: Proposer, tree: TreeConfig | None, sampling: SamplingConfig,
                    batch_size: int, anchors_per_forward: int) -> None:
    """Refuse what ``offline_report`` cannot score exactly (a replayed tree under sampling) or at all."""
    if replayed(drafter, tree) and not chosen_rounds(drafter, tree) and not sampling.greedy:
        raise UserError(
            f"{type(drafter).__name__} grows its tree from its own drafts, which offline evaluation replays exactly "
            "under greedy decoding only; score it on greedy rollouts (--temperature 0) or with real decoding "
            "(evaluate --mode online)."
        )
    if batch_size < 1 or anchors_per_forward < 1:
        raise UserError(f"batch_size ({batch_size}) and anchors_per_forward ({anchors_per_forward}) must be >= 1.")


def _report(data: RolloutSet, rounds: Tensor, reached: Tensor, accepted: Tensor,
            seconds: dict[str, float]) -> OfflineReport:
    """The report of the opened rollouts ``data``: rounds (R,) per rollout, slots reached and accepted (K,)."""
    return OfflineReport(
        rounds=rounds,
        tokens=torch.tensor([len(x) for x in data.response_ids], dtype=torch.int64),
        domains=list(data.domains),
        prompt_keys=list(data.prompt_keys),
        finished=list(data.finished),
        slot_reached=reached,
        slot_accepted=accepted,
        seconds=seconds,
    )


def offline_report(
    target: Target,
    drafter: Proposer | Literal["ngram"],
    rollouts: Rollouts,
    sampling: SamplingConfig | None = None,
    *,
    max_rollouts: int | None = None,
    batch_size: int = 4,
    anchors_per_forward: int = 256,
    max_elems: int = 1 << 24,
    progress: bool | Callable[[int], None] = False,
    tree: TreeConfig | dict | None = None,
) -> OfflineReport:
    """Exact expected rounds of every rollout, and the pooled MAL, MAL per domain and AR_k.

    Args:
        target: a loaded ``Target`` (``load_target``).
        drafter: a loaded drafter (``load_drafter``) bound to ``target``, or n-gram lookup (``NgramDrafter()``, or
            ``"ngram"`` as ``generate`` takes it).
        rollouts: rollouts in memory: a ``RolloutSet`` (``load_rollout_set(folder)``, or ``open_rollouts`` of
            ``evaluation/inputs.py``), a ``datasets.Dataset`` of rollouts, or a list of ``(prompt_ids,
            response_ids)`` pairs. A path is refused: open the folder first.
        sampling: the config the rollouts were drawn under; None = the one the rollouts record.
            Rollouts drawn under another config, or from another target, are refused.
        max_rollouts: evaluate at most this many (``spread``: round-robin over domains, prompts first).
        batch_size: rollouts per target forward (right-padded, sorted by length).
        anchors_per_forward: anchors (over the batch) per drafter forward: memory, not results.
        max_elems: largest logits tensor materialised at once: memory, not results.
        progress: True shows a rich progress bar; a callable is called with the rollouts done per batch.
        tree: score rounds that verify the drafter's tree (``TreeConfig`` or a dict of its fields) instead of a
            chain, as ``generate(..., plan=TreeConfig(...))`` decodes: exact under greedy and sampling for best-first
            trees (``rounds.tree_accept``), under greedy only for the others (``replay_tree_rounds``).
    """
    start = time.perf_counter()
    refuse_paths("offline evaluation", target=target, rollouts=rollouts)
    drafter = as_proposer(drafter)  # "ngram" names n-gram lookup, as generate(drafter="ngram") takes it
    drafter.use_target(target)
    tree = TreeConfig.coerce(tree)
    if tree is not None:
        drafter.check_tree()
    data, sampling = open_rollouts(rollouts, target, sampling, max_rollouts)
    _check_scorable(drafter, tree, sampling, batch_size, anchors_per_forward)

    r, k = len(data), drafter.block_size
    rounds = torch.zeros(r, dtype=torch.float64)
    reached = torch.zeros(k, dtype=torch.float64)
    accepted = torch.zeros(k, dtype=torch.float64)
    seconds: dict[str, float] = {}
    todo = [i for i in sorted(range(r), key=lambda i: len(data.prompt_ids[i]) + len(data.response_ids[i]))
            if data.response_ids[i]]
    own_bar, callback = advancer(progress)
    with evaluating(drafter), progress_bar(f"offline rounds ({type(drafter).__name__}, K={k})", r, own_bar) as bar:
        advance = callback or bar.advance
        advance(r - len(todo))  # empty responses: no rounds
        for lo in range(0, len(todo), batch_size):
            index = todo[lo : lo + batch_size]
            tau, re, ac = score_outputs(
                target, drafter, [data.prompt_ids[i] for i in index], [data.response_ids[i] for i in index],
                sampling, anchors_per_forward, max_elems, seconds, tree,
            )
            rounds[index] = tau
            reached += re
            accepted += ac
            advance(len(index))
    seconds["total"] = time.perf_counter() - start
    return _report(data, rounds, reached, accepted, seconds)


def offline_rounds(target: Target, drafter: Proposer | Literal["ngram"],
                   rollouts: str | os.PathLike | Rollouts, sampling: SamplingConfig | None = None,
                   **kwargs: Any) -> Tensor:
    """Exact expected rounds per rollout (R,) float64, in the rollouts' order (part of the stable public API).

    ``rollouts``: a rollouts folder written by ``lightning-spec rollouts`` (this public entry point is an edge: it
    loads the folder, ``load_rollout_set``), or rollouts in memory: a ``RolloutSet``, a ``datasets.Dataset`` or a
    list of ``(prompt_ids, response_ids)`` pairs; ``sampling`` must be the config they were drawn under (default:
    the one they record). Pooled MAL of the set is ``Σ len(response) / Σ rounds``; see ``offline_report`` (loaded
    objects only) for that, per domain, and the keyword arguments."""
    if isinstance(rollouts, (str, os.PathLike)):
        rollouts = load_rollout_set(rollouts)
    return offline_report(target, drafter, rollouts, sampling, **kwargs).rounds

