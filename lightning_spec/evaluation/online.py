"""Online evaluation: real speculative decoding of the same prompts by plain decoding and every drafter, interleaved
prompt by prompt in one process, so a load change on the machine hits every arm alike (MAL, tokens/s, speedup).

Three parts, each usable alone:

- what decodes: one ``Decoding`` per checkpoint and plan (``decoding_of``): a ``DrafterDecoding`` (a drafter decoding
  with a plan, or with what decoding auto picked; plain decoding is one without a drafter) or an
  ``AdaptingDecoding`` (a drafter adapting while it decodes, an ``adapt`` plan, ``adaptation.py``). The
  runner only asks each to decode.
- the timed loop: ``OnlineRun.run()`` warms every decoding up, decodes prompt by prompt and returns the raw record,
  ``OnlineTimings`` (tokens, rounds and seconds per decoding and prompt, acceptance counts per slot).
- the statistics: ``online_statistics(timings, ...)``, a pure function of that record: per arm MAL, tokens/s and the
  speedup over plain decoding with a paired bootstrap interval, and the ``Comparison`` of MAL (``paired.py``).

``online_result`` puts them together as the JSON ``lightning-spec evaluate --mode online`` writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from lightning_spec.adaptation import CostAwareAdapter, decode_adapting
from lightning_spec.decoding.plans import Adapt, Auto, Chain, Plain, Plan, Run
from lightning_spec.decoding.proposer import Proposer
from lightning_spec.decoding.timed import DecodeReport, decode_prompts
from lightning_spec.evaluation.report import common_plan
from lightning_spec.paired import Bootstrap, Comparison, bootstrap_mal, compare, percentile_interval
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig
from lightning_spec.target import dtype_name

if TYPE_CHECKING:
    from lightning_spec.decoding.auto import Choice
    from lightning_spec.target import Target

WARM_UP_TOKENS = 8  # tokens of the warm-up decode (first calls pay one-off costs that are not decoding speed)


# ------------------------------------------------------------------------------------------ what decodes
class Decoding(Protocol):
    """One checkpoint of an arm and the way it decodes, as ``OnlineRun`` uses it."""

    name: str  # its arm: checkpoints given one name are seeds of one arm
    checkpoint: str
    plan: Plan  # how it was asked to decode

    @property
    def slots(self) -> int:
        """Draft slots its acceptance is counted over (a tree's depth)."""

    @property
    def parameters(self) -> int:
        """Parameters of its drafter."""

    def warm_up(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
                seed: int) -> None:
        """Decode briefly so that one-off costs (kernel selection, allocation) stay out of the timed loop."""

    def decode(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
               seed: int) -> DecodeReport:
        """Decode ``prompts`` (prompt i with seed ``seed + i``)."""

    def arm_details(self, seeds: list[Decoding]) -> dict[str, Any]:
        """What the JSON records about its arm (``seeds``: the arm's decodings, this one first) beyond the figures."""


@dataclass
class DrafterDecoding:
    """A checkpoint's drafter decoding with a plan (``decoding/plans.py``), or with what decoding auto picked for it
    (``choose_decodings``); without a drafter, plain decoding.

    Args:
        name: its arm.
        checkpoint: the checkpoint or exported folder it was loaded from.
        drafter: the loaded drafter, bound to the target (None: plain decoding).
        plan: how it decodes (``auto``: decoding auto picks, ``choose_decodings``).
        choice: decoding auto's ``Choice`` (``decoding/auto/``): the plan, and the target's dtype, it decodes with
            instead.
        dtype: the target's dtype it decodes in (``Target.cast``; None: the target's own): plain decoding in the
            dtype decoding auto found fastest.
    """

    name: str
    checkpoint: str
    drafter: Proposer | None
    plan: Plan = Chain()
    choice: Choice | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Auto):  # a plan the drafter cannot run is refused before anything decodes
            run = self.run
            if run.tree is not None and run.proposer is not None:
                run.proposer.check_tree()

    @property
    def decodes(self) -> Plan:
        """The plan it decodes with: its own, or decoding auto's pick."""
        if self.choice is not None:
            return self.choice.plan
        if isinstance(self.plan, Auto):
            raise ValueError(f"arm {self.name!r} decodes with decoding auto, which choose_decodings resolves first.")
        return self.plan

    @property
    def run(self) -> Run:
        """What ``generate`` runs for it: a plan of the drafter, n-gram lookup or plain decoding."""
        return self.decodes.resolve(self.drafter)

    @property
    def slots(self) -> int:
        run = self.run
        return (run.length or run.proposer.block_size) if run.proposer is not None else 1

    @property
    def parameters(self) -> int:
        """The drafter's weights (0 for n-gram lookup, which has none)."""
        if not isinstance(self.drafter, torch.nn.Module):
            return 0
        return int(sum(p.numel() for p in self.drafter.parameters()))

    def warm_up(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
                seed: int) -> None:
        self.decode(target, prompts, sampling, max_new_tokens, seed)

    def decode(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
               seed: int) -> DecodeReport:
        dtype = self.choice.dtype if self.choice is not None else self.dtype
        target = target if dtype is None else target.cast(dtype)
        return decode_prompts(target, self.drafter, prompts, sampling, max_new_tokens, seed=seed, plan=self.decodes)

    def arm_details(self, seeds: list[Decoding]) -> dict[str, Any]:
        """Decoding auto's pick of the arm's first checkpoint, the speed it expected on its calibration prompts and
        the lower bound it was picked on (the arm's measured figures sit beside them)."""
        if self.choice is None:
            return {}
        choice = self.choice
        return {"auto": {"picked": choice.plan.label, "plan": choice.plan.to_dict(), "dtype": choice.dtype,
                         "plain_dtype": choice.plain_dtype,
                         "expected_mal": choice.expected.mal, "expected_tokens_per_s": choice.expected.tokens_per_s,
                         "expected_speedup": choice.expected_speedup, "lcb": choice.expected.lcb,
                         "confidence": choice.confidence, "margin": choice.margin,
                         "calibration_prompts": choice.prompts, "machine": choice.machine}}


