"""EagleDrafter: the body EAGLE-3 (``eagle3.py``) and P-EAGLE (``peagle.py``) share: the EAGLE-3 autoregressive
drafter (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test", arXiv 2503.01840), as ``block.py`` is DFlash's descendants'. A family registers a subclass of it in its own
file; this one declares no family.

Reads top to bottom:
1. Fusion: the target's hidden states of a low, a middle and a high layer (default [1, L/2 - 1, L - 4],
   0-indexed, as SpecForge's EAGLE-3 trainer) are concatenated and mapped by ``fc`` (3H -> H) to one fused
   feature g_p per position p (the target's state after reading x_p, the one that predicts x_{p+1}).
2. One decoder layer whose attention input is 2H wide: [input_norm(e(x_p)) ; hidden_norm(u_p)], the frozen target
   embedding of the token at position p next to a hidden state u_p; the residual stream starts from u_p. For a
   committed position u_p = g_{p-1} (the feature that predicted x_p; g_{-1} = 0). Its output, through the final
   norm and the target's frozen LM head restricted to the draft vocabulary, predicts x_{p+1}.
3. Autoregressive chain with its own KV cache. A round anchored at n (the last committed token, whose own target
   features do not exist yet) drafts slot 1 from [e(x_n) ; g_{n-1}], slot t > 1 from [e(x_{n+t-1}) ; h_{t-1}],
   h_{t-1} the layer's own output at slot t - 1 (its pre-norm hidden state). Slot t sits at position n + t - 1
   and attends to the committed positions < n (built from true features) and to the round's own slots 1..t.
   After verification the accepted drafts' entries are dropped and the committed positions are re-run with the
   target's real features (slot 1's entry, [e(x_n) ; g_{n-1}], already is such an entry). A committed entry embeds
   its token, so ``begin`` takes the prefill's token ids next to its features.
4. Training-time test (TTT): training runs the same chain teacher-forced (the drafted tokens are the data's), every
   slot fed the drafter's own hidden state of the slot before, so slot t is trained on the inputs it meets when
   decoding. All anchors of a step run in parallel: step t is one batched layer call over the anchors, whose
   attention reads the committed entries' keys and values (projected once for every position of the sequence,
   shared by all anchors, each anchor masked to positions <= n) and each anchor's own slots 2..t.
5. Reduced vocabulary: the head covers the draft vocabulary (``DraftVocab``, EAGLE-3's d2t / t2d).
6. EAGLE-3.1's options, off by default (EAGLE-3 as published; vLLM reads each from the exported config, and the
   speculators trainer turns ``norm_before_fc`` and ``norm_output`` on by default):
   - ``norm_before_fc``: one RMSNorm over the concatenated features before ``fc`` (``input_norm``, 3H wide; the
     speculators format takes it or ``fc_norm``, not both);
   - ``fc_norm``: one RMSNorm per feature layer before the concatenation (``fc_norms.<i>``, H wide each): the
     layers' scales differ by orders of magnitude (a late layer's residual stream is far larger than an early
     one's), and ``fc`` otherwise sees mostly the largest;
   - ``norm_output``: the next slot's hidden input is the final-normed state norm(h_t), the one the head reads,
     instead of the pre-norm h_t, so its scale does not drift from slot to slot (speculators PR #610 reports +7.9%
     mean acceptance length for ``fc_norm`` with ``norm_output``).

``block_size`` (K) is both the proposals per round and the TTT unroll. EAGLE-3 trains with an unroll of 7
(SpecForge's default) and may draft more or fewer steps at serving time; here ``forward`` must return every slot
``propose`` draws from, with the same distribution (the offline evaluator and EDR score a drafter through
``forward``), so the unroll is K: a shorter unroll would leave slots untrained and unscored, a longer one would
train slots that are never drafted. An unroll of 7 is ``block_size: 7`` (the default).

Differences from SpecForge's trainer, on purpose: the LM head and the embedding are the target's, frozen (the
drafter contract; EAGLE-3 trains its own reduced head, initialised from the target's); the loss and its position
weights are objective parts (EAGLE-3's is KL to the target renormalised on the draft vocabulary with weights 0.8^(t-1):
``KL`` + ``Geometric(0.8)``); chains start at sampled anchors rather than at every position (``num_anchors``); and
the TTT mask of the authors' trainer (and SpecForge's) hides from unroll step j the j most recent entries before
the query, the anchor's own included, which decoding shows it (SafeAILab/EAGLE issue 247), whereas here training
and decoding attend to exactly the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal, TreeProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput
from lightning_spec.drafters.layers import (
    RMSNorm,
    TargetShape,
    chain_attention,
    fused_weight,
    gated_mlp,
    init_weights,
    low_mid_high_layers,
    rope,
)
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig
    from lightning_spec.target import Target


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer: Llama-style, its attention projections reading [norm(e) ; norm(u)] (2H), its
    residual stream starting from the hidden input u."""

    def __init__(self, shape: TargetShape) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim, eps = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_norm = RMSNorm(hidden, eps)  # on the token embedding
        self.hidden_norm = RMSNorm(hidden, eps)  # on the fused feature / the previous slot's hidden state
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, hidden, bias=False)
        self.fused: dict[str, tuple[tuple, Tensor]] = {}  # decoding's stacked projections (``fused_weight``)

    def _input(self, emb: Tensor, u: Tensor) -> Tensor:
        return torch.cat([self.input_norm(emb), self.hidden_norm(u)], dim=-1)  # (N, T, 2H)

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        n, t, _ = x.shape
        return x.view(n, t, n_heads, self.head_dim).transpose(1, 2)  # (N, heads, T, D)

    def kv(self, emb: Tensor, u: Tensor, pos: Tensor, theta: float) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values of entries (e, u) (N, T, H) at positions ``pos`` (N, T): (N, kv_heads, T, D)."""
        x = self._input(emb, u)
        k = rope(self._heads(self.k_proj(x), self.kv_heads), pos[:, None], theta)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def qkv(self, emb: Tensor, u: Tensor, pos: Tensor, theta: float) -> tuple[Tensor, Tensor, Tensor]:
        """Query (N, heads, T, D), key and value (N, kv_heads, T, D) of entries (e, u) at positions ``pos``."""
        x = self._input(emb, u)
        w = fused_weight(self.fused, "qkv", self.q_proj, self.k_proj, self.v_proj)
        if w is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # one product while decoding (and scoring without gradients)
            q, k, v = (x @ w.t()).split([self.q_proj.out_features, self.k_proj.out_features,
                                         self.v_proj.out_features], dim=-1)
        q = rope(self._heads(q, self.heads), pos[:, None], theta)
        k = rope(self._heads(k, self.kv_heads), pos[:, None], theta)
        return q, k, self._heads(v, self.kv_heads)

    def finish(self, u: Tensor, attn: Tensor) -> Tensor:
        """u (N, T, H), attention output (N, heads, T, D) -> the layer's output (N, T, H)."""
        n, _, t, _ = attn.shape
        h = u + self.o_proj(attn.transpose(1, 2).reshape(n, t, -1))
        return h + gated_mlp(self, self.fused, self.post_norm(h))


