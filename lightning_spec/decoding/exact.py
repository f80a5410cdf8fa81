"""The exact rounds of a proposer on known outputs: what speculative decoding of a given prompt + response takes,
without decoding it (EDR's offline evaluator: Zhao & Cai 2026, arXiv 2610.10411, §3.4).

Two ways, one entry point (``score_outputs``):
- scored: one teacher-forced target forward and one drafter forward from every anchor give every slot's
  acceptance, and the round chain's dynamic programme (``rounds.py``) its exact expected rounds, under greedy
  decoding and sampling alike;
- replayed (``replay_tree_rounds``): rounds whose proposal depends on the drafter's own earlier drafts (dynamic
  trees, D²SD, SpecBlock) or on the committed tokens (n-gram lookup) are replayed round by round with the same
  calls ``generate`` makes, the target's features read from one teacher-forced forward.

The offline evaluator (``evaluation/offline.py``) scores rollout sets with it; decoding auto (``auto/estimate.py``)
and deploy-time adaptation (``adaptation.py``) score their calibration outputs and windows with it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_spec.decoding.engine import draft
from lightning_spec.decoding.proposer import Drafting, Proposer, TreeGrowth
from lightning_spec.decoding.rounds import chain, chain_dp, every_anchor, target_table
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.target import Target


@torch.no_grad()
def score_outputs(
    target: Target,
    drafter: Proposer,
    prompts: list[list[int]],
    responses: list[list[int]],
    sampling: SamplingConfig,
    anchors_per_forward: int,
    max_elems: int,
    seconds: dict[str, float],
    tree: TreeConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """τ(x) (N,), the exact expected rounds to decode each output (prompt + response) speculatively, and the
    expected rounds that verify and accept each slot (K,), (K,), summed over the batch: replayed round by round
    (``replayed``), or scored from one teacher-forced target and drafter forward (``rounds.py``). The outputs are
    right-padded into one batch. ``anchors_per_forward`` and ``max_elems`` bound memory, not results; ``seconds``
    gets the time spent in the target, the drafter and the dynamic programme added."""
    dev = target.device
    n, k = len(prompts), drafter.block_size
    s = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(n, s, dtype=torch.long, device=dev)
    mask = torch.zeros(n, s, dtype=torch.bool, device=dev)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[i, len(p) : len(p) + len(r)] = True

    t0 = time.perf_counter()
    if replayed(drafter, tree):  # rounds that one teacher-forced drafter forward cannot score: replay them
        layers = list(drafter.target_layers)  # n-gram lookup reads no features: no target forward at all
        features = target(ids, layers=layers, logits=False).features if layers else None
        t1 = time.perf_counter()
        rounds, reached, accepted = replay_tree_rounds(drafter, ids, features, prompts, responses, tree, sampling)
        seconds["target"] = seconds.get("target", 0.0) + t1 - t0
        seconds["drafter"] = seconds.get("drafter", 0.0) + time.perf_counter() - t1
        return rounds, reached, accepted
    out = target(ids, layers=list(drafter.target_layers), logits=False)  # right padding: causal, no mask needed
    table = target_table(out.last_hidden, target.lm_head, ids, mask, sampling, drafter.vocab,
                         target.eos_token_ids, costs=False, max_elems=max_elems)
    t1 = time.perf_counter()
    batch = {"input_ids": ids, "loss_mask": mask}
    chunk = max(1, min(max(1, anchors_per_forward // n), max_elems // max(1, n * k * drafter.vocab.ids.numel())))
    stats = every_anchor(lambda anchors: drafter(batch, out.features, anchors), mask, table, k, sampling, chunk,
                         costs=False, tree=tree)
    t2 = time.perf_counter()

    ch = chain(mask, k)
    values = chain_dp(stats.accept, 1 - stats.accept, ch)  # cost R = 1 - A: the value recursion counts rounds too
    rounds = values.start.sum(-1)  # τ(x) = Σ_n ω_{n,n+1} (EDR Prop. 1)
    occ = values.occupancy  # (N, S, K) P(round n starts and verifies slot k), verified slots only
    reached = (occ * stats.drafted).sum((0, 1))  # rounds that submitted slot k (AR_k's denominator)
    accepted = (occ * stats.accept).sum((0, 1))
    seconds["target"] = seconds.get("target", 0.0) + t1 - t0
    seconds["drafter"] = seconds.get("drafter", 0.0) + t2 - t1
    seconds["dp"] = seconds.get("dp", 0.0) + time.perf_counter() - t2
    return rounds.cpu(), reached.cpu(), accepted.cpu()


def replayed(drafter: Proposer, tree: TreeConfig | None) -> bool:
    """Whether the drafter's rounds are replayed (``replay_tree_rounds``) rather than scored from one teacher-forced
    forward: trees grown from the drafter's own drafts, trees with n-gram candidates merged in, and every round
    of a drafter whose drafts are chosen from the committed tokens (n-gram lookup)."""
    if drafter.drafting is Drafting.CHOSEN:
        return True
    return tree is not None and (bool(tree.ngram) or drafter.tree_growth is not TreeGrowth.BEST_FIRST)


@torch.no_grad()
def replay_tree_rounds(
    drafter: Proposer,
    ids: Tensor,  # (N, S) prompt + response per row, right-padded
    features: Tensor | None,  # (N, S, F) the target's features of ``ids`` (teacher-forced); None: reads none
    prompts: list[list[int]],
    responses: list[list[int]],
    tree: TreeConfig | None,
    sampling: SamplingConfig | None = None,
    sizes: list[int] | None = None,
    length: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy rounds of trees that a drafter grows from its own drafts (EAGLE-2's dynamic trees, D²SD's re-drafts,
    SpecBlock's rank-sized trees), replayed along greedy rollouts: τ(x) (N,), and per depth the rounds that
    reached it and accepted it, (K,), (K,) (deeper n-gram nodes count in τ only).

    Rounds whose every node is chosen, not drawn (n-gram chains and tries, best-first trees, either with n-gram
    candidates merged in) are replayed under ``sampling`` as well: given the output such a round accepts the
    longest root path the output follows (a chosen chain token x is accepted with p(x), and then the output is x;
    a chosen child likewise), so the replay is exact under every sampling config. ``sizes``, when given, gets each
    round's number of draft nodes (what its verify forward runs besides the anchor). ``length``: chains cut to their
    first ``length`` drafts (a plan's shorter chain, ``decoding/plans.py``).

    Under greedy decoding a round is a function of the committed prefix: the drafter's state is built from the
    target's features of the committed tokens, its tree from that state, and the target accepts the longest root
    path whose tokens are the rollout's next tokens (the target's argmax on a greedy rollout; the first matching
    child in draft order, ``TreeProposal.accept``). So the engine's rounds are replayed with the drafter alone: the
    same ``begin`` / ``propose_tree`` / ``extend`` calls as ``generate``, the committed nodes' features read from
    one teacher-forced target forward instead of each round's verify forward. Offline rounds are then the
    engine's rounds exactly (up to floating-point differences between the two forwards), one drafter call per
    round instead of a target forward."""
    sampling = sampling or SamplingConfig()
    k = drafter.block_size
    rounds = torch.zeros(len(prompts), dtype=torch.float64)
    reached = torch.zeros(k, dtype=torch.float64)
    accepted = torch.zeros(k, dtype=torch.float64)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        seq = prompt + response
        a = len(prompt) - 1  # the anchor's index in seq: the engine prefills the prompt without its last token
        state = drafter.begin(features[row : row + 1, :a] if features is not None else None, ids[row : row + 1, :a])
        while True:
            anchor = ids[row, a : a + 1]  # (1,)
            proposal = draft(drafter, state, anchor, seq[: a + 1], sampling, tree, length=length)
            kids = proposal.children()
            if sizes is not None:
                sizes.append(proposal.num_drafted)
            tokens = proposal.tokens.tolist()
            path = [0]
            while a + len(path) < len(seq):  # the next token exists: follow the first child that drafted it
                child = next((c for c in kids[path[-1]] if tokens[c - 1] == seq[a + len(path)]), None)
                if child is None:
                    break
                path.append(child)
            rounds[row] += 1
            depth = len(path) - 1  # accepted drafts
            left = len(seq) - 1 - a  # response tokens still to commit, the slot's own included
            reached[: min(depth + 1, left, k)] += 1  # slots this round verified with their ancestors accepted
            accepted[: min(depth, k)] += 1
            a += depth + 1  # the accepted drafts and the target's next token
            if a >= len(seq) - 1:  # the response's last token is committed: generation ended
                break
            feats = None
            if features is not None:
                feats = features.new_zeros(1, proposal.num_drafted + 1, features.shape[-1])  # (1, T, F)
                feats[0, path] = features[row, a - depth - 1 : a]  # the committed nodes' features
            drafter.extend(state, feats, path)
    return rounds, reached, accepted
