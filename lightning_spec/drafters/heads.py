"""Drafters on the target's last hidden state: Medusa heads and DeepSeek-V3 MTP modules, both chain-drafted.

Medusa (Cai et al. 2024, arXiv 2401.10774, §2.1.1): K heads on the target's last hidden state h_t. Head k is a
residual block and the LM head, p^(k)_t = softmax(W_2 (SiLU(W_1^(k) h_t) + h_t)), and predicts x_{t+k+1}. The
heads run side by side and see nothing but h_t; W_1 starts at zero and W_2 is the LM head, so each head starts
as the target's own next-token head.

DeepSeek-V3 multi-token prediction (DeepSeek-AI 2024, arXiv 2412.19437, §2.2, Eq. 21-23): D sequential modules.
Module k joins the previous depth's state and the embedding of the next known token, h'^k_i = M_k[RMSNorm(h^{k-1}_i);
RMSNorm(Emb(t_{i+k}))], runs one transformer block, h^k = TRM_k(h'^k), and predicts t_{i+k+1} through the
output head. Embedding and output head are shared with the main model; each module has its own final RMSNorm
before the head (``shared_head.norm`` in the released checkpoints).

Our convention. A round is anchored at n, the last committed token (the bonus); the target has run positions
< n only, so the anchor has no target hidden state yet. Both families read h_{n-1}: the last layer's state at
n - 1, whose LM head predicted x_n (the anchor). They get it as a target feature layer, ``target_layers =
[L - 1]``: the HF hidden state of the last layer is already final-normed (``target.py``), i.e. the state the LM
head reads, which is Medusa's h_t exactly; MTP normalises its input with its own RMSNorm anyway.

- Medusa: head k reads h_{n-1} and predicts x_{n+k}, k = 1..K (the paper's t = n - 1). The heads never see the
  anchor token x_n: where the target sampled x_n, they still spread their mass over every x_n it might have
  drawn. That, and that no slot sees the drafted tokens before it, is why Medusa accepts less than the drafters
  that read the anchor (DFlash, EAGLE, MTP). ``propose`` ignores the anchor.
- MTP: h'_0 = h_{n-1}; slot k runs module k on [RMSNorm(h'_{k-1}); RMSNorm(Emb(x_{n+k-1}))], x_n being the anchor,
  and predicts x_{n+k}. Chain drafting feeds the drafted token into the next slot; training feeds the realised
  one (teacher forcing), unrolling all K slots on the modules' own states h'_k, so slot k's distribution in
  ``forward`` is the one ``propose`` draws from whenever slots 1..k-1 were accepted.
- MTP with ``num_modules`` D < K: slot k uses module min(k, D), i.e. the last module again for the later slots,
  as serving engines run a DeepSeek-V3 checkpoint (one MTP module) for several speculative tokens (vLLM, SGLang,
  TensorRT-LLM's "MTP Eagle"). Because training unrolls every slot, the reused module is trained on its own
  states, like EAGLE's training-time test.
- MTP attention. In DeepSeek-V3, TRM_k attends causally over the sequence at depth k, and serving engines keep a
  KV cache per module over committed positions. Here a block attends within the round: to the entries its
  module wrote at earlier slots of the same round (one reused module: causal attention over the round, what a
  serving engine's cache holds of the round; one module per slot: itself only, where attention is exactly
  o_proj(v) and the module has no query and key projections). Everything before the anchor reaches the modules
  through h_{n-1}. Attention over committed positions is left out on purpose: with one reused module it would
  make this EAGLE's drafter (``eagle3.py``: one decoder layer over [Emb(x_p); state] with a cache of committed
  entries) with a projection in front, and with D > 1 each module's committed entries would need the earlier
  modules' states at every committed position (TensorRT-LLM's "MTP Vanilla" keeps the last D tokens and states
  for that).

Losses are objective parts (the family owns none): Medusa's Σ_k 0.8^k CE_k is ``CE`` + ``Geometric(0.8)``
(``normalize: weight`` cancels its factor 0.8 against our t - 1 exponent); DeepSeek-V3's (λ/D) Σ_k CE_k is ``CE``
+ ``Uniform`` with ``normalize: slots`` (λ weighs it against the main model's loss, which has no counterpart
here). See experiments/drafters/medusa.yaml and mtp.yaml.

Trees (a later kind of proposal) need more than the chain: ``MedusaDrafter.slot_logits`` gives every head's
logits at once (a Medusa tree is a product of their top-k), ``MTPDrafter.advance`` runs one slot from a chain's
state (a tree expands a node by one call per child, from a copy of that state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput, DraftVocab
from lightning_spec.drafters.block import DraftLayer, RMSNorm
from lightning_spec.sampling import SamplingConfig


# --------------------------------------------------------------------------------------- shared: h_{n-1}
@dataclass
class LastHiddenState:
    """Decoding state of both families: the target's last-layer state h_{n-1} before the next anchor n."""

    last: Tensor  # (1, H)


