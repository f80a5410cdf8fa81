"""N-gram candidates (``decoding/ngram.py``): prompt-and-output lookup alone and merged into a family's tree.

- the lookup ranks longer suffix matches first, then the most recent occurrence, and skips continuations that add
  nothing to a trie; ``merge`` keeps every tree valid (parents first, distinct siblings) within its node budget and
  its budget of new nodes, and gives way from the family's least valuable nodes;
- the family guarantees with n-grams alone (chain and trie) and merged into a best-first (DFlash) and a dynamic
  (EAGLE-3) tree: greedy decoding equals the independent argmax loop with drafts accepted, sampled decoding is
  distributed as the target (χ² against the enumerated joint), and the offline replay gives every real run's
  rounds exactly, sampled runs included where the tree is chosen (n-grams alone, best-first + n-grams);
- settings a user can get wrong are refused in one sentence.
"""

import random

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference, random_prompts
from helpers.families import trained
from helpers.sampling import assert_matches, exact_joint

from lightning_spec import SamplingConfig, TreeConfig, generate, offline_rounds
from lightning_spec.decoding.ngram import NgramDrafter, lookup, merge

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
REPEATING = [1, 5, 3, 1, 5, 3, 6, 1, 5]  # a prompt whose suffix recurs, so lookups draft from the first round


# ------------------------------------------------------------------------------------------------ the parts
def test_lookup_prefers_longer_matches_then_recent_ones():
    ctx = [7, 1, 2, 3, 9, 1, 2, 4, 5, 2, 6, 1, 2]
    # suffix [1, 2] occurs at 5 (most recent) and 1; the 1-gram [2] also at 9, but longer matches come first
    assert lookup(ctx, 3, count=3, max_ngram=2) == [[4, 5, 2], [3, 9, 1], [6, 1, 2]]
    assert lookup(ctx, 2, count=1, max_ngram=1) == [[6, 1]]  # the 1-gram [2]: its most recent earlier occurrence
    assert lookup(ctx, 3, count=3, min_ngram=3) == []  # [6, 1, 2] never occurred before
    assert lookup([4, 4, 4, 4], 5, count=3) == [[4, 4, 4]]  # recent matches cut short grow into the oldest one
    assert lookup([3], 4) == [] and lookup([1, 2, 1], 0) == []


