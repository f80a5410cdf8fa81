"""Tree decoding checks every tree family shares: greedy tree decoding is the argmax loop (and its rounds left the
first branch, so the cache compaction ran), and the sampled outcomes of tree decoding, for a χ² against the exact
joint (tests/decoding/test_trees.py, drafters/test_d2sd.py, drafters/test_specblock*.py, test_target.py)."""

import contextlib

import torch

from helpers.decoding import MAX_NEW, argmax_reference
from helpers.sampling import NEW, PROMPT
from lightning_spec import SamplingConfig, TreeConfig, generate
from lightning_spec.target import Target

T1 = SamplingConfig(temperature=1.0)


@contextlib.contextmanager
def committed_paths():
    """The node paths the engine commits (``Target.keep``'s argument), round by round."""
    paths: list[list[int]] = []
    keep = Target.keep.__func__

    def spy(cls, cache, past, path):
        paths.append(list(path))
        return keep(cls, cache, past, path)

    Target.keep = classmethod(spy)
    try:
        yield paths
    finally:
        Target.keep = classmethod(keep)


def off_the_first_branch(paths: list[list[int]]) -> int:
    """Rounds whose committed path is not a prefix of the nodes' order: the cache compacts, keeping nodes past a
    branch the path left (the case a wrong compaction breaks while chain-shaped paths still pass)."""
    return sum(path != list(range(len(path))) for path in paths)


def assert_greedy_tree_is_the_argmax_loop(drafter, target, prompts, tree: TreeConfig, off_branch: bool = True) -> None:
    """Greedy tree decoding of every prompt equals the independent argmax loop, within the node budget, some
    drafts were accepted (the tree's paths, not only the target's own tokens), and, with ``off_branch``, some round
    committed a path off the first branch (so the KV compaction ran). Shared by every tree family's tests."""
    accepted = 0
    with committed_paths() as paths:
        for prompt in prompts:
            out = generate(target, prompt, MAX_NEW, drafter=drafter, plan=tree)
            assert out.tokens == argmax_reference(target, prompt, MAX_NEW), prompt
            accepted += sum(out.accept_lengths)
            assert max(out.draft_lengths) <= tree.nodes
    assert accepted > 0
    if off_branch:
        assert off_the_first_branch(paths) > 0, paths


def tree_empirical(target, drafter, runs: int = 800):
    """``helpers.sampling.empirical`` with a tree of 4 nodes, top 3 per node, every round."""
    v = target.vocab_size
    counts = torch.zeros(v**NEW, dtype=torch.float64)
    first = []
    for seed in range(runs):
        out = generate(target, PROMPT, NEW, T1, drafter=drafter, seed=seed, plan=TreeConfig(nodes=4, top_k=3))
        counts[sum(t * v ** (NEW - 1 - j) for j, t in enumerate(out.tokens))] += 1
        first.append(out.accept_lengths[0])
    return counts, first
