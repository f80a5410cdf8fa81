"""DSparkDrafter: semi-autoregressive drafting with confidence-scheduled verification (Cheng et al. 2026, DeepSeek,
arXiv 2607.05147, "DSpark").

Reads top to bottom:
1. Parallel stage (§3.1): the DFlash backbone (``ParallelBlockDrafter``'s layers, KV injection of the fused target
   features, context strictly before the anchor) with one change: the anchor slot is itself the first prediction,
   so a block is ``[anchor, MASK x (K - 1)]`` at positions n..n+K-1 and its K outputs h_1..h_K give base logits
   U_k = head(h_k) for x_{n+1..n+K}.
2. Sequential stage (§3.1, Eq. 4-6): p_k(v | x_0, x_<k) = softmax(U_k + B_k)(v), a transition bias over the draft
   vocabulary from the previous token (x_0 = the anchor). Vanilla Markov head: B(x_{k-1}, .) = W1[x_{k-1}] W2
   (rank r, Eq. 5). RNN head: z_k = [s_{k-1}; W1[x_{k-1}]; h_k], s_k = σ(W_g z_k) ⊙ s_{k-1} + (1 - σ(W_g z_k)) ⊙
   tanh(W_c z_k), B_k = W2ᵀ tanh(W_o z_k), s_0 = 0 (Eq. 6). Training is teacher-forced (the previous token is the
   gold one); decoding samples left to right.
3. Confidence head (§3.2.1, Eq. 7-8): c_k = σ(wᵀ[h_k; W1[x_{k-1}]]), the probability that slot k is accepted
   given that slots < k were; trained toward c*_k = 1 - ½‖p^d_k - p^t_k‖₁ by the ``ConfidenceBCE`` objective part
   (the forward exposes its logits as ``aux["confidence"]``). Calibrated after training by Sequential Temperature
   Scaling (``calibrate``): per slot, left to right, the temperature T_k of σ(z_k / T_k) that minimises the ECE of
   Π_{i≤k} c_i on held-out data; the temperatures are drafter state (saved with it).
4. Prefix scheduler (§3.2.2, Alg. 1 for one sequence): a_j = Π_{i≤j} c_i, Θ(ℓ) = (1 + Σ_{j≤ℓ} a_j) / cost(1 + ℓ)
   with cost(T) the relative cost of verifying T tokens; admit slots left to right and stop at the first ℓ whose
   Θ does not improve. The cut needs c_{ℓ+1}, which depends on x_ℓ only: it is decided before verification, so
   verification stays lossless (the paper's App. A: a look-ahead search would not be). ``propose`` submits a
   ``ChainProposal`` of k ≤ K tokens; the training forward reports the same cut as ``DraftOutput.drafted``, so the
   offline evaluator and EDR score the blocks decoding submits.

Where the paper is silent (choices made here):
- The draft vocabulary: W2 maps to the draft vocabulary (the logits are U_k + B_k over Vd); W1 has Vd + 1 rows,
  one per draft token and one shared row for every target token outside it (only an anchor can be outside:
  drafted tokens are draft tokens).
- The confidence head's input is [h_k; W1[x_{k-1}]] for both heads (Eq. 7 names the Markov embedding; the RNN
  head has it too).
- STS: ECE over 20 equal-width bins (DeepSpec's evaluator bins its reliability diagrams so), temperatures on a
  geometric grid 0.1..10; the calibration target is the expected prefix acceptance Π_{i≤k} α_i, α = Σ_v min(p, q)
  under the decoding ``SamplingConfig`` on teacher-forced held-out blocks (under greedy: the draft's argmax equals
  the target's).
- cost(T): by default the verify cost of SmolLM2-135M on one CPU thread (``cpu_verify_cost``); pass the profile of
  your own target and hardware as ``verify_cost``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.block import BlockDraftState, ParallelBlockDrafter
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target

MARKOV_KINDS = ("vanilla", "rnn")


def cpu_verify_cost(tokens: int) -> float:
    """Relative cost of a target forward over ``tokens`` query tokens, SmolLM2-135M fp32 on one CPU thread against a
    warm cache (benchmarks/README.md): 1 for one token, ~1.45 for two (the matrix products switch from GEMV to
    GEMM, most of the jump), then ~0.04 per extra token (measured: 1.44 at 4 tokens, 1.67-1.9 at 9)."""
    return 1.0 if tokens <= 1 else 1.45 + 0.04 * (tokens - 2)


def prefix_length(confidence: Tensor, cost: Tensor) -> Tensor:
    """DSpark's hardware-aware prefix scheduler for one sequence (Alg. 1 with R = 1): how many slots to submit.

    confidence (..., K): calibrated c_1..c_K; cost (K + 1,): cost(1 + ℓ) for ℓ = 0..K. With a_j = Π_{i≤j} c_i and
    Θ(ℓ) = (1 + Σ_{j≤ℓ} a_j) / cost(1 + ℓ), slot ℓ is admitted while a_ℓ > 0 and Θ(ℓ) > Θ(ℓ - 1) (every earlier
    slot admitted): the first non-improvement stops. Returns (...,) long in 0..K. The decision about slot ℓ reads
    c_1..c_ℓ only (``propose`` calls this on the prefix it has).
    """
    survive = confidence.float().cumprod(-1)  # (..., K) a_j
    theta = (1 + survive.cumsum(-1)) / cost[1:]  # (..., K) Θ(ℓ), ℓ = 1..K
    before = torch.cat([(1 / cost[:1]).expand_as(theta[..., :1]), theta[..., :-1]], -1)  # Θ(ℓ - 1)
    admit = (survive > 0) & (theta > before)
    return admit.long().cumprod(-1).sum(-1)  # (...,)


# ---------------------------------------------------------------------------------------------- sequential stage
class MarkovHead(nn.Module):
    """The sequential stage (DSpark §3.1): the transition bias B_k = W2 m_k over the draft vocabulary, with
    m_k = W1[x_{k-1}] (vanilla, Eq. 5) or m_k = tanh(W_o z_k) of the gated recurrence (RNN, Eq. 6).

    Args:
        kind: ``vanilla`` or ``rnn``.
        rank: r, the width of W1's rows (and of the RNN state).
        rows: rows of W1 (the draft vocabulary plus one row for tokens outside it).
        hidden: the backbone's hidden size d (the RNN reads h_k).
        vocab: Vd, the draft vocabulary size (W2's outputs).
    """

    def __init__(self, kind: str, rank: int, rows: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(rows, rank)  # W1
        self.out = nn.Linear(rank, vocab, bias=False)  # W2
        # W_g, W_c, W_o as one projection of z = [s; W1[x]; h], split into gate, candidate and output (Eq. 6)
        self.rnn = nn.Linear(2 * rank + hidden, 3 * rank) if kind == "rnn" else None

    def step(self, state: Tensor | None, prev: Tensor, hidden: Tensor) -> tuple[Tensor | None, Tensor]:
        """One slot: state s_{k-1} (..., r) or None (vanilla), W1[x_{k-1}] (..., r), h_k (..., d) -> s_k, m_k."""
        if self.rnn is None:
            return None, prev
        gate, cand, out = self.rnn(torch.cat([state, prev, hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(cand), torch.tanh(out)

    def unroll(self, prev: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced m_1..m_K: W1[x_{k-1}] (..., K, r), h (..., K, d) -> (..., K, r)."""
        if self.rnn is None:
            return prev
        state = prev.new_zeros(prev[..., 0, :].shape)  # s_0 = 0
        outs = []
        for k in range(prev.shape[-2]):
            state, m = self.step(state, prev[..., k, :], hidden[..., k, :])
            outs.append(m)
        return torch.stack(outs, -2)


# ---------------------------------------------------------------------------------------------------- drafter
@dataclass
class Calibration:
    """What ``DSparkDrafter.calibrate`` found: per slot k, the temperature and the ECE of Π_{i≤k} c_i before and
    after (held-out blocks whose slots 1..k are all supervised; NaN where there are none)."""

    temperature: Tensor  # (K,)
    ece_before: Tensor  # (K,)
    ece_after: Tensor  # (K,)
    blocks: Tensor  # (K,) how many blocks reach slot k


class DSparkDrafter(ParallelBlockDrafter):
    """DSpark (Cheng et al. 2026, arXiv 2607.05147): a DFlash backbone whose anchor slot is the first prediction,
    a Markov (or RNN) head over the draft vocabulary, a confidence head, and a prefix scheduler that submits
    k ≤ K tokens per round.

    Args:
        block_size: K, the most draft tokens per round (the block's K inputs are the anchor and K - 1 masks).
        num_layers: draft decoder layers of the backbone.
        target_layers: 0-indexed target layers whose outputs form the context (default as ``ParallelBlockDrafter``).
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the heads to the most frequent target tokens of the training data (None = the
            full target vocabulary).
        intermediate_size: the backbone's MLP width; default the target's.
        context_shortcut: ``ParallelBlockDrafter``'s EAGLE-style slot inputs [H_ctx[n - 1]; e(x_n)] (not in DSpark).
        init_from_target: start the backbone's layers from the target's last layers (``ParallelBlockDrafter``).
        markov: ``vanilla`` (B = W1[x_{k-1}] W2, Eq. 5) or ``rnn`` (the gated recurrent head, Eq. 6).
        markov_rank: r, the rank of W1 W2 (the paper's default 256).
        prefix_scheduler: cut each block where verifying more does not pay (Alg. 1); False submits all K slots.
        verify_cost: cost(T), the relative cost of verifying T = 1, 2, ... tokens in one target forward (only
            ratios matter), at least K + 1 values; None = ``cpu_verify_cost`` (SmolLM2-135M on one CPU thread).
        qk_norm, mask_token_id: ``ParallelBlockDrafter``'s Qwen3 query/key norms and one shared mask vector (from that
            token's embedding), as the DSpark layers vLLM serves; the speculators export needs both
            (experiments/drafters/dspark_export.yaml).
    """

    family = "dspark"
    parallel_slots = False  # the Markov head makes slot k read the token drafted at k - 1
    tree_growth = TreeGrowth.NONE  # so chains only: no best-first tree over the block

    def __init__(
        self,
        block_size: int = 8,
        num_layers: int = 1,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        context_shortcut: bool = False,
        init_from_target: bool = False,
        markov: Literal["vanilla", "rnn"] = "vanilla",
        markov_rank: int = 256,
        prefix_scheduler: bool = True,
        verify_cost: list[float] | None = None,
        qk_norm: bool = False,
        mask_token_id: int | None = None,
    ) -> None:
        super().__init__(
            block_size=block_size, num_layers=num_layers, target_layers=target_layers, num_anchors=num_anchors,
            draft_vocab_size=draft_vocab_size, intermediate_size=intermediate_size, context_shortcut=context_shortcut,
            init_from_target=init_from_target, qk_norm=qk_norm, mask_token_id=mask_token_id,
        )
        if markov not in MARKOV_KINDS:
            raise UserError(f"drafter.markov must be one of {MARKOV_KINDS}, got {markov!r}.")
        if markov_rank < 1:
            raise UserError(f"drafter.markov_rank must be >= 1, got {markov_rank}.")
        if verify_cost is not None and (len(verify_cost) < block_size + 1 or min(verify_cost) <= 0):
            raise UserError(
                f"drafter.verify_cost must hold cost(T) > 0 for T = 1..block_size + 1 ({block_size + 1} values), got "
                f"{list(verify_cost)}; measure your target's verify forward or leave it unset."
            )
        self.markov = markov
        self.markov_rank = markov_rank
        self.prefix_scheduler = prefix_scheduler
        self.verify_cost = list(verify_cost) if verify_cost is not None else None
        costs = self.verify_cost or [cpu_verify_cost(t) for t in range(1, block_size + 2)]
        self.register_buffer("costs", torch.tensor(costs[: block_size + 1]), persistent=False)  # (K+1,)
        # Sequential Temperature Scaling (``calibrate``): c_k = σ(z_k / T_k); 1 until calibrated
        self.register_buffer("confidence_temperature", torch.ones(block_size))  # (K,)

    @property
    def mask_slots(self) -> int:
        return self.block_size - 1  # the anchor slot is a prediction: [anchor, MASK x (K - 1)]

    # ------------------------------------------------------------------------------------------- building
    def build(self, target: Target) -> None:
        super().build(target)
        hidden, vd = target.hidden_size, self.vocab.ids.numel()
        # the anchor slot is a prediction: K - 1 mask vectors (the block body built K, all equal at init; one shared
        # vector with mask_token_id stays one)
        self.mask_embedding = nn.Parameter(self.mask_embedding.detach()[: self.mask_slots].clone())
        self.sequential = MarkovHead(self.markov, self.markov_rank, vd + 1, hidden, vd)
        self.confidence = nn.Linear(hidden + self.markov_rank, 1)  # w (and a bias) of Eq. 7
        with torch.no_grad():  # N(0, 0.02) as the backbone (and DeepSpec's HF initialiser); B_k ≈ 0, c ≈ 0.5
            for p in (*self.sequential.parameters(), *self.confidence.parameters()):
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)
                else:
                    nn.init.zeros_(p)

    def rows(self, ids: Tensor) -> Tensor:
        """Target ids -> rows of W1: their draft id, or the last row (Vd) for a token outside the draft vocabulary."""
        draft, inside = self.vocab.to_draft(ids)
        return torch.where(inside, draft, torch.full_like(draft, self.vocab.ids.numel()))

    def conf_logit(self, hidden: Tensor, prev: Tensor) -> Tensor:
        """z_k = wᵀ[h_k; W1[x_{k-1}]] + b: (..., H), (..., r) -> (...,); the confidence is σ(z_k / T_k)."""
        return self.confidence(torch.cat([hidden, prev], -1))[..., 0]

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Teacher-forced forward: slot k's previous token is the gold x_{n+k-1} (the anchor for k = 1), so slot k's
        distribution is the one ``propose`` draws from when slots < k were accepted; ``drafted`` is the cut the
        scheduler makes there."""
        ids = batch["input_ids"]
        n, s = ids.shape
        k = self.block_size
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        a = starts.shape[1]
        hidden = self.backbone(ids, features, starts)  # (N, A, K, H): the block [anchor, K - 1 masks], every slot
        pos = starts[..., None] + torch.arange(k, device=ids.device)  # (N, A, K): n..n+K-1
        prev_ids = ids.gather(1, pos.clamp(max=s - 1).reshape(n, -1)).view(n, a, k)  # (N, A, K) x_{n+k-1}, gold
        prev = self.sequential.embed(self.rows(prev_ids))  # (N, A, K, r) W1[x_{k-1}]
        markov = self.sequential.unroll(prev, hidden)  # (N, A, K, r) m_k
        conf = self.conf_logit(hidden, prev)  # (N, A, K)
        drafted = None
        if self.prefix_scheduler:
            with torch.no_grad():
                drafted = prefix_length(torch.sigmoid(conf / self.confidence_temperature), self.costs)  # (N, A)

        def logits(hidden_chunk: Tensor, index: Tensor) -> Tensor:  # U_k + B_k over the draft vocabulary
            return self.head(hidden_chunk) + self.sequential.out(markov.index_select(1, index))  # (N, a, K, Vd)

        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=starts, hidden=hidden, head=logits,
                           aux={"confidence": conf}, drafted=drafted)

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def propose(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        """The backbone once, then slot by slot: the confidence of slot k (from x_{k-1}) decides whether it is
        admitted; an admitted slot's token is drawn from softmax(U_k + B_k) under ``sampling``."""
        k = self.block_size
        hidden = self.block_hidden(state, anchor)[0]  # (K, H): the anchor slot predicts too
        base = self.head(hidden)  # (K, Vd) U_k

        row = self.rows(anchor.reshape(1))[0]  # W1's row of x_0
        rnn_state = hidden.new_zeros(self.markov_rank) if self.sequential.rnn is not None else None
        conf: list[Tensor] = []
        tokens: list[Tensor] = []
        probs: list[Tensor] = []
        for slot in range(k):
            prev = self.sequential.embed(row)  # (r,)
            if self.prefix_scheduler:
                conf.append(torch.sigmoid(self.conf_logit(hidden[slot], prev) / self.confidence_temperature[slot]))
                if int(prefix_length(torch.stack(conf), self.costs[: slot + 2])) <= slot:
                    break  # Θ stopped improving: the block is cut before this slot's token is drawn
            rnn_state, m = self.sequential.step(rnn_state, prev, hidden[slot])
            logits = base[slot] + self.sequential.out(m)  # (Vd,)
            q = sampling.probs(logits)  # (Vd,)
            row = sampling.sample(q, generator)  # a draft id: the next slot's row of W1
            tokens.append(row)
            probs.append(q)
        if not tokens:
            return ChainProposal.empty(anchor.device)
        drafted = self.vocab.to_target(torch.stack(tokens))  # (k,)
        if sampling.greedy:
            return ChainProposal(tokens=drafted)
        return ChainProposal(tokens=drafted, probs=self.vocab.scatter(torch.stack(probs)))  # (k, V)

    # ---------------------------------------------------------------------------------------- calibration
    @torch.no_grad()
    def calibrate(
        self,
        batches: Iterable[dict[str, Tensor]],
        sampling: SamplingConfig | dict | None = None,
        grid: Sequence[float] | None = None,
        bins: int = 20,
        anchors_per_forward: int = 64,
    ) -> Calibration:
        """Sequential Temperature Scaling (DSpark §3.2.1) on held-out data; the temperatures are stored in the
        drafter (``confidence_temperature``, saved with its weights) and used by the scheduler from then on.

        Every position n whose next token is supervised starts a teacher-forced block. Slot k's outcome is its
        acceptance α_k = Σ_v min(p_k(v), q_k(v)) with the target's p (full vocabulary) and the draft's q both under
        ``sampling`` (under greedy: 1 when the draft's argmax is the target's), and the truth for the prefix is
        Π_{i≤k} α_i. Left to right, T_k is the grid value minimising the ECE of Π_{i≤k} σ(z_i / T_i), earlier
        temperatures fixed.

        Args:
            batches: held-out batches with ``input_ids`` (N, S) and ``loss_mask`` (N, S), e.g. the validation
                dataloader; the drafter's bound target gives their features and p.
            sampling: the sampling the drafter will decode under (default temperature 1, as c*'s training target).
            grid: candidate temperatures (default 81 values, geometric over 0.1..10).
            bins: equal-width ECE bins on [0, 1].
            anchors_per_forward: anchors per row in one forward (memory).
        """
        sampling = SamplingConfig.coerce(sampling if sampling is not None else {"temperature": 1.0})
        grid_t = torch.tensor(list(grid) if grid is not None else torch.logspace(-1, 1, 81).tolist())
        if grid_t.numel() == 0 or bool((grid_t <= 0).any()):
            raise UserError(f"calibrate(grid=...) must list temperatures > 0, got {grid_t.tolist()}.")
        was_training = self.training
        self.eval()
        try:
            z, acc, ok = self._held_out_blocks(batches, sampling, anchors_per_forward)
        finally:
            self.train(was_training)
        if not bool(ok[:, 0].any()):
            raise UserError("calibrate found no supervised block in the held-out batches; pass batches with "
                            "input_ids and a loss_mask that marks the responses.")
        result = sequential_temperature_scaling(z, acc, ok, grid_t, bins)
        self.confidence_temperature.copy_(result.temperature.to(self.confidence_temperature))
        return result

    def _held_out_blocks(
        self, batches: Iterable[dict[str, Tensor]], sampling: SamplingConfig, chunk: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Confidence logits z, acceptances α and validity of every slot of every held-out block: (M, K) each."""
        target, ids_d = self.target, self.vocab.ids
        zs, accs, oks = [], [], []
        for batch in batches:
            ids = batch["input_ids"].to(target.device)
            mask = batch["loss_mask"].to(target.device).bool()
            n, s = ids.shape
            out = target(ids, layers=list(self.target_layers), logits=False)
            # p_t over the draft vocabulary from the target's full warped distribution, t = position + 1
            p_next = torch.stack([sampling.probs(target.lm_head(out.last_hidden[i]))[:, ids_d.to(ids.device)]
                                  for i in range(n)])  # (N, S, Vd)
            start_ok = torch.zeros_like(mask)
            start_ok[:, :-1] = mask[:, 1:]
            pos = torch.arange(s, device=ids.device).expand(n, s)
            starts = torch.where(start_ok, pos, pos + s).sort(-1).values  # round starts first, padding last
            for lo in range(0, int(start_ok.sum(-1).max()), chunk):
                positions = starts[:, lo : lo + chunk]  # (N, C)
                keep = positions < s
                anchors = Anchors(torch.where(keep, positions, torch.zeros_like(positions)), keep)
                draft = self({"input_ids": ids, "loss_mask": mask}, out.features, anchors)
                at = (anchors.positions[..., None] + torch.arange(self.block_size, device=ids.device)).clamp(max=s - 1)
                flat = at.reshape(n, -1, 1).expand(-1, -1, p_next.shape[-1])  # (N, CK, Vd): p of x_{n+t}
                p = p_next.gather(1, flat).view(*at.shape, -1)  # (N, C, K, Vd)
                q = sampling.probs(draft.logits)  # (N, C, K, Vd)
                alpha = torch.minimum(p, q).sum(-1)  # (N, C, K)
                zs.append(draft.aux["confidence"][keep])
                accs.append(alpha[keep])
                oks.append(draft.valid[keep])
        k = self.block_size
        if not zs:
            return torch.zeros(0, k), torch.zeros(0, k), torch.zeros(0, k, dtype=torch.bool)
        return torch.cat(zs).float().cpu(), torch.cat(accs).float().cpu(), torch.cat(oks).cpu()


def expected_calibration_error(pred: Tensor, truth: Tensor, bins: int) -> Tensor:
    """ECE = Σ_b (n_b / M) |mean_b(pred) - mean_b(truth)| over ``bins`` equal-width bins of pred (Naeini et al.
    2015), for G candidate predictions at once: pred (G, M), truth (M,) -> (G,)."""
    g, m = pred.shape
    index = (pred * bins).long().clamp(0, bins - 1) + bins * torch.arange(g)[:, None]  # (G, M)
    gap = torch.zeros(g * bins, dtype=torch.float64)
    gap.index_add_(0, index.reshape(-1), (pred.double() - truth.double()).reshape(-1))
    return gap.view(g, bins).abs().sum(-1) / max(m, 1)


def sequential_temperature_scaling(z: Tensor, acc: Tensor, ok: Tensor, grid: Tensor, bins: int = 20) -> Calibration:
    """STS (DSpark §3.2.1): confidence logits z (M, K), per-slot outcomes acc (M, K) in [0, 1], ok (M, K) bool (the
    slot is supervised) -> per slot the temperature on ``grid`` minimising the ECE of Π_{i≤k} σ(z_i / T_i) against
    Π_{i≤k} acc_i over the blocks whose slots 1..k are all supervised, left to right, earlier slots fixed."""
    m, k = z.shape
    temps = torch.ones(k)
    before, after = torch.full((k,), float("nan")), torch.full((k,), float("nan"))
    blocks = torch.zeros(k, dtype=torch.long)
    pred_raw = torch.ones(m)  # Π σ(z_i), uncalibrated
    pred = torch.ones(m)  # Π σ(z_i / T_i) of the slots already calibrated
    truth = torch.ones(m)
    alive = torch.ones(m, dtype=torch.bool)
    for slot in range(k):
        alive = alive & ok[:, slot]
        blocks[slot] = int(alive.sum())
        truth = truth * acc[:, slot]
        pred_raw = pred_raw * torch.sigmoid(z[:, slot])
        if not bool(alive.any()):
            break
        cand = pred[None, alive] * torch.sigmoid(z[None, alive, slot] / grid[:, None])  # (G, M')
        ece = expected_calibration_error(cand, truth[alive], bins)  # (G,)
        best = int(ece.argmin())
        temps[slot] = grid[best]
        before[slot] = float(expected_calibration_error(pred_raw[None, alive], truth[alive], bins)[0])
        after[slot] = float(ece[best])
        pred = pred * torch.sigmoid(z[:, slot] / temps[slot])
    return Calibration(temperature=temps, ece_before=before, ece_after=after, blocks=blocks)
