"""SamplingConfig: the distribution tokens are drawn from, after temperature, top-k and top-p.

Lossless verification is exact only when p and q are the distributions tokens were actually drawn from
(Leviathan et al. 2023; EDR, Zhao & Cai 2026, arXiv 2610.10411, §5.1). So one implementation serves the
decoding engine (verification and drafting), the objectives (target distributions p) and the offline
evaluator, and training and evaluation always agree on p.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_spec.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature / top-p / top-k warps of the logits.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it before the softmax.
        top_p: nucleus filtering: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens (0 = off). Applied before ``top_p``, as in transformers.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        # NaN fails every comparison, so each check is written to be False for it
        t = self.temperature
        if not (isinstance(t, numbers.Real) and math.isfinite(t) and t >= 0):
            raise UserError(f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}.")
        if not (isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1):
            raise UserError(f"sampling.top_p must be in (0, 1], got {self.top_p}.")
        if not (isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise UserError(f"sampling.top_k must be an int >= 0 (0 = off), got {self.top_k!r}.")

    # ------------------------------------------------------------------------------------------ conversion
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, as stored in rollout metadata, results files and MLflow params."""
        return {"temperature": float(self.temperature), "top_p": float(self.top_p), "top_k": int(self.top_k)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingConfig:
        """The inverse of ``to_dict``; unknown keys are refused in one sentence."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"sampling has unknown keys {unknown}; use {sorted(known)}.")
        return cls(**{k: (int(v) if k == "top_k" else float(v)) for k, v in values.items()})

    @classmethod
    def coerce(cls, sampling: SamplingConfig | Mapping[str, Any] | None) -> SamplingConfig:
        """What a public function accepts as ``sampling``: a config, a dict of its fields, or None (greedy)."""
        if sampling is None:
            return cls()
        if isinstance(sampling, cls):
            return sampling
        if isinstance(sampling, Mapping):
            return cls.from_dict(sampling)
        raise TypeError(
            f"sampling must be a SamplingConfig or a dict like {{'temperature': 1.0}}, not {type(sampling).__name__}."
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logprobs(self, logits: Tensor) -> Tensor:
        """Log of the warped distribution; filtered tokens get -inf. Greedy: a one-hot on the argmax."""
        logits = logits.float()
        if self.greedy:
            out = torch.full_like(logits, float("-inf"))
            return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
            drop_sorted = (probs.cumsum(-1) - probs) >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.log_softmax(-1)

    def probs(self, logits: Tensor) -> Tensor:
        """The warped distribution over the last dim: (..., V) -> (..., V), rows sum to 1."""
        return self.logprobs(logits).exp()

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of ``probs`` (..., V) -> (...,); greedy takes the argmax.

        Seeded generators live on the CPU (one seed gives the same draws on any device), so with one the draw
        happens there and the token moves back to ``probs``' device."""
        if self.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        if generator is not None and generator.device != flat.device:
            flat = flat.to(generator.device)
        return torch.multinomial(flat, 1, generator=generator).to(probs.device).reshape(probs.shape[:-1])
