"""D²SD (Zhang et al. 2026, arXiv 2606.04446): the variable-prefix drafter and its shared-prefix tree.

- the prefix length is drawn with Pr(l = j) ∝ β^j, j = 0..K-1, per example and reproducibly (``anchor_seed``);
- the training forward with l = 0 is DFlash's forward; with l known tokens it equals a DFlash block whose first l
  mask vectors are the gold tokens' embeddings (a block built by hand); slots t <= l are not predictions;
- ``VPDecay`` is w_t = exp(-(t - l - 1)/τ) for t > l, and ``Objective(CE(), VPDecay)`` is L_VP, both by hand;
- the rejection-boundary posterior and the shared-prefix trie by hand;
- the batched branch pass equals each branch run alone, and the teacher-forced forward at the same prefix;
- the tree is the DFlash trunk plus the branches at the top-S boundaries, under the node and depth caps;
- greedy tree decoding equals the argmax loop with a trained drafter (drafts accepted); sampled tree decoding is
  distributed as the target (χ²); chain decoding is held to the family guarantees in tests/drafters/test_families.py;
- the loss trains; save/load keeps the config and the tree output; offline tree scoring under sampling is refused
  in one sentence.
"""

import math

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference
from helpers.families import FAMILIES, build, trained
from helpers.sampling import PROMPT, assert_matches, chi_square, exact_joint
from helpers.trees import assert_greedy_tree_is_the_argmax_loop, tree_empirical

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import save_drafter
from lightning_spec.drafters import Anchors, D2SDDrafter, DFlashDrafter, DraftOutput
from lightning_spec.drafters.base import seeded_rand
from lightning_spec.drafters.d2sd import boundary_posterior, shared_prefix_tree
from lightning_spec.objectives import CE, ExpDecay, Objective, StepContext, VPDecay

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
K = 3


@pytest.fixture(scope="module")
def family():
    """D2SDDrafter's entry in helpers/families.py (tests/drafters/test_families.py holds it to every guarantee)."""
    assert "d2sd" in FAMILIES
    return "d2sd"


@pytest.fixture(scope="module")
def accepted_drafter(family, diverse_target, prompts):
    return trained(family, diverse_target, prompts, k=K)


def vp(target, k: int = 4, seed: int = 0, **kwargs) -> D2SDDrafter:
    torch.manual_seed(seed)
    drafter = D2SDDrafter(block_size=k, num_layers=1, **kwargs)
    drafter.bind(target)
    return drafter.eval()


def a_batch(target, s: int = 14, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, s), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}


# ------------------------------------------------------------------------------------------ prefix sampling


def test_prefix_lengths_are_beta_geometric_and_reproducible(diverse_target):
    drafter = vp(diverse_target, k=4, prefix_beta=0.5)
    torch.testing.assert_close(drafter.prefix_probs(), torch.tensor([8, 4, 2, 1], dtype=torch.float64) / 15)
    rows, a = 200, 500
    seeds = torch.arange(rows) * 7919 + 3
    batch = {"input_ids": torch.zeros(rows, 2, dtype=torch.long), "anchor_seed": seeds}
    lengths = drafter.sample_prefix(batch, torch.Size([rows, a]))  # (rows, A)
    counts = torch.bincount(lengths.flatten(), minlength=4).double()
    stat, bound = chi_square(counts, drafter.prefix_probs())
    assert stat < bound, (counts.tolist(), stat, bound)
    # per example: the same lengths in another batch, next to other rows, with fewer anchors
    again = drafter.sample_prefix({"input_ids": batch["input_ids"][5:7], "anchor_seed": seeds[[5, 6]]},
                                  torch.Size([2, 40]))
    assert torch.equal(again, lengths[5:7, :40])
    assert not torch.equal(lengths[0], lengths[1])
    anchor_stream = seeded_rand(seeds, a, torch.float64)  # the uniforms that picked the anchors: not reused
    reused = torch.searchsorted(drafter.prefix_probs().cumsum(0), anchor_stream, right=True).clamp(max=3)
    assert (reused != lengths).float().mean() > 0.3
    # without seeds: the generator's draws
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    shape = torch.Size([3, 9])
    assert torch.equal(drafter.sample_prefix({"input_ids": batch["input_ids"]}, shape, g1),
                       drafter.sample_prefix({"input_ids": batch["input_ids"]}, shape, g2))


