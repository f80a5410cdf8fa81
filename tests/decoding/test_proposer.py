"""The proposal contract (``decoding/proposer.py``): every proposer (the nine families, n-gram lookup and its
trie) is a ``Proposer`` declaring ``tree_growth`` and ``drafting``, and callers read those declarations, never a
proposer's class or an exception. The greedy, sampling and offline guarantees of each kind are in
``test_trees.py`` and ``test_ngram.py``; this file holds the contract itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.families import FAMILIES, build

from lightning_spec import TreeConfig, UserError
from lightning_spec.decoding.auto import candidates
from lightning_spec.decoding.ngram import NgramDrafter, as_proposer
from lightning_spec.decoding.plans import Tree
from lightning_spec.decoding.proposer import Drafting, Proposer, TreeGrowth, chosen_rounds, evaluating
from lightning_spec.drafters import DFlyDrafter
from lightning_spec.evaluation.offline import replayed

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_spec"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_a_proposer_with_declared_growth_and_drafting(name, diverse_target):
    drafter = build(name, diverse_target, k=3)
    assert isinstance(drafter, Proposer)
    assert isinstance(drafter.tree_growth, TreeGrowth) and drafter.drafting is Drafting.DRAWN
    if drafter.tree_growth is TreeGrowth.BEST_FIRST:  # its tree is built over position_logits
        assert drafter.parallel_slots
    trees = [p for p in candidates(drafter) if isinstance(p, Tree)]
    assert bool(trees) == drafter.grows_trees  # decoding auto offers trees by the declaration alone
    if drafter.grows_trees:
        drafter.check_tree()
    else:
        with pytest.raises(UserError, match="decode it as a chain"):
            drafter.check_tree()


def test_ngram_lookup_is_a_proposer_that_imitates_no_module():
    lookup = as_proposer("ngram")
    assert isinstance(lookup, NgramDrafter) and isinstance(lookup, Proposer)
    assert (lookup.tree_growth, lookup.drafting) == (TreeGrowth.OWN, Drafting.CHOSEN)
    assert lookup.target_layers == []
    for module_method in ("eval", "train", "training", "parameters", "vocab_size"):  # not an nn.Module, nor posing
        assert not hasattr(lookup, module_method), module_method
    with evaluating(lookup) as same:  # the callers' eval-mode block takes it as it is
        assert same is lookup


def test_evaluating_restores_a_drafters_training_mode(diverse_target):
    drafter = build("dflash", diverse_target, k=3).train()
    with evaluating(drafter):
        assert not drafter.training
    assert drafter.training


def test_as_proposer_refuses_what_is_not_one_in_one_sentence():
    assert as_proposer(None) is None
    lookup = NgramDrafter(block_size=4)
    assert as_proposer(lookup) is lookup
    for bad in ("lookup", object()):
        with pytest.raises(UserError, match="'ngram' \\(prompt lookup\\) or None"):
            as_proposer(bad)


@pytest.mark.parametrize("hidden_correction,growth", [(True, TreeGrowth.NONE), (False, TreeGrowth.BEST_FIRST)])
def test_a_declaration_that_depends_on_the_instance_follows_it(hidden_correction, growth):
    """DFly's slots read the token drafted before them only with its correction head: without it the block is
    drafted in parallel and grows best-first trees."""
    drafter = DFlyDrafter(3, hidden_correction=hidden_correction)
    assert drafter.tree_growth is growth and drafter.parallel_slots is (growth is TreeGrowth.BEST_FIRST)


def test_the_offline_evaluator_reads_the_declarations(diverse_target):
    tree, merged = TreeConfig(nodes=4, top_k=2), TreeConfig(nodes=4, top_k=2, ngram=2)
    dflash, eagle = build("dflash", diverse_target, k=3), build("eagle3", diverse_target, k=3)
    lookup = NgramDrafter(block_size=3)
    # scored from one teacher-forced forward: chains of drawn drafts and best-first trees
    assert not replayed(dflash, None) and not replayed(dflash, tree) and not replayed(eagle, None)
    # replayed: n-gram rounds, trees grown from the drafter's own drafts, trees with n-gram nodes merged in
    assert replayed(lookup, None) and replayed(eagle, tree) and replayed(dflash, merged)
    # exact under sampling: rounds whose every node is chosen
    assert chosen_rounds(lookup, None) and chosen_rounds(dflash, tree) and chosen_rounds(dflash, merged)
    assert not chosen_rounds(dflash, None) and not chosen_rounds(eagle, tree)


def _violations(path: Path) -> list[str]:
    """``isinstance(x, NgramDrafter)``, ``x == "ngram"`` on a drafter, or an ``except`` around ``check_tree()``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if "NgramDrafter" in ast.unparse(node.args[1]):
                found.append(f"{path.name}:{node.lineno} isinstance on NgramDrafter")
        if isinstance(node, ast.Compare) and "drafter" in ast.unparse(node.left):
            if any(isinstance(c, ast.Constant) and c.value == "ngram" for c in node.comparators):
                found.append(f"{path.name}:{node.lineno} compares a drafter with 'ngram'")
        if isinstance(node, ast.Try) and node.handlers:
            if any("check_tree" in ast.unparse(stmt) for stmt in node.body):
                found.append(f"{path.name}:{node.lineno} catches check_tree() to learn a capability")
    return found


def test_no_caller_special_cases_ngram_lookup_or_catches_a_capability():
    found = [v for path in sorted(PACKAGE.rglob("*.py")) if path.name != "ngram.py" for v in _violations(path)]
    assert not found, found


def test_the_scan_finds_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("try:\n    d.check_tree()\nexcept ValueError:\n    pass\n"
                   "if isinstance(drafter, NgramDrafter):\n    pass\nif drafter == 'ngram':\n    pass\n")
    assert len(_violations(bad)) == 3
