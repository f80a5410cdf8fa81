"""Cost-aware adaptation of a drafter at decode time: the verifier's free labels, spent only when they pay.

SpecBlock (Shi et al. 2026, arXiv 2605.07243) observes that every verified position is a free label and proposes a
bandit over update scopes that updates the drafter during deployment only when the expected throughput gain
exceeds the update's cost. Only the abstract is public; the design below is ours (DERIVED).

A window is one ``generate`` call. The target decides every token (the engine is lossless), so greedy output is
plain greedy decoding whatever the drafter's weights. After the window, prompt + committed tokens are a target
sequence whose response tokens are labels; the adapter then, in this order:

1. Measures the last update (if the previous window made one) on THIS window, which it was not trained on
   (prequential, so not flattered by fitting its own data): the exact expected rounds τ of the window under the
   drafter before and after that update (EDR's offline estimator, Zhao & Cai 2026, arXiv 2610.10411, §3.4; exact
   rounds under greedy, exact expectations under sampling, paired on the same tokens), from one target forward.
   Gain Δ = T/τ_after − T/τ_before in MAL units, T the window's tokens. Only the updated scope's tensors are
   snapshotted and swapped in to score "before".
2. Decides an arm among the update scopes (``none``, ``head``, ``last``, ``all``; ``scope_parameters``). With m the
   EMA of the windows' MAL and t_r the EMA of the engine's seconds per round, raising MAL from m to m + Δ saves
   S(Δ) = H · t_r · (1/m − 1/(m + Δ)) seconds over the next H = ``horizon_tokens`` tokens (m + Δ clamped to >= 1).
   Arm a scores S(Δ̄_a + c·sqrt(ln n / n_a)) − C_a: Δ̄_a the EMA of its measured gains, n_a how many, n the
   windows decided so far (so an arm judged unprofitable is retried slowly: gains drift with the traffic),
   c = ``exploration``, C_a the EMA of its measured seconds (the window's target forward and the optimizer
   steps, plus the two drafter passes that score its gain in the next window). S is increasing in Δ, so this is
   the UCB of the saving. An arm never measured scores +inf (each is tried once, in ``scopes`` order). The best
   arm is applied when its score is > 0, else ``none``.
3. Applies the arm: one target forward over the window (``target(ids, layers=drafter.target_layers,
   logits=False)``, shared with step 1), then ``steps`` optimizer steps of CE on the committed tokens through the
   drafter's teacher-forced forward (batch ``input_ids``, ``loss_mask`` on the response, ``attention_mask``;
   anchors drawn by the drafter's own ``sample_anchors``, seeded per step), only the scope's parameters
   trainable; one optimizer per arm keeps its state across windows. Eval mode and ``requires_grad`` are restored.

All of it is timed into the window: the returned ``Generation.seconds`` is the engine's seconds plus the
adapter's, so tokens/s is honest. ``adapter.history`` logs every window's ``Decision``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_spec.decoding.engine import Generation, generate
from lightning_spec.decoding.exact import replay_tree_rounds
from lightning_spec.decoding.plans import SCOPES, Adapt
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.decoding.rounds import chain, chain_dp, every_anchor, target_table
from lightning_spec.decoding.timed import DecodeReport
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.errors import UserError
from lightning_spec.objectives import CE, Objective
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.drafters import Drafter
    from lightning_spec.target import Target



# ---------------------------------------------------------------------------------------------------- scopes
def scope_parameters(drafter: Drafter, scope: str) -> list[str]:
    """Names of the drafter's parameters an update with ``scope`` trains, in ``named_parameters`` order:

    - ``all``: every parameter (the frozen target is not a submodule, so it never is).
    - ``head`` and ``last``: the parameters of the submodules the family declares for them
      (``Drafter.adaptation_scopes``): its own output side (the final norm, an own head, SpecBlock's rank head), and
      its last decoder layer with the final norm. Empty where the family declares none (Medusa's heads are all of
      it, so only ``all`` applies).
    """
    if scope not in SCOPES:
        raise UserError(f"adaptation scope {scope!r} is unknown; choose among {', '.join(SCOPES)}.")
    names = [name for name, _ in drafter.named_parameters()]
    if scope == "all":
        return names
    modules = drafter.adaptation_scopes().get(scope, [])
    return [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]


# -------------------------------------------------------------------------------------------------- decision
@dataclass
class ArmStats:
    """What the adapter knows about one update scope."""

    n: int = 0  # gains measured
    gain: float = 0.0  # EMA of the measured MAL gains Δ
    cost: float = 0.0  # EMA of the update's seconds: the window's target forward + the optimizer steps
    score_cost: float = 0.0  # EMA of the seconds spent measuring its gain in the next window (drafter passes)
    updates: int = 0  # times applied

    @property
    def seconds(self) -> float:
        """C_a: the seconds one application of the arm costs the deployment."""
        return self.cost + self.score_cost


def expected_saving(horizon_tokens: float, seconds_per_round: float, mal: float, delta: float) -> float:
    """Seconds saved over ``horizon_tokens`` tokens when MAL rises from ``mal`` to ``mal + delta`` at
    ``seconds_per_round``: H · t_r · (1/m − 1/(m + Δ)); MAL is never below 1 (every round commits a token)."""
    m = max(mal, 1.0)
    return horizon_tokens * seconds_per_round * (1.0 / m - 1.0 / max(m + delta, 1.0))


def decide(
    arms: dict[str, ArmStats],
    mal: float,
    seconds_per_round: float,
    horizon_tokens: float,
    exploration: float,
    windows: int,
) -> tuple[str, dict[str, float], float]:
    """(arm, score per arm, the chosen arm's UCB saving): the arm with the largest UCB saving minus its cost when
    that is positive, else ``none``. Arms never measured score +inf, the first in order wins."""
    scores: dict[str, float] = {}
    savings: dict[str, float] = {}
    for name, s in arms.items():
        if s.n == 0:
            scores[name] = savings[name] = math.inf
            continue
        bonus = exploration * math.sqrt(math.log(max(windows, 1)) / s.n)
        savings[name] = expected_saving(horizon_tokens, seconds_per_round, mal, s.gain + bonus)
        scores[name] = savings[name] - s.seconds
    best = max(scores, key=lambda a: scores[a], default=None)  # max keeps the first of equal scores
    if best is None or not scores[best] > 0:
        return "none", scores, 0.0
    return best, scores, savings[best]


@dataclass
class Decision:
    """One window of ``CostAwareAdapter.generate``."""

    window: int
    arm: str  # the update applied after this window (``none``: no update)
    predicted_saving: float  # UCB saving of the chosen arm over the horizon, seconds (inf: first try; 0: none)
    cost: float  # the chosen arm's estimated cost C_a before this update, seconds (0: none)
    mal: float  # the window's realised MAL (tokens per round, bonus included)
    tokens: int
    rounds: int
    decode_seconds: float  # the engine's seconds
    update_seconds: float = 0.0  # this window's update: its steps, and the target forward unless measuring ran it
    score_seconds: float = 0.0  # measuring the previous update's gain on this window
    measured_arm: str | None = None  # the previous update, scored on this window
    measured_gain: float | None = None  # its Δ: MAL after minus MAL before, exact on this window
    scores: dict[str, float] = field(default_factory=dict)  # every arm's UCB saving minus cost
    forced: bool = False

    @property
    def overhead_seconds(self) -> float:
        return self.update_seconds + self.score_seconds


# ---------------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def window_rounds(
    target: Target, drafter: Drafter, ids: Tensor, mask: Tensor, out: Any, sampling: SamplingConfig,
    tree: TreeConfig | None, chunk: int,
) -> float:
    """Exact expected rounds τ of one decoded window (1, S) with response ``mask`` (1, S), from the target forward
    ``out`` (features and final hidden states), as ``exact.score_outputs`` computes them, from the forward the
    update shares."""
    if tree is not None and drafter.tree_growth is not TreeGrowth.BEST_FIRST:  # replayed, greedy only
        prompt_len = int(mask[0].nonzero()[0])
        seq = ids[0].tolist()
        rounds, _, _ = replay_tree_rounds(drafter, ids, out.features, [seq[:prompt_len]], [seq[prompt_len:]], tree)
        return float(rounds.sum())
    table = target_table(out.last_hidden, target.lm_head, ids, mask, sampling, drafter.vocab, target.eos_token_ids,
                         costs=False)
    batch = {"input_ids": ids, "loss_mask": mask}
    stats = every_anchor(lambda anchors: drafter(batch, out.features, anchors), mask, table, drafter.block_size,
                         sampling, chunk, costs=False, tree=tree)
    values = chain_dp(stats.accept, 1 - stats.accept, chain(mask, drafter.block_size))
    return float(values.start.sum())  # τ(x) = Σ_n ω_{n,n+1} (EDR Prop. 1)


@torch.no_grad()
def _swap(params: list[nn.Parameter], other: list[Tensor]) -> None:
    """Exchange the values of ``params`` and ``other`` in place (twice: back as before)."""
    for p, o in zip(params, other):
        held = p.detach().clone()
        p.copy_(o)
        o.copy_(held)


def _prompt_list(input_ids: Any) -> list[int]:
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
        input_ids = input_ids["input_ids"]
    return torch.as_tensor(input_ids).reshape(-1).tolist()


# ---------------------------------------------------------------------------------------------------- adapter
class CostAwareAdapter:
    """A drafter and its target in deployment: decode, then update the drafter on the verified window when the
    bandit over update scopes expects the saving to beat the cost (module docstring; SpecBlock, arXiv 2605.07243).

    Args:
        drafter: the drafter to adapt, in place (load a copy for a side-by-side comparison).
        target: its target (a ``Target``); the target decides every token.
        plan: the ``adapt`` plan (``decoding/plans.py``): how it decodes between updates (a chain or a tree), and
            the bandit's and the update's knobs (scopes, learning rate, steps, optimizer, horizon, exploration, EMA
            weight, a forced arm, the scoring chunk); None: the defaults.
        seed: seeds the update steps' anchor draws.
    """

    def __init__(self, drafter: nn.Module, target: Target, plan: Adapt | None = None, seed: int = 0) -> None:
        plan = plan if plan is not None else Adapt()
        scopes, force = plan.scopes, plan.force
        self.drafter, self.target, self.plan = drafter, target, plan
        self.lr, self.steps, self.optimizer, self.weight_decay = plan.lr, plan.steps, plan.optimizer, plan.weight_decay
        self.max_grad_norm, self.horizon_tokens = plan.max_grad_norm, plan.horizon_tokens
        self.exploration, self.ema = plan.exploration, plan.ema
        self.tree, self.score_chunk, self.seed = plan.decoding.resolve(drafter).tree, plan.score_chunk, seed
        if self.tree is not None:
            drafter.check_tree()
        drafter.use_target(target)
        params = dict(drafter.named_parameters())
        self.scopes: dict[str, list[str]] = {}
        self.skipped: list[str] = []
        for scope in dict.fromkeys(scopes):
            names = scope_parameters(drafter, scope)
            if names:
                self.scopes[scope] = names
            else:
                self.skipped.append(scope)
        self._params = {s: [params[n] for n in names] for s, names in self.scopes.items()}
        if force is not None and force != "none" and force not in self.scopes:
            raise UserError(f"decoding.force={force!r} of kind 'adapt' is not an available scope of "
                            f"{type(drafter).__name__} ({', '.join(self.scopes) or 'none'}); force one of them or "
                            "'none'.")
        self.force = force
        self.objective = Objective(CE())
        self.arms = {s: ArmStats() for s in self.scopes}
        self.history: list[Decision] = []
        self.mal: float | None = None  # EMA of the windows' MAL
        self.seconds_per_round: float | None = None  # EMA of the engine's seconds per round
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._pending: tuple[str, list[Tensor]] | None = None  # the last update: arm and its scope's old values

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    # -------------------------------------------------------------------------------------------- decoding
    def generate(
        self, input_ids: Any, max_new_tokens: int, sampling: SamplingConfig | dict | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Decode one prompt with the engine's ``generate`` (the target decides every token), then measure the
        last update, decide and maybe apply one on this window. ``seconds`` includes the adapter's time."""
        sampling = SamplingConfig.coerce(sampling)
        if self.tree is not None and self.drafter.tree_growth is not TreeGrowth.BEST_FIRST and not sampling.greedy:
            raise UserError(f"{type(self.drafter).__name__} grows its tree from its own drafts, whose rounds the "
                            "adapter can score exactly under greedy decoding only; adapt with temperature 0 or "
                            "decode chains.")
        gen = generate(self.target, input_ids, max_new_tokens, sampling, drafter=self.drafter, seed=seed,
                       plan=self.tree)  # None: the drafter's chain
        start = time.perf_counter()
        window = len(self.history)
        record = Decision(window=window, arm="none", predicted_saving=0.0, cost=0.0, mal=gen.mal,
                          tokens=len(gen.tokens), rounds=gen.rounds, decode_seconds=gen.seconds)
        if gen.tokens:
            self.mal = self._average(self.mal, gen.mal)
            self.seconds_per_round = self._average(self.seconds_per_round, gen.seconds / max(gen.rounds, 1))
            prompt = _prompt_list(input_ids)
            device = self.target.device
            ids = torch.tensor([prompt + gen.tokens], device=device)  # (1, S)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, len(prompt) :] = True  # the committed tokens: verified by the target
            out, forward = None, 0.0  # one target forward per window serves the measurement and the update
            if self._pending is not None:
                t0 = time.perf_counter()
                out = self._features(ids)
                forward = time.perf_counter() - t0
                record.measured_arm, record.measured_gain = self._measure(ids, mask, out, sampling, len(gen.tokens))
                record.score_seconds = time.perf_counter() - t0
            self._decide(record, window + 1)
            if record.arm != "none":
                t0 = time.perf_counter()
                if out is None:
                    out = self._features(ids)
                    forward = time.perf_counter() - t0
                t1 = time.perf_counter()
                self._pending = (record.arm, self._update(record.arm, ids, mask, out.features, window))
                record.update_seconds = time.perf_counter() - t0
                # C_a counts the window's target forward in the update (it needs one, shared or not)
                arm = self.arms[record.arm]
                arm.cost = self._average(arm.cost if arm.updates else None, forward + time.perf_counter() - t1)
                arm.updates += 1
        self.history.append(record)
        return dataclasses.replace(gen, seconds=gen.seconds + time.perf_counter() - start)

    @torch.no_grad()
    def _features(self, ids: Tensor) -> Any:
        return self.target(ids, layers=list(self.drafter.target_layers), logits=False)

    def _measure(self, ids: Tensor, mask: Tensor, out: Any, sampling: SamplingConfig, tokens: int) -> tuple[str, float]:
        """Score the last update on this window: Δ = T/τ_after − T/τ_before, then fold it into its arm's stats
        (the seconds of the two drafter passes into its cost; the target forward is counted in updates)."""
        arm, old = self._pending
        self._pending = None
        start = time.perf_counter()
        params = self._params[arm]
        after = window_rounds(self.target, self.drafter, ids, mask, out, sampling, self.tree, self.score_chunk)
        _swap(params, old)
        try:
            before = window_rounds(self.target, self.drafter, ids, mask, out, sampling, self.tree, self.score_chunk)
        finally:
            _swap(params, old)
        gain = tokens / max(after, 1e-12) - tokens / max(before, 1e-12)
        s = self.arms[arm]
        s.gain = self._average(s.gain if s.n else None, gain)
        s.score_cost = self._average(s.score_cost if s.n else None, time.perf_counter() - start)
        s.n += 1
        return arm, gain

    def _decide(self, record: Decision, windows: int) -> None:
        arm, scores, saving = decide(self.arms, self.mal or 1.0, self.seconds_per_round or 0.0,
                                     self.horizon_tokens, self.exploration, windows)
        record.scores = scores
        if self.force is not None:
            arm, record.forced = self.force, True
            saving = 0.0 if arm == "none" else scores[arm] + self.arms[arm].seconds
        record.arm = arm
        if arm != "none":
            record.predicted_saving = saving
            record.cost = self.arms[arm].seconds

    # ---------------------------------------------------------------------------------------------- update
    def _make_optimizer(self, arm: str) -> torch.optim.Optimizer:
        if arm not in self._optimizers:
            params = self._params[arm]
            if self.optimizer == "sgd":
                self._optimizers[arm] = torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
            else:
                self._optimizers[arm] = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return self._optimizers[arm]

    def _update(self, arm: str, ids: Tensor, mask: Tensor, features: Tensor, window: int) -> list[Tensor]:
        """``steps`` steps of CE on the window's committed tokens, only ``arm``'s parameters trainable. Returns the
        scope's values before the update (to score it on the next window)."""
        drafter = self.drafter
        params = self._params[arm]
        old = [p.detach().clone() for p in params]
        flags = [(p, p.requires_grad) for p in drafter.parameters()]
        drafter.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        opt = self._make_optimizer(arm)
        batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}
        drafter.train()
        try:
            with torch.enable_grad():
                for step in range(self.steps):
                    seeded = {**batch, "anchor_seed": torch.tensor([(self.seed * 1_000_003 + window) * 1_009 + step])}
                    terms = self.objective(drafter(seeded, features))
                    if not float(terms.den) > 0:  # no supervised slot: nothing to learn from
                        break
                    opt.zero_grad(set_to_none=True)
                    (terms.num / terms.den).backward()
                    if self.max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
                    opt.step()
        finally:
            opt.zero_grad(set_to_none=True)
            for p, flag in flags:
                p.requires_grad_(flag)
            drafter.eval()
        return old

    # ------------------------------------------------------------------------------------------- reporting
    def summary(self) -> dict[str, Any]:
        """Per arm: updates applied, gains measured, their EMA and the cost estimate; the total adapter seconds."""
        return {
            "windows": len(self.history),
            "skipped_scopes": list(self.skipped),
            "adapter_seconds": sum(d.overhead_seconds for d in self.history),
            "arms": {a: {"updates": s.updates, "measured": s.n, "gain": s.gain, "seconds": s.seconds}
                     for a, s in self.arms.items()},
        }


def decode_adapting(
    adapter: CostAwareAdapter, prompts: list[dict[str, Any]], sampling: SamplingConfig, max_new_tokens: int,
    seed: int = 0,
) -> DecodeReport:
    """``decode_prompts`` with an adapting drafter: each prompt is one window, in order, the adapter's time counted
    in ``seconds``."""
    k = adapter.block_size
    report = DecodeReport(torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64))
    for i, prompt in enumerate(prompts):
        gen = adapter.generate(prompt["prompt_ids"], max_new_tokens, sampling, seed=prompt.get("seed", seed + i))
        report.add(gen, prompt["domain"], tree=adapter.tree is not None)
    return report