def test_uniform_beta_and_a_steeper_beta_move_the_lengths(diverse_target):
    """β = 1 is uniform over 0..K-1; a steeper β makes short prefixes more frequent (the same uniforms)."""
    seeds = torch.arange(100)
    batch = {"input_ids": torch.zeros(100, 2, dtype=torch.long), "anchor_seed": seeds}
    flat = vp(diverse_target, k=4, prefix_beta=1.0).sample_prefix(batch, torch.Size([100, 200]))
    steep = vp(diverse_target, k=4, prefix_beta=0.3).sample_prefix(batch, torch.Size([100, 200]))
    stat, bound = chi_square(torch.bincount(flat.flatten(), minlength=4).double(), torch.full((4,), 0.25))
    assert stat < bound
    assert bool((steep <= flat).all()) and (steep == 0).float().mean() > 0.65


# ------------------------------------------------------------------------------------------ training forward


def test_no_prefix_is_the_dflash_forward(diverse_target):
    drafter = vp(diverse_target, context_shortcut=True)
    dflash = DFlashDrafter(block_size=4, num_layers=1, context_shortcut=True)
    dflash.bind(diverse_target)
    dflash.load_state_dict(drafter.state_dict())
    batch = a_batch(diverse_target)
    features = diverse_target(batch["input_ids"], layers=drafter.target_layers, logits=False).features
    anchors = Anchors.all(torch.tensor([[0, 3, 9], [2, 5, 12]]))
    ours = drafter(batch, features, anchors, prefix=torch.zeros(2, 3, dtype=torch.long))
    theirs = dflash(batch, features, anchors)
    assert torch.equal(ours.logits, theirs.logits)
    assert torch.equal(ours.valid, theirs.valid)
    drafter.eval()  # eval mode: l = 0 without asking, the chain ``propose`` drafts
    assert torch.equal(drafter(batch, features, anchors).logits, theirs.logits)


@pytest.mark.parametrize("length", [1, 2, 3])
def test_a_known_prefix_equals_a_hand_built_block(diverse_target, length):
    """With l known tokens, the VP block at an anchor is the DFlash block whose first l mask vectors are the gold
    tokens' embeddings: run a DFlashDrafter with those mask vectors swapped in (the context shortcut on)."""
    drafter = vp(diverse_target, context_shortcut=True)
    batch = a_batch(diverse_target)
    ids = batch["input_ids"]
    features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
    n = 6
    anchors = Anchors.all(torch.tensor([[n], [n]]))
    out = drafter(batch, features, anchors, prefix=torch.tensor([[length], [0]]))
    dflash = DFlashDrafter(block_size=4, num_layers=1, context_shortcut=True)
    dflash.bind(diverse_target)
    state = drafter.state_dict()
    state["mask_embedding"] = state["mask_embedding"].clone()
    state["mask_embedding"][:length] = diverse_target.embed_tokens(ids[0, n + 1 : n + 1 + length])
    dflash.load_state_dict(state)
    by_hand = dflash(batch, features, anchors).logits  # row 0: the hand-built block
    torch.testing.assert_close(out.logits[0], by_hand[0], atol=1e-6, rtol=1e-6)
    slots = torch.arange(1, 5)
    assert out.valid[0, 0].tolist() == (slots > length).tolist()  # the known slots are inputs, not predictions
    assert out.valid[1, 0].all()
    assert out.aux["prefix_length"].tolist() == [[length], [0]]
    assert not torch.allclose(out.logits[0], drafter(batch, features, anchors, torch.zeros(2, 1).long()).logits[0])


def test_training_draws_the_prefix_per_example(diverse_target):
    drafter = vp(diverse_target).train()
    batch = {**a_batch(diverse_target), "anchor_seed": torch.tensor([11, 12])}
    features = diverse_target(batch["input_ids"], layers=drafter.target_layers, logits=False).features
    out = drafter(batch, features)
    want = drafter.sample_prefix(batch, out.anchors.shape)
    assert torch.equal(out.aux["prefix_length"], want) and bool((want > 0).any())
    with pytest.raises(ValueError, match="prefix must be"):
        drafter(batch, features, Anchors.all(torch.tensor([[1], [2]])), prefix=torch.tensor([[4], [0]]))


