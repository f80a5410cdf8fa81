"""Decoding chosen from measured costs: plain, n-gram lookup, the drafter's chain or one of its trees (with or
without n-gram candidates), whichever is expected to give the most tokens per second on this machine, picked over
plain decoding only when it is sure enough to be faster.

A plan's speed is tokens per round over seconds per round, and both are measured, not assumed:
- tokens per round: the plan's rounds scored exactly on calibration outputs, the target's own answers to a few
  prompts (``evaluation.offline.replay_tree_rounds`` replays every round and gives its size, so proposals whose size
  varies, such as n-gram lookups that find nothing, are costed round by round; drawn chains under sampling are
  scored by the exact evaluator, ``offline_report``);
- seconds per round: the proposal's time plus the target's verify forward over the anchor and the proposal's nodes,
  both timed on this machine against a warm KV cache (``measure_costs``; the target's times are kept for the
  process, per machine, dtype, thread count and target), plus the loop's own bookkeeping per round, measured as
  what a timed decode spent beyond those (``round_overhead``: plain decoding's from the calibration decodes, a
  speculative plan's from one decode of a calibration prompt with it); each prompt's prefill is added once.
Each plan is estimated per calibration prompt; its expected tokens/s is Σ tokens / Σ seconds over them.

Plain decoding is one of the plans and the judge: another plan is picked only when the one-sided lower
confidence bound of its pooled speedup over plain, Σ plain seconds / Σ its seconds (``speedup_bound``: a t
interval on the log of that ratio by the delta method, paired over prompts because every plan is scored on the
same outputs) exceeds 1 + ``margin``. Picking the best of many plans is held to a 5% error as a whole
(``decide``): from 4 calibration prompts the candidate is the plan with the highest bound on every other prompt,
and it is picked only if its bound on the remaining prompts, which did not choose it, clears the margin; with
fewer prompts the bounds of all m plans hold together (Šidák, ``family_confidence``). The best of twenty bounds
each at 95% would pick a plan no faster than plain in 13-16% of runs. A point estimate would take whatever the
calibration prompts happened to favour: two of them whose answers repeated themselves made an n-gram trie look
1.42x faster, and it measured 0.69x on other prompts.
One calibration prompt gives no bound, so it keeps plain decoding.

What the estimate still leaves out: the cache's growth over an answer (verify times are taken at one context
length; the measured per-round residual absorbs it only for plain and the plans decoded to measure it), the
bookkeeping of speculative plans not decoded (they take the largest measured), and prompts unlike the
calibration ones. ``benchmarks/decode_speed.py`` reports measured over expected as engine efficiency.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding.engine import Generation, _as_ids, draft, generate
from lightning_spec.decoding.plans import Chain, Ngram, Plain, Plan, Tree
from lightning_spec.decoding.proposer import TreeGrowth, chosen_rounds
from lightning_spec.errors import UserError
from lightning_spec.evaluation.offline import offline_report, replay_tree_rounds
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig

PLAIN = Plain()


def candidates(drafter: Any = None) -> list[Plan]:
    """The plans ``choose_decoding`` compares by default: plain; n-gram chains of 4 and 10 tokens and n-gram tries
    of 8 and 16 nodes; with a drafter its chain, its chain cut to half its slots (K >= 4), and, where the chain is
    a one-child tree (tree growth best-first or dynamic), chains that stop where the drafter's confidence falls below
    0.3 or 0.1; and if it grows trees, trees of 4..32 nodes, top 2 or 4, each without and with a quarter of the
    nodes offered to n-gram candidates."""
    out: list[Plan] = [PLAIN, Ngram(length=4), Ngram(length=10), Ngram(length=10, nodes=8, top_k=3),
                       Ngram(length=10, nodes=16, top_k=4)]
    if drafter is None:
        return out
    out.append(Chain())
    if drafter.block_size >= 4:
        out.append(Chain(length=drafter.block_size // 2))
    if drafter.tree_growth in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC):
        out += [Chain(stop_below=0.3), Chain(stop_below=0.1)]
    if not drafter.grows_trees:  # a chain-only family
        return out
    for nodes in (4, 8, 16, 32):
        for top_k in (2, 4) if nodes >= 8 else (2,):
            for ngram in (0, max(2, nodes // 4)):
                out.append(Tree(nodes=nodes, top_k=top_k, ngram=ngram))
    return out


# ------------------------------------------------------------------------------------------------- costs
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
def measure_costs(target: Any, drafter: Any, plans: list[Plan], context: list[int], repeats: int = 7) -> Costs:
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


# ------------------------------------------------------------------------------------------ the estimate
CONFIDENCE = 0.95  # one-sided: a plan is picked when its speedup's lower bound at this confidence clears the margin
MARGIN = 0.05  # what the bound must beat plain by: machine noise between calibration and decoding (plain decoding
# measured against itself spread 0.94x-1.00x on the 2-core CPU), the cache growth the verify model leaves out, and
# prompts less like the calibration ones than they are like each other; 5% keeps a pick >= ~0.98x plain elsewhere
PROBES = 2  # decodes of one calibration prompt that measure a leading speculative plan's bookkeeping per round


@dataclass(frozen=True)
class Estimate:
    """A plan's figures on each calibration output: tokens, rounds (exact; expected for drawn chains) and expected
    seconds (the prompt's prefill + Σ over rounds of draft + verify + bookkeeping); ``lcb``: the lower confidence
    bound of its pooled speedup over plain (``speedup_bound``; plain's is 1, None where undefined)."""

    plan: Plan
    prompt_tokens: tuple[int, ...]  # (P,)
    prompt_rounds: tuple[float, ...]  # (P,)
    prompt_seconds: tuple[float, ...]  # (P,)
    lcb: float | None = None

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


@torch.no_grad()
def estimate(target: Any, drafter: Any, plan: Plan, outputs: list[tuple[list[int], list[int]]],
             sampling: SamplingConfig, costs: Costs, features: list[Tensor | None] | None = None,
             prefill: list[float] | None = None) -> Estimate | None:
    """The plan's exact rounds on each of ``outputs`` (prompt, response) and their expected seconds: its proposals
    and verify forwards (``costs``), its bookkeeping per round (``Costs.overhead_seconds``) and each prompt's
    ``prefill`` seconds (None: none). None when they cannot be scored exactly (a tree grown from drawn drafts, under
    sampling). ``features``: the target's features of each output for the drafter's layers, computed once for every
    plan (None: computed here). ``lcb`` is left to ``with_bounds``, which compares plans."""
    counted = _count(target, drafter, plan, outputs, sampling, costs, features)
    return None if counted is None else _with_overheads(counted, costs, prefill)


def _count(target: Any, drafter: Any, plan: Plan, outputs: list[tuple[list[int], list[int]]],
           sampling: SamplingConfig, costs: Costs, features: list[Tensor | None] | None) -> Estimate | None:
    """``estimate`` without bookkeeping and prefill: per prompt, its rounds and their draft + verify seconds."""
    tokens = tuple(len(r) for _, r in outputs)
    run = plan.resolve(drafter)
    if run.proposer is None:
        verify = costs.verify_seconds(1, tree=False)
        return Estimate(plan, tokens, tuple(map(float, tokens)), tuple(t * verify for t in tokens))
    d, tree = run.proposer, run.tree
    d.use_target(target)
    per_round_draft = costs.draft[plan]
    chosen = sampling.greedy or chosen_rounds(d, tree)
    if chosen:  # replay every round: exact, with each round's size
        layers = list(d.target_layers)
        features = features or output_features(target, layers, outputs)
        rounds, seconds = [], []
        for (prompt, response), feats in zip(outputs, features):
            sizes: list[int] = []  # draft nodes of each of this output's rounds
            if response:
                ids = torch.tensor([prompt + response], device=target.device)
                replay_tree_rounds(d, ids, feats if layers else None, [prompt], [response], tree, sampling, sizes,
                                   length=run.length)
            rounds.append(float(len(sizes)))
            seconds.append(sum(per_round_draft + costs.verify_seconds(1 + n, tree is not None) for n in sizes))
        return Estimate(plan, tokens, tuple(rounds), tuple(seconds))
    if tree is not None or (run.length or d.block_size) < d.block_size:  # the exact evaluator scores whole chains
        return None
    rounds = offline_report(target, d, outputs, sampling).rounds.tolist()  # drawn chains: exact expected rounds
    per_round = per_round_draft + costs.verify_seconds(1 + d.block_size, False)
    return Estimate(plan, tokens, tuple(rounds), tuple(r * per_round for r in rounds))


def _with_overheads(counted: Estimate, costs: Costs, prefill: list[float] | None) -> Estimate:
    """``counted`` (draft + verify seconds per prompt) with its bookkeeping per round and each prompt's prefill."""
    per_round = costs.overhead_seconds(counted.plan)
    prefill = prefill or [0.0] * len(counted.prompt_tokens)
    seconds = tuple(s + r * per_round + p for s, r, p in zip(counted.prompt_seconds, counted.prompt_rounds, prefill))
    return dataclasses.replace(counted, prompt_seconds=seconds)


def output_features(target: Any, layers: list[int], outputs: list[tuple[list[int], list[int]]]
                    ) -> list[Tensor | None]:
    """The target's features (1, S, F) of each prompt + response for ``layers`` (None without layers)."""
    if not layers:
        return [None] * len(outputs)
    return [target(torch.tensor([p + r], device=target.device), layers=layers, logits=False).features
            for p, r in outputs]


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


# ---------------------------------------------------------------------------------------------- the judge
def t_quantile(q: float, dof: int) -> float:
    """Student's t quantile (P(T <= t) = q >= 0.5, ``dof`` >= 1 degrees of freedom), by bisection on the closed
    form of P(|T| <= t) for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    lo, hi = 0.0, 1e6
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_within(mid, dof) < 2 * q - 1 else (lo, mid)
    return (lo + hi) / 2


def _t_within(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` degrees of freedom; θ = atan(t / √dof)."""
    theta = math.atan(t / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    total = 0.0
    if dof % 2:  # odd: (2/π)(θ + sinθ (cosθ + (2/3) cos³θ + (2·4)/(3·5) cos⁵θ + ...)), (dof - 1) / 2 terms
        term = math.sin(theta) * math.cos(theta)
        for j in range((dof - 1) // 2):
            total += term
            term *= c2 * (2 * j + 2) / (2 * j + 3)
        return 2 / math.pi * (theta + total)
    term = 1.0  # even: sinθ (1 + (1/2) cos²θ + (1·3)/(2·4) cos⁴θ + ...), dof / 2 terms
    for j in range(dof // 2):
        total += term
        term *= c2 * (2 * j + 1) / (2 * j + 2)
    return math.sin(theta) * total


def speedup_bound(plain: Estimate, other: Estimate, confidence: float = CONFIDENCE) -> float | None:
    """The one-sided lower confidence bound of ``other``'s speedup over plain decoding: the pooled speedup its
    ``tokens_per_s`` reports, R = Σ plain seconds / Σ other seconds (both decode the same outputs, so the tokens
    cancel), not a mean of per-prompt speedups (a plan fast on short prompts and slow on long ones is slower
    overall). The bound is taken on log R by the delta method, paired over prompts: prompt i moves log R by
    z_i = p_i / mean(p) - o_i / mean(o), so log R's standard error is sd(z) / √n and the bound is
    R · exp(-t_{confidence, n-1} · sd(z) / √n). None from fewer than 2 prompts with tokens: one says nothing of how
    the speedup varies from prompt to prompt."""
    pairs = [(p, o) for p, o, t in zip(plain.prompt_seconds, other.prompt_seconds, plain.prompt_tokens)
             if t > 0 and p > 0 and o > 0]
    if len(pairs) < 2:
        return None
    mean_p, mean_o = statistics.fmean(p for p, _ in pairs), statistics.fmean(o for _, o in pairs)
    spread = statistics.stdev(p / mean_p - o / mean_o for p, o in pairs) / math.sqrt(len(pairs))
    return mean_p / mean_o * math.exp(-t_quantile(confidence, len(pairs) - 1) * spread)


def family_confidence(confidence: float, plans: int) -> float:
    """The confidence each of ``plans`` bounds is taken at so that all of them hold together at ``confidence``
    (Šidák: confidence ** (1 / m)). ``pick`` takes the best of m bounds: at 95% each, a plan no faster than plain
    clears one of 20 by chance far more often than 5% of the time (13.6% in the simulation of
    tests/evaluation/test_auto.py); at the corrected level, at most 5%."""
    return confidence ** (1 / max(plans, 1))


def with_bounds(estimates: list[Estimate], confidence: float = CONFIDENCE, joint: bool = True) -> list[Estimate]:
    """``estimates`` (plain's among them), each with its ``lcb`` over plain's (plain's own: 1), every bound at the
    ``family_confidence`` of the plans compared, so that they hold together at ``confidence`` (``joint``), or each
    at ``confidence`` alone."""
    plain = next(e for e in estimates if e.plan == PLAIN)
    each = family_confidence(confidence, sum(e.plan != PLAIN for e in estimates)) if joint else confidence
    return [dataclasses.replace(e, lcb=1.0 if e.plan == PLAIN else speedup_bound(plain, e, each))
            for e in estimates]


def pick(estimates: list[Estimate], margin: float = MARGIN) -> Plan:
    """Plain decoding, unless some plan's ``lcb`` exceeds 1 + ``margin``; of those, the one with the highest bound.
    Not the highest estimate: of many plans scored on a few prompts, the one estimated fastest is the likeliest
    to have been lucky on them (the winner's curse), and the bound discounts a plan by how much its speedup
    varied from prompt to prompt. Ties go to the simpler plan, listed first."""
    best = None
    for e in estimates:
        if e.plan != PLAIN and e.lcb is not None and e.lcb > 1 + margin and (best is None or e.lcb > best.lcb):
            best = e
    return PLAIN if best is None else best.plan


def on_prompts(estimate: Estimate, prompts: list[int]) -> Estimate:
    """``estimate`` restricted to the calibration prompts ``prompts`` (indices), its bound left to be taken."""
    def keep(values: tuple) -> tuple:
        return tuple(values[i] for i in prompts)

    return Estimate(estimate.plan, keep(estimate.prompt_tokens), keep(estimate.prompt_rounds),
                    keep(estimate.prompt_seconds))


@dataclass(frozen=True)
class Verdict:
    """What the judge decided: the pick, and under the split rule the candidate chosen on half the calibration
    prompts and its bound on the other half (None under the joint rule)."""

    plan: Plan
    candidate: Plan | None = None
    confirmed: float | None = None  # the candidate's lower bound on the prompts it was not chosen on
    confirm_prompts: int = 0


def decide(estimates: list[Estimate], margin: float = MARGIN, confidence: float = CONFIDENCE) -> Verdict:
    """Pick over many plans with the family-wise error held at 1 - ``confidence``. From 4 calibration prompts with
    tokens: the candidate is the plan with the highest lower bound on every other prompt (no threshold there: the
    choice is not the test), confirmed on the others by one bound at ``confidence``; picked when that bound beats
    plain by ``margin``. Choosing and confirming on different prompts is one test whatever the number of plans, which
    keeps more power than holding m bounds together (Šidák at m = 22 asks t_{0.9977} instead of t_{0.95}). With
    fewer prompts: the joint bounds over all of them (``with_bounds``, ``pick``)."""
    plain = next(e for e in estimates if e.plan == PLAIN)
    usable = [i for i, t in enumerate(plain.prompt_tokens) if t > 0]
    if len(usable) < 4 or len(estimates) < 3:
        return Verdict(pick(with_bounds(estimates, confidence), margin))
    choose, confirm = usable[0::2], usable[1::2]
    ranked = [e for e in with_bounds([on_prompts(e, choose) for e in estimates], confidence, joint=False)
              if e.plan != PLAIN and e.lcb is not None and e.seconds < on_prompts(plain, choose).seconds]
    if not ranked:  # no plan was faster than plain on the prompts it would be chosen on
        return Verdict(PLAIN, None, None, len(confirm))
    candidate = max(ranked, key=lambda e: e.lcb).plan  # the first listed among equals
    chosen = next(e for e in estimates if e.plan == candidate)
    bound = speedup_bound(on_prompts(plain, confirm), on_prompts(chosen, confirm), confidence)
    picked = candidate if bound is not None and bound > 1 + margin else PLAIN
    return Verdict(picked, candidate, bound, len(confirm))


# -------------------------------------------------------------------------------------------- the choice
@dataclass
class Choice:
    """The plan ``choose_decoding`` picked, what ``generate`` takes for it, every plan's estimate (with its
    lower bound), and the margin and confidence it was judged at."""

    plan: Plan  # generate(plan=...)
    drafter: Any  # generate(drafter=...): the drafter the plan drafts with (None: none)
    estimates: list[Estimate]
    machine: str
    dtype: str
    margin: float = MARGIN
    confidence: float = CONFIDENCE
    costs: Costs | None = None  # what the estimates were computed from (timed here, or passed in)
    verdict: Verdict | None = None  # how the pick was judged (``decide``); None: the joint rule

    @property
    def expected(self) -> Estimate:
        return next(e for e in self.estimates if e.plan == self.plan)

    @property
    def plain(self) -> Estimate:
        return next(e for e in self.estimates if e.plan == PLAIN)

    @property
    def expected_speedup(self) -> float:
        return self.expected.tokens_per_s / self.plain.tokens_per_s

    @property
    def compared(self) -> int:
        """Plans judged against plain: the bounds hold together over this many (``family_confidence``)."""
        return sum(e.plan != PLAIN for e in self.estimates)

    @property
    def prompts(self) -> int:
        """Calibration prompts that count in the bounds (an answer of no token counts in none)."""
        return sum(t > 0 for t in self.plain.prompt_tokens)

    def generate(self, target: Any, input_ids: Any, max_new_tokens: int, sampling: Any = None, seed: int | None = None
                 ) -> Any:
        return generate(target, input_ids, max_new_tokens, sampling, drafter=self.drafter, seed=seed, plan=self.plan)

    def describe(self, measured_speedup: float | None = None, measured_tokens_per_s: float | None = None) -> str:
        """One line: what was picked, its expected MAL, tokens/s and speedup over plain with the lower bound (or why
        plain was kept), and the measured speedup and tokens/s when given; when plain was kept, the measured figure
        is plain decoding against itself, so it is given as the run-to-run spread, not as a speed result."""
        e, pct = self.expected, f"{self.confidence:.0%}"
        v = self.verdict
        split = v is not None and v.confirm_prompts > 0
        if self.plan != PLAIN and split:
            why = (f"{self.expected_speedup:.2f}x plain, {pct} lower bound {v.confirmed:.2f}x on the "
                   f"{v.confirm_prompts} calibration prompts it was not chosen on (of {self.compared} plans)")
        elif self.plan != PLAIN:
            why = (f"{self.expected_speedup:.2f}x plain, {pct} joint lower bound {e.lcb:.2f}x of {self.compared} "
                   f"plans over {self.prompts} calibration prompts")
        elif self.prompts < 2:
            why = (f"{self.prompts} calibration prompt with tokens gives no lower bound (it takes 2), so no plan "
                   "is picked over plain")
        elif split and v.candidate is not None:
            bound = "no bound" if v.confirmed is None else f"a {pct} lower bound of {v.confirmed:.2f}x"
            why = (f"the best of {self.compared} plans on half the calibration prompts, {v.candidate.label}, has "
                   f"{bound} on the {v.confirm_prompts} others, not above {1 + self.margin:.2f}x")
        elif split:
            why = "no plan was faster than plain on the half of the calibration prompts a candidate is chosen on"
        else:
            best = max((x for x in self.estimates if x.lcb is not None and x.plan != PLAIN),
                       key=lambda x: x.lcb, default=None)
            why = (f"no plan's {pct} joint lower bound ({self.compared} plans) over {self.prompts} calibration "
                   f"prompts beat plain by {self.margin:.0%}"
                   + (f"; best {best.plan.label} at {best.lcb:.2f}x, expected "
                      f"{best.tokens_per_s / self.plain.tokens_per_s:.2f}x" if best else ""))
        line = (f"decoding auto: {self.plan.label} (expected MAL {e.mal:.2f}, {e.tokens_per_s:.1f} tokens/s, "
                f"{why}; {self.machine}, {self.dtype})")
        if measured_speedup is not None and self.plan == PLAIN:  # plain against plain: no speed result, noise
            line += f"; kept plain decoding: plain against itself measured {measured_speedup:.2f}x (run-to-run spread)"
        elif measured_speedup is not None:
            line += f"; measured {measured_speedup:.2f}x"
            if measured_tokens_per_s is not None:
                line += f", {measured_tokens_per_s:.1f} tokens/s"
        return line

    def table(self) -> str:
        """Every plan's estimate, fastest first, with its lower bound."""
        rows = sorted(self.estimates, key=lambda e: -e.tokens_per_s)
        plain = self.plain.tokens_per_s
        lines = [f"  {'plan':<36}{'MAL':>6}{'tokens/s':>10}{'/ plain':>9}{'LCB':>8}"]
        lines += [f"  {e.plan.label:<36}{e.mal:>6.2f}{e.tokens_per_s:>10.2f}{e.tokens_per_s / plain:>8.2f}x"
                  + (f"{e.lcb:>7.2f}x" if e.lcb is not None else f"{'-':>8}")
                  + ("  <- picked" if e.plan == self.plan else "") for e in rows]
        lines.append(f"  LCB: the lower bound of the speedup over plain, {self.confidence:.0%} for all {self.compared} "
                     f"plans together (each at {family_confidence(self.confidence, self.compared):.2%}), over the "
                     f"{self.prompts} calibration prompts")
        v = self.verdict
        if v is not None and v.confirm_prompts:
            confirmed = "none" if v.candidate is None else (
                f"{v.candidate.label}, " + ("no bound" if v.confirmed is None else f"{v.confirmed:.2f}x"))
            lines.append(f"  picked: the plan with the highest {self.confidence:.0%} bound on every other calibration "
                         f"prompt, confirmed on the other {v.confirm_prompts} above {1 + self.margin:.2f}x "
                         f"(candidate: {confirmed})")
        else:
            lines.append(f"  picked over plain only above {1 + self.margin:.2f}x")
        return "\n".join(lines)


def choose_decoding(
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    sampling: SamplingConfig | dict | None = None,
    max_new_tokens: int = 48,
    plans: list[Plan] | None = None,
    costs: Costs | None = None,
    outputs: list[list[int]] | None = None,
    margin: float = MARGIN,
    progress: bool = False,
) -> Choice:
    """``decoding: auto``: the fastest plan for this target, drafter and machine that is sure enough to beat plain
    decoding (``pick``), else plain decoding.

    Args:
        target: a loaded ``Target``.
        drafter: the trained drafter (bound to ``target``), or None (plain and n-gram plans only).
        prompts: calibration prompts (each as ``generate`` takes it: token ids or a tokenizer's output), prompts the
            decoding will not be judged on, a few of every kind it will decode (one gives no lower bound: plain).
        sampling: the decoding's sampling config (None: greedy).
        max_new_tokens: tokens the target answers each calibration prompt with.
        plans: the plans to compare (default ``candidates(drafter)``); plain is always among them.
        costs: measured ``Costs`` to use instead of timing them (``measure_costs``); given, nothing is timed, and
            bookkeeping and prefill count only as far as ``costs.overhead`` says.
        outputs: the target's answers to ``prompts`` under ``sampling`` if already decoded (else decoded here, timed
            for plain decoding's bookkeeping per round and each prompt's prefill when ``costs`` is None).
        margin: how much faster than plain a plan's lower bound must be (``MARGIN``: why 5%).
        progress: show a progress bar over the plans.
    """
    sampling = SamplingConfig.coerce(sampling)
    if not prompts:
        raise UserError("choose_decoding needs calibration prompts: a few prompts like those it will decode.")
    if margin < 0:
        raise UserError(f"choose_decoding margin={margin} must be >= 0: it is how far a plan's lower bound must "
                        "beat plain decoding (0.05: by 5%).")
    prompts = [_as_ids(p, target.vocab_size, target.device)[0].tolist() for p in prompts]  # what generate takes
    plans = list(plans or candidates(drafter))
    if PLAIN not in plans:
        plans.insert(0, PLAIN)
    decodes = None
    if outputs is None:
        decodes = [generate(target, p, max_new_tokens, sampling, seed=i) for i, p in enumerate(prompts)]
        outputs = [g.tokens for g in decodes]
    pairs = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
    timed = costs is None and decodes is not None  # costs passed in: nothing is timed (deterministic)
    if costs is None:
        longest = max(pairs, key=lambda pr: len(pr[0]) + len(pr[1]))
        costs = measure_costs(target, drafter, plans, longest[0] + longest[1][: len(longest[1]) // 2])
    if timed:  # the median over the decodes: the first pays one-off costs
        costs.overhead[PLAIN] = statistics.median(round_overhead(g, PLAIN, costs) for g in decodes)
    # one target forward per output for every drafter plan (n-gram lookup reads no features)
    features = output_features(target, list(drafter.target_layers) if drafter is not None else [], pairs)
    counted = []
    with progress_bar("decoding auto: scoring plans", len(plans), progress) as bar:
        for plan in plans:
            c = _count(target, drafter, plan, pairs, sampling, costs, features)
            if c is not None:
                counted.append(c)
            bar.advance(1)
    prefill = [g.prefill_seconds for g in decodes] if timed else None
    probe = max(range(len(pairs)), key=lambda i: len(pairs[i][1]))  # the longest answer: the most rounds timed
    for probes in range(PROBES + 1):  # measure the leader's bookkeeping, then judge again
        estimates = with_bounds([_with_overheads(c, costs, prefill) for c in counted])
        verdict = decide(estimates, margin)
        lead = verdict.candidate or verdict.plan
        if not timed or lead == PLAIN or lead in costs.overhead or probes == PROBES:
            break
        gen = generate(target, prompts[probe], max_new_tokens, sampling, drafter=drafter, seed=probe, plan=lead)
        costs.overhead[lead] = round_overhead(gen, lead, costs)
    return Choice(verdict.plan, drafter, estimates, costs.machine or machine_name(target.device),
                  str(target.dtype).replace("torch.", ""), margin, CONFIDENCE, costs, verdict)
