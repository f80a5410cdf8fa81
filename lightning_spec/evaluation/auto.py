"""Decoding chosen from measured costs: plain, n-gram lookup, the drafter's chain or one of its trees (with or
without n-gram candidates), whichever is expected to give the most tokens per second on this machine.

A setting's speed is tokens per round over seconds per round, and both are measured, not assumed:
- tokens per round: the setting's rounds scored exactly on calibration outputs, the target's own answers to a few
  prompts (``evaluation.offline.replay_tree_rounds`` replays every round and gives its size, so proposals whose size
  varies, such as n-gram lookups that find nothing, are costed round by round; drawn chains under sampling are
  scored by the exact evaluator, ``offline_report``);
- seconds per round: the proposal's time plus the target's verify forward over the anchor and the proposal's nodes,
  both timed on this machine against a warm KV cache (``measure_costs``; the target's times are kept for the
  process, per machine, dtype, thread count and target).
Expected tokens/s = Σ tokens / Σ over rounds of (draft + verify(1 + nodes)). Plain decoding is one of the settings
and the others must beat it to be picked, so a drafter whose acceptance cannot pay for its verify cost falls back
to plain decoding or to n-gram lookup. What the estimate leaves out (the loop's own bookkeeping per round, the
prefill) is what ``benchmarks/decode_speed.py`` reports as engine efficiency: measured over expected.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding.engine import _as_ids, draft, generate
from lightning_spec.decoding.ngram import NgramDrafter
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.evaluation.offline import offline_report, replay_tree_rounds
from lightning_spec.progress import progress_bar
from lightning_spec.sampling import SamplingConfig


@dataclass(frozen=True)
class Setting:
    """One way to decode. ``kind``: ``plain``, ``ngram`` (prompt-and-output lookup of up to ``block_size`` tokens)
    or ``drafter`` (the trained drafter); ``tree``: None for a chain."""

    kind: str
    tree: TreeConfig | None = None
    block_size: int = 0

    @property
    def label(self) -> str:
        if self.kind == "plain":
            return "plain"
        what = f"n-gram (K={self.block_size})" if self.kind == "ngram" else "drafter"
        if self.tree is None:
            return f"{what} chain"
        extra = f" + {self.tree.ngram} n-gram" if self.tree.ngram else ""
        return f"{what} tree {self.tree.nodes}/top {self.tree.top_k}{extra}"

    def drafter(self, trained: Any) -> Any:
        """What ``generate(drafter=...)`` takes for this setting, given the trained drafter."""
        if self.kind == "plain":
            return None
        return NgramDrafter(block_size=self.block_size) if self.kind == "ngram" else trained


PLAIN = Setting("plain")


def candidates(drafter: Any = None) -> list[Setting]:
    """The settings ``choose_decoding`` compares by default: plain; n-gram chains of 4 and 10 tokens and n-gram
    tries of 8 and 16 nodes; with a drafter its chain and, if it grows trees, trees of 4..32 nodes, top 2 or 4,
    each without and with a quarter of the nodes offered to n-gram candidates."""
    out = [PLAIN, Setting("ngram", None, 4), Setting("ngram", None, 10),
           Setting("ngram", TreeConfig(nodes=8, top_k=3), 10), Setting("ngram", TreeConfig(nodes=16, top_k=4), 10)]
    if drafter is None:
        return out
    out.append(Setting("drafter"))
    try:
        drafter.check_tree()
    except ValueError:  # a chain-only family
        return out
    for nodes in (4, 8, 16, 32):
        for top_k in (2, 4) if nodes >= 8 else (2,):
            for ngram in (0, max(2, nodes // 4)):
                out.append(Setting("drafter", TreeConfig(nodes=nodes, top_k=top_k, ngram=ngram)))
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
    under an ancestor mask (trees), at a few T (linear in between), and each setting's proposal."""

    verify: dict[int, float]  # T -> seconds, causal
    tree_verify: dict[int, float]  # T -> seconds, under a tree mask
    draft: dict[Setting, float] = field(default_factory=dict)
    machine: str = ""

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
def measure_costs(target: Any, drafter: Any, settings: list[Setting], context: list[int], repeats: int = 7) -> Costs:
    """Time the target's verify forwards for every query length the settings can need (once per process for this
    target, dtype, machine, thread count and context length) and each setting's proposal, after ``context``,
    interleaved (``_median_seconds``)."""
    most = max([1] + [1 + (s.tree.nodes if s.tree else (s.block_size or drafter.block_size))
                      for s in settings if s.kind != "plain"])
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
    for setting in settings:
        d = setting.drafter(drafter)
        if d is not None:
            d.use_target(target)
            state = d.begin(out.features, ids)
            fns["draft", setting] = lambda d=d, state=state, s=setting: draft(d, state, anchor, context, greedy, s.tree)
    seconds = _median_seconds(fns, repeats)
    if key not in _VERIFY_COSTS:
        verify = {t: v for (kind, t), v in seconds.items() if kind == "verify"}
        tree_verify = {t: v for (kind, t), v in seconds.items() if kind == "tree"}
        _VERIFY_COSTS[key] = verify, tree_verify or dict(verify)
    verify, tree_verify = _VERIFY_COSTS[key]
    draft_seconds = {s: seconds.get(("draft", s), 0.0) for s in settings}  # plain drafts nothing
    return Costs(verify=verify, tree_verify=tree_verify, draft=draft_seconds, machine=key[0])