def test_settings_are_checked_in_one_sentence():
    with pytest.raises(ValueError, match="drafter.prefix_beta must be in"):
        D2SDDrafter(prefix_beta=0.0)
    with pytest.raises(ValueError, match="drafter.branches must be an int >= 0"):
        D2SDDrafter(branches=-1)
    with pytest.raises(ValueError, match="position_weight.tau must be > 0"):
        VPDecay(tau=0.0)


# --------------------------------------------------------------------------------------------- the VP loss


def test_vp_decay_and_the_vp_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, 4, 5, generator=g)
    labels = torch.tensor([[[1, 2, 3, 4], [0, 1, 2, 3]]])
    prefix = torch.tensor([[0, 2]])
    valid = torch.arange(1, 5) > prefix[..., None]  # (1, 2, 4) as D2SDDrafter gives it
    draft = DraftOutput(logits, labels, valid, torch.zeros(1, 2, dtype=torch.long), aux={"prefix_length": prefix})
    tau = 2.0
    weights = VPDecay(tau)(draft, StepContext())
    e = math.exp
    torch.testing.assert_close(weights[0, 0], torch.tensor([1, e(-1 / tau), e(-2 / tau), e(-3 / tau)]))
    torch.testing.assert_close(weights[0, 1], torch.tensor([0, 0, 1, e(-1 / tau)]))
    logp = logits.log_softmax(-1)
    num = den = 0.0
    for a, known in enumerate([0, 2]):
        for t in range(known + 1, 5):
            w = e(-(t - known - 1) / tau)
            num += w * -float(logp[0, a, t - 1, labels[0, a, t - 1]])
            den += w
    terms = Objective(CE(), VPDecay(tau))(draft)
    assert float(terms.value) == pytest.approx(num / den, rel=1e-6)
    plain = DraftOutput(logits, labels, torch.ones_like(valid), torch.zeros(1, 2, dtype=torch.long))
    none = StepContext()
    assert torch.equal(VPDecay(tau)(plain, none), ExpDecay(tau)(plain, none))  # no known prefix: the DFlash decay


def test_the_vp_loss_trains(diverse_target, prompts):
    drafter = vp(diverse_target, k=K).train()
    rows = [p + argmax_reference(diverse_target, p, MAX_NEW) for p in prompts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(p) : len(row)] = True
    batch = {"input_ids": ids, "loss_mask": mask, "anchor_seed": torch.arange(len(rows))}  # the same blocks each step
    features = diverse_target(ids, layers=drafter.target_layers, logits=False).features
    objective = Objective(CE(), VPDecay(2.0))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        draft = drafter(batch, features)
        assert bool((draft.aux["prefix_length"] > 0).any())
        terms = objective(draft)
        opt.zero_grad()
        (terms.num / terms.den).backward()
        opt.step()
        losses.append(float(terms.value))
    assert losses[-1] < 0.7 * losses[0], losses


# --------------------------------------------------------------------------------------------- the D²SD tree


def test_boundary_posterior_by_hand():
    c = torch.tensor([0.9, 0.5, 0.8, 0.6], dtype=torch.float64)
    want = [1 - 0.9, 0.9 * (1 - 0.5), 0.9 * 0.5 * (1 - 0.8), 0.9 * 0.5 * 0.8 * (1 - 0.6)]
    torch.testing.assert_close(boundary_posterior(c), torch.tensor(want, dtype=torch.float64))


def test_shared_prefix_tree_by_hand():
    trunk, b1, b0 = [5, 6, 7, 8], [5, 9, 10, 11], [5, 12, 13, 14]  # b0 re-drafts d_1 as 5 again: it merges
    tokens, parents = shared_prefix_tree([trunk, b1, b0], nodes=20)
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert parents.tolist() == [0, 1, 2, 3, 1, 5, 6, 1, 8, 9]
    tokens, parents = shared_prefix_tree([trunk, [5, 6, 3]], nodes=20)  # a branch under trunk node 2
    assert tokens.tolist() == [5, 6, 7, 8, 3] and parents.tolist() == [0, 1, 2, 3, 2]
    tokens, parents = shared_prefix_tree([trunk, b1, b0], nodes=6)  # the budget ends inside the first branch
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10] and parents.tolist() == [0, 1, 2, 3, 1, 5]
    assert shared_prefix_tree([trunk, trunk], nodes=20)[0].tolist() == trunk  # a duplicate path adds nothing


