"""Decoding plans (lightning_spec/decoding/plans.py): one value says how to decode, read from YAML or a command line
and refused in one sentence when it cannot run; and the new plans keep the guarantees for every family.

- ``parse_plan``: a kind's name, a mapping with a kind, a ``Plan``; unknown kinds, unknown fields and bad values are
  one sentence; ``to_dict`` writes back what parses to the same plan.
- a shorter chain (``length``), a chain that stops on the drafter's confidence (``stop_below``) and a tree that
  stops at a path value: greedy output equals plain greedy output for every family that can run them (the others
  are refused, naming the field), and under sampling the output is distributed as the target's (χ²).
- the threshold does what it says: a dynamic drafter runs no slot past the stop, a high threshold drafts nothing
  and decodes one token per round, and the chain's drafts per round vary with the drafter's confidence.
"""

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference
from helpers.families import FAMILIES, build, trained
from helpers.sampling import NEW, PROMPT, assert_matches, empirical, exact_joint

from lightning_spec import SamplingConfig, generate
from lightning_spec.decoding.plans import PLANS, Adapt, Auto, Chain, Ngram, Plain, Tree, parse_plan
from lightning_spec.decoding.proposer import TreeGrowth
from lightning_spec.errors import UserError

T1 = SamplingConfig(temperature=1.0)
NEW_PLANS = {"chain-2": Chain(length=2), "chain-stop": Chain(stop_below=0.3),
             "tree-stop": Tree(nodes=4, top_k=2, stop_below=0.05)}


def runs(plan, drafter) -> bool:
    """Whether ``drafter`` can run ``plan``: a threshold needs a tree grown best-first or dynamically."""
    return not plan.stop_below or drafter.tree_growth in (TreeGrowth.BEST_FIRST, TreeGrowth.DYNAMIC)


def test_a_plan_is_read_from_a_name_a_mapping_or_itself():
    assert parse_plan("plain") == Plain() and parse_plan(None) == Chain() and parse_plan(None, "plain") == Plain()
    assert parse_plan({"kind": "tree", "nodes": 8, "top_k": 2, "ngram": 2}) == Tree(nodes=8, top_k=2, ngram=2)
    assert parse_plan({"kind": "chain", "stop_below": 0.2}) == Chain(stop_below=0.2)
    assert parse_plan(Ngram(length=4)) == Ngram(length=4)
    assert list(PLANS) == ["plain", "chain", "tree", "ngram", "auto", "adapt"]
    adapt = Adapt(decoding=Tree(nodes=8), scopes=("head",), lr=1e-3)
    for plan in (Plain(), Chain(length=3, stop_below=0.1), Tree(nodes=8, ngram=2), Ngram(nodes=8), Auto(margin=0.1),
                 adapt):
        assert parse_plan(plan.to_dict()) == plan
    assert adapt.to_dict() == {"kind": "adapt", "decoding": {"kind": "tree", "nodes": 8}, "scopes": ["head"],
                               "lr": 1e-3}
    assert Tree(nodes=8).to_dict() == {"kind": "tree", "nodes": 8}


@pytest.mark.parametrize("value,message", [
    ({"kind": "beam"}, "decoding.kind must be one of plain, chain, tree, ngram, auto, adapt, got 'beam'"),
    ({"nodes": 4}, "decoding.kind must be one of plain, chain, tree, ngram, auto, adapt, got None"),
    ({"kind": "tree", "width": 4}, "decoding kind 'tree' has no field 'width'; its fields are nodes, top_k, depth"),
    ({"kind": "plain", "length": 4}, "decoding kind 'plain' has no field 'length'; it has no fields"),
    ({"kind": "chain", "length": 0}, "decoding.length must be an int >= 1 or null for kind 'chain', got 0"),
    ({"kind": "chain", "stop_below": 1.5}, r"tree.stop_below must be a number in \[0, 1\)"),
    ({"kind": "tree", "nodes": 0}, "tree.nodes must be an int >= 1, got 0"),
    ({"kind": "auto", "margin": -1}, "decoding.margin must be a number >= 0"),
    (3, "decoding must be a kind"),
])
def test_a_bad_plan_is_one_sentence(value, message):
    with pytest.raises(UserError, match=message):
        parse_plan(value)


