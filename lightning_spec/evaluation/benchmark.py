"""Real speculative decoding over a set of prompts: MAL per domain, acceptance per slot, tokens/s, speedup.

Used by the ``SpecDecodeValidation`` callback, the quickstart table and the benchmarks. Plain decoding of the
same prompts runs in the same process through the same engine, so the speedup is a like-for-like ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_spec.decoding.engine import generate
from lightning_spec.metrics import MeanAcceptedLength, SlotAcceptance
from lightning_spec.sampling import SamplingConfig


@dataclass
class DecodeReport:
    """Pooled results of decoding a prompt set (metrics objects so DDP ranks can be summed)."""

    mal: MeanAcceptedLength
    mal_by_domain: dict[str, MeanAcceptedLength]
    slots: SlotAcceptance
    tokens: int = 0
    seconds: float = 0.0
    plain_tokens: int = 0
    plain_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

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
    target: Any,
    drafter: Any,
    prompts: list[dict[str, Any]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    measure_plain: bool = False,
    seed: int = 0,
    progress: Any = None,
) -> DecodeReport:
    """Decode every prompt (dicts with ``prompt_ids`` and ``domain``) with the drafter, and optionally plain.

    Seeds are per prompt (``prompt["seed"]`` when given, else ``seed + i``) so runs are reproducible and
    plain/speculative see the same prompts.
    ``progress`` is an optional callable advanced once per prompt.
    """
    report = DecodeReport(
        mal=MeanAcceptedLength(),
        mal_by_domain={},
        slots=SlotAcceptance(drafter.block_size if drafter is not None else 1),
    )
    for i, prompt in enumerate(prompts):
        prompt_seed = prompt.get("seed", seed + i)
        gen = generate(target, prompt["prompt_ids"], max_new_tokens, sampling, drafter=drafter, seed=prompt_seed)
        report.mal.update(len(gen.tokens), gen.rounds)
        report.mal_by_domain.setdefault(prompt["domain"], MeanAcceptedLength()).update(len(gen.tokens), gen.rounds)
        report.slots.update(gen.accept_lengths)
        report.tokens += len(gen.tokens)
        report.rounds += gen.rounds
        report.seconds += gen.seconds
        report.draft_seconds += gen.draft_seconds
        report.verify_seconds += gen.verify_seconds
        if measure_plain:
            plain = generate(target, prompt["prompt_ids"], max_new_tokens, sampling, drafter=None, seed=prompt_seed)
            report.plain_tokens += len(plain.tokens)
            report.plain_seconds += plain.seconds
        if progress is not None:
            progress()
    return report