class LastHiddenDrafter(Drafter):
    """What Medusa and MTP share: the last target layer as their only feature, h_{n-1} per anchor (zero at n = 0,
    where no position precedes the anchor, in training and decoding alike), and a state that keeps h_{n-1}."""

    def __init__(self, block_size: int, num_anchors: int, draft_vocab_size: int | None) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"drafter.block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.num_anchors = num_anchors
        self.draft_vocab_size = draft_vocab_size
        self.target_layers: list[int] = []  # [L - 1], set by bind
        self.vocab = DraftVocab(draft_vocab_size)
        self.built = False

    def bind(self, target: Any) -> None:
        super().bind(target)
        self.target_layers = [target.num_layers - 1]  # final-normed: the state the LM head reads
        if self.built:
            return
        self.vocab.build(target.vocab_size)
        self.build(target)
        self.to(target.device)
        self.built = True

    def build(self, target: Any) -> None:
        """The family's own layers, target-shaped (called once, from ``bind``)."""
        raise NotImplementedError

    def previous_hidden(self, features: Tensor, anchors: Tensor) -> Tensor:
        """h_{n-1} for every anchor n: features (N, S, H), anchors (N, A) -> (N, A, H), zero where n = 0."""
        prev = features.gather(1, (anchors - 1).clamp(min=0)[..., None].expand(-1, -1, features.shape[-1]))
        return prev * (anchors > 0)[..., None]  # (N, A, H)

    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> LastHiddenState:
        """The prefill covers the prompt but its last token (the first anchor): h_{n-1} is the last feature. The
        prompt's tokens are not read (see the module docstring on what MTP's blocks attend to)."""
        if features.shape[1] == 0:  # a one-token prompt: nothing precedes the anchor
            return LastHiddenState(last=features.new_zeros(1, features.shape[-1]))
        return LastHiddenState(last=features[:, -1])

    @torch.no_grad()
    def extend(self, state: LastHiddenState, features: Tensor, path: list[int]) -> None:
        """The last committed node sits just before the next anchor (the token the target commits after it)."""
        state.last = features[:, path[-1]]  # (1, H)


# ------------------------------------------------------------------------------------------------- Medusa
class ResBlock(nn.Module):
    """x + SiLU(W x + b) (Medusa §2.1.1; the authors' code has the bias). W and b start at zero: the identity."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaDrafter(LastHiddenDrafter):
    """Medusa-1 heads on the frozen target (Cai et al. 2024, arXiv 2401.10774): head k = ``num_layers`` residual
    blocks, then the target's frozen LM head over the draft vocabulary; head k predicts x_{n+k} from h_{n-1}.

    The paper trains a separate W_2 per head, initialised from the LM head; here every head shares the frozen LM
    head (over the draft vocabulary), as every other family of this package does.

    Args:
        block_size: K, the number of heads (the paper uses 4-5).
        num_layers: residual blocks per head (Medusa's ``medusa_num_layers``, 1 in the paper).
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data (None = the
            full target vocabulary).
    """

    def __init__(
        self,
        block_size: int = 5,
        num_layers: int = 1,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__(block_size, num_anchors, draft_vocab_size)
        if num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {num_layers}.")
        self.num_layers = num_layers

    def config_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_anchors": self.num_anchors,
            "draft_vocab_size": self.draft_vocab_size,
        }

    def build(self, target: Any) -> None:
        hidden = target.hidden_size
        self.medusa = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(self.num_layers))) for _ in range(self.block_size)
        )

    def heads_hidden(self, h: Tensor) -> Tensor:
        """(..., H) h_{n-1} -> (..., K, H): every head's state before the shared LM head."""
        h = h.to(self.medusa[0][0].linear.weight.dtype)
        return torch.stack([head(h) for head in self.medusa], dim=-2)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Every head of every anchor; the heads do not depend on the tokens, so nothing is teacher-forced."""
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        hidden = self.heads_hidden(self.previous_hidden(features, anchors.positions))  # (N, A, K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=hidden, head=self._logits)

    def _logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd)

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def slot_logits(self, state: LastHiddenState) -> Tensor:
        """Every head's logits over the draft vocabulary, (K, Vd): independent of the anchor and of each other."""
        return self.head(self.heads_hidden(state.last[0]))

    @torch.no_grad()
    def propose(
        self, state: LastHiddenState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        """Head k's top token (greedy) or a draw from it (sampling) at slot k; the anchor is not read."""
        logits = self.slot_logits(state)  # (K, Vd)
        if sampling.greedy:
            return ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        q = sampling.probs(logits)  # (K, Vd)
        return ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)), probs=self.vocab.scatter(q))


