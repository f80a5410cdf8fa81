"""D²SD: a DFlash draft, its likely rejection points, and variable-prefix re-drafts verified as one shared-prefix
tree (Zhang et al. 2026, arXiv 2606.04446, §3).

Reads top to bottom:
1. ``D2SDDrafter`` (the variable-prefix drafter) is DFlash's architecture (``block.ParallelBlockDrafter``) whose
   block after the anchor may start with l known tokens: positions 0..l of the block hold the anchor and the gold
   x_{n+1..n+l} (their frozen embeddings), positions l+1..K the learned mask vectors. l = 0 is DFlash exactly.
2. Training: per anchor, Pr(l = j) ∝ β^j, j = 0..K-1 (β = ``prefix_beta``); slots t <= l are inputs, not
   predictions (``DraftOutput.valid`` is False there), and ``aux["prefix_length"]`` (N, A) carries l to the
   objective, where ``objectives.VPDecay`` gives L_VP = Σ_{t>l} w_t CE_t / Σ_{t>l} w_t, w_t = exp(-(t-l-1)/τ).
3. Decoding a chain (``propose``): the plain DFlash draft (l = 0), unchanged.
4. Decoding a tree (``propose_tree``, the D²SD cycle):
   a. the DFlash draft d_1..d_K with confidences c_k = max_v q_k(v);
   b. the rejection-boundary posterior r(i) = Π_{k<=i} c_k · (1 - c_{i+1}), the chance that the first rejection
      falls on slot i + 1; S = the ``branches`` largest r(i);
   c. for each i in S the VP-drafter re-drafts slots i+1..K with the anchor and d_1..d_i known, all branches in
      one pass of the draft layers (the branch blocks side by side over the one decoding context, not copied);
   d. the shared-prefix tree: the DFlash draft is the trunk, branch i hangs its re-drafted tokens under trunk node
      i (depth i). The target verifies it in one forward with the ancestor mask (our stand-in for the paper's
      cascade attention: the shared prefix is verified once, no KV is replicated either way).

Choices where the paper leaves room (DERIVED here, checked against the authors' decoding loop,
catnanami/D2-SD ``generation/d3_generator.py``; tested in tests/drafters/test_d2sd.py):
- One model. The authors run two checkpoints, a DFlash drafter for the trunk and the VP-drafter for the branches;
  here the VP-drafter drafts both, since l = 0 is in its training distribution (it is DFlash there). Loading a
  separate DFlash trunk is not offered.
- Index ranges. The paper's γ counts the anchor (its B = 16 is ``block_size: 15`` here, README "Conventions"),
  so its l ∈ 0..γ-2 and i ∈ 0..γ-2 are 0..K-1 here: the deepest branch keeps d_1..d_{K-1} and re-drafts slot K,
  which training covers (l = K-1 is sampled). The authors' loop scores the same K boundaries. NeMo PR #3032
  samples l over [min(2, γ-1), γ-1]; we follow the paper.
- l is drawn independently of the data: an anchor near the end of its sequence may have no supervised slot after
  its prefix and then contributes nothing. Draws are per example (``anchor_seed``, salted), like the anchors.
- In eval mode (``drafter.eval()``: validation loss, the offline evaluator) the forward uses l = 0, the
  distributions ``propose`` draws a chain from, so chain scoring stays exact; ``forward(prefix=...)`` forces l.
- Nodes are chosen, not drawn: the argmax of q (of ``sampling.probs`` under sampling) at every slot, trunk and
  branches alike, with ``probs=None``, so the deterministic candidate rule verifies the tree losslessly (the
  paper drafts greedily as well). A branch whose tokens coincide with nodes already in the tree merges into them
  (the tree is a trie of the K+1 paths), so duplicate siblings are never verified twice. A branch's first slot may
  repeat the trunk's token there (the authors' loop does not exclude it); it then merges and its later slots
  become alternatives under the trunk's node. ``distinct_branches=True`` (ours, off by default) makes slot i + 1
  of branch i the best token other than d_{i+1}: at this scale (slot-1 acceptance ~0.2) r(i) puts the likely
  rejection at slot 1, where a re-draft from the same distribution proposes d_1 again (docs/reproductions.md,
  "D²SD's shared-prefix tree beats the diffusion drafter alone").
- ``TreeConfig``: ``nodes`` caps the draft nodes (the trunk first, then the branches by decreasing r(i), a branch
  cut where the budget ends); ``depth`` truncates every path at that slot (boundaries i < depth only);
  ``top_k`` is not used (the tree's width is ``branches``).
- Offline, the tree is scored on greedy rollouts by replaying each round (``decoding.exact.replay_tree_rounds``):
  its branches are drafted from draft tokens off the output's path, which only the drafter itself can give.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_spec.decoding.proposals import TreeProposal
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.decoding.trees import tree_probs
from lightning_spec.drafters.base import Anchors, DraftOutput, seeded_rand
from lightning_spec.drafters.block import BlockDraftState, ParallelBlockDrafter
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.trees import TreeConfig

# Prefix lengths draw from their own stream, seeded from the example's anchor seed plus this salt (a large odd
# number), so they do not reuse the uniforms that picked the anchors.
PREFIX_SALT = 0x9E3779B97F4A7C15 % 2**62


def boundary_posterior(confidence: Tensor) -> Tensor:
    """r(i) = Π_{k<=i} c_k · (1 - c_{i+1}), i = 0..D-1, from per-slot confidences c_1..c_D ``confidence`` (D,): the
    probability that slots 1..i are accepted and slot i + 1 is the first rejection, if c_k were slot k's acceptance
    probability given the slots before it (D²SD §3, "rejection-boundary posterior")."""
    reach = torch.cat([confidence.new_ones(1), confidence[:-1]]).cumprod(0)  # (D,) Π_{k<=i} c_k, 1 at i = 0
    return reach * (1 - confidence)  # (D,)


def shared_prefix_tree(paths: list[list[int]], nodes: int) -> tuple[Tensor, Tensor]:
    """The trie of ``paths`` (token lists from the anchor), inserted in order, as draft nodes' tokens (T,) and
    parents (T,) (0 = the anchor, parents before children). A token equal to an existing child of the same parent
    merges into it; insertion stops once the tree holds ``nodes`` draft nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: list[dict[int, int]] = [{}]  # per node (the anchor first): token -> child node
    for path in paths:
        node = 0
        for token in path:
            child = children[node].get(token)
            if child is None:
                if len(tokens) >= nodes:
                    break
                tokens.append(token)
                parents.append(node)
                children.append({})
                child = children[node][token] = len(tokens)
            node = child
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