def valid_tree(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Asserts parents come first and siblings differ; returns every root path as a token tuple."""
    paths = {0: ()}
    seen = set()
    for i, (tok, parent) in enumerate(zip(tokens, parents), start=1):
        assert 0 <= parent < i
        assert (parent, tok) not in seen, "two siblings draft the same token"
        seen.add((parent, tok))
        paths[i] = paths[parent] + (tok,)
    return set(paths.values())


@pytest.mark.parametrize("seed", range(40))
def test_merge_keeps_a_valid_tree_in_budget_with_the_paths_and_the_most_valuable_family_nodes(seed):
    rng = random.Random(seed)
    tokens, parents = [], []
    for i in range(rng.randint(0, 12)):  # a random family tree, distinct siblings
        parent = rng.randint(0, i)
        tok = rng.choice([t for t in range(6) if (parent, t) not in set(zip(parents, tokens))] or [None])
        if tok is not None:
            tokens.append(tok)
            parents.append(parent)
    family_paths = valid_tree(tokens, parents)
    paths = [[rng.randint(0, 5) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 3))]
    budget, max_new = rng.randint(1, 14), rng.randint(0, 8)
    out_tokens, out_parents = merge(tokens, parents, paths, budget, max_new)
    merged = valid_tree(out_tokens, out_parents)
    assert len(out_tokens) <= budget
    assert len(merged - family_paths) <= max_new
    first = paths[0][: min(budget, max_new + len(paths[0]))]
    # the first path is in the tree as far as the budgets allow: each of its prefixes is either kept or was new
    for n in range(1, len(first) + 1):
        if tuple(first[:n]) not in merged:
            assert len(out_tokens) == budget or len(merged - family_paths) == max_new
            break
    # the family's nodes off every path give way from the last one added: the survivors are the first ones
    off_paths = [i for i in range(1, len(tokens) + 1)
                 if not any(_path(tokens, parents, i) == tuple(p[: len(_path(tokens, parents, i))]) for p in paths)]
    kept = [i for i in off_paths if _path(tokens, parents, i) in merged]
    assert kept == off_paths[: len(kept)]


def _path(tokens, parents, node):
    out = []
    while node:
        out.append(tokens[node - 1])
        node = parents[node - 1]
    return tuple(reversed(out))


def test_settings_are_refused_in_one_sentence(diverse_target):
    with pytest.raises(ValueError, match="'ngram' \\(prompt lookup\\) or None"):
        generate(diverse_target, [1, 2, 3], 4, drafter="lookup")
    with pytest.raises(ValueError, match="tree.ngram must be an int in 0..tree.nodes"):
        TreeConfig(nodes=4, ngram=5)
    with pytest.raises(ValueError, match="min_ngram .* must be <= max_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="its fields are nodes, top_k, depth, ngram and stop_below"):
        TreeConfig.coerce({"ngrams": 3})


# -------------------------------------------------------------------------------- the family guarantees
@pytest.fixture(scope="module")
def prompts(diverse_target):
    return random_prompts(diverse_target.vocab_size) + [REPEATING]


# (drafter, tree) settings: n-grams alone as a chain and as a trie, merged into a best-first and a dynamic tree
SETTINGS = {
    "ngram chain": ("ngram", None),
    "ngram trie": ("ngram", TreeConfig(nodes=8, top_k=3)),
    "dflash + ngram": ("dflash", TreeConfig(nodes=8, top_k=3, ngram=4)),
    "eagle3 + ngram": ("eagle3", TreeConfig(nodes=8, top_k=3, ngram=4)),
}
CHOSEN = ["ngram chain", "ngram trie", "dflash + ngram"]  # every node chosen: replayed exactly under sampling


def drafter_for(name, target, prompts, steps=3):
    family, tree = SETTINGS[name]
    # a barely trained family leaves room for the n-grams to add accepted tokens
    drafter = NgramDrafter(block_size=4) if family == "ngram" else trained(family, target, prompts, k=3, steps=steps)
    return drafter, tree


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_decoding_equals_the_argmax_loop(name, diverse_target, prompts):
    drafter, tree = drafter_for(name, diverse_target, prompts)
    accepted = 0
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=tree)
        assert out.tokens == argmax_reference(diverse_target, prompt, MAX_NEW), (name, prompt)
        accepted += sum(out.accept_lengths)
        assert max(out.draft_lengths) <= (tree.nodes if tree else drafter.block_size)
    assert accepted > 0


def test_merged_ngrams_add_accepted_tokens_to_the_familys_tree(diverse_target, prompts):
    """The same barely trained DFlash tree, with and without n-gram nodes: the merge commits more per round on
    text that repeats (a random target's greedy output loops)."""
    drafter, tree = drafter_for("dflash + ngram", diverse_target, prompts)
    plain_tree = TreeConfig(nodes=tree.nodes, top_k=tree.top_k)
    with_ngrams = sum(generate(diverse_target, p, MAX_NEW, drafter=drafter, plan=tree).rounds for p in prompts)
    without = sum(generate(diverse_target, p, MAX_NEW, drafter=drafter, plan=plain_tree).rounds for p in prompts)
    assert with_ngrams < without


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_decoding_is_lossless(name, make_random_llama):
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    # the prompt restates its start after the target's own continuation of it: the lookup drafts that continuation,
    # which the target often (not always) samples again
    start = [1, 5, 3]
    prompt = start + argmax_reference(target, start, 4) + start
    drafter, tree = drafter_for(name, target, [prompt])
    new, v = 3, target.vocab_size
    counts = torch.zeros(v**new, dtype=torch.float64)
    accepted = []
    for seed in range(800):
        out = generate(target, prompt, new, T1, drafter=drafter, seed=seed, plan=tree)
        counts[sum(t * v ** (new - 1 - j) for j, t in enumerate(out.tokens))] += 1
        accepted.append(out.accept_lengths[0])
    assert_matches(counts, exact_joint(target, prompt, T1, new), v, new, name)
    assert any(a == 0 for a in accepted) and any(a > 0 for a in accepted), accepted[:50]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_offline_rounds_equal_the_engines_on_every_output(name, diverse_target, prompts):
    drafter, tree = drafter_for(name, diverse_target, prompts)
    for sampling in [GREEDY, T1] if name in CHOSEN else [GREEDY]:
        pairs, real = [], []
        for i, prompt in enumerate(prompts * (1 if sampling.greedy else 3)):
            out = generate(diverse_target, prompt, MAX_NEW, sampling, drafter=drafter, seed=i, plan=tree)
            pairs.append((prompt, out.tokens))
            real.append(float(out.rounds))
        assert sum(real) < sum(len(tokens) for _, tokens in pairs), (name, sampling)  # drafts were accepted
        assert offline_rounds(diverse_target, drafter, pairs, sampling, tree=tree).tolist() == real, (name, sampling)


def test_ngram_alone_is_scored_offline_by_name_without_features(diverse_target, prompts):
    pairs = [(p, argmax_reference(diverse_target, p, MAX_NEW)) for p in prompts]
    by_name = offline_rounds(diverse_target, "ngram", pairs, GREEDY)
    real = [float(generate(diverse_target, p, MAX_NEW, drafter="ngram").rounds) for p in prompts]
    assert by_name.tolist() == real


def test_a_merged_dynamic_tree_is_refused_offline_under_sampling(diverse_target, prompts):
    drafter, tree = drafter_for("eagle3 + ngram", diverse_target, prompts)
    with pytest.raises(ValueError, match="greedy decoding only"):
        offline_rounds(diverse_target, drafter, [([1, 2], [3, 4])], T1, tree=tree)


@pytest.mark.parametrize("family", ["eagle3", "mtp", "specblock"])
def test_a_merged_tree_commits_the_verified_tokens_into_the_drafters_own_state(family, diverse_target, prompts):
    """Drafters that keep their own entries of the committed tokens (EAGLE-3, MTP, SpecBlock) re-commit the accepted
    path's tokens after each round. With n-gram nodes merged in, the verified tree is not the one the drafter grew
    (``merge`` drops and renumbers nodes): the drafter must commit the verified tree's tokens, so its entries are the
    committed text, token for token (before, it read its own tree's numbering: wrong tokens, or an IndexError)."""
    drafter = trained(family, diverse_target, prompts, k=3, steps=1)  # its tree differs from the n-grams'
    tree = TreeConfig(nodes=8, top_k=2, ngram=6)
    committed: list[int] = []
    commit = drafter._commit

    def spy(state, ids, features):
        committed.extend(ids[0].tolist())
        return commit(state, ids, features)

    drafter._commit = spy
    for prompt in prompts:
        committed.clear()
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=tree)
        text = prompt + out.tokens
        assert len(committed) > len(prompt) and committed == text[: len(committed)], (family, prompt)


def test_a_merged_ngram_trie_commits_the_verified_tokens(diverse_target, prompts):
    """The same for n-gram lookup grown as a trie with n-gram candidates merged in: its history is the text."""
    drafter, tree = NgramDrafter(block_size=4), TreeConfig(nodes=8, top_k=3, ngram=4)
    states = []
    begin = drafter.begin
    drafter.begin = lambda *a: states.append(begin(*a)) or states[-1]
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=drafter, plan=tree)
        history = states[-1].history
        assert len(history) > len(prompt) and history == (prompt + out.tokens)[: len(history)], prompt
