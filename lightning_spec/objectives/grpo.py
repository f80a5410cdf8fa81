"""GRPO on simulated acceptance: the second stage of Xia et al. (arXiv 2609.24150, "Acceptance-Aware Draft Model
Training for Speculative Decoding"), after EAL or WTV. The paper's abstract names the stage; the formulas below are
derived here from GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300) and PPO's clipped surrogate (Schulman et
al. 2017, arXiv 1707.06347).

Per anchor n of a training batch:

1. Draw G drafts x̃^(g)_{1:K}, slot k from the drafter's slot distribution q_k (no gradient): q at the serving
   warps (``sampling.probs`` of the draft logits, what ``propose`` draws from), or at ``draft_temperature`` when
   serving is greedy (otherwise all G drafts are the argmax and every advantage is 0).
2. Verify them against the target's slot distributions p_k as the decoding engine would: greedy, accept while
   x̃_k = argmax p_k; under sampling, accept x̃_k iff u_k < min(1, p_k(x̃_k) / q_k(x̃_k)) (Leviathan et al. 2023,
   arXiv 2211.17192). An unsupervised slot ends the run.
3. Reward R_g = accepted length (+1 with ``bonus``, the MAL convention; a constant shift, so it moves only the
   logged reward, not the advantages); advantage Â_g = (R_g - mean_g R) / (std_g R + 1e-6) per anchor.
4. Loss per (anchor, g, supervised slot k): -min(ρ Â_g, clip(ρ, 1 - ε, 1 + ε) Â_g), ρ = q_θ(x̃_k) / q_old(x̃_k).
   One update per draw, so q_old = sg(q_θ): ρ = 1 in value and the gradient is -Â_g ∇log q_θ(x̃_k).
   Plus β·KL(q_θ ‖ q_ref) per supervised slot, q_ref the frozen starting drafter (``ctx.reference_logits``),
   both at the draft temperature without top-k/top-p (a filtered KL is infinite where the supports differ).
5. (num, den) = (Σ of the terms, number of supervised (anchor, g, slot) terms): the value is the mean surrogate
   plus β times the mean KL per slot. Its value is ~β·KL (advantages sum to 0 per anchor): watch
   ``train/grpo_reward_mean`` (mean simulated accepted length) and ``train/grpo_kl`` instead.

Exactness. p_k and q_k are the teacher-forced distributions on the training trajectory: slot k's are conditioned
on the trajectory's tokens x_{n+1..n+k-1}, not on the drafted x̃_{<k}. A round's reward depends on slot k only
when x̃_{<k} was accepted, so the simulation is exact when an accepted prefix is the trajectory's prefix:
greedy verification on the target's greedy rollouts, for every drafter (autoregressive ones included, since q_k
on an accepted prefix is q_k on the trajectory). Under sampling (T > 0) an accepted x̃_k is distributed as
min(p_k, q_k) / α_k while the trajectory's x_{n+k} is a draw from p_k, so later slots' p (and, for autoregressive
drafters, q) condition on another prefix: the reward is then an approximation, exact only where p_{k+1} does not
depend on that token. Drafters whose slots do not read earlier drafted tokens (``drafter.parallel_slots``: DFlash,
Medusa) remove the q side of the error, not the p side. Train on target rollouts under the serving sampling
(``lightning-spec rollouts``): on other data the trajectory is not one the target would produce.

Draws are reproducible: anchor n of example i draws from its own generator, seeded from the batch's
``anchor_seed`` (i), the anchor's position and ``seed_salt``, so a draw does not depend on the batch, the chunk
or the DDP rank an anchor lands in, and a chunk's recomputation in the backward pass draws the same drafts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_spec.decoding.verify import acceptance_probability
from lightning_spec.drafters.base import DraftOutput, seeded_rand
from lightning_spec.errors import UserError
from lightning_spec.objectives.context import StepContext
from lightning_spec.objectives.objective import Objective
from lightning_spec.sampling import SamplingConfig

GRPO_SALT = 0x6A09E667F3BCC908  # mixed into the draw seeds, so they differ from the anchors' (same anchor_seed)
ADV_EPS = 1e-6  # GRPO's std guard: a group with one reward value gets advantages 0


# ------------------------------------------------------------------------------------------- pure functions
def group_advantages(rewards: Tensor) -> Tensor:
    """GRPO's group-normalised advantages (Shao et al. 2024, arXiv 2402.03300, §4.1.2): Â_g = (R_g - mean_g R) /
    (std_g R + 1e-6) over the last dim, std the sample standard deviation (Bessel-corrected, as TRL's GRPO).

    rewards (N, A, G) -> (N, A, G); a group whose G rewards are equal gets zeros."""
    rewards = rewards.double() if rewards.dtype == torch.float64 else rewards.float()
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True)
    return (rewards - mean) / (std + ADV_EPS)  # (N, A, G)


def clipped_surrogate(logq: Tensor, logq_old: Tensor, advantages: Tensor, clip: float) -> Tensor:
    """PPO's clipped surrogate as a loss (Schulman et al. 2017, arXiv 1707.06347, Eq. 7), elementwise:
    -min(ρ Â, clip(ρ, 1 - ε, 1 + ε) Â) with ρ = exp(logq - logq_old). Where the clip binds (ρ > 1 + ε with Â > 0,
    ρ < 1 - ε with Â < 0) the term is constant in logq: no gradient."""
    ratio = (logq - logq_old).exp()
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)


def sample_tokens(q: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draws from each slot's distribution: token = the first v with Σ_{w≤v} q(w) > u·Σ q.

    q (..., K, Vd) probabilities, uniforms (..., G, K) in [0, 1) -> (..., G, K) token ids; a token of
    probability 0 is never drawn."""
    cdf = q.double().cumsum(-1)  # (..., K, Vd)
    u = uniforms.double().transpose(-1, -2) * cdf[..., -1:]  # (..., K, G)
    tokens = torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True).clamp(max=q.shape[-1] - 1)
    return tokens.transpose(-1, -2)  # (..., G, K)


