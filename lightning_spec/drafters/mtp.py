"""MTPDrafter: DeepSeek-V3's multi-token prediction modules on the target's last hidden state, chain-drafted.

DeepSeek-V3 multi-token prediction (DeepSeek-AI 2024, arXiv 2412.19437, §2.2, Eq. 21-23): D sequential modules.
Module k joins the previous depth's state and the embedding of the next known token, h'^k_i = M_k[RMSNorm(h^{k-1}_i);
RMSNorm(Emb(t_{i+k}))], runs one transformer block, h^k = TRM_k(h'^k), and predicts t_{i+k+1} through the
output head. Embedding and output head are shared with the main model; each module has its own final RMSNorm
before the head (``shared_head.norm`` in the released checkpoints).

Our convention: a round is anchored at n, the last committed token, and the family reads h_{n-1}, the target's
last-layer state before it (``layers.LastHiddenDrafter``, shared with Medusa, says why).

- MTP streams. Index every depth by the token its entry embeds: s^0_p = h_p, and module k's entry at position p is
  u^k_p = M_k[RMSNorm(s^{k-1}_{p-1}); RMSNorm(Emb(x_p))], its output s^k_p = TRM_k(u^k)_p with causal attention over
  its own entries at positions <= p, predicting x_{p+1} (the paper's h'^k_i and h^k_i at i = p - k). Before position
  0 every depth's state is 0 (the h_{-1} = 0 that anchor 0 reads). DeepSeek-V3 trains these streams over the
  whole sequence; serving engines keep each module's keys and values over the committed tokens as its KV cache.
- MTP round anchored at n: slot t runs module m = min(t, D) at position n + t - 1 on [RMSNorm(the previous slot's
  output); RMSNorm(Emb(x_{n+t-1}))] (slot 1 reads h_{n-1}; x_n is the anchor) and predicts x_{n+t}; for t <= D
  this is the stream's entry u^t_{n+t-1}. It attends to module m's committed entries, positions <= n (the module's
  cache, built in ``begin`` and ``extend``, plus the anchor's entry, whose inputs are committed; module 1's is slot
  1's), and to module m's entries of this round. Module m >= 3 has no entries at n + 1..n + m - 2: they need depth
  m - 1 after the anchor, which a chain never computes (no gap for D <= 2, DeepSeek-V3 trains D = 1).
- MTP with ``num_modules`` D < K: slots t > D run module D again, on the previous slot's output, as serving
  engines run a DeepSeek-V3 checkpoint (one MTP module) for several speculative tokens (vLLM, SGLang,
  TensorRT-LLM's "MTP Eagle"). Their context is the same committed module-D cache plus module D's entries of the
  round from slot D on: module D drafts on autoregressively over its own stream, one entry a step, as an engine's
  MTP cache does during a round. With D = 1 this is EAGLE's chain (``eagle3.py``) with DeepSeek-V3's projection.
- What a depth passes on: DeepSeek-V3 (as vLLM runs it) hands the next depth the module's output before the
  module's own final RMSNorm; the Qwen3-Next MTP layers and speculators' MTP hand on the normed output, the state
  the head reads (``normed_chain``). The next depth normalises its input with its own RMSNorm either way, but
  RMSNorm(w ⊙ RMSNorm(h)) is not RMSNorm(h), so the two are different drafters.
- Committed entries always come from the streams (the target's states, the committed tokens), never from the
  chain: ``extend`` runs the streams over the committed nodes and drops the drafts' entries (as ``eagle3.py``).
  Training runs each module's stream once per sequence, then each slot of all anchors in one batched call,
  teacher-forced, each anchor masked to its module's entries < n: slot t's distribution in ``forward`` is the one
  ``propose`` draws from whenever slots 1..t-1 were accepted. A reused module is trained on its own states, like
  EAGLE's training-time test.

Losses are objective parts (the family owns none): DeepSeek-V3's (λ/D) Σ_k CE_k is ``CE`` + ``Uniform`` with
``normalize: slots`` (λ weighs it against the main model's loss, which has no counterpart here); see
experiments/drafters/mtp.yaml.

Trees: MTP grows EAGLE-2's dynamic tree: ``tree_step`` continues chosen rows of a round's chain by one ``advance``
(their entries copied per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, DraftOutput
from lightning_spec.drafters.layers import (
    DraftLayer,
    LastHiddenDrafter,
    RMSNorm,
    TargetShape,
    causal_attention,
    chain_attention,
    init_weights,
)
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module: u = M_k [RMSNorm(s); RMSNorm(e)] (Eq. 21), a Llama-style decoder block whose
    causal attention runs over the module's own entries (Eq. 22), and its own RMSNorm before the shared head."""

    def __init__(self, shape: TargetShape, qk_norm: bool = False) -> None:
        super().__init__()
        self.hnorm = RMSNorm(shape.hidden, shape.eps)
        self.enorm = RMSNorm(shape.hidden, shape.eps)
        self.proj = nn.Linear(2 * shape.hidden, shape.hidden, bias=False)  # M_k
        self.block = DraftLayer(shape, qk_norm)  # TRM_k
        self.out_norm = RMSNorm(shape.hidden, shape.eps)

    def entry(self, below: Tensor, emb: Tensor) -> Tensor:
        """u = M_k[RMSNorm(below); RMSNorm(emb)]: the state one depth below at the previous position (..., H) and the
        entry's token embedding (..., H) -> (..., H)."""
        return self.proj(torch.cat([self.hnorm(below), self.enorm(emb.to(below.dtype))], dim=-1))