class D2SDDrafter(ParallelBlockDrafter):
    """The variable-prefix drafter of D²SD: DFlash (``ParallelBlockDrafter``) trained with l known tokens after the
    anchor, decoded as a chain (plain DFlash) or as D²SD's shared-prefix tree (``generate(..., plan=TreeConfig(...))``).

    Args:
        block_size: K, draft proposals per round (the block holds the anchor plus K slots).
        num_layers: draft decoder layers.
        target_layers: 0-indexed target layers whose outputs form the context (default as ``ParallelBlockDrafter``).
        num_anchors: anchors sampled per training sequence.
        draft_vocab_size: restrict the LM head to the most frequent target tokens (None = the full vocabulary).
        intermediate_size: MLP width; default the target's.
        context_shortcut: ``ParallelBlockDrafter``'s EAGLE-style slot inputs (not in the paper).
        init_from_target: start the draft layers from the target's last layers (``ParallelBlockDrafter``).
        prefix_beta: β in (0, 1] of the training prefix length, Pr(l = j) ∝ β^j, j = 0..K-1 (1 = uniform; smaller
            trains mostly short prefixes, which the rejection boundary most often needs).
        branches: re-drafted branches per tree round (the paper's K = 4), >= 0 (0: the tree is the DFlash draft).
        distinct_branches: a branch's first re-drafted slot takes the best token other than the trunk's there
            (not in the paper: its branches may repeat the trunk's token at the very slot they are meant to
            replace, and then merge into the trunk; see the module docstring).
    """

    family = "d2sd"
    tree_growth = TreeGrowth.OWN  # propose_tree: D²SD's shared-prefix tree, not the best-first tree over the block

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
        prefix_beta: float = 0.8,
        branches: int = 4,
        distinct_branches: bool = False,
    ) -> None:
        super().__init__(
            block_size=block_size, num_layers=num_layers, target_layers=target_layers, num_anchors=num_anchors,
            draft_vocab_size=draft_vocab_size, intermediate_size=intermediate_size, context_shortcut=context_shortcut,
            init_from_target=init_from_target,
        )
        if isinstance(prefix_beta, bool) or not 0 < prefix_beta <= 1:
            raise UserError(f"drafter.prefix_beta must be in (0, 1] (Pr(l = j) ∝ prefix_beta^j), got {prefix_beta!r}.")
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 0:
            raise UserError(f"drafter.branches must be an int >= 0 (re-drafted branches per tree), got {branches!r}.")
        self.prefix_beta = prefix_beta
        self.branches = branches
        self.distinct_branches = bool(distinct_branches)
        self._known: tuple[Tensor, Tensor] | None = None  # set only inside ``known_prefix``

    # ------------------------------------------------------------------------------------- the known prefix
    @contextmanager
    def known_prefix(self, tokens: Tensor, length: Tensor) -> Iterator[None]:
        """Within this scope every block ``embed_block`` builds holds known tokens: block position j (0 = the
        anchor) is ``tokens[..., j]`` (target ids, (..., K + 1)) for j <= ``length`` (...,), a mask slot after.

        Why a scope: ``ParallelBlockDrafter.backbone`` and ``block_hidden`` embed a block from its anchor alone; passing
        the
        prefix through here reuses DFlash's layers, masks and context shortcut unchanged, so l = 0 is DFlash."""
        self._known = (tokens, length)
        try:
            yield
        finally:
            self._known = None

    def embed_block(self, anchor_tokens: Tensor) -> Tensor:
        """(...,) anchor ids -> (..., K + 1, H): DFlash's [anchor, K masks], the known prefix's slots replaced by the
        frozen embeddings of their tokens."""
        block = super().embed_block(anchor_tokens)  # (..., K + 1, H)
        if self._known is None:
            return block
        tokens, length = self._known  # (..., K + 1), (...,)
        known = torch.arange(self.block_size + 1, device=tokens.device) <= length[..., None]  # (..., K + 1)
        gold = self.target.embed_tokens(tokens).to(block.dtype)  # (..., K + 1, H)
        return torch.where(known[..., None], gold, block)

    # ------------------------------------------------------------------------------------------- training
    def prefix_probs(self) -> Tensor:
        """Pr(l = j) = β^j / Σ_i β^i, j = 0..K-1: (K,) float64."""
        weights = self.prefix_beta ** torch.arange(self.block_size, dtype=torch.float64)
        return weights / weights.sum()

    def sample_prefix(
        self, batch: dict[str, Tensor], shape: torch.Size, generator: torch.Generator | None = None
    ) -> Tensor:
        """Prefix lengths (N, A) for the anchors of ``shape`` (N, A), by the inverse CDF of ``prefix_probs``.

        Row i draws from its own generator seeded with ``batch["anchor_seed"][i]`` + a salt when the batch has it
        (as ``sample_anchors``: the same draws in any batch, padding or DDP rank; anchor j gets the row's j-th
        uniform); otherwise from ``generator`` (or the global RNG)."""
        n, a = shape
        seeds = batch.get("anchor_seed")
        if seeds is not None:
            u = seeded_rand((seeds.to(torch.int64).cpu() + PREFIX_SALT) % 2**62, a, torch.float64)  # (N, A)
        else:
            u = torch.rand(n, a, generator=generator, dtype=torch.float64)
        cdf = self.prefix_probs().cumsum(0)  # (K,)
        length = torch.searchsorted(cdf, u, right=True).clamp(max=self.block_size - 1)  # l = #{j: cdf_j <= u}
        return length.to(batch["input_ids"].device)

    def forward(
        self,
        batch: dict[str, Tensor],
        features: Tensor,
        anchors: Anchors | None = None,
        prefix: Tensor | None = None,
    ) -> DraftOutput:
        """Training forward with a known prefix per anchor: ``prefix`` (N, A) lengths l in 0..K-1; None: drawn
        (``sample_prefix``) in training mode, 0 in eval mode (the chain ``propose`` drafts). Slots t <= l are
        inputs: ``valid`` is False there; l goes to the objective as ``aux["prefix_length"]``."""
        ids = batch["input_ids"]
        n, s = ids.shape
        k = self.block_size
        anchors = anchors if anchors is not None else self.sample_anchors(batch)
        starts = anchors.positions  # (N, A)
        if prefix is None:
            prefix = self.sample_prefix(batch, starts.shape) if self.training else torch.zeros_like(starts)
        prefix = prefix.to(starts.device)
        if prefix.shape != starts.shape or bool(((prefix < 0) | (prefix >= k)).any()):
            raise ValueError(f"D2SDDrafter.forward prefix must be (N, A) = {tuple(starts.shape)} lengths in 0..{k - 1} "
                             "(the known tokens after each anchor).")
        pos = (starts[..., None] + torch.arange(k + 1, device=ids.device)).clamp(max=s - 1)  # (N, A, K + 1)
        tokens = ids.gather(1, pos.reshape(n, -1)).view(*starts.shape, k + 1)  # (N, A, K + 1) the gold block
        with self.known_prefix(tokens, prefix):
            hidden = self.backbone(ids, features, starts)[:, :, 1:]  # (N, A, K, H) the slots
        labels, valid = self.labels(batch, anchors)  # (N, A, K)
        predicted = torch.arange(1, k + 1, device=ids.device) > prefix[..., None]  # (N, A, K) slots after the prefix
        return DraftOutput(labels=labels, valid=valid & predicted, anchors=starts, hidden=hidden,
                           head=self._slot_logits, aux={"prefix_length": prefix})

    # ------------------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def branch_logits(self, state: BlockDraftState, anchor: Tensor, draft: Tensor, lengths: Tensor) -> Tensor:
        """Re-drafts in one pass: branch b keeps the anchor (1,) and the first ``lengths[b]`` tokens of ``draft``
        (K,) (target ids) and masks the rest. Returns the draft logits (R, K, Vd) of every slot of the R branches.

        The R blocks go side by side through the draft layers over the one decoding context (``block_attention``:
        each block sees the whole context and itself only), as ``block_hidden`` runs one block."""
        r = lengths.numel()
        tokens = torch.cat([anchor.reshape(1), draft]).expand(r, -1)  # (R, K + 1)
        with self.known_prefix(tokens, lengths):
            h = self.embed_block(anchor.reshape(1).expand(r))  # (R, B, H)
        b = h.shape[1]
        if self.shortcut is not None:
            prev = state.last if state.last is not None else h.new_zeros(1, h.shape[-1])  # (1, H)
            h = h + self.shortcut(torch.cat([prev.expand(r, -1), h[:, 0]], dim=-1))[:, None]
        h = h.reshape(1, r * b, -1)  # (1, RB, H)
        pos = torch.arange(state.length, state.length + b, device=h.device).repeat(r)[None]  # (1, RB)
        for i, layer in enumerate(self.layers):
            if state.length:
                ck, cv = state.keys[i], state.values[i]
            else:  # empty context (a one-token prompt): each block attends to itself only
                ck = cv = h.new_zeros(1, layer.kv_heads, 0, layer.head_dim)
            h = layer(h, pos, ck, cv, None, b, self.rope_theta)
        return self.head(self.norm(h).view(r, b, -1)[:, 1:])  # (R, K, Vd)

    @torch.no_grad()
    def propose_tree(
        self, state: BlockDraftState, anchor: Tensor, sampling: SamplingConfig, tree: TreeConfig, generator=None
    ) -> TreeProposal:
        """D²SD's tree after ``anchor`` (the module docstring, step 4): the DFlash trunk, the ``branches`` most
        likely rejection boundaries re-drafted by the VP-drafter in one pass, merged into one shared-prefix tree of
        at most ``tree.nodes`` draft nodes and depth ``tree.depth`` (``tree.top_k`` is not used)."""
        depth = min(tree.depth or self.block_size, self.block_size)
        q = tree_probs(self.position_logits(state, anchor), sampling)  # (K, Vd)
        confidence, trunk = q.max(-1)  # (K,) c_k, (K,) d_k (draft ids)
        r = boundary_posterior(confidence[:depth].double())  # (D,)
        chosen = r.topk(min(self.branches, depth)).indices  # (S,) boundaries i, most likely first
        paths = [trunk[:depth].tolist()]
        if chosen.numel():
            branch = self.branch_logits(state, anchor, self.vocab.to_target(trunk), chosen)  # (S, K, Vd)
            q_branch = tree_probs(branch, sampling)  # (S, K, Vd)
            if self.distinct_branches:  # slot i + 1 of branch i: anything but the trunk's d_{i+1}, which it replaces
                rows = torch.arange(chosen.numel(), device=q_branch.device)
                q_branch[rows, chosen, trunk[chosen]] = -1.0
            redraft = q_branch.argmax(-1)  # (S, K)
            trunk_ids = trunk.tolist()
            for i, row in zip(chosen.tolist(), redraft.tolist()):
                paths.append(trunk_ids[:i] + row[i:depth])  # d_1..d_i, then the re-drafted slots i+1..D
        index, parents = shared_prefix_tree(paths, tree.nodes)  # (T,), (T,)
        device = anchor.device
        return TreeProposal(tokens=self.vocab.to_target(index.to(device)), parents=parents.to(device))