# ---------------------------------------------------------------------------------------------------- MTP
class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module: M_k [RMSNorm(h); RMSNorm(e)] -> a Llama-style decoder block -> h^k, and its own
    RMSNorm before the shared head.

    ``attends``: whether the module runs at more than one slot of a round (the last module when D < K). One that
    runs at a single slot attends to its own entry alone: a softmax over one key is 1, so its attention is
    o_proj(v_proj(x)) exactly, and it has no query or key projections (they would only get rounding noise for
    gradients, which Adam would turn into updates)."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float, attends: bool
    ) -> None:
        super().__init__()
        self.attends = attends
        self.hnorm = RMSNorm(hidden, eps)
        self.enorm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)  # M_k
        self.block = DraftLayer(hidden, heads, kv_heads, head_dim, inter, eps)  # TRM_k
        if not attends:
            del self.block.q_proj, self.block.k_proj
        self.out_norm = RMSNorm(hidden, eps)

    def run_block(
        self, u: Tensor, pos: Tensor, past: tuple[Tensor, Tensor] | None, theta: float
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The block on u (B, 1, H) at slot ``pos`` (B, 1), attending to ``past`` (this round's earlier entries of
        this module, (B, kv_heads, j, D) each) and itself. Returns h^k (B, H) and the entries with its own."""
        b = self.block
        if not self.attends:  # one key: the attention output is its value
            v = b.v_proj(b.input_norm(u)).view(-1, b.kv_heads, b.head_dim)  # (B, kv_heads, D)
            h = u[:, 0] + b.o_proj(v.repeat_interleave(b.heads // b.kv_heads, dim=1).flatten(1))  # (B, H)
            x = b.post_norm(h)
            return h + b.down_proj(F.silu(b.gate_proj(x)) * b.up_proj(x)), None
        key, value = b.kv(b.input_norm(u), pos, theta)  # (B, kv_heads, 1, D): this slot's entry
        past_k, past_v = past if past is not None else (key[:, :, :0], value[:, :, :0])
        h = b(u, pos, past_k, past_v, None, 1, theta)[:, 0]  # (B, H)
        return h, (torch.cat([past_k, key], 2), torch.cat([past_v, value], 2))


@dataclass
class MTPChain:
    """One round's chain after ``slot`` slots, for B anchors side by side: h'_slot, and per module the keys and
    values it wrote this round (its attention reads them at its later slots)."""

    hidden: Tensor  # (B, H) h'_slot (h'_0 = h_{n-1})
    entries: list[tuple[Tensor, Tensor] | None]  # per module: keys, values (B, kv_heads, j, D)
    slot: int = 0


class MTPDrafter(LastHiddenDrafter):
    """DeepSeek-V3 MTP modules as a chain drafter (DeepSeek-AI 2024, arXiv 2412.19437, §2.2): slot k runs module
    min(k, D) on [RMSNorm(h'_{k-1}); RMSNorm(Emb(x_{n+k-1}))] with h'_0 = h_{n-1} and x_n the anchor, and predicts
    x_{n+k} through the frozen LM head over the draft vocabulary.

    Args:
        block_size: K, draft proposals per round.
        num_modules: D, MTP modules (DeepSeek-V3 trains D = 1); slots after the D-th reuse the last module.
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data (None = the
            full target vocabulary).
        intermediate_size: MLP width of each module's block; default the target's.
    """

    def __init__(
        self,
        block_size: int = 8,
        num_modules: int = 1,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__(block_size, num_anchors, draft_vocab_size)
        if not 1 <= num_modules <= block_size:
            raise ValueError(
                f"drafter.num_modules={num_modules} must be in 1..block_size ({block_size}); later slots reuse the "
                "last module, so more modules than slots would never run."
            )
        self.num_modules = num_modules
        self.intermediate_size = intermediate_size

    def config_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_modules": self.num_modules,
            "num_anchors": self.num_anchors,
            "draft_vocab_size": self.draft_vocab_size,
            "intermediate_size": self.intermediate_size,
        }

    def build(self, target: Any) -> None:
        cfg = target.config
        hidden = target.hidden_size
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        inter = self.intermediate_size or cfg.intermediate_size
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(rope_params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        d = self.num_modules  # only the last module can run at several slots (when D < K)
        self.mtp = nn.ModuleList(
            MTPModule(hidden, heads, kv_heads, head_dim, inter, eps, attends=m == d - 1 and d < self.block_size)
            for m in range(d)
        )
        self._init_weights(target)

    @torch.no_grad()
    def _init_weights(self, target: Any) -> None:
        for name, p in self.mtp.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):  # GPT-2 residual scaling, 1 block deep
                    p.div_(math.sqrt(2))
        # each module's output norm feeds the frozen LM head: start from the target's own final norm scale
        final_norm = getattr(target.base, "norm", None)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            for module in self.mtp:
                module.out_norm.weight.copy_(final_norm.weight.detach().to(module.out_norm.weight.dtype))

    # ------------------------------------------------------------------------------------------- one slot
    def new_chain(self, last: Tensor) -> MTPChain:
        """A round's chain before its first slot: h'_0 = h_{n-1}, last (B, H)."""
        return MTPChain(hidden=last.to(self.mtp[0].proj.weight.dtype), entries=[None] * self.num_modules)

    def advance(self, chain: MTPChain, tokens: Tensor) -> Tensor:
        """Run slot k = chain.slot + 1 on the known token x_{n+k-1} (tokens (B,) target ids: the anchor at k = 1,
        then the realised or the drafted token) and move the chain on. Returns the state the head reads, (B, H)."""
        m = min(chain.slot, self.num_modules - 1)  # slot k uses module min(k, D)
        module = self.mtp[m]
        emb = self.target.embed_tokens(tokens).to(module.proj.weight.dtype)  # (B, H)
        u = module.proj(torch.cat([module.hnorm(chain.hidden), module.enorm(emb)], dim=-1))[:, None]  # (B, 1, H)
        pos = torch.full_like(tokens, chain.slot)[:, None]  # (B, 1): the slot, for RoPE within the round
        h, chain.entries[m] = module.run_block(u, pos, chain.entries[m], self.rope_theta)  # (B, H) h'_k
        chain.hidden, chain.slot = h, chain.slot + 1
        return module.out_norm(h)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """All K slots of every anchor, teacher-forced: slot k reads the realised x_{n+k-1} (the anchor at k = 1)
        and the modules' own h'_{k-1}, exactly as ``propose`` does when slots 1..k-1 were accepted."""
        ids = batch["input_ids"]
        n, s = ids.shape
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        a = starts.shape[1]
        prev = self.previous_hidden(features, starts)  # (N, A, H) h_{n-1}
        pos = (starts[..., None] + torch.arange(self.block_size, device=ids.device)).clamp(max=s - 1)  # (N, A, K)
        known = ids.gather(1, pos.reshape(n, -1)).view(n * a, self.block_size)  # (NA, K) x_{n+k-1}; past the end
        # of the sequence the slots are invalid, and so is every slot after them
        chain = self.new_chain(prev.reshape(n * a, -1))
        hidden = torch.stack([self.advance(chain, known[:, k]) for k in range(self.block_size)], dim=1)  # (NA, K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=starts, hidden=hidden.view(n, a, self.block_size, -1),
                           head=self._logits)

    def _logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd)

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def propose(
        self, state: LastHiddenState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        """Draft slot by slot, each drafted token the next slot's input."""
        chain = self.new_chain(state.last)
        token = anchor.reshape(1)
        tokens, probs = [], []
        for _ in range(self.block_size):
            logits = self.head(self.advance(chain, token))  # (1, Vd)
            if sampling.greedy:
                draft = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # (1, Vd)
                draft = sampling.sample(q, generator)
                probs.append(q)
            token = self.vocab.to_target(draft)  # (1,)
            tokens.append(token)
        tokens = torch.cat(tokens)  # (K,)
        if sampling.greedy:
            return ChainProposal(tokens=tokens)
        return ChainProposal(tokens=tokens, probs=self.vocab.scatter(torch.cat(probs)))
