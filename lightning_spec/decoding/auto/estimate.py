"""A plan's figures on each calibration output: its exact rounds and their expected seconds (``estimate``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_spec.decoding.auto.costs import Costs
from lightning_spec.decoding.exact import replay_tree_rounds, score_outputs
from lightning_spec.decoding.plans import Plan
from lightning_spec.decoding.proposer import Proposer, chosen_rounds, evaluating
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


@dataclass(frozen=True)
class Estimate:
    """A plan's figures on each calibration output: tokens, rounds (exact; expected for drawn chains) and expected
    seconds (the prompt's prefill + Σ over rounds of draft + verify + bookkeeping) with the target in ``dtype``
    (None: the target's own, when auto searches one dtype); ``lcb``: the lower confidence bound of its pooled speedup
    over the baseline, the fastest plain decoding (``speedup_bound``; the baseline's is 1, None where undefined)."""

    plan: Plan
    prompt_tokens: tuple[int, ...]  # (P,)
    prompt_rounds: tuple[float, ...]  # (P,)
    prompt_seconds: tuple[float, ...]  # (P,)
    lcb: float | None = None
    dtype: str | None = None

    @property
    def key(self) -> tuple[Plan, str | None]:
        """What decodes: the plan and the target's dtype."""
        return self.plan, self.dtype

    @property
    def label(self) -> str:
        return self.plan.label if self.dtype is None else f"{self.plan.label}, {self.dtype}"

    @property
    def tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def rounds(self) -> float:
        return sum(self.prompt_rounds)

    @property
    def seconds(self) -> float:
        return sum(self.prompt_seconds)

    @property
    def mal(self) -> float:
        return self.tokens / max(self.rounds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


@dataclass(frozen=True)
class Rounds:
    """A plan's rounds on each calibration output, whatever the dtype they are timed in: each round's drafted nodes
    where they were replayed (``sizes``), else the expected rounds of drawn chains of ``nodes`` slots."""

    plan: Plan
    prompt_tokens: tuple[int, ...]  # (P,)
    prompt_rounds: tuple[float, ...]  # (P,)
    sizes: tuple[tuple[int, ...], ...] | None  # (P, rounds of prompt p): draft nodes per round; None: drawn chains
    nodes: int = 0  # drawn chains: the slots every round verifies
    tree: bool = False  # verified under a tree mask

    def timed(self, costs: Costs, dtype: str | None = None) -> Estimate:
        """Its draft + verify seconds per prompt by ``costs`` (bookkeeping and prefill: ``_with_overheads``)."""
        draft = costs.draft.get(self.plan, 0.0)
        if self.sizes is not None:
            seconds = tuple(sum(draft + costs.verify_seconds(1 + n, self.tree) for n in sizes) for sizes in self.sizes)
        else:
            per_round = draft + costs.verify_seconds(1 + self.nodes, False)
            seconds = tuple(r * per_round for r in self.prompt_rounds)
        return Estimate(self.plan, self.prompt_tokens, self.prompt_rounds, seconds, dtype=dtype)


@torch.no_grad()
def estimate(target: Target, drafter: Proposer | None, plan: Plan, outputs: list[tuple[list[int], list[int]]],
             sampling: SamplingConfig, costs: Costs, features: list[Tensor | None] | None = None,
             prefill: list[float] | None = None) -> Estimate | None:
    """The plan's exact rounds on each of ``outputs`` (prompt, response) and their expected seconds: its proposals
    and verify forwards (``costs``), its bookkeeping per round (``Costs.overhead_seconds``) and each prompt's
    ``prefill`` seconds (None: none). None when they cannot be scored exactly (a tree grown from drawn drafts, under
    sampling). ``features``: the target's features of each output for the drafter's layers, computed once for every
    plan (None: computed here). ``lcb`` is left to ``with_bounds``, which compares plans."""
    counted = count_rounds(target, drafter, plan, outputs, sampling, features)
    return None if counted is None else _with_overheads(counted.timed(costs), costs, prefill)


def count_rounds(target: Target, drafter: Proposer | None, plan: Plan, outputs: list[tuple[list[int], list[int]]],
                 sampling: SamplingConfig, features: list[Tensor | None] | None) -> Rounds | None:
    """The plan's rounds on each output (``Rounds``): replayed exactly where the rounds are chosen (greedy, or
    drafts chosen under sampling), expected for drawn chains; None for a tree grown from drawn drafts."""
    tokens = tuple(len(r) for _, r in outputs)
    run = plan.resolve(drafter)
    if run.proposer is None:
        return Rounds(plan, tokens, tuple(map(float, tokens)), tuple((0,) * t for t in tokens))
    d, tree = run.proposer, run.tree
    d.use_target(target)
    chosen = sampling.greedy or chosen_rounds(d, tree)
    if chosen:  # replay every round: exact, with each round's size
        layers = list(d.target_layers)
        features = features or output_features(target, layers, outputs)
        sizes: list[tuple[int, ...]] = []
        for (prompt, response), feats in zip(outputs, features):
            drafted: list[int] = []  # draft nodes of each of this output's rounds
            if response:
                ids = torch.tensor([prompt + response], device=target.device)
                replay_tree_rounds(d, ids, feats if layers else None, [prompt], [response], tree, sampling, drafted,
                                   length=run.length)
            sizes.append(tuple(drafted))
        return Rounds(plan, tokens, tuple(float(len(s)) for s in sizes), tuple(sizes), tree=tree is not None)
    if tree is not None or (run.length or d.block_size) < d.block_size:  # the exact evaluator scores whole chains
        return None
    rounds = []  # drawn chains: exact expected rounds, one output at a time
    with evaluating(d):
        for prompt, response in outputs:
            tau = score_outputs(target, d, [prompt], [response], sampling, 256, 1 << 24, {})[0] if response else [0.0]
            rounds.append(float(tau[0]))
    return Rounds(plan, tokens, tuple(rounds), None, nodes=d.block_size)


def _with_overheads(counted: Estimate, costs: Costs, prefill: list[float] | None) -> Estimate:
    """``counted`` (draft + verify seconds per prompt) with its bookkeeping per round and each prompt's prefill."""
    per_round = costs.overhead_seconds(counted.plan)
    prefill = prefill or [0.0] * len(counted.prompt_tokens)
    seconds = tuple(s + r * per_round + p for s, r, p in zip(counted.prompt_seconds, counted.prompt_rounds, prefill))
    return dataclasses.replace(counted, prompt_seconds=seconds)


def output_features(target: Target, layers: list[int], outputs: list[tuple[list[int], list[int]]]
                    ) -> list[Tensor | None]:
    """The target's features (1, S, F) of each prompt + response for ``layers`` (None without layers)."""
    if not layers:
        return [None] * len(outputs)
    return [target(torch.tensor([p + r], device=target.device), layers=layers, logits=False).features
            for p, r in outputs]