@dataclass
class MTPState:
    """Decoding state: per module the keys and values of its committed entries at positions 0..length-1, and per
    depth d = 0..D-1 the stream's state s^d at position length - 1 (the next committed entries read it)."""

    keys: list[Tensor]  # per module (1, kv_heads, length, D)
    values: list[Tensor]
    last: list[Tensor]  # per depth (1, H): s^0 = h_{length-1}, the target's; zeros when length == 0
    length: int = 0
    nodes: list[Tensor] = field(default_factory=list)  # this round's tokens: the anchor, then the drafts, (1,) each


@dataclass
class MTPRows:
    """One round's chain for anchors (N, A) side by side, after ``slot`` slots: the state the next slot reads, and
    per module the committed entries it attends to and the entries it wrote this round."""

    hidden: Tensor  # (N, A, H): h_{n-1} before slot 1, then the last slot's output
    starts: Tensor  # (N, A) the anchor positions n
    context: list[tuple[Tensor, Tensor, Tensor | None]]  # per module: committed keys, values (N, kv_heads, S, D)
    # and which of them each anchor sees, (N, A, S) bool (None: all)
    entries: list[tuple[Tensor, Tensor]]  # per module: this round's keys, values (N, kv_heads, A, J, D)
    slot: int = 0


class MTPDrafter(LastHiddenDrafter):
    """DeepSeek-V3 MTP modules as a chain drafter (DeepSeek-AI 2024, arXiv 2412.19437, §2.2): slot t runs module
    min(t, D) on [RMSNorm(h'_{t-1}); RMSNorm(Emb(x_{n+t-1}))] with h'_0 = h_{n-1} and x_n the anchor, attending to
    the module's committed entries and its entries of the round (see the module docstring), and predicts x_{n+t}
    through the frozen LM head over the draft vocabulary.

    Args:
        block_size: K, draft proposals per round.
        num_modules: D, MTP modules (DeepSeek-V3 trains D = 1); slots after the D-th reuse the last module.
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data (None = the
            full target vocabulary).
        intermediate_size: MLP width of each module's block; default the target's.
        qk_norm: Qwen3's per-head RMSNorm on queries and keys in each module's block (the Qwen3 MTP layers of
            Qwen3-Next / Qwen3.5 and of the speculators library).
        normed_chain: the next depth (and the next slot) reads a module's output after its own final RMSNorm,
            the state its head reads, as the Qwen3-Next MTP layers and speculators' MTP do; False (DeepSeek-V3 as
            vLLM runs it) passes the state before that norm on. The speculators export needs qk_norm, normed_chain,
            one module and the full vocabulary (experiments/drafters/mtp_export.yaml).
    """

    family = "mtp"
    tree_growth = TreeGrowth.DYNAMIC  # tree_start / tree_step below: EAGLE-2's dynamic tree over the chained modules

    def adaptation_scopes(self) -> dict[str, list[str]]:
        last = f"mtp.{self.num_modules - 1}"  # the module that drafts every slot past the others
        return {"head": [f"{last}.out_norm"], "last": [f"{last}.block", f"{last}.out_norm"]}

    def __init__(
        self,
        block_size: int = 8,
        num_modules: int = 1,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        qk_norm: bool = False,
        normed_chain: bool = False,
    ) -> None:
        super().__init__(block_size, num_anchors, draft_vocab_size)
        if not 1 <= num_modules <= block_size:
            raise UserError(
                f"drafter.num_modules={num_modules} must be in 1..block_size ({block_size}); later slots reuse the "
                "last module, so more modules than slots would never run."
            )
        self.num_modules = num_modules
        self.intermediate_size = intermediate_size
        self.qk_norm = qk_norm
        self.normed_chain = normed_chain

    def build(self, target: Target) -> None:
        shape = TargetShape.of(target, self.intermediate_size)
        self.rope_theta = shape.rope_theta
        self.mtp = nn.ModuleList(MTPModule(shape, self.qk_norm) for _ in range(self.num_modules))
        init_weights(self.mtp, 1, target, [module.out_norm for module in self.mtp])  # each module is 1 block deep

    # ----------------------------------------------------------------------------------- committed streams
    def streams(
        self, ids: Tensor, h: Tensor, before: list[Tensor], past: list[tuple[Tensor, Tensor]] | None
    ) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor]]:
        """Every module's stream over T new committed positions L..L+T-1 (Eq. 21-22 over the sequence): tokens ids
        (B, T), the target's states h (B, T, H) there, ``before`` per depth 0..D-1 its state at position L - 1
        (B, H), ``past`` per module the keys and values (B, kv_heads, L, D) of positions < L (None: L = 0).
        Returns per module the keys and values of positions 0..L+T-1, and per depth 0..D-1 its states (B, T, H) at
        the new positions (depth 0: h). Causal, so a position's entries read nothing after it."""
        b, t = ids.shape
        start = past[0][0].shape[2] if past is not None else 0
        pos = torch.arange(start, start + t, device=ids.device).expand(b, t)  # (B, T)
        emb = self.target.embed_tokens(ids)  # (B, T, H)
        states = [h.to(self.mtp[0].proj.weight.dtype)]  # s^0
        cache = []
        for m, module in enumerate(self.mtp):
            below = torch.cat([before[m][:, None], states[m][:, :-1]], dim=1)  # (B, T, H): s^m at p - 1
            u = module.entry(below, emb)  # (B, T, H)
            x = module.block.input_norm(u)
            k, v = module.block.kv(x, pos, self.rope_theta)  # (B, kv_heads, T, D)
            if past is not None:
                k, v = torch.cat([past[m][0], k], 2), torch.cat([past[m][1], v], 2)
            cache.append((k, v))
            if m + 1 < self.num_modules:  # the next module reads this depth's states (the last depth's are unread)
                q = module.block.query(x, pos, self.rope_theta)  # (B, heads, T, D)
                states.append(self.passed_on(module, module.block.finish(u, causal_attention(q, k, v))))  # (B, T, H)
        return cache, states

    # ------------------------------------------------------------------------------------------- one slot
    def new_chain(
        self, before: list[Tensor], anchor: Tensor, starts: Tensor, context: list[tuple[Tensor, Tensor, Tensor | None]]
    ) -> MTPRows:
        """A round's chain before its first slot, for anchors at ``starts`` (N, A) with tokens ``anchor`` (N, A):
        ``before`` per depth 0..D-1 the committed stream's state at n - 1 (N, A, H), ``context`` per module its
        committed entries before the anchor. Modules 2..D start with the anchor's own entry (its inputs, depth
        m - 1 at n - 1 and x_n, are committed); module 1's anchor entry is slot 1's."""
        emb = self.target.embed_tokens(anchor)  # (N, A, H)
        n, a = starts.shape
        entries = []
        for m, module in enumerate(self.mtp):
            b = module.block
            if m == 0:
                entries.append((emb.new_zeros(n, b.kv_heads, a, 0, b.head_dim),) * 2)
                continue
            k, v = b.kv(b.input_norm(module.entry(before[m], emb)), starts, self.rope_theta)  # (N, kv_heads, A, D)
            entries.append((k[:, :, :, None], v[:, :, :, None]))
        return MTPRows(hidden=before[0], starts=starts, context=context, entries=entries)

    def advance(self, chain: MTPRows, tokens: Tensor) -> Tensor:
        """Run slot t = chain.slot + 1 on the known token x_{n+t-1} (tokens (N, A) target ids: the anchor at t = 1,
        then the realised or the drafted token) and move the chain on. Returns the state the head reads, (N, A, H)."""
        m = min(chain.slot, self.num_modules - 1)  # slot t runs module min(t, D)
        module = self.mtp[m]
        b = module.block
        u = module.entry(chain.hidden, self.target.embed_tokens(tokens))  # (N, A, H)
        pos = chain.starts + chain.slot  # (N, A): x_{n+t-1}'s position
        x = b.input_norm(u)
        q = b.query(x, pos, self.rope_theta)  # (N, heads, A, D)
        k, v = b.kv(x, pos, self.rope_theta)  # (N, kv_heads, A, D)
        own_k, own_v = (torch.cat([own, new[:, :, :, None]], 3) for own, new in zip(chain.entries[m], (k, v)))
        chain.entries[m] = (own_k, own_v)  # (N, kv_heads, A, J, D)
        ctx_k, ctx_v, seen = chain.context[m]
        h = b.finish(u, chain_attention(q, ctx_k, ctx_v, seen, own_k, own_v))  # (N, A, H) h'_t
        chain.hidden, chain.slot = self.passed_on(module, h), chain.slot + 1
        return module.out_norm(h)

    def passed_on(self, module: MTPModule, h: Tensor) -> Tensor:
        """What the next depth or slot reads of a module's output h (..., H): h, or RMSNorm(h) with ``normed_chain``."""
        return module.out_norm(h) if self.normed_chain else h

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """The streams once over each sequence, then all K slots of every anchor, teacher-forced: slot t reads the
        realised x_{n+t-1} (the anchor at t = 1) and the modules' own h'_{t-1}, and attends to its module's stream
        entries before n and its round's entries, exactly as ``propose`` does when slots 1..t-1 were accepted."""
        ids = batch["input_ids"]
        n, s = ids.shape
        k = self.block_size
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        zero = features.new_zeros(n, features.shape[-1]).to(self.mtp[0].proj.weight.dtype)
        cache, states = self.streams(ids, features, [zero] * self.num_modules, None)
        before = [self.previous_hidden(state, starts) for state in states]  # (N, A, H) per depth, zero at n = 0
        seen = torch.arange(s, device=ids.device) < starts[..., None]  # (N, A, S): the entries before the anchor
        chain = self.new_chain(before, ids.gather(1, starts), starts, [(ck, cv, seen) for ck, cv in cache])
        pos = (starts[..., None] + torch.arange(k, device=ids.device)).clamp(max=s - 1)  # (N, A, K)
        known = ids.gather(1, pos.reshape(n, -1)).view(*pos.shape)  # (N, A, K) x_{n+t-1}; past the end of the
        # sequence the slots are invalid, and so is every slot after them
        hidden = torch.stack([self.advance(chain, known[..., t]) for t in range(k)], dim=2)  # (N, A, K, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        return DraftOutput(labels=labels, valid=valid, anchors=starts, hidden=hidden, head=self._logits)

    def _logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd)

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> MTPState:
        """The streams over the prefill: features (1, S, H) and the tokens ``input_ids`` (1, S) at positions
        0..S-1 (every module's entry embeds its token)."""
        if input_ids is None or input_ids.shape[-1] != features.shape[1]:
            raise ValueError(
                "MTPDrafter.begin needs the prefill's token ids (input_ids, one per feature position): the MTP "
                "modules' committed entries embed their tokens; pass begin(features, input_ids)."
            )
        w = self.mtp[0].proj.weight
        empty = [w.new_zeros(1, m.block.kv_heads, 0, m.block.head_dim) for m in self.mtp]  # (1, kv_heads, 0, D)
        zero = w.new_zeros(1, w.shape[0])  # (1, H)
        state = MTPState(keys=empty, values=list(empty), last=[zero] * self.num_modules)
        self._commit(state, input_ids.reshape(1, -1).to(w.device), features)
        return state

    def _commit(self, state: MTPState, ids: Tensor, features: Tensor) -> None:
        """Run the streams over committed tokens ids (1, T) at positions length.. with the target's states (1, T, H)."""
        if ids.shape[1] == 0:
            return
        cache, states = self.streams(ids, features, state.last, list(zip(state.keys, state.values)))
        state.keys, state.values = [ck for ck, _ in cache], [cv for _, cv in cache]
        state.last = [depth[:, -1] for depth in states]
        state.length += ids.shape[1]

    def _round(self, state: MTPState, token: Tensor) -> MTPRows:
        """The chain of a round anchored at n = ``state.length`` on the anchor ``token`` (1, 1), before slot 1."""
        starts = torch.full_like(token, state.length)
        context = [(ck, cv, None) for ck, cv in zip(state.keys, state.values)]
        return self.new_chain([last[:, None] for last in state.last], token, starts, context)

    @torch.no_grad()
    def propose(self, state: MTPState, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """Draft slot by slot from the anchor x_n at position n = ``state.length``, each drafted token the next slot's
        input."""
        token = anchor.reshape(1, 1).to(state.keys[0].device)  # (1, 1)
        chain = self._round(state, token)
        state.nodes = [token[0]]
        tokens, probs = [], []
        for _ in range(self.block_size):
            logits = self.head(self.advance(chain, token))[0]  # (1, Vd)
            if sampling.greedy:
                draft = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # (1, Vd)
                draft = sampling.sample(q, generator)
                probs.append(q)
            token = self.vocab.to_target(draft)[None]  # (1, 1)
            tokens.append(token[0])
            state.nodes.append(token[0])
        tokens = torch.cat(tokens)  # (K,)
        if sampling.greedy:
            return ChainProposal(tokens=tokens)
        return ChainProposal(tokens=tokens, probs=self.vocab.scatter(torch.cat(probs)))

    # ----------------------------------------------------------------------- dynamic trees (EAGLE-2)
    @torch.no_grad()
    def tree_start(self, state: MTPState, anchor: Tensor) -> tuple[MTPRows, Tensor]:
        token = anchor.reshape(1, 1).to(state.keys[0].device)  # (1, 1)
        chain = self._round(state, token)
        return chain, self.head(self.advance(chain, token))[0]  # (1, Vd)

    @torch.no_grad()
    def tree_step(self, chain: MTPRows, rows: Tensor, tokens: Tensor) -> tuple[MTPRows, Tensor]:
        rows = rows.to(chain.hidden.device)
        branch = MTPRows(
            hidden=chain.hidden[:, rows], starts=chain.starts[:, rows], context=chain.context,  # decoding: seen None
            entries=[(k[:, :, rows], v[:, :, rows]) for k, v in chain.entries], slot=chain.slot,
        )
        ids = self.vocab.to_target(tokens.to(chain.hidden.device))[None]  # (1, A)
        return branch, self.head(self.advance(branch, ids))[0]  # (A, Vd)

    def propose_tree(self, state: MTPState, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig,
                     generator=None) -> TreeProposal:
        proposal = super().propose_tree(state, anchor, sampling, tree, generator)
        self.adopt(state, anchor, proposal)
        return proposal

    def adopt(self, state: MTPState, anchor: Tensor, proposal: TreeProposal) -> None:
        state.nodes = [anchor.reshape(1), *proposal.tokens.reshape(-1, 1)]  # extend reads the committed ones

    @torch.no_grad()
    def extend(self, state: MTPState, features: Tensor, path: list[int]) -> None:
        """The committed nodes (the anchor and the accepted drafts) join the streams with the target's states; the
        drafts' own entries, built from the chain's states, are dropped."""
        ids = torch.cat([state.nodes[i] for i in path])[None]  # (1, P)
        self._commit(state, ids, features[:, path])
        state.nodes = []