# -------------------------------------------------------------------------------------------- the choice
@dataclass
class Estimate:
    """A setting's figures on the calibration outputs: tokens, rounds (expected, exact) and expected seconds."""

    setting: Setting
    tokens: int
    rounds: float
    seconds: float

    @property
    def mal(self) -> float:
        return self.tokens / max(self.rounds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


@dataclass
class Choice:
    """The setting ``choose_decoding`` picked, what ``generate`` takes for it, and every setting's estimate."""

    setting: Setting
    drafter: Any  # generate(drafter=...)
    tree: TreeConfig | None  # generate(tree=...)
    estimates: list[Estimate]
    machine: str
    dtype: str

    @property
    def expected(self) -> Estimate:
        return next(e for e in self.estimates if e.setting == self.setting)

    @property
    def expected_speedup(self) -> float:
        plain = next(e for e in self.estimates if e.setting == PLAIN)
        return self.expected.tokens_per_s / plain.tokens_per_s

    def generate(self, target: Any, input_ids: Any, max_new_tokens: int, sampling: Any = None, seed: int | None = None
                 ) -> Any:
        return generate(target, input_ids, max_new_tokens, sampling, drafter=self.drafter, seed=seed, tree=self.tree)

    def describe(self, measured_speedup: float | None = None) -> str:
        """One line: what was picked, its expected MAL and speedup over plain, and the measured one if given."""
        e = self.expected
        line = (f"decoding auto: {self.setting.label} (expected MAL {e.mal:.2f}, {e.tokens_per_s:.1f} tokens/s, "
                f"{self.expected_speedup:.2f}x plain on {self.machine}, {self.dtype})")
        if measured_speedup is not None:
            line += f"; measured {measured_speedup:.2f}x"
        return line

    def table(self) -> str:
        """Every setting's estimate, fastest first."""
        rows = sorted(self.estimates, key=lambda e: -e.tokens_per_s)
        plain = next(e for e in self.estimates if e.setting == PLAIN).tokens_per_s
        lines = [f"  {'setting':<36}{'MAL':>6}{'tokens/s':>10}{'/ plain':>9}"]
        lines += [f"  {e.setting.label:<36}{e.mal:>6.2f}{e.tokens_per_s:>10.2f}{e.tokens_per_s / plain:>8.2f}x"
                  + ("  <- picked" if e.setting == self.setting else "") for e in rows]
        return "\n".join(lines)


@torch.no_grad()
def estimate(target: Any, drafter: Any, setting: Setting, outputs: list[tuple[list[int], list[int]]],
             sampling: SamplingConfig, costs: Costs, features: list[Tensor | None] | None = None) -> Estimate | None:
    """The setting's exact rounds on ``outputs`` (prompt, response) and their expected seconds; None when they
    cannot be scored exactly (a tree grown from drawn drafts, under sampling). ``features``: the target's features
    of each output for the drafter's layers, computed once for every setting (None: computed here)."""
    tokens = sum(len(r) for _, r in outputs)
    if setting.kind == "plain":
        return Estimate(setting, tokens, tokens, tokens * costs.verify_seconds(1, tree=False))
    d = setting.drafter(drafter)
    d.use_target(target)
    tree = setting.tree
    per_round_draft = costs.draft[setting]
    chosen = sampling.greedy or d.chosen_drafts or (tree is not None and d.best_first_trees)
    if chosen:  # replay every round: exact, with each round's size
        sizes: list[int] = []
        layers = list(d.target_layers)
        features = features or output_features(target, layers, outputs)
        for (prompt, response), feats in zip(outputs, features):
            if response:
                ids = torch.tensor([prompt + response], device=target.device)
                replay_tree_rounds(d, ids, feats if layers else None, [prompt], [response], tree, sampling, sizes)
        seconds = sum(per_round_draft + costs.verify_seconds(1 + n, tree is not None) for n in sizes)
        return Estimate(setting, tokens, len(sizes), seconds)
    if tree is not None:
        return None
    rounds = float(offline_report(target, d, outputs, sampling).rounds.sum())  # drawn chains: exact expected rounds
    return Estimate(setting, tokens, rounds, rounds * (per_round_draft + costs.verify_seconds(1 + d.block_size, False)))


def output_features(target: Any, layers: list[int], outputs: list[tuple[list[int], list[int]]]
                    ) -> list[Tensor | None]:
    """The target's features (1, S, F) of each prompt + response for ``layers`` (None without layers)."""
    if not layers:
        return [None] * len(outputs)
    return [target(torch.tensor([p + r], device=target.device), layers=layers, logits=False).features
            for p, r in outputs]


def choose_decoding(
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    sampling: SamplingConfig | dict | None = None,
    max_new_tokens: int = 48,
    settings: list[Setting] | None = None,
    costs: Costs | None = None,
    outputs: list[list[int]] | None = None,
    progress: bool = False,
) -> Choice:
    """``decoding: auto``: the fastest setting for this target, drafter and machine.

    Args:
        target: a loaded ``Target``.
        drafter: the trained drafter (bound to ``target``), or None (plain and n-gram settings only).
        prompts: calibration prompts (each as ``generate`` takes it: token ids or a tokenizer's output), a few the
            decoding will not be judged on.
        sampling: the decoding's sampling config (None: greedy).
        max_new_tokens: tokens the target answers each calibration prompt with.
        settings: the settings to compare (default ``candidates(drafter)``); plain is always among them.
        costs: measured ``Costs`` to use instead of timing them (``measure_costs``).
        outputs: the target's answers to ``prompts`` under ``sampling`` if already decoded (else decoded here).
        progress: show a progress bar over the settings.
    """
    sampling = SamplingConfig.coerce(sampling)
    if not prompts:
        raise ValueError("choose_decoding needs calibration prompts: a few prompts like those it will decode.")
    prompts = [_as_ids(p, target.vocab_size, target.device)[0].tolist() for p in prompts]  # what generate takes
    settings = list(settings or candidates(drafter))
    if PLAIN not in settings:
        settings.insert(0, PLAIN)
    if outputs is None:
        outputs = [generate(target, p, max_new_tokens, sampling, seed=i).tokens for i, p in enumerate(prompts)]
    pairs = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
    if costs is None:
        longest = max(pairs, key=lambda pr: len(pr[0]) + len(pr[1]))
        costs = measure_costs(target, drafter, settings, longest[0] + longest[1][: len(longest[1]) // 2])
    # one target forward per output for every drafter setting (n-gram lookup reads no features)
    features = output_features(target, list(drafter.target_layers) if drafter is not None else [], pairs)
    estimates = []
    with progress_bar("decoding auto: scoring settings", len(settings), progress) as bar:
        for setting in settings:
            e = estimate(target, drafter, setting, pairs, sampling, costs, features)
            if e is not None:
                estimates.append(e)
            bar.advance(1)
    best = PLAIN
    for e in estimates:  # strictly faster than the best so far: ties keep the simpler setting listed first
        if e.tokens_per_s > next(x for x in estimates if x.setting == best).tokens_per_s:
            best = e.setting
    return Choice(best, best.drafter(drafter), best.tree, estimates, costs.machine or machine_name(target.device),
                  str(target.dtype).replace("torch.", ""))