def test_plans_that_cannot_run_say_why(diverse_target):
    with pytest.raises(UserError, match="decoding 'chain' drafts with a drafter, and none was given"):
        generate(diverse_target, [1, 2], 4, plan="chain")
    with pytest.raises(UserError, match="decoding 'auto' is chosen on calibration prompts first"):
        generate(diverse_target, [1, 2], 4, plan="auto")
    dspark = build("dspark", diverse_target, 3)
    assert dspark.tree_growth is TreeGrowth.NONE
    with pytest.raises(UserError, match="decoding.stop_below needs a drafter whose chain is its one-child tree"):
        generate(diverse_target, [1, 2], 4, drafter=dspark, plan=Chain(stop_below=0.5))
    assert len(generate(diverse_target, [1, 2], 4, drafter=dspark, plan=Plain()).tokens) == 4  # plain ignores it


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.mark.parametrize("name", list(NEW_PLANS))
def test_greedy_output_is_plain_greedy_output_under_every_new_plan(family, name, diverse_target, prompts):
    plan, drafter = NEW_PLANS[name], trained(family, diverse_target, prompts, k=3)
    if not runs(plan, drafter):
        with pytest.raises(UserError, match="stop_below"):
            generate(diverse_target, prompts[0], MAX_NEW, drafter=drafter, plan=plan)
        return
    drafted = []
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=plan)
        assert out.tokens == argmax_reference(diverse_target, prompt, MAX_NEW), (family, name)
        drafted += out.draft_lengths
    most = plan.length if isinstance(plan, Chain) and plan.length else (plan.nodes if isinstance(plan, Tree) else 3)
    assert max(drafted) <= most and sum(drafted) > 0


@pytest.mark.parametrize("name", list(NEW_PLANS))
def test_sampling_is_lossless_under_every_new_plan(family, name, make_random_llama):
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    plan, drafter = NEW_PLANS[name], build(family, target, k=2)
    if not runs(plan, drafter):
        pytest.skip(f"{family} refuses {name}: the greedy test checks the refusal")
    counts, _ = empirical(target, T1, drafter, runs=500, plan=plan)
    assert_matches(counts, exact_joint(target, PROMPT, T1), target.vocab_size, NEW, (family, name))


def test_a_confidence_stop_drafts_fewer_slots_and_runs_none_past_it(diverse_target, prompts):
    """EAGLE-3 (dynamic): every drafter step after the stop is skipped, so a threshold above every path value runs
    one slot per round and verifies nothing (one token per forward, still the plain output); a middling one drafts
    a varying number of slots, fewer than K on average."""
    drafter = trained("eagle3", diverse_target, prompts, k=3)
    steps = []
    original = drafter.tree_step
    drafter.tree_step = lambda *a: steps.append(1) or original(*a)
    never = generate(diverse_target, prompts[1], MAX_NEW, drafter=drafter, plan=Chain(stop_below=0.999999))
    assert never.tokens == argmax_reference(diverse_target, prompts[1], MAX_NEW)
    assert steps == [] and set(never.draft_lengths) == {0} and never.rounds == len(never.tokens)
    some = generate(diverse_target, prompts[1], MAX_NEW, drafter=drafter, plan=Chain(stop_below=0.5))
    full = generate(diverse_target, prompts[1], MAX_NEW, drafter=drafter, plan=Chain())
    assert some.tokens == full.tokens
    assert set(full.draft_lengths) == {3} and len(set(some.draft_lengths)) > 1  # fewer than K in some rounds


def test_a_shorter_chain_verifies_its_first_slots_only(diverse_target, prompts):
    drafter = trained("dflash", diverse_target, prompts, k=3)
    out = generate(diverse_target, prompts[2], MAX_NEW, drafter=drafter, plan=Chain(length=1))
    assert set(out.draft_lengths) == {1} and out.block_size == 1
    assert max(out.accept_lengths) <= 1
    assert generate(diverse_target, prompts[2], MAX_NEW, drafter=drafter, plan=Chain(length=9)).block_size == 3
    torch.testing.assert_close(torch.tensor(out.tokens), torch.tensor(argmax_reference(diverse_target, prompts[2],
                                                                                       MAX_NEW)))


def test_a_new_mode_is_one_registered_class(diverse_target, prompts):
    """The recipe of docs/trees.md: a frozen dataclass with a kind, its fields and ``resolve``, registered; then
    ``parse_plan`` reads it and ``generate`` runs it, and greedy output stays plain greedy output."""
    from dataclasses import dataclass
    from typing import ClassVar

    from lightning_spec.decoding.plans import Plan, Run, register

    @register
    @dataclass(frozen=True)
    class FirstSlot(Plan):
        """The drafter's first draft only."""

        kind: ClassVar[str] = "first_slot"

        def resolve(self, drafter):
            return Run(drafter, None, 1)

    try:
        drafter = trained("dflash", diverse_target, prompts, k=3)
        out = generate(diverse_target, prompts[2], MAX_NEW, drafter=drafter, plan="first_slot")
        assert parse_plan({"kind": "first_slot"}) == FirstSlot() and set(out.draft_lengths) == {1}
        assert out.tokens == argmax_reference(diverse_target, prompts[2], MAX_NEW)
        with pytest.raises(ValueError, match="decoding plan kind 'first_slot' is registered twice"):
            register(FirstSlot)
    finally:
        PLANS.pop("first_slot")