def simulated_accept(
    draft_tokens: Tensor,
    p: Tensor,
    q: Tensor | None,
    uniforms: Tensor | None,
    greedy: bool,
    valid: Tensor | None = None,
) -> Tensor:
    """Accepted length of each draft under chain verification (Leviathan et al. 2023, arXiv 2211.17192): the
    leading run of accepted slots, the engine's rules (``decoding/verify.py``) on every draft at once.

    Args:
        draft_tokens: (..., G, K) drafted ids, slot k drawn from q_k.
        p: greedy: the target's argmax ids (..., K); sampling: the target's probabilities (..., K, Vd).
        q: (..., K, Vd) the draft distributions the tokens were drawn from (sampling only).
        uniforms: (..., G, K) in [0, 1): slot k is accepted iff u < min(1, p_k(x̃_k) / q_k(x̃_k)) (sampling only).
        greedy: accept while x̃_k == argmax p_k.
        valid: (..., K) bool; an invalid slot is never accepted, so it ends the run.

    Returns:
        (..., G) int64 accepted draft tokens (the bonus excluded).
    """
    if greedy:
        hit = draft_tokens == p.unsqueeze(-2)  # (..., G, K)
    else:
        if q is None or uniforms is None:
            raise ValueError("simulated_accept under sampling needs the draft probabilities q and the uniforms.")
        index = draft_tokens.transpose(-1, -2)  # (..., K, G)
        p_x = p.gather(-1, index).transpose(-1, -2)  # (..., G, K)
        q_x = q.gather(-1, index).transpose(-1, -2)
        hit = uniforms.to(p_x.dtype) < acceptance_probability(p_x, q_x)  # (..., G, K)
    if valid is not None:
        hit = hit & valid.unsqueeze(-2)
    return hit.to(torch.int64).cumprod(-1).sum(-1)  # (..., G)


def anchor_draw_seeds(row_seeds: Tensor, anchors: Tensor, salt: int) -> Tensor:
    """(N,) example seeds and (N, A) anchor positions -> (N·A,) int64 seeds, one generator per anchor: a function
    of (example, anchor position, salt) only."""
    out = []
    for seed, positions in zip(row_seeds.tolist(), anchors.tolist()):
        for pos in positions:
            mixed = (int(seed) ^ GRPO_SALT) * 1_000_003 + (int(pos) + 1) * 998_244_353 + int(salt) * 1_000_033
            out.append(mixed % 2**62)
    return torch.tensor(out, dtype=torch.int64)