@dataclass
class AdaptingDecoding:
    """A checkpoint's drafter adapting while it decodes the prompts in order (an ``adapt`` plan,
    ``adaptation.py``): each prompt is its next window, its update time counted in its seconds."""

    name: str
    checkpoint: str
    adapter: CostAwareAdapter

    @property
    def plan(self) -> Plan:
        return self.adapter.plan

    @property
    def slots(self) -> int:
        return self.adapter.block_size

    @property
    def parameters(self) -> int:
        return int(sum(p.numel() for p in self.adapter.drafter.parameters()))

    def warm_up(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
                seed: int) -> None:
        """Warmed up without adapting: the warm-up is no window."""
        decode_prompts(target, self.adapter.drafter, prompts, sampling, max_new_tokens, seed=seed,
                       plan=self.adapter.plan.decoding)

    def decode(self, target: Target, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
               seed: int) -> DecodeReport:
        return decode_adapting(self.adapter, prompts, sampling, max_new_tokens, seed=seed)

    def arm_details(self, seeds: list[Decoding]) -> dict[str, Any]:
        """What every checkpoint's adapter spent its updates on (``CostAwareAdapter.summary``)."""
        return {"adaptation": [s.adapter.summary() for s in seeds]}


def decoding_of(name: str, checkpoint: str, drafter: Proposer, plan: Plan, target: Target, seed: int) -> Decoding:
    """How one checkpoint decodes under ``plan``: an adapting copy for an ``adapt`` plan (``drafter`` is adapted in
    place: load it for this arm alone), otherwise the drafter with the plan."""
    if isinstance(plan, Adapt):
        return AdaptingDecoding(name, checkpoint, CostAwareAdapter(drafter, target, plan, seed=seed))
    return DrafterDecoding(name, checkpoint, drafter, plan)


def choose_decodings(decodings: list[Decoding], target: Target, calibration: list[list[int]],
                     sampling: SamplingConfig, max_new_tokens: int, progress: bool) -> list[Decoding]:
    """Every decoding whose plan is ``auto`` with decoding auto's pick (``choose_decoding`` on ``calibration``,
    held-out prompts); the others as they are. Prints each pick."""
    from lightning_spec.decoding.auto import choose_decoding

    chosen = [dataclasses.replace(d, choice=choose_decoding(target, d.drafter, calibration, sampling, max_new_tokens,
                                                            auto=d.plan, progress=progress))
              if isinstance(d.plan, Auto) else d for d in decodings]
    for d in chosen:
        if isinstance(d, DrafterDecoding) and d.choice is not None:
            print(d.choice.describe())
    return chosen


def plain_dtype(run: OnlineRun) -> str:
    """The target's dtype the run's plain row decoded in."""
    cast = run.plain.dtype if isinstance(run.plain, DrafterDecoding) else None
    return cast or dtype_name(run.target.dtype)