def a_state(drafter, target, n: int = 7, seed: int = 0):
    ids = a_batch(target, seed=seed)["input_ids"][:1]
    features = target(ids[:, :n], layers=drafter.target_layers, logits=False).features
    return drafter.begin(features, ids[:, :n]), ids, features


@pytest.mark.parametrize("shortcut", [False, True])
def test_the_batched_branch_pass_equals_each_branch_alone(diverse_target, shortcut):
    drafter = vp(diverse_target, k=4, seed=1, context_shortcut=shortcut)
    n = 7
    state, ids, _ = a_state(drafter, diverse_target, n)
    anchor, draft = ids[0, n : n + 1], ids[0, n + 1 : n + 5]  # the gold block as the "draft"
    lengths = torch.tensor([2, 0, 3, 1])
    together = drafter.branch_logits(state, anchor, draft, lengths)  # (4, K, Vd)
    for b, length in enumerate(lengths.tolist()):
        alone = drafter.branch_logits(state, anchor, draft, torch.tensor([length]))[0]
        torch.testing.assert_close(together[b], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1], drafter.position_logits(state, anchor), atol=1e-5, rtol=1e-5)
    # the decoding pass drafts what the teacher-forced forward trains, at every prefix length
    full = diverse_target(ids, layers=drafter.target_layers, logits=False).features
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    for b, length in enumerate(lengths.tolist()):
        out = drafter(batch, full, Anchors.all(torch.tensor([[n]])), prefix=torch.tensor([[length]]))
        torch.testing.assert_close(together[b], out.logits[0, 0], atol=1e-5, rtol=1e-5)


def test_a_one_token_prompt_has_an_empty_context(diverse_target):
    drafter = vp(diverse_target, k=3)
    state = drafter.begin(torch.zeros(1, 0, len(drafter.target_layers) * diverse_target.hidden_size),
                          torch.zeros(1, 0, dtype=torch.long))
    logits = drafter.branch_logits(state, torch.tensor([4]), torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    torch.testing.assert_close(logits[0], drafter.position_logits(state, torch.tensor([4])), atol=1e-5, rtol=1e-5)


def paths_of(proposal) -> list[tuple[int, ...]]:
    paths = [()]
    for tok, parent in zip(proposal.tokens.tolist(), proposal.parents.tolist()):
        paths.append(paths[parent] + (tok,))
    return paths[1:]


@pytest.mark.parametrize("tree", [TreeConfig(nodes=64), TreeConfig(nodes=7), TreeConfig(nodes=64, depth=3)])
def test_the_tree_is_the_trunk_and_the_branches_at_the_likeliest_boundaries(diverse_target, tree):
    drafter = vp(diverse_target, k=5, seed=3, branches=3)
    with torch.no_grad():  # weights far from the init, so that known tokens change the re-drafts
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    n = 7
    state, ids, _ = a_state(drafter, diverse_target, n)
    anchor = ids[0, n : n + 1]
    proposal = drafter.propose_tree(state, anchor, GREEDY, tree)
    q = drafter.position_logits(state, anchor).softmax(-1)  # (K, Vd)
    depth = tree.depth or 5
    trunk = q.argmax(-1).tolist()[:depth]
    c = q.max(-1).values.tolist()
    r = [math.prod(c[:i]) * (1 - c[i]) for i in range(depth)]
    boundaries = sorted(range(depth), key=lambda i: -r[i])[:3]
    redraft = drafter.branch_logits(state, anchor, torch.tensor(q.argmax(-1).tolist()), torch.tensor(boundaries))
    want = [tuple(trunk)] + [tuple(trunk[:i] + redraft[b].argmax(-1).tolist()[i:depth]) for b, i in
                             enumerate(boundaries)]
    got = paths_of(proposal)
    assert got[: len(trunk[: tree.nodes])] == [tuple(trunk[:d]) for d in range(1, min(depth, tree.nodes) + 1)]
    assert proposal.parents.tolist()[: min(depth, tree.nodes)] == list(range(min(depth, tree.nodes)))
    prefixes = {p[:d] for p in want for d in range(1, len(p) + 1)}
    assert set(got) <= prefixes and len(got) == len(set(got))  # every node is on a wanted path, none twice
    assert max(map(len, got)) <= depth
    if tree.nodes >= len(prefixes):
        assert set(got) == prefixes  # every branch whole, hanging under trunk node i at depth i
        assert len(prefixes) > depth + 2  # the branches re-drafted other tokens than the trunk's (the test has teeth)
    else:
        assert len(got) == tree.nodes


def test_offline_tree_scoring_under_sampling_is_refused_in_one_sentence(diverse_target):
    """Greedy D²SD trees are replayed offline (tests/decoding/test_trees.py); sampled ones have no exact offline
    score."""
    drafter = vp(diverse_target, k=3)
    with pytest.raises(ValueError, match="greedy decoding only.*evaluate --mode online"):
        offline_rounds(diverse_target, drafter, [([1, 2], [3, 4])], SamplingConfig(temperature=1.0), tree={"nodes": 4})


def test_distinct_branches_replace_the_trunk_token_at_their_boundary(diverse_target):
    """``distinct_branches``: branch i's slot i + 1 is the best token other than the trunk's d_{i+1}, so every branch
    adds a sibling of the trunk at depth i + 1 (none merges into the trunk there), and its later slots are the
    re-draft's as before."""
    drafter = vp(diverse_target, k=4, seed=3, branches=4, distinct_branches=True)
    n = 7
    state, ids, _ = a_state(drafter, diverse_target, n)
    anchor = ids[0, n : n + 1]
    q = drafter.position_logits(state, anchor).softmax(-1)  # (K, Vd)
    trunk = q.argmax(-1)
    redraft = drafter.branch_logits(state, anchor, trunk, torch.arange(4)).softmax(-1)  # (4, K, Vd) boundaries 0..3
    got = set(paths_of(drafter.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=64))))
    for i in range(4):
        alternative = redraft[i, i].clone()
        alternative[trunk[i]] = -1
        later = tuple(redraft[i, i + 1 :].argmax(-1).tolist())
        branch = tuple(trunk[:i].tolist()) + (int(alternative.argmax()),) + later
        assert branch in got and branch[i] != int(trunk[i])
    assert len(got) == 4 + sum(4 - i for i in range(4))  # the trunk and four branches, no node shared past a boundary