# -------------------------------------------------------------------------------------------------- objective
class GRPO(Objective):
    """GRPO on simulated acceptance (Xia et al., arXiv 2609.24150; the module docstring has the math and where the
    simulation is exact). Start it from a first-stage drafter (``model.init_from``: EAL for greedy serving, WTV
    for sampling); the KL term pulls towards that drafter.

    Args:
        sampling: the serving configuration the drafter is trained for: temperature 0 simulates greedy
            verification; T > 0 rejection sampling against the target under these warps.
        group_size: G, drafts per anchor (≥ 2: advantages compare drafts of one anchor).
        draft_temperature: the temperature drafts are drawn at when ``sampling`` is greedy (and of the KL then);
            under sampling the drafts use the serving warps.
        clip: ε of the clipped ratio.
        kl_weight: β, the weight of KL(q_θ ‖ q_ref) per slot.
        bonus: reward = accepted length + 1 (tokens per round, as MAL counts); shifts the logged reward only.
        seed_salt: changes every draw while keeping them reproducible.
    """

    needs_target = True  # p_k per slot: target logits over the draft vocabulary
    needs_reference = True  # q_ref: the module keeps a frozen copy of the starting drafter

    def __init__(
        self,
        sampling: SamplingConfig = SamplingConfig(),
        group_size: int = 4,
        draft_temperature: float = 1.0,
        clip: float = 0.2,
        kl_weight: float = 0.05,
        bonus: bool = False,
        seed_salt: int = 0,
    ) -> None:
        super().__init__(normalize="slots")
        if not (isinstance(group_size, int) and group_size >= 2):
            raise UserError(f"objective.group_size is {group_size}; GRPO compares drafts of an anchor, set it >= 2.")
        if not (math.isfinite(draft_temperature) and draft_temperature > 0):
            raise UserError(
                f"objective.draft_temperature is {draft_temperature}; set a temperature > 0 (e.g. 1.0), or the "
                "drafts of an anchor are all the argmax."
            )
        if not 0 <= clip < 1:
            raise UserError(f"objective.clip is {clip}; set ε in [0, 1), e.g. 0.2.")
        if not (math.isfinite(kl_weight) and kl_weight >= 0):
            raise UserError(f"objective.kl_weight is {kl_weight}; set β >= 0, e.g. 0.05.")
        self.sampling = SamplingConfig.coerce(sampling)
        self.group_size = group_size
        self.draft_temperature = draft_temperature
        self.clip = clip
        self.kl_weight = kl_weight
        self.bonus = bonus
        self.seed_salt = seed_salt

    @property
    def parts(self) -> tuple[Any, ...]:
        return ()

    @property
    def temperature(self) -> float:
        """The temperature of the drafts and of the KL."""
        return self.draft_temperature if self.sampling.greedy else self.sampling.temperature

    # ------------------------------------------------------------------------------------------ terms
    def draft_logprobs(self, logits: Tensor) -> Tensor:
        """log q of the distribution drafts are drawn from: (N, A, K, Vd)."""
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if self.sampling.greedy:
            return (logits / self.draft_temperature).log_softmax(-1)
        return self.sampling.logprobs(logits).to(logits.dtype)

    def uniforms(self, draft: DraftOutput, ctx: StepContext) -> Tensor:
        """(N, A, 2, G, K) float64 uniforms on the logits' device: [..., 0, :, :] draw the tokens, [..., 1, :, :]
        decide the acceptances."""
        n, a, k = draft.valid.shape
        rows = ctx.seeds  # (N,) the module's per-example anchor_seed
        if rows is None or len(rows) != n:  # a batch without 'index': seeded by the row in this batch
            rows = torch.arange(n)
        seeds = anchor_draw_seeds(rows.cpu(), draft.anchors.cpu(), self.seed_salt)
        u = seeded_rand(seeds, 2 * self.group_size * k, dtype=torch.float64)  # (N·A, 2·G·K)
        return u.view(n, a, 2, self.group_size, k).to(draft.valid.device)

    def sums(self, draft: DraftOutput, ctx: StepContext) -> list[tuple[Tensor, Tensor]]:
        """[(num, den), (Σ reward, draws), (Σ KL, slots)]: the loss, then the two logged metrics' sums."""
        if ctx.target_logits is None:
            raise ValueError("GRPO needs the target's logits per slot; train it through DraftModule (needs_target).")
        mask = self.slot_mask(draft, ctx)  # (N, A, K)
        g = self.group_size
        logits = draft.logits if draft.logits.dtype == torch.float64 else draft.logits.float()  # (N, A, K, Vd)
        logq_all = self.draft_logprobs(logits)  # (N, A, K, Vd)
        with torch.no_grad():
            q = logq_all.exp()
            u = self.uniforms(draft, ctx)  # (N, A, 2, G, K)
            tokens = sample_tokens(q, u[:, :, 0])  # (N, A, G, K)
            if self.sampling.greedy:
                p = ctx.target_logits.argmax(-1)  # (N, A, K)
            else:
                p = self.sampling.probs(ctx.target_logits).to(q.dtype)  # (N, A, K, Vd)
            accepted = simulated_accept(tokens, p, q, u[:, :, 1], self.sampling.greedy, valid=mask)  # (N, A, G)
            rewards = accepted.to(logits.dtype) + float(self.bonus)
            advantages = group_advantages(rewards).to(logits.dtype)  # (N, A, G)
        logq = logq_all.gather(-1, tokens.transpose(-1, -2)).transpose(-1, -2)  # (N, A, G, K)
        surrogate = clipped_surrogate(logq, logq.detach(), advantages[..., None], self.clip)  # (N, A, G, K)
        slots = mask[:, :, None, :].expand_as(surrogate)  # (N, A, G, K)
        num = torch.where(slots, surrogate, torch.zeros_like(surrogate)).sum()
        kl_sum = num.new_zeros(())
        if self.kl_weight > 0 or ctx.reference_logits is not None:
            kl = self.reference_kl(ctx, logits)  # (N, A, K)
            kl_sum = torch.where(mask, kl, torch.zeros_like(kl)).sum()
            num = num + self.kl_weight * g * kl_sum  # the KL counts once per (anchor, g, slot) term
        den = (g * mask.sum()).to(num.dtype)
        anchors = mask.any(-1)  # (N, A): anchors with a supervised slot
        reward_sum = (rewards * anchors[..., None]).sum().detach()
        draws = (g * anchors.sum()).to(num.dtype)
        return [(num, den), (reward_sum.to(num.dtype), draws), (kl_sum.detach(), mask.sum().to(num.dtype))]

    def reference_kl(self, ctx: StepContext, logits: Tensor) -> Tensor:
        """KL(q_θ ‖ q_ref) per slot (N, A, K), both softmax(z / T) at the drafts' temperature, over Vd."""
        if ctx.reference_logits is None:
            raise UserError(
                "GRPO's objective.kl_weight > 0 needs the starting drafter's logits (ctx.reference_logits); train "
                "it through DraftModule with model.init_from set, or set objective.kl_weight: 0."
            )
        t = self.temperature
        logq = (logits / t).log_softmax(-1)  # (N, A, K, Vd)
        logr = (ctx.reference_logits.to(logits.dtype) / t).log_softmax(-1)
        return (logq.exp() * (logq - logr)).sum(-1)  # (N, A, K)

    # ------------------------------------------------------------------------------------------ reduction
    def sequence_dens(self, draft: DraftOutput, ctx: StepContext) -> list[Tensor | None]:
        return [None] * self.num_pairs

    @property
    def num_pairs(self) -> int:
        return 3

    def combine(self, pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        (num, den), (reward, draws), (kl, slots) = pairs
        metrics = {
            "grpo_reward_mean": reward / draws.clamp_min(1),  # mean simulated accepted length (+1 with bonus)
            "grpo_kl": kl / slots.clamp_min(1),  # mean KL(q_θ ‖ q_ref) per supervised slot
        }
        return num, den, metrics