def plain_baseline(decodings: list[Decoding]) -> DrafterDecoding:
    """The plain decoding every speedup is over: in the dtype decoding auto found fastest for plain decoding where
    an arm's auto searched the target's dtypes (``Auto.dtypes``), else in the target's own."""
    dtypes = [d.choice.plain_dtype for d in decodings if isinstance(d, DrafterDecoding) and d.choice is not None]
    return DrafterDecoding("plain", "", None, Plain(), dtype=next((t for t in dtypes if t is not None), None))


# -------------------------------------------------------------------------------------------- the timed loop
@dataclass
class OnlineTimings:
    """The raw record of a run. Row 0 is plain decoding, row 1 + j the run's j-th decoding; column i prompt i."""

    tokens: np.ndarray  # (1 + D, P) committed tokens
    rounds: np.ndarray  # (1 + D, P) rounds (target forwards)
    seconds: np.ndarray  # (1 + D, P) wall seconds (an adapting decoding's updates included)
    draft_seconds: np.ndarray  # (1 + D, P) seconds inside the drafter's propose
    slots: list[np.ndarray]  # per decoding (2, K): Σ rounds accepting slot k, Σ rounds verifying it

    @classmethod
    def zeros(cls, slots: list[int], prompts: int) -> OnlineTimings:
        """An empty record for decodings with ``slots`` draft slots each (plain decoding's row added)."""
        shape = (len(slots) + 1, prompts)
        return cls(np.zeros(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape),
                   [np.zeros((2, k)) for k in slots])

    def add(self, row: int, prompt: int, report: DecodeReport) -> None:
        self.tokens[row, prompt], self.rounds[row, prompt] = report.tokens, report.rounds
        self.seconds[row, prompt], self.draft_seconds[row, prompt] = report.seconds, report.draft_seconds
        if row > 0:
            self.slots[row - 1] += np.stack([report.slot_accepted.numpy(), report.slot_reached.numpy()])


@dataclass
class OnlineRun:
    """Plain decoding and every decoding over the same prompts, interleaved prompt by prompt.

    Args:
        target: the loaded target.
        decodings: one per checkpoint (an arm's seeds share its name), in the order of the JSON's arms.
        prompts: dicts with ``id``, ``domain`` and ``prompt_ids`` (``inputs.open_prompts``).
        sampling: the sampling config every decoding uses.
        max_new_tokens: the generation budget per prompt.
        seed: prompt i decodes with seed ``seed + i`` in every row.
        progress: show a progress bar.
        plain: the baseline every speedup is over (default: plain decoding by the same engine).
    """

    target: Target
    decodings: list[Decoding]
    prompts: list[dict[str, Any]]
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int = 0
    progress: bool = True
    plain: Decoding = field(default_factory=lambda: DrafterDecoding("plain", "", None, Plain()))

    @property
    def rows(self) -> list[Decoding]:
        """Plain decoding, then every decoding."""
        return [self.plain, *self.decodings]

    def warm_up(self) -> None:
        tokens = min(WARM_UP_TOKENS, self.max_new_tokens)
        for d in self.rows:
            d.warm_up(self.target, self.prompts[:1], self.sampling, tokens, self.seed)

    def run(self) -> OnlineTimings:
        """Warm up, then per prompt plain decoding and every decoding (so a load change hits all alike)."""
        self.warm_up()
        rows = self.rows
        timings = OnlineTimings.zeros([d.slots for d in self.decodings], len(self.prompts))
        label = f"online decoding ({len(self.decodings)} drafters + plain)"
        with progress_bar(label, len(self.prompts), self.progress) as bar:
            for i, prompt in enumerate(self.prompts):
                for j, d in enumerate(rows):
                    report = d.decode(self.target, [prompt], self.sampling, self.max_new_tokens, self.seed + i)
                    timings.add(j, i, report)
                bar.advance(1)
        return timings


# -------------------------------------------------------------------------------------------- the statistics
@dataclass
class OnlineStatistics:
    """Per arm its figures (the JSON's), plain decoding's, and the paired comparison of MAL."""

    arms: dict[str, dict[str, Any]]
    plain: dict[str, Any]
    comparison: Comparison