@dataclass
class Eagle3Rows:
    """A round's draft rows after some slots: each row's next hidden input and its own entries (its path's slots),
    over the committed entries of ``state`` that every row sees. One row for a chain, one per node for a tree."""

    u: Tensor  # (1, A, H)
    keys: Tensor  # (1, kv_heads, A, J, D)
    values: Tensor
    state: Eagle3State


@dataclass
class Eagle3State:
    """Decoding state: the committed entries of positions 0..length-1, built from the target's true features."""

    keys: Tensor  # (1, kv_heads, length, D)
    values: Tensor  # (1, kv_heads, length, D)
    length: int  # committed positions with an entry; the next anchor sits at position ``length``
    last: Tensor  # (1, H) fused feature g_{length-1} (zeros when length == 0): slot 1's hidden input
    nodes: list[Tensor] = field(default_factory=list)  # this round's tokens: the anchor, then the drafts, (1,) each


class EagleDrafter(Drafter):
    """The EAGLE-3 drafter's body: fused low/mid/high target features, one decoder layer over [embedding ; hidden], an
    autoregressive chain trained by training-time test.

    Args:
        block_size: K, draft tokens per round, and the training-time-test unroll (EAGLE-3 trains 7 steps).
        target_layers: 0-indexed target layers fused by ``fc``. Default EAGLE-3's low / middle / high layers,
            [1, L/2 - 1, L - 4].
        num_anchors: chains (anchors) per training sequence; EAGLE-3 trains one from every position (set it to
            the sequence length or more for that).
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data (EAGLE-3's
            reduced vocabulary, d2t / t2d; None = the full target vocabulary).
        intermediate_size: MLP width; default the target's.
        own_head: the LM head over the draft vocabulary is the drafter's own weights, trained, starting from the
            target's rows (EAGLE-3's released drafters train theirs; needed to import one faithfully). Off: the
            target's frozen head, as every family here.
        norm_before_fc: EAGLE-3.1: one RMSNorm over the concatenated target features before ``fc``.
        fc_norm: EAGLE-3.1: one RMSNorm per target feature layer before the concatenation.
        norm_output: EAGLE-3.1: each slot passes its final-normed state (the head's input) to the next slot instead
            of the pre-norm one.
    """

    tree_growth = TreeGrowth.DYNAMIC  # tree_start / tree_step below: EAGLE-2's dynamic tree

    def __init__(
        self,
        block_size: int = 7,
        target_layers: list[int] | None = None,
        num_anchors: int = 64,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        own_head: bool = False,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> None:
        super().__init__(block_size, target_layers, num_anchors, draft_vocab_size)
        self.intermediate_size = intermediate_size
        self.own_head = own_head
        if norm_before_fc and fc_norm:
            raise UserError(f"{type(self).__name__}.norm_before_fc and fc_norm are two ways to norm the target "
                            "features before fc (over their concatenation, or per layer) and the speculators format "
                            "takes one: set one of them.")
        self.norm_before_fc, self.fc_norm, self.norm_output = norm_before_fc, fc_norm, norm_output

    # ------------------------------------------------------------------------------------------- building
    def default_target_layers(self, num_target_layers: int) -> list[int]:
        return low_mid_high_layers(num_target_layers)  # EAGLE-3's [1, L/2 - 1, L - 4]

    def adaptation_scopes(self) -> dict[str, list[str]]:
        own = ["lm_head"] if self.own_head else []
        return {"head": ["norm", *own], "last": ["layer", "norm", *own]}

    def build(self, target: Target) -> None:
        shape = TargetShape.of(target, self.intermediate_size)
        hidden, self.rope_theta = shape.hidden, shape.rope_theta
        width = len(self.target_layers) * hidden
        if self.norm_before_fc:
            self.input_norm = RMSNorm(width, shape.eps)  # over the concatenated features (3H)
        if self.fc_norm:
            self.fc_norms = nn.ModuleList(RMSNorm(hidden, shape.eps) for _ in self.target_layers)  # H each
        self.fc = nn.Linear(width, hidden, bias=False)  # 3H -> H
        self.layer = Eagle3Layer(shape)
        self.norm = RMSNorm(hidden, shape.eps)
        init_weights(self, 1, target, [self.norm])
        if self.own_head:  # (Vd, H), rows of the target's head until the draft vocabulary is chosen
            self.lm_head = nn.Parameter(torch.empty(self.vocab.ids.numel(), hidden))
            self.on_vocab_chosen()

    @torch.no_grad()
    def on_vocab_chosen(self) -> None:
        """An own head starts from the target's rows of the draft vocabulary (called again once ``fit`` chose it)."""
        if self.own_head:
            self.lm_head.copy_(self.vocab.head_weight(self.target.lm_head).to(self.lm_head.dtype))

    def head(self, hidden: Tensor) -> Tensor:
        """Draft logits (..., H) -> (..., Vd): the own head when ``own_head``, else the target's frozen rows."""
        if not self.own_head:
            return super().head(hidden)
        return hidden.to(self.lm_head.dtype) @ self.lm_head.t()

    def fuse(self, features: Tensor) -> Tensor:
        """(N, S, len(target_layers) * H) -> fused features g (N, S, H), through EAGLE-3.1's norms when on."""
        x = features.to(self.fc.weight.dtype)
        if self.norm_before_fc:
            x = self.input_norm(x)
        if self.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norms, x.chunk(len(self.fc_norms), dim=-1))], -1)
        return self.fc(x)

    def next_input(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """A slot's output h (..., H) -> (the next slot's hidden input, the head's input norm(h)): h itself, or with
        ``norm_output`` the normed state."""
        normed = self.norm(h)
        return (normed if self.norm_output else h), normed

    def embed(self, ids: Tensor) -> Tensor:
        """Target ids (...,) -> the target's frozen embedding (..., H)."""
        return self.target.embed_tokens(ids).to(self.fc.weight.dtype)

    def _committed_kv(self, ids: Tensor, g: Tensor, g_before: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Keys and values (N, kv_heads, T, D) of committed entries [e(x_p) ; g_{p-1}] for p = start..start+T-1:
        ids (N, T) the tokens x_p, g (N, T, H) their own fused features g_p, g_before (N, H) g_{start-1}."""
        n, t = ids.shape
        g_prev = torch.cat([g_before[:, None], g[:, :-1]], dim=1)  # (N, T, H): g_{p-1}
        pos = torch.arange(start, start + t, device=ids.device).expand(n, t)
        return self.layer.kv(self.embed(ids), g_prev, pos, self.rope_theta)

    # ------------------------------------------------------------------------------------------- training
    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Training-time test over every anchor at once. batch: input_ids (N, S), loss_mask (N, S); features
        (N, S, F) of ``target_layers``; ``anchors`` default to ``sample_anchors(batch)``.

        Slot t of anchor n is the decoding chain's slot t with the data's tokens as the drafts: position n + t - 1,
        input [e(x_{n+t-1}) ; h_{t-1}] (h_0 = g_{n-1}), attending to the committed entries <= n (the entry at n is
        slot 1's own) and to the anchor's slots 2..t."""
        ids = batch["input_ids"]
        n, s = ids.shape
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        g = self.fuse(features)  # (N, S, H)
        ctx_k, ctx_v = self._committed_kv(ids, g, g.new_zeros(n, g.shape[-1]), 0)  # (N, Hkv, S, D)
        ctx_ok = torch.arange(s, device=ids.device) <= starts[..., None]  # (N, A, S)
        g_prev = F.pad(g, (0, 0, 1, 0))[:, :-1]  # (N, S, H): g_{p-1}, zeros at p = 0
        u = g_prev.gather(1, starts[..., None].expand(-1, -1, g.shape[-1]))  # (N, A, H): h_0 = g_{n-1}
        own_k, own_v, hidden = [], [], []
        for t in range(1, self.block_size + 1):
            pos = starts + t - 1  # (N, A): slot t's position
            emb = self.embed(ids.gather(1, pos.clamp(max=s - 1)))  # (N, A, H): x_{n+t-1} (teacher-forced)
            q, k, v = self.layer.qkv(emb, u, pos, self.rope_theta)  # q (N, Hq, A, D); k, v (N, Hkv, A, D)
            if t > 1:  # slot 1's entry is the committed entry at n, already in ctx_k
                own_k.append(k)
                own_v.append(v)
            empty = k.new_zeros(*k.shape[:3], 0, k.shape[-1])
            keys = torch.stack(own_k, dim=3) if own_k else empty  # (N, Hkv, A, t-1, D)
            values = torch.stack(own_v, dim=3) if own_v else empty
            u, normed = self.next_input(self.layer.finish(u, chain_attention(q, ctx_k, ctx_v, ctx_ok, keys, values)))
            hidden.append(normed)  # (N, A, H)
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        hidden = torch.stack(hidden, dim=2)  # (N, A, K, H)
        return DraftOutput(labels=labels, valid=valid, anchors=starts, hidden=hidden, head=self._slot_logits)

    def _slot_logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd): the frozen target head over the draft vocabulary

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> Eagle3State:
        """The committed entries of the prefill: features (1, S, F) and the tokens ``input_ids`` (1, S) at the same
        positions 0..S-1 (a committed entry embeds its own token)."""
        if input_ids is None or input_ids.shape[-1] != features.shape[1]:
            raise ValueError(
                f"{type(self).__name__}.begin needs the prefill's token ids (input_ids, one per feature position): "
                "EAGLE-3's committed entries embed their tokens; pass begin(features, input_ids)."
            )
        layer, dev = self.layer, self.fc.weight.device
        zero = torch.zeros(1, self.fc.out_features, device=dev, dtype=self.fc.weight.dtype)
        state = Eagle3State(
            keys=torch.zeros(1, layer.kv_heads, 0, layer.head_dim, device=dev, dtype=zero.dtype),
            values=torch.zeros(1, layer.kv_heads, 0, layer.head_dim, device=dev, dtype=zero.dtype),
            length=0,
            last=zero,
        )
        self._commit(state, input_ids.reshape(1, -1).to(dev), features)
        return state

    def _commit(self, state: Eagle3State, ids: Tensor, features: Tensor) -> None:
        """Append committed entries for tokens ids (1, T) at positions length.. with their features (1, T, F)."""
        t = ids.shape[1]
        if t == 0:
            return
        g = self.fuse(features)  # (1, T, H)
        k, v = self._committed_kv(ids, g, state.last, state.length)
        state.keys, state.values = torch.cat([state.keys, k], 2), torch.cat([state.values, v], 2)
        state.length += t
        state.last = g[:, -1]

    def _slot(self, chain: Eagle3Rows, tokens: Tensor) -> Tensor:
        """One slot for every row of ``chain`` on its known token ``tokens`` (A,) (target ids): the row's entry joins
        its own, its output is the next slot's hidden input. Returns the rows' draft logits (A, Vd)."""
        state = chain.state
        pos = torch.full((1, tokens.shape[0]), state.length + chain.keys.shape[3], device=tokens.device)  # (1, A)
        q, k, v = self.layer.qkv(self.embed(tokens)[None], chain.u, pos, self.rope_theta)  # q (1, Hq, A, D)
        chain.keys = torch.cat([chain.keys, k[:, :, :, None]], 3)  # (1, Hkv, A, J + 1, D)
        chain.values = torch.cat([chain.values, v[:, :, :, None]], 3)
        attn = chain_attention(q, state.keys, state.values, None, chain.keys, chain.values)
        chain.u, normed = self.next_input(self.layer.finish(chain.u, attn))  # (1, A, H) each
        return self.head(normed[0])  # (A, Vd)

    def _chain(self, state: Eagle3State) -> Eagle3Rows:
        """A round's chain before slot 1: one row, h_0 = g_{n-1}, no entries of its own yet."""
        empty = state.keys.new_zeros(1, self.layer.kv_heads, 1, 0, self.layer.head_dim)
        return Eagle3Rows(u=state.last[:, None], keys=empty, values=empty, state=state)

    @torch.no_grad()
    def propose(self, state: Eagle3State, anchor: Tensor, sampling: SamplingConfig, generator=None) -> ChainProposal:
        """K slots in a row from the anchor x_n at position n = ``state.length``; each slot's entry joins the
        round's own keys, and its sampled token is the next slot's input."""
        token = anchor.reshape(1).to(state.keys.device)  # (1,)
        chain = self._chain(state)
        tokens, probs = [], []
        state.nodes = [token]
        for _ in range(self.block_size):
            logits = self._slot(chain, token)[0]  # (Vd,)
            if sampling.greedy:
                draft = logits.argmax(-1)
            else:
                q_t = sampling.probs(logits)  # (Vd,)
                draft = sampling.sample(q_t, generator)
                probs.append(self.vocab.scatter(q_t))  # (V,)
            token = self.vocab.to_target(draft.reshape(1))  # (1,) target id
            tokens.append(token)
            state.nodes.append(token)
        drafted = torch.cat(tokens)  # (K,)
        return ChainProposal(tokens=drafted, probs=torch.stack(probs) if probs else None)

    # ----------------------------------------------------------------------- dynamic trees (EAGLE-2)
    @torch.no_grad()
    def tree_start(self, state: Eagle3State, anchor: Tensor) -> tuple[Eagle3Rows, Tensor]:
        chain = self._chain(state)
        return chain, self._slot(chain, anchor.reshape(1).to(state.keys.device))

    @torch.no_grad()
    def tree_step(self, chain: Eagle3Rows, rows: Tensor, tokens: Tensor) -> tuple[Eagle3Rows, Tensor]:
        rows = rows.to(chain.u.device)
        branch = Eagle3Rows(u=chain.u[:, rows], keys=chain.keys[:, :, rows], values=chain.values[:, :, rows],
                             state=chain.state)
        return branch, self._slot(branch, self.vocab.to_target(tokens.to(chain.u.device)))

    def propose_tree(self, state: Eagle3State, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig,
                     generator=None) -> TreeProposal:
        proposal = super().propose_tree(state, anchor, sampling, tree, generator)
        self.adopt(state, anchor, proposal)
        return proposal

    def adopt(self, state: Eagle3State, anchor: Tensor, proposal: TreeProposal) -> None:
        state.nodes = [anchor.reshape(1), *proposal.tokens.reshape(-1, 1)]  # extend reads the committed ones

    @torch.no_grad()
    def extend(self, state: Eagle3State, features: Tensor, path: list[int]) -> None:
        """The committed nodes (the anchor and the accepted drafts) become committed entries, re-run with their
        true features: the drafts' own entries, built from the drafter's hidden states, are dropped."""
        ids = torch.cat([state.nodes[i] for i in path])[None]  # (1, P)
        self._commit(state, ids, features[:, path])
        state.nodes = []
