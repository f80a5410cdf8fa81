"""The decoding loop: one engine for plain and speculative decoding, every drafter.

A round: the drafter proposes (``decoding/proposals.py``), one target forward verifies the proposal's nodes after
the anchor, the proposal's own rule accepts a path (greedy match or lossless rejection sampling), the accepted
tokens and the target's next token are committed, the target cache keeps the committed path and the drafter's
state is extended with it. Nothing here depends on the drafter family or the proposal kind.

Convention: the prefill covers the prompt *except its last token*; that token is the anchor of the first
round. So every new token is committed by some round, rounds = target verification forwards, and
MAL = len(tokens) / rounds exactly (bonus included) — the same accounting as EDR's offline evaluator.
Plain decoding is the same loop with an empty draft (K = 0).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_spec.decoding.ngram import as_proposer, merge_into
from lightning_spec.decoding.plans import Plan, Run, parse_plan
from lightning_spec.decoding.proposals import ChainProposal, Proposal
from lightning_spec.decoding.trees import TreeConfig
from lightning_spec.errors import UserError
from lightning_spec.sampling import SamplingConfig

if TYPE_CHECKING:
    from lightning_spec.decoding.proposer import Proposer
    from lightning_spec.target import Target


@dataclass
class Generation:
    """The result of one ``generate`` call."""

    tokens: list[int]  # new tokens only (EOS included when generated)
    accept_lengths: list[int]  # accepted draft tokens per round, bonus excluded
    rounds: int  # target verification forwards
    seconds: float  # wall time of the whole call (prefill included)
    draft_seconds: float = 0.0  # time inside drafter.propose
    verify_seconds: float = 0.0  # time inside the target verify forwards
    prefill_seconds: float = 0.0  # the prompt's prefill and the drafter's begin, inside ``seconds`` (GPU: not synced)
    block_size: int = 0  # K, the most a round drafts (0 for plain decoding)
    draft_lengths: list[int] = field(default_factory=list)  # draft tokens submitted per round (<= K)
    # with trace=True, per round: the drafted chain (target ids) and the target's log-probability of each drafted
    # token in the verification forward (under ``sampling``; greedy: the plain softmax), what on-policy training
    # replays (the rejected drafts of a round are drafts[r][accept_lengths[r]:])
    drafts: list[list[int]] = field(default_factory=list)
    draft_logp: list[list[float]] = field(default_factory=list)

    @property
    def mal(self) -> float:
        """Tokens committed per round, bonus included."""
        return len(self.tokens) / max(self.rounds, 1)


def _as_ids(input_ids: Any, vocab_size: int, device: torch.device) -> Tensor:
    if hasattr(input_ids, "keys") and "input_ids" in input_ids:  # a tokenizer's BatchEncoding
        input_ids = input_ids["input_ids"]
    try:
        ids = torch.as_tensor(input_ids, device=device)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise UserError("input_ids must be token ids: a non-empty list of ints, a 1-D tensor, or a (1, S) tensor.")
    ids = ids.long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise UserError(f"generate takes one prompt; input_ids has batch size {ids.shape[0]}.")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise UserError("input_ids must be a non-empty list of ints, a 1-D tensor, or a (1, S) tensor.")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise UserError(
            f"input_ids holds token id {int(bad[0])}, outside the target's vocabulary 0..{vocab_size - 1}; "
            "tokenize the prompt with the target's own tokenizer (target.tokenizer)."
        )
    return ids[None]  # (1, S)


def draft(drafter: Proposer, state: Any, anchor: Tensor, context: list[int], sampling: SamplingConfig,
          tree: TreeConfig | None, generator: torch.Generator | None = None, length: int | None = None) -> Proposal:
    """A round's proposal after ``anchor`` (the last of the committed tokens ``context``): the drafter's chain (its
    first ``length`` drafts when given: a plan's shorter chain) or tree, with ``tree.ngram`` n-gram candidates merged
    in (``decoding/ngram.py``). The one place the engine and the offline replay
    (``decoding.exact.replay_tree_rounds``) get their proposals from."""
    if tree is None:
        proposal = drafter.propose(state, anchor, sampling, generator)
        return proposal if length is None else proposal.truncated(length)
    proposal = drafter.propose_tree(state, anchor, sampling, tree, generator)
    if not tree.ngram:
        return proposal
    merged = merge_into(proposal, context, tree)
    if merged is not proposal:  # nodes dropped and renumbered: the drafter reads the verified tree's tokens
        drafter.adopt(state, anchor, merged)
    return merged


def resolve_run(drafter: Proposer | str | None, plan: Plan | TreeConfig | dict | str | None) -> Run:
    """What ``generate`` runs: ``plan`` resolved with ``drafter`` (``decoding/plans.py``); without a plan, the
    drafter's chain, or plain decoding without a drafter."""
    proposer = as_proposer(drafter)
    return parse_plan(plan, default="chain" if proposer is not None else "plain").resolve(proposer)


def _check_request(drafter: Proposer | None, tree: TreeConfig | None, trace: bool, max_new_tokens: Any) -> None:
    """Refuse a ``generate`` call that cannot run, before the target is touched."""
    if tree is not None and trace:
        raise UserError("generate(trace=True) records chains; decode with a chain plan to trace the drafts.")
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}.")


def _generator(seed: int | None, sampling: SamplingConfig) -> torch.Generator | None:
    """The draws' generator: seeded by ``seed``, else a fresh seed when sampling, none for greedy decoding."""
    if seed is not None:
        return torch.Generator().manual_seed(seed)
    if not sampling.greedy:
        return torch.Generator().manual_seed(torch.seed() % (2**63))
    return None


