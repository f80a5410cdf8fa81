"""What a round costs on this machine, measured: the target's verify forward per query length, each plan's
proposal, and the decoding loop's own bookkeeping per round (``round_overhead``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_spec.decoding.auto.candidates import PLAIN
from lightning_spec.decoding.engine import Generation, draft
from lightning_spec.decoding.plans import Plan
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.proposer import Proposer
    from lightning_spec.target import Target


def machine_name(device: torch.device) -> str:
    """The GPU's or the CPU's model name: what a measured cost belongs to."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "cpu")
    except OSError:
        import platform

        return platform.processor() or "cpu"


@dataclass
class Costs:
    """Seconds on this machine: the target's forward over T query tokens after a warm cache, causal (chains) and
    under an ancestor mask (trees), at a few T (linear in between), each plan's proposal, and the loop's own
    bookkeeping per round (``round_overhead``)."""

    verify: dict[int, float]  # T -> seconds, causal
    tree_verify: dict[int, float]  # T -> seconds, under a tree mask
    draft: dict[Plan, float] = field(default_factory=dict)
    machine: str = ""
    overhead: dict[Plan, float] = field(default_factory=dict)  # seconds per round beyond draft and verify

    def overhead_seconds(self, plan: Plan) -> float:
        """The seconds per round ``plan``'s decoding spends beyond its modelled draft and verify
        (``round_overhead``): its own where measured; a speculative plan not measured takes the largest measured
        (speculative rounds keep caches, accept and extend at least as plain rounds do: the cautious guess); 0 where
        nothing was measured (costs passed in)."""
        if plan in self.overhead:
            return self.overhead[plan]
        return max(self.overhead.values()) if self.overhead and plan != PLAIN else 0.0

    def verify_seconds(self, tokens: int, tree: bool) -> float:
        """The verify forward over ``tokens`` query tokens (the anchor included), interpolated."""
        table = self.tree_verify if tree and tokens > 1 else self.verify
        ts = sorted(table)
        if tokens <= ts[0]:
            return table[ts[0]]
        for lo, hi in zip(ts, ts[1:]):
            if tokens <= hi:
                return table[lo] + (table[hi] - table[lo]) * (tokens - lo) / (hi - lo)
        lo, hi = ts[-2:] if len(ts) > 1 else (ts[0], ts[0])  # past the last point: the last slope
        slope = (table[hi] - table[lo]) / (hi - lo) if hi > lo else 0.0
        return table[hi] + slope * (tokens - hi)


_VERIFY_COSTS: dict[tuple, tuple[dict[int, float], dict[int, float]]] = {}  # kept for the process


def _median_seconds(fns: dict[Any, Any], repeats: int) -> dict[Any, float]:
    """The median seconds of every function, timed in turn within each repeat: a change of load on the machine
    hits every figure alike, so their ratios (what the choice turns on) hold."""
    for fn in fns.values():
        fn()  # warm-up: first calls pay one-off costs
    times: dict[Any, list[float]] = {name: [] for name in fns}
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()  # wait for queued kernels around each timing
    for _ in range(repeats):
        for name, fn in fns.items():
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if gpu:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _token_counts(most: int) -> list[int]:
    return sorted({t for t in (1, 2, 3, 5, 9, 17, 33, 65) if t < most} | {most})


@torch.no_grad()
def measure_costs(target: Target, drafter: Proposer | None, plans: list[Plan], context: list[int],
                  repeats: int = 7) -> Costs:
    """Time the target's verify forwards for every query length the plans can need (once per process for this
    target, dtype, machine, thread count and context length) and each plan's proposal, after ``context``,
    interleaved (``_median_seconds``)."""
    runs = {plan: plan.resolve(drafter) for plan in plans}
    most = max([1] + [1 + (r.tree.nodes if r.tree else (r.length or r.proposer.block_size))
                      for r in runs.values() if r.proposer is not None])
    layers = list(drafter.target_layers) if drafter is not None else []
    ids = torch.tensor([context[:-1]], device=target.device)
    cache = target.new_cache()
    out = target(ids, layers=layers, cache=cache, logits=False)
    past = cache.get_seq_length()
    key = (machine_name(target.device), str(target.dtype), torch.get_num_threads(), target.fingerprint, len(layers),
           past // 64, most)
    fns: dict[Any, Any] = {}
    if key not in _VERIFY_COSTS:
        gen = torch.Generator().manual_seed(0)
        for t in _token_counts(most):
            block = torch.randint(0, target.vocab_size, (1, t), generator=gen).to(target.device)
            mask = torch.ones(t, t, dtype=torch.bool).tril()  # an ancestor mask (a chain-shaped tree)

            def step(block=block, mask=None, lay=layers if t > 1 else []):
                positions = mask.sum(-1) - 1 if mask is not None else None
                target(block, layers=lay, cache=cache, positions=positions, tree_mask=mask)
                target.crop(cache, past)

            fns["verify", t] = step
            if t > 1:
                fns["tree", t] = lambda step=step, mask=mask: step(mask=mask)
    anchor = torch.tensor(context[-1:], device=target.device)
    greedy = SamplingConfig()
    for plan, run in runs.items():
        d = run.proposer
        if d is not None:
            d.use_target(target)
            state = d.begin(out.features, ids)
            fns["draft", plan] = lambda d=d, state=state, r=run: draft(d, state, anchor, context, greedy, r.tree,
                                                                       length=r.length)
    seconds = _median_seconds(fns, repeats)
    if key not in _VERIFY_COSTS:
        verify = {t: v for (kind, t), v in seconds.items() if kind == "verify"}
        tree_verify = {t: v for (kind, t), v in seconds.items() if kind == "tree"}
        _VERIFY_COSTS[key] = verify, tree_verify or dict(verify)
    verify, tree_verify = _VERIFY_COSTS[key]
    draft_seconds = {s: seconds.get(("draft", s), 0.0) for s in plans}  # plain drafts nothing
    return Costs(verify=verify, tree_verify=tree_verify, draft=draft_seconds, machine=key[0])




def round_overhead(gen: Generation, plan: Plan, costs: Costs) -> float:
    """Seconds per round that a timed decode with ``plan`` spent beyond its prefill and what ``costs`` model (a
    proposal and a verify forward over each round's drafted nodes): the loop's own bookkeeping (keeping the cache,
    accepting, the drafter's extend, the n-gram context) and what the verify times, taken at one context length,
    miss at this decode's (negative where they cost more than the loop's forwards did). Never below minus the
    cheapest round's modelled cost (a proposal and a 1-token verify), so no round costs less than nothing."""
    draft_seconds = costs.draft.get(plan, 0.0)
    modelled = sum(draft_seconds + costs.verify_seconds(1 + n, plan.verifies_tree) for n in gen.draft_lengths)
    residual = (gen.seconds - gen.prefill_seconds - modelled) / max(gen.rounds, 1)
    return max(residual, -(draft_seconds + costs.verify_seconds(1, tree=False)))
