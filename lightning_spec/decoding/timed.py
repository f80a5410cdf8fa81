"""Real speculative decoding over a set of prompts: MAL per domain, acceptance per slot, tokens/s, speedup.

Used by the ``SpecDecodeValidation`` callback and ``lightning-spec evaluate --mode online``. Plain decoding of the
same prompts runs in the same process through the same engine, so the speedup is a like-for-like ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_spec.decoding.engine import generate, resolve_run
from lightning_spec.decoding.plans import Plan
from lightning_spec.metrics import ratio, slot_counts
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.proposer import Proposer
    from lightning_spec.target import Target


@dataclass
class DecodeReport:
    """Sums over a decoded prompt set; every figure is a ratio of them (so DDP ranks add their sums first).

    The per-domain and per-slot sums have the names and shapes of ``OfflineReport``'s (``domain_sums``,
    ``slot_accepted``, ``slot_reached``), so one reduction serves both evaluations.
    """

    slot_accepted: Tensor  # (K,) float64 rounds that accepted draft k
    slot_reached: Tensor  # (K,) float64 rounds that verified draft k
    by_domain: dict[str, list[int]] = field(default_factory=dict)  # domain -> [Σ tokens, Σ rounds]
    tokens: int = 0  # committed tokens, bonus included
    rounds: int = 0
    seconds: float = 0.0
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    answers: list[tuple[list[int], list[int], str]] = field(default_factory=list)  # (prompt, tokens, domain) each

    def add(self, gen: Any, domain: str, tree: bool = False) -> None:
        """Add one speculative ``Generation`` of a prompt of ``domain``; with ``tree``, slot k counts depth k (a
        tree's nodes are not its depth: every round of a tree reaches depth 1..K while its path lasts)."""
        sums = self.by_domain.setdefault(domain, [0, 0])
        sums[0] += len(gen.tokens)
        sums[1] += gen.rounds
        drafted = None if tree else gen.draft_lengths
        accepted, reached = slot_counts(gen.accept_lengths, len(self.slot_accepted), drafted)
        self.slot_accepted += accepted
        self.slot_reached += reached
        self.tokens += len(gen.tokens)
        self.rounds += gen.rounds
        self.seconds += gen.seconds
        self.draft_seconds += gen.draft_seconds
        self.verify_seconds += gen.verify_seconds

    def domain_sums(self) -> dict[str, tuple[float, float]]:
        """{domain: (Σ tokens, Σ rounds)}, domains sorted."""
        return {d: (float(t), float(r)) for d, (t, r) in sorted(self.by_domain.items())}

    @property
    def mal(self) -> float:
        return ratio(self.tokens, self.rounds)

    @property
    def mal_by_domain(self) -> dict[str, float]:
        return {d: ratio(t, r) for d, (t, r) in self.domain_sums().items()}

    @property
    def accept_rate(self) -> Tensor:
        """AR_k = rounds accepting draft k / rounds verifying it, k = 1..K."""
        return self.slot_accepted / self.slot_reached.clamp_min(1e-12)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def plain_tokens_per_s(self) -> float:
        return self.plain_tokens / max(self.plain_seconds, 1e-9)

    @property
    def speedup(self) -> float | None:
        return self.tokens_per_s / self.plain_tokens_per_s if self.plain_seconds > 0 else None


def decode_prompts(
    target: Target,
    drafter: Proposer | str | None,
    prompts: list[dict[str, Any]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    measure_plain: bool = False,
    seed: int = 0,
    progress: Any = None,
    plan: Plan | dict | str | None = None,
) -> DecodeReport:
    """Decode every prompt (dicts with ``prompt_ids`` and ``domain``) with the drafter, and optionally plain.

    Seeds are per prompt (``prompt["seed"]`` when given, else ``seed + i``) so runs are reproducible and
    plain/speculative see the same prompts.
    ``progress`` is an optional callable advanced once per prompt; ``plan`` (``decoding/plans.py``; None: the chain)
    says how to decode (a tree's slot k is its depth k in the acceptance counts).
    """
    run = resolve_run(drafter, plan)
    block_size = (run.length or run.proposer.block_size) if run.proposer is not None else 1
    report = DecodeReport(torch.zeros(block_size, dtype=torch.float64), torch.zeros(block_size, dtype=torch.float64))
    for i, prompt in enumerate(prompts):
        prompt_seed = prompt.get("seed", seed + i)
        gen = generate(target, prompt["prompt_ids"], max_new_tokens, sampling, drafter=drafter, seed=prompt_seed,
                       plan=plan)
        report.add(gen, prompt["domain"], tree=run.tree is not None)
        report.answers.append((list(map(int, prompt["prompt_ids"])), list(gen.tokens), prompt["domain"]))
        if measure_plain:
            plain = generate(target, prompt["prompt_ids"], max_new_tokens, sampling, drafter=None, seed=prompt_seed)
            report.plain_tokens += len(plain.tokens)
            report.plain_seconds += plain.seconds
        if progress is not None:
            progress()
    return report