def online_statistics(timings: OnlineTimings, names: list[str], keys: list[str], domains: list[str],
                      bootstrap: Bootstrap) -> OnlineStatistics:
    """MAL, acceptance, tokens/s and speedup per arm from the record of a run. ``names``: the arm of every decoding
    (row 1 + j); ``keys``, ``domains``: each prompt's id (the bootstrap's clusters) and domain (the per-domain
    comparisons).

    An arm's checkpoints (seeds) decode their own tokens: tokens and rounds are averaged per prompt. The speedup's
    interval is paired: tokens/s of every arm and of plain decoding are recomputed on the same bootstrap resamples
    of all the prompts together (the MAL bootstrap's ratio of sums, with seconds for rounds)."""
    tok, rnd, sec = timings.tokens, timings.rounds, timings.seconds
    arm_list = list(dict.fromkeys(names))
    idx = {name: [j + 1 for j, n in enumerate(names) if n == name] for name in arm_list}
    comparison = compare(
        {name: rnd[idx[name]].mean(0) for name in arm_list},
        {name: tok[idx[name]].mean(0) for name in arm_list},
        keys, domains, bootstrap.baseline, bootstrap.n_resamples, bootstrap.confidence, bootstrap.seed,
    )
    for a in comparison.arms:
        a.checkpoint_mal = [float(tok[j].sum() / max(rnd[j].sum(), 1e-12)) for j in idx[a.name]]
    plain_tps = tok[0].sum() / max(sec[0].sum(), 1e-9)
    per_arm_tok = np.stack([tok[0]] + [tok[idx[name]].mean(0) for name in arm_list])  # (1 + A, R)
    per_arm_sec = np.stack([sec[0]] + [sec[idx[name]].mean(0) for name in arm_list])
    # all prompts resampled together, as the MAL intervals (by domain, a domain of one prompt would be a point)
    tps_boot = bootstrap_mal(per_arm_tok, per_arm_sec, keys, None, bootstrap.n_resamples, bootstrap.seed)
    speedup_boot = tps_boot[:, 1:] / tps_boot[:, :1]  # (B, A)
    arms = {}
    for a, name in enumerate(arm_list):
        j = idx[name]
        tps = tok[j].sum() / max(sec[j].sum(), 1e-9)
        # (2, K) counts added over the seeds; seeds whose picks draft fewer slots (decoding auto) reach none past K
        width = max(timings.slots[i - 1].shape[1] for i in j)
        acc = sum(np.pad(timings.slots[i - 1], ((0, 0), (0, width - timings.slots[i - 1].shape[1]))) for i in j)
        arms[name] = {
            "mal": comparison.arm(name).mal,
            "mal_by_domain": {d: comparison.arm(name, d).mal for d in comparison.by_domain},
            "accept_rate": (acc[0] / np.maximum(acc[1], 1)).tolist(),
            "tokens": int(tok[j].sum()),
            "seconds": float(sec[j].sum()),
            "tokens_per_s": float(tps),
            "speedup": float(tps / plain_tps),
            "speedup_ci": list(percentile_interval(speedup_boot[:, a], bootstrap.confidence)),
            "draft_ms_per_round": float(1000 * timings.draft_seconds[j].sum() / max(rnd[j].sum(), 1)),
        }
    plain = {"tokens": int(tok[0].sum()), "seconds": float(sec[0].sum()), "tokens_per_s": float(plain_tps)}
    return OnlineStatistics(arms, plain, comparison)


def online_result(run: OnlineRun, timings: OnlineTimings, bootstrap: Bootstrap, spec: str,
                  sources: list[str]) -> tuple[dict[str, Any], Comparison]:
    """The JSON of ``evaluate --mode online`` (``spec``: the target as named; ``sources``: the prompt sources) and
    the comparison its tables print."""
    keys = [p["id"] for p in run.prompts]
    domains = [p["domain"] for p in run.prompts]
    stats = online_statistics(timings, [d.name for d in run.decodings], keys, domains, bootstrap)
    arms = {}
    for name, figures in stats.arms.items():
        seeds = [d for d in run.decodings if d.name == name]
        arms[name] = {"checkpoints": [d.checkpoint for d in seeds], **figures, "parameters": seeds[0].parameters,
                      "decoding": seeds[0].plan.to_dict(), **seeds[0].arm_details(seeds)}
    return {
        "mode": "online",
        "target": spec,
        "target_fingerprint": run.target.fingerprint,
        "precision": run.target.precision,
        "sampling": run.sampling.to_dict(),
        "decoding": common_plan([d.plan for d in run.decodings]),
        "sources": [str(s) for s in sources],
        "prompts": len(run.prompts),
        "max_new_tokens": run.max_new_tokens,
        "plain": stats.plain | {"dtype": plain_dtype(run)},
        "rows": {"prompt_id": keys, "domain": domains, "plain_tokens": timings.tokens[0].tolist()},
        "arms": arms,
        "comparison": stats.comparison.to_dict(),
    }, stats.comparison