# ---------------------------------------------------------------------------------------- decoding guarantees


@pytest.mark.parametrize("tree", [TreeConfig(nodes=12), TreeConfig(nodes=5, depth=2)])
@pytest.mark.parametrize("distinct", [False, True], ids=["paper", "distinct"])
def test_greedy_tree_decoding_equals_the_argmax_loop(accepted_drafter, diverse_target, prompts, tree, distinct):
    accepted_drafter.distinct_branches = distinct
    try:
        # the paper's tree merges every re-draft into the trunk (module docstring): its paths stay on the first branch
        assert_greedy_tree_is_the_argmax_loop(accepted_drafter, diverse_target, prompts, tree, off_branch=distinct)
    finally:
        accepted_drafter.distinct_branches = False


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)


def test_sampled_tree_decoding_is_lossless(family, small_target):
    drafter = build(family, small_target, k=2)
    counts, first = tree_empirical(small_target, drafter)
    assert_matches(counts, exact_joint(small_target, PROMPT, T1), small_target.vocab_size, 3, "d2sd tree")
    assert any(a == 0 for a in first) and any(a > 0 for a in first), first[:50]


def test_save_and_load_round_trip(accepted_drafter, diverse_target, prompts, tmp_path):
    accepted_drafter.branches = 2  # non-default settings must come back
    accepted_drafter.distinct_branches = True
    try:
        folder = save_drafter(accepted_drafter, tmp_path / "drafter", "random")
        loaded = load_drafter(folder, target=diverse_target)
        assert type(loaded) is D2SDDrafter
        assert loaded.config_dict() == accepted_drafter.config_dict()
        assert loaded.config_dict()["branches"] == 2 and loaded.config_dict()["prefix_beta"] == 0.8
        assert loaded.distinct_branches is True
        for (key, a), (_, b) in zip(loaded.state_dict().items(), accepted_drafter.state_dict().items()):
            assert torch.equal(a, b), key
        tree = TreeConfig(nodes=8)
        for prompt in prompts[:2]:
            assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded, plan=tree).tokens == generate(
                diverse_target, prompt, MAX_NEW, drafter=accepted_drafter, plan=tree
            ).tokens
    finally:
        accepted_drafter.branches = 4
        accepted_drafter.distinct_branches = False