def _prefill(target: Target, drafter: Proposer | None, ids: Tensor, layers: list[int], cache: Any) -> Any:
    """Prefill the target cache with the prompt (1, S) but its last token (the first round's anchor); the
    drafter's state begun on those positions' features (None without a drafter)."""
    state = None
    if ids.shape[1] > 1:
        out = target(ids[:, :-1], layers=layers, cache=cache, logits=False)  # prefill, no logits needed
        if drafter is not None:
            state = drafter.begin(out.features, ids[:, :-1])
    elif drafter is not None:
        state = drafter.begin(torch.zeros(1, 0, len(layers) * target.hidden_size, device=target.device), ids[:, :0])
    return state


def _commit(new: list[int], eos: set[int], room: int) -> list[int]:
    """A round's accepted drafts and next token, cut after the first EOS and to the ``room`` left in the budget."""
    for i, tok in enumerate(new):
        if tok in eos:
            new = new[: i + 1]
            break
    return new[:room]


def _trace_round(gen: Generation, logits: Tensor, nodes: Tensor, drafted: int, sampling: SamplingConfig) -> None:
    """Record a chain round's drafted tokens and the target's log-probability of each (``trace=True``).
    ``logits`` (T, V) of the verify forward: logits[i] predicts node i + 1, the drafted tokens are nodes 1..k."""
    logits = logits[:drafted].float()  # (k, V)
    logp = logits.log_softmax(-1) if sampling.greedy else sampling.logprobs(logits)
    gen.drafts.append(nodes[1 : drafted + 1].tolist())
    gen.draft_logp.append(logp.gather(-1, nodes[1 : drafted + 1, None])[:, 0].tolist())


@torch.no_grad()
def generate(
    target: Target,
    input_ids: Any,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    drafter: Proposer | str | None = None,
    seed: int | None = None,
    trace: bool = False,
    plan: Plan | TreeConfig | dict | str | None = None,
) -> Generation:
    """Decode one prompt with the target, speculatively when a drafter is given.

    ``input_ids``: one prompt (list of ints, 1-D or (1, S) tensor, or a tokenizer's output); ``sampling``: a
    ``SamplingConfig`` or a dict of its fields (None: greedy); ``drafter=None`` decodes plainly with the same code
    path; ``seed`` makes sampled decoding reproducible; ``trace`` records every round's drafted chain and the target's
    log-probabilities of it (``Generation.drafts``, ``draft_logp``); ``plan`` says how to decode
    (``decoding/plans.py``: plain, a chain of fewer slots or one that stops on the drafter's confidence, a tree of
    the drafter's, a ``TreeConfig`` standing for that tree, n-gram lookup, ...), with ``drafter`` the drafter it
    drafts with; None is the drafter's chain, or plain decoding without a drafter. Stops after ``max_new_tokens`` or
    the target's EOS."""
    sampling = SamplingConfig.coerce(sampling)
    run = resolve_run(drafter, plan)
    drafter, tree = run.proposer, run.tree
    _check_request(drafter, tree, trace, max_new_tokens)
    device = target.device
    ids = _as_ids(input_ids, target.vocab_size, device)
    generator = _generator(seed, sampling)
    eos = set(target.eos_token_ids)
    layers = list(drafter.target_layers) if drafter is not None else []
    k = (run.length or drafter.block_size) if drafter is not None else 0
    if drafter is not None:
        drafter.use_target(target)

    start = time.perf_counter()
    cache = target.new_cache()
    state = _prefill(target, drafter, ids, layers, cache)
    # filled round by round; ``rounds`` and ``seconds`` are set at the end
    gen = Generation([], [], 0, 0.0, prefill_seconds=time.perf_counter() - start, block_size=k)
    anchor = ids[0, -1:]  # (1,)
    context = ids[0].tolist() if tree is not None and tree.ngram else []  # committed tokens, for n-gram merges
    while len(gen.tokens) < max_new_tokens:
        t0 = time.perf_counter()
        proposal = None if drafter is None else draft(drafter, state, anchor, context, sampling, tree, generator,
                                                       run.length)
        proposal = proposal if proposal is not None else ChainProposal.empty(device)
        t1 = time.perf_counter()
        nodes, offsets, tree_mask = proposal.verify_inputs(anchor)  # (T,), (T,), (T, T) | None
        past = cache.get_seq_length()
        out = target(nodes[None], layers=layers, cache=cache, positions=offsets, tree_mask=tree_mask)
        path, nxt = proposal.accept(out.logits[0], sampling, generator)  # committed nodes, the anchor first
        gen.verify_seconds += time.perf_counter() - t1
        gen.draft_seconds += t1 - t0
        new = _commit(nodes[path[1:]].tolist() + [nxt], eos, max_new_tokens - len(gen.tokens))
        gen.tokens.extend(new)
        gen.accept_lengths.append(min(len(path) - 1, len(new)))  # accepted drafts, bonus excluded
        gen.draft_lengths.append(proposal.num_drafted)
        if trace:
            _trace_round(gen, out.logits[0], nodes, proposal.num_drafted, sampling)
        if new[-1] in eos or len(gen.tokens) >= max_new_tokens:
            break
        # keep the anchor and the accepted drafts in the caches; the committed next token is the new anchor
        target.keep(cache, past, path)
        if drafter is not None:
            drafter.extend(state, out.features, path)
        if context:
            context.extend(new)
        anchor = torch.tensor([nxt], device=device)
    gen.rounds = len(gen.accept_lengths)
    gen.seconds = time.perf_counter() - start
    return gen
