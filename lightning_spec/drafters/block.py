"""The block-parallel body that DFlash publishes and DSpark, D²SD, DFly and Domino extend: no family of its own
(``dflash.py`` is DFlash, this body as published). What it does reads top to bottom in ``dflash.py``'s docstring:
fused target features injected into every draft layer's keys and values, a block ``[anchor, MASK x K]`` drafted in
one forward, slot t predicting x_{n+t} through the target's frozen head.

- ``ParallelBlockDrafter``: the layers, the training forward over every anchor's block at once, the decoding
  cache and the chain proposal; AdaFlash's optional length head (``LengthHead``) cuts a chain round short.
- ``ChainedBlockDrafter``: the same block whose slot t also reads the token drafted at slot t - 1 (DFly's hidden
  correction, Domino's GRU), drafted left to right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_spec.decoding.proposals import ChainProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.drafters.base import Anchors, Drafter, DraftOutput
from lightning_spec.drafters.layers import DraftLayer, RMSNorm, TargetShape, init_weights, spread_layers
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


class LengthHead(nn.Module):
    """AdaFlash's adaptive length head (Qian et al. 2026, arXiv 2607.19223; the "two_model" head with
    ``thresh_head_direct_len``): the states h_1..h_K (..., K, H) of a block's slots -> pred (...,) in [0, 1],

        f = [mean_k h_k ; h_K],  x = SiLU(W_1 f + b_1),  x = x + SiLU(W_2 x + b_2),  pred = σ(w_3ᵀ x + b_3),

    trained (``objectives.LengthMSE``) towards (accepted length + 1) / K. The drafter feeds it detached states, so
    its loss trains the head only. AdaFlash pools the whole block, the anchor position included; here the K slots.
    """

    def __init__(self, hidden: int, width: int = 256) -> None:
        super().__init__()
        self.down = nn.Linear(2 * hidden, width)  # W_1 (AdaFlash's bottleneck: 256)
        self.res = nn.Linear(width, width)  # W_2
        self.out = nn.Linear(width, 1)  # w_3

    def forward(self, slots: Tensor) -> Tensor:
        feat = torch.cat([slots.mean(-2), slots[..., -1, :]], -1)  # (..., 2H)
        x = F.silu(self.down(feat))  # (..., W)
        x = x + F.silu(self.res(x))
        return torch.sigmoid(self.out(x))[..., 0]  # (...,)


@dataclass
class BlockDraftState:
    """Decoding context: per-layer keys/values of the fused features of committed positions 0..length-1."""

    keys: list[Tensor]  # per layer (1, kv_heads, length, D)
    values: list[Tensor]
    length: int
    last: Tensor | None = None  # (1, H) fused feature of position length - 1 (for the context shortcut)


class ParallelBlockDrafter(Drafter):
    """DFlash's block-parallel drafter, the body the block families share (the module docstring).

    Args:
        block_size: K, draft proposals per round (the block holds the anchor plus K masks).
        num_layers: draft decoder layers.
        target_layers: 0-indexed target layers whose outputs form the context. Default: ``num_layers + 2``
            layers spread uniformly over 1..L-3, plus the last-but-one layer, as DFlash.
        num_anchors: anchors sampled per training sequence (uniformly, without replacement, where a label follows).
        draft_vocab_size: restrict the LM head to the most frequent target tokens of the training data
            (None = the full target vocabulary). Filled from the data the first time ``fit`` sets up.
        intermediate_size: MLP width; default the target's.
        context_shortcut: also add W [H_ctx[n - 1] ; e(x_n)] — the fused feature of the last committed context
            position and the anchor's embedding, EAGLE's two inputs — to every block slot's input. Not in DFlash,
            which reaches both only through attention; a small drafter trained for minutes learns much faster
            with them in its residual stream (see experiments/quickstart.yaml).
        init_from_target: start draft layer i from the weights of target layer L - num_layers + i (the last
            layers, whose output the frozen final norm and LM head expect) instead of random; needs the
            target's layer shapes (the default ``intermediate_size``). Measured on the quickstart setting: MAL
            -0.029 after 500 steps, so it is off by default (docs/quickstart.md, "What moves MAL at the
            quickstart's scale").
        length_head: add AdaFlash's adaptive length head (``LengthHead``, arXiv 2607.19223): the training forward
            gives its prediction as ``aux["length"]`` (N, A) and the cut as ``drafted``; a chain round submits
            k = clamp(round(pred * K * length_rate), length_min, K) tokens. Train it with
            ``objectives.LengthMSE``. Its weights exist only when on (checkpoints without it load unchanged).
            The attribute ``use_length_head`` (True when the head exists) switches the cut off at run time, to
            decode the same drafter with and without it; trees ignore the head (``position_logits`` is unchanged).
        length_rate: the scale of the cut (AdaFlash: 1.3; > 1 drafts past the predicted length).
        length_min: the fewest tokens a cut round submits, 0..block_size.
        qk_norm: Qwen3's per-head RMSNorm on queries and keys, as DFlash's released drafters (and the layers
            vLLM serves for DFlash); needed to export to the speculators / SGLang DFlash formats.
        mask_token_id: None = one learned mask vector per slot (starts as DFlash, lets each slot know its offset);
            a token id = DFlash's single mask token shared by every slot, its vector learned from that token's
            target embedding (exported as the mask embedding vLLM substitutes for the id). The exported DFlash
            formats need one shared mask, so export needs this set.
    """

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
        length_head: bool = False,
        length_rate: float = 1.3,
        length_min: int = 1,
        qk_norm: bool = False,
        mask_token_id: int | None = None,
    ) -> None:
        super().__init__(block_size, target_layers, num_anchors, draft_vocab_size)
        if num_layers < 1:
            raise UserError(f"drafter.num_layers must be >= 1, got {num_layers}.")
        if not length_rate > 0:
            raise UserError(f"drafter.length_rate must be > 0 (the cut's scale, AdaFlash: 1.3), got {length_rate}.")
        if not 0 <= length_min <= block_size:
            raise UserError(f"drafter.length_min must be in 0..block_size={block_size}, got {length_min}.")
        self.num_layers = num_layers
        self.intermediate_size = intermediate_size
        self.context_shortcut = context_shortcut
        self.init_from_target = init_from_target
        self.length_head = length_head
        self.length_rate = length_rate
        self.length_min = length_min
        self.qk_norm = qk_norm
        self.mask_token_id = mask_token_id
        self.length: LengthHead | None = None  # built in bind when length_head
        self.use_length_head = length_head  # run-time switch: False decodes full blocks (not saved)

    @property
    def mask_slots(self) -> int:
        """Mask positions after the anchor in a block: K here (every slot is a mask; DSpark's anchor predicts)."""
        return self.block_size

    # ------------------------------------------------------------------------------------------- building
    def default_target_layers(self, num_target_layers: int) -> list[int]:
        return spread_layers(num_target_layers, self.num_layers + 2)  # DFlash's num_layers + 2, spread

    def adaptation_scopes(self) -> dict[str, list[str]]:
        return {"head": ["norm"], "last": [f"layers.{self.num_layers - 1}", "norm"]}

    def build(self, target: Target) -> None:
        shape = TargetShape.of(target, self.intermediate_size)
        hidden, self.rope_theta = shape.hidden, shape.rope_theta
        self.fc = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.ctx_norm = RMSNorm(hidden, shape.eps)
        self.layers = nn.ModuleList(self.make_layer(shape) for _ in range(self.num_layers))
        self.norm = RMSNorm(hidden, shape.eps)
        # one learned mask vector per slot (DFlash shares one mask token; identical at init, so this starts
        # as DFlash and lets the residual stream know which offset it predicts), or DFlash's one shared vector
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < target.vocab_size:
            raise UserError(
                f"drafter.mask_token_id={self.mask_token_id} is not a token of the target "
                f"(0..{target.vocab_size - 1}); "
                "pick a token the data rarely uses, or null for one learned mask vector per slot."
            )
        shared = self.mask_token_id is not None
        self.mask_embedding = nn.Parameter(torch.zeros(1 if shared else self.block_size, hidden))
        self.shortcut = nn.Linear(2 * hidden, hidden, bias=False) if self.context_shortcut else None
        self._init_weights(target)
        if self.length_head:  # after the backbone's init: the same seed gives the same backbone with or without it
            self.length = LengthHead(hidden)
            with torch.no_grad():  # N(0, 0.02) as every matrix here, zero biases: pred ≈ σ(0) = 0.5 at the start
                for layer in (self.length.down, self.length.res, self.length.out):
                    nn.init.normal_(layer.weight, std=0.02)
                    nn.init.zeros_(layer.bias)

    def make_layer(self, shape: TargetShape) -> DraftLayer:
        """One draft layer of the target's shape (DFlash2 wraps its sublayers in convolutions)."""
        return DraftLayer(shape, self.qk_norm)

    @torch.no_grad()
    def _init_weights(self, target: Target) -> None:
        init_weights(self, self.num_layers, target, [self.norm])
        table = target.embed_tokens.weight
        start = table.mean(0) if self.mask_token_id is None else table[self.mask_token_id]
        self.mask_embedding.copy_(start.expand_as(self.mask_embedding))
        if self.init_from_target and target.has_layer_weights:  # a head-only target: the weights come from a file
            self._copy_target_layers(target)

    @torch.no_grad()
    def _copy_target_layers(self, target: Target) -> None:
        """Draft layer i <- target layer L - num_layers + i (HF Llama/Qwen names: q/k/v/o_proj, gate/up/down_proj,
        input_layernorm, post_attention_layernorm, and Qwen3's q_norm/k_norm where the target has them: a Llama
        target has none, and the drafter's stay ones). A family's own sublayer wrappers (DFlash2's convolutions) keep
        their start."""
        hf_name = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
        hf_name.update({m: f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")})
        hf_name.update({m: f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")})
        for layer, src in zip(self.layers, list(target.base.layers)[-self.num_layers :]):
            src_params = dict(src.named_parameters())
            for name, p in layer.named_parameters():
                module, _, leaf = name.partition(".")
                if module not in hf_name:
                    continue
                key = f"{hf_name[module]}.{leaf}"
                if module in ("q_norm", "k_norm") and key not in src_params:
                    continue
                if key not in src_params or src_params[key].shape != p.shape:
                    raise UserError(
                        f"drafter.init_from_target: target parameter {key} is missing or shaped differently from the "
                        f"draft layer's {name} {tuple(p.shape)}; leave drafter.intermediate_size unset or turn it off."
                    )
                p.copy_(src_params[key].detach().to(p.dtype))

    def context(self, features: Tensor) -> Tensor:
        """(N, S, len(target_layers) * H) -> fused context H_ctx (N, S, H)."""
        return self.ctx_norm(self.fc(features.to(self.fc.weight.dtype)))

    def layer_contexts(self, features: Tensor) -> tuple[list[Tensor], Tensor]:
        """(N, S, F) -> the context each draft layer's keys and values read, (N, S, H) per layer, and the shared
        H_ctx (the context shortcut's input). DFlash injects the one H_ctx into every layer."""
        ctx = self.context(features)
        return [ctx] * len(self.layers), ctx

    def embed_block(self, anchor_tokens: Tensor) -> Tensor:
        """(...,) anchor ids -> (..., 1 + M, H): the anchor's frozen embedding, then the M = ``mask_slots`` (K) learned
        mask vectors (M copies of the one shared vector with ``mask_token_id``)."""
        emb = self.target.embed_tokens(anchor_tokens).to(self.mask_embedding.dtype)  # (..., H)
        rows = -1 if self.mask_token_id is None else self.mask_slots  # the per-slot vectors, or copies of one
        masks = self.mask_embedding.expand(*anchor_tokens.shape, rows, -1)  # (..., M, H)
        return torch.cat([emb[..., None, :], masks], dim=-2)

    # ------------------------------------------------------------------------------------------- training
    def backbone(self, ids: Tensor, features: Tensor, starts: Tensor) -> Tensor:
        """The draft layers over every anchor's block at once: ids (N, S), features (N, S, F), anchors ``starts``
        (N, A) -> the final normed states (N, A, B, H) of the B = ``embed_block`` positions of each block (the
        anchor, then the K slots)."""
        n, s = ids.shape
        a = starts.shape[1]
        contexts, ctx = self.layer_contexts(features)  # L x (N, S, H), (N, S, H)
        ctx_pos = torch.arange(s, device=ids.device).expand(n, s)  # (N, S)
        h = self.embed_block(ids.gather(1, starts))  # (N, A, B, H)
        b = h.shape[2]
        blk_pos = (starts[..., None] + torch.arange(b, device=ids.device)).reshape(n, a * b)  # (N, AB)
        if self.shortcut is not None:  # [H_ctx[n - 1] ; e(x_n)] into every slot (H_ctx[-1] = 0 at anchor 0)
            prev = ctx.gather(1, (starts - 1).clamp(min=0)[..., None].expand(-1, -1, ctx.shape[-1]))  # (N, A, H)
            prev = prev * (starts > 0)[..., None]
            h = h + self.shortcut(torch.cat([prev, h[:, :, 0]], dim=-1))[:, :, None]
        h = h.reshape(n, a * b, -1)  # (N, AB, H)
        # each block sees the context strictly before its anchor, and the whole of itself
        q_anchor = starts.repeat_interleave(b, dim=1)  # (N, AB)
        ctx_ok = ctx_pos[:, None, :] < q_anchor[..., None]  # (N, AB, S)
        for layer, context in zip(self.layers, contexts):
            ck, cv = layer.kv(context, ctx_pos, self.rope_theta)
            h = layer(h, blk_pos, ck, cv, ctx_ok, b, self.rope_theta)
        return self.norm(h).view(n, a, b, -1)

    def forward(self, batch: dict[str, Tensor], features: Tensor, anchors: Anchors | None = None) -> DraftOutput:
        """Training forward. batch: input_ids (N, S), loss_mask (N, S); features (N, S, F) of the target layers.
        ``anchors`` default to ``sample_anchors(batch)``; the offline evaluator and EDR pass their own."""
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        hidden = self.backbone(batch["input_ids"], features, anchors.positions)[:, :, 1:]  # (N, A, K, H) the slots
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        aux, drafted = {}, None
        if self.length is not None:
            aux["length"] = self.length(hidden.detach())  # (N, A): its loss trains the head only
            if self.use_length_head:
                drafted = self.length_cut(aux["length"].detach())  # (N, A) the slots ``propose`` submits there
        return DraftOutput(labels=labels, valid=valid, anchors=anchors.positions, hidden=hidden,
                           head=self._slot_logits, aux=aux, drafted=drafted)

    def _slot_logits(self, hidden: Tensor, index: Tensor) -> Tensor:
        return self.head(hidden)  # (N, a, K, Vd): the frozen target head over the draft vocabulary

    def length_cut(self, pred: Tensor) -> Tensor:
        """AdaFlash's cut: the length head's pred (...,) -> k = clamp(round(pred * K * length_rate), length_min, K),
        the tokens a chain round submits (...,) long. The training forward and ``propose`` both call this. A NaN
        prediction (a diverged head) submits the whole block, as without the head."""
        k = torch.round(pred.float() * (self.block_size * self.length_rate)).nan_to_num(nan=float(self.block_size))
        return k.clamp(self.length_min, self.block_size).long()

    @property
    def cuts_blocks(self) -> bool:
        """True when chain rounds submit the length head's cut (the head exists and ``use_length_head``)."""
        return self.length is not None and self.use_length_head

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def begin(self, features: Tensor, input_ids: Tensor | None = None) -> BlockDraftState:
        state = BlockDraftState(keys=[torch.empty(0)] * len(self.layers), values=[torch.empty(0)] * len(self.layers),
                                length=0)
        self._append(state, features)
        return state

    @torch.no_grad()
    def extend(self, state: BlockDraftState, features: Tensor, path: list[int]) -> None:
        """The committed nodes' features become context (the anchor and the accepted drafts)."""
        self._append(state, features[:, path])

    def _append(self, state: BlockDraftState, features: Tensor) -> None:
        t = features.shape[1]
        contexts, ctx = self.layer_contexts(features)  # L x (1, T, H), (1, T, H)
        pos = torch.arange(state.length, state.length + t, device=ctx.device)[None]
        for i, (layer, context) in enumerate(zip(self.layers, contexts)):
            k, v = layer.kv(context, pos, self.rope_theta)
            if state.length:
                k, v = torch.cat([state.keys[i], k], 2), torch.cat([state.values[i], v], 2)
            state.keys[i], state.values[i] = k, v
        state.length += t
        if t:
            state.last = ctx[:, -1]

    @torch.no_grad()
    def block_hidden(self, state: BlockDraftState, anchor: Tensor) -> Tensor:
        """The draft layers over one block after ``anchor`` (1,) on the decoding context: the final normed states
        (1, B, H) of its B = ``embed_block`` positions (the anchor, then the K slots)."""
        h = self.embed_block(anchor.reshape(1))  # (1, B, H)
        b = h.shape[1]
        if self.shortcut is not None:
            prev = state.last if state.last is not None else h.new_zeros(1, h.shape[-1])  # (1, H)
            h = h + self.shortcut(torch.cat([prev, h[:, 0]], dim=-1))[:, None]
        pos = torch.arange(state.length, state.length + b, device=h.device)[None]
        for i, layer in enumerate(self.layers):
            if state.length:
                ck, cv = state.keys[i], state.values[i]
            else:  # empty context (a one-token prompt): the block attends to itself only
                ck = cv = h.new_zeros(1, layer.kv_heads, 0, layer.head_dim)
            h = layer(h, pos, ck, cv, None, b, self.rope_theta)
        return self.norm(h)

    parallel_slots = True  # the block's K slots are drafted in one forward, none reads another's token
    tree_growth = TreeGrowth.BEST_FIRST  # the best-first tree over the block's slot distributions

    @torch.no_grad()
    def position_logits(self, state: BlockDraftState, anchor: Tensor) -> Tensor:
        return self.head(self.block_hidden(state, anchor)[0, 1:])  # (K, Vd): the block's slots, in parallel

    @torch.no_grad()
    def propose(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        if self.cuts_blocks:  # the length head decides k before any token is drawn: verification stays lossless
            hidden = self.block_hidden(state, anchor)[0, 1:]  # (K, H) the slots
            k = int(self.length_cut(self.length(hidden)))
            if k == 0:
                return ChainProposal.empty(anchor.device)
            logits = self.head(hidden[:k])  # (k, Vd): the head of the submitted slots only
        else:
            logits = self.position_logits(state, anchor)  # (K, Vd)
        if sampling.greedy:
            return ChainProposal(tokens=self.vocab.to_target(logits.argmax(-1)))
        q = sampling.probs(logits)  # (k, Vd), k = K without the cut
        return ChainProposal(tokens=self.vocab.to_target(sampling.sample(q, generator)), probs=self.vocab.scatter(q))


# ------------------------------------------------------------------------------------ the left-to-right chain
def previous_tokens(ids: Tensor, starts: Tensor, k: int) -> Tensor:
    """x_{n+t-1} for slots t = 1..K of every anchor n: the anchor, then the gold tokens. (N, S), (N, A) -> (N, A, K);
    positions past the sequence repeat its last token (their slots are not valid)."""
    n, s = ids.shape
    pos = (starts[..., None] + torch.arange(k, device=ids.device)).clamp(max=s - 1)  # (N, A, K)
    return ids.gather(1, pos.reshape(n, -1)).view(n, -1, k)


class ChainedBlockDrafter(ParallelBlockDrafter):
    """A DFlash block whose slot t also reads the token at slot t - 1: the backbone runs once per round, then the
    slots are drawn in order, each from ``slot_logits(h, t, previous token, carry)``.

    The training forward computes the same logits teacher-forced (previous token = gold), so when slots 1..t-1
    were accepted (drafted = gold) slot t's distribution is the one ``forward`` gives.
    """

    left_to_right: bool = True  # False: the slots are independent and ParallelBlockDrafter.propose drafts them

    def slot_logits(self, hidden: Tensor, t: int, previous: Tensor, carry: Any) -> tuple[Tensor, Any]:
        """Logits (1, Vd) of slot t + 1 (0-based ``t``) from the block's states ``hidden`` (K, H) and the token
        ``previous`` (1,) before it (target id), and what the next slot needs (``carry``, None at slot 1)."""
        raise NotImplementedError

    @property
    def parallel_slots(self) -> bool:  # slot t reads the token drafted at t - 1 unless the chain is off
        return not self.left_to_right

    @property
    def tree_growth(self) -> TreeGrowth:  # a property: DFly turns the chain off per instance (hidden_correction)
        return TreeGrowth.NONE if self.left_to_right else TreeGrowth.BEST_FIRST

    @torch.no_grad()
    def propose(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, generator=None
    ) -> ChainProposal:
        if not self.left_to_right:
            return super().propose(state, anchor, sampling, generator)
        hidden = self.block_hidden(state, anchor)[0, 1:]  # (K, H) the slots' states
        previous, carry = anchor.reshape(1), None
        tokens, probs = [], []
        for t in range(self.block_size):
            logits, carry = self.slot_logits(hidden, t, previous, carry)  # (1, Vd)
            if sampling.greedy:
                draft = logits.argmax(-1)  # (1,)
            else:
                q = sampling.probs(logits)  # (1, Vd)
                draft = sampling.sample(q, generator)
                probs.append(q)
            previous = self.vocab.to_target(draft)  # (1,) the next slot reads the drafted token
            tokens.append(previous)
        if sampling.greedy:
            return ChainProposal(tokens=torch.cat(tokens))
        return ChainProposal(tokens=torch.cat(tokens), probs=self.vocab.scatter(torch.cat(probs)))  # (K,), (K, V)
