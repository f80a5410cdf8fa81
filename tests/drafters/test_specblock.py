"""SpecBlock (Shi et al. 2026, arXiv 2605.07243), one block: fused slot inputs, the layer-wise shift, the rank head
and its ordinal loss, and the rank-sized tree. Block TTT and trees by block expansion: test_specblock_ttt.py.

- the fused inputs and the layer-wise shift by hand; the slot mask (a later slot's query never reaches an earlier
  slot; a later position never reaches an earlier one);
- the training forward at an anchor equals the block ``propose`` drafts on the decoding cache;
- the 15 rank features and the rank labels by hand; ``RankOrdinal`` by hand (kernel, distance weight, frequency
  reweighting, first-mistake cut); the SpecBlock mixture trains the drafter and the rank head;
- the tree from given rank classes by hand; greedy tree decoding equals the argmax loop with a trained drafter;
  sampled tree decoding is distributed as the target (χ²); chain decoding is held to the family guarantees in
  tests/drafters/test_families.py (whose SpecBlock runs two blocks); save/load; one-sentence errors.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.decoding import MAX_NEW, argmax_reference
from helpers.families import FAMILIES, build, trained
from helpers.sampling import PROMPT, assert_matches, exact_joint
from helpers.specblock import a_batch, features_of, sb
from helpers.trees import assert_greedy_tree_is_the_argmax_loop, tree_empirical

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter
from lightning_spec.checkpoint import save_drafter
from lightning_spec.drafters import Anchors, DraftOutput, SpecBlockDrafter
from lightning_spec.drafters.specblock_rank import rank_features, rank_labels, rank_tree
from lightning_spec.objectives import (
    KL,
    Geometric,
    Mixture,
    Objective,
    PositionProduct,
    RankOrdinal,
    StepContext,
    ValidPrefix,
)
from lightning_spec.objectives.rank import ordinal_targets

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
K = 3


@pytest.fixture(scope="module")
def family():
    """SpecBlockDrafter's entry in helpers/families.py (tests/drafters/test_families.py holds it to every guarantee)."""
    assert "specblock" in FAMILIES
    return "specblock"


# ------------------------------------------------------------------------------------------ architecture


def test_fused_inputs_and_the_layer_wise_shift_by_hand(diverse_target):
    d = sb(diverse_target, k=3, layers=2)
    batch = a_batch(diverse_target)
    ids = batch["input_ids"]
    feats = features_of(diverse_target, d, ids)  # (N, S, F)

    def norm(x, mod):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.eps) * mod.weight

    i = 5
    g = feats[0, i - 1]  # the feature of the position before (it predicted x_i)
    cond = norm(g @ d.condition_proj.weight.t(), d.condition_norm)
    emb = norm(diverse_target.embed_tokens(ids[0, i]), d.embed_norm)
    want = torch.stack([torch.cat([cond, emb, norm(d.query[k], d.query_norm)]) @ d.fuse.weight.t() for k in range(3)])
    before = F.pad(feats, (0, 0, 1, 0))[:, :-1]
    got = d.inputs(before, ids)  # (N, S, K, H)
    torch.testing.assert_close(got[0, i], want, atol=1e-5, rtol=1e-5)
    zero = d.inputs(before, ids)[0, 0]  # position 0: no feature before it, the condition part is RMSNorm(0) = 0
    torch.testing.assert_close(zero, torch.stack([torch.cat([0 * cond, norm(diverse_target.embed_tokens(ids[0, 0]),
                               d.embed_norm), norm(d.query[k], d.query_norm)]) @ d.fuse.weight.t() for k in range(3)]),
                               atol=1e-5, rtol=1e-5)
    # the shift: W [h ; h with slot k - 1 in slot k, slot 0 kept]
    h = torch.randn(1, 2, 3, diverse_target.hidden_size)
    w = d.shifts[0].weight
    for k, src in [(0, 0), (1, 0), (2, 1)]:
        torch.testing.assert_close(d.shift(1, h)[0, 1, k], torch.cat([h[0, 1, k], h[0, 1, src]]) @ w.t())


def test_the_shift_starts_as_the_identity(diverse_target):
    torch.manual_seed(0)
    d = SpecBlockDrafter(block_size=3, num_layers=2)
    d.bind(diverse_target)
    h = torch.randn(2, 4, 3, diverse_target.hidden_size)
    torch.testing.assert_close(d.shift(1, h), h)


def test_a_slot_never_sees_a_later_slot_or_a_later_position(diverse_target):
    d = sb(diverse_target, k=4, layers=2)
    batch = a_batch(diverse_target)
    feats = features_of(diverse_target, d, batch["input_ids"])
    anchors = Anchors.all(torch.tensor([[2, 6, 9], [1, 4, 10]]))
    base = d(batch, feats, anchors).logits  # (N, A, K, Vd)
    with torch.no_grad():
        d.query[2].add_(1.0)  # slot 2's query vector changes
    moved = d(batch, feats, anchors).logits
    torch.testing.assert_close(moved[:, :, :2], base[:, :, :2], atol=1e-6, rtol=1e-6)  # slots 0, 1 untouched
    assert (moved[:, :, 2:] - base[:, :, 2:]).abs().max() > 1e-3  # slots 2, 3 read it (the shift and attention)
    # a later position's token and feature never reach an earlier block
    later = {**batch, "input_ids": batch["input_ids"].clone()}
    later["input_ids"][:, 7:] = (later["input_ids"][:, 7:] + 1) % diverse_target.vocab_size
    feats2 = feats.clone()
    feats2[:, 6:] += 1.0
    out = d(later, feats2, Anchors.all(torch.tensor([[2, 6], [1, 4]])))
    torch.testing.assert_close(out.logits, d(batch, feats, Anchors.all(torch.tensor([[2, 6], [1, 4]]))).logits,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 6])
def test_the_training_forward_is_what_propose_drafts(diverse_target, n):
    """Teacher forcing given acceptance: the block at anchor n of the training forward is the block drafted on the
    decoding cache of positions < n, whether the cache came from the prefill or from extend rounds."""
    d = sb(diverse_target, k=3)
    batch = a_batch(diverse_target)
    ids = batch["input_ids"][:1]
    feats = features_of(diverse_target, d, ids)
    out = d({"input_ids": ids, "loss_mask": batch["loss_mask"][:1]}, feats, Anchors.all(torch.tensor([[n]])))
    state = d.begin(feats[:, :n], ids[:, :n])
    block = d.first_block(state, ids[0, n : n + 1]).normed[0]  # (K, H)
    torch.testing.assert_close(d.head(block), out.logits[0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d.rank_logits(block, out.logits[0, 0]), out.materialize().aux["rank"][0, 0], atol=1e-5,
                               rtol=1e-5)
    # the same cache grown by extend: a round commits the anchor and two accepted drafts
    if n >= 3:
        state = d.begin(feats[:, : n - 3], ids[:, : n - 3])
        d.propose(state, ids[0, n - 3 : n - 2], GREEDY)
        state.nodes[1:3] = [ids[0, n - 2 : n - 1], ids[0, n - 1 : n]]  # as if the drafts were the data's tokens
        verified = torch.cat([feats[:, n - 3 : n], feats[:, :1]], 1)  # (1, 4, F): the last node is rejected
        d.extend(state, verified, [0, 1, 2])
        assert state.length == n
        block = d.first_block(state, ids[0, n : n + 1]).normed[0]
        torch.testing.assert_close(d.head(block), out.logits[0, 0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ rank head and loss


def test_rank_features_by_hand():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0, -1.0, 0.5] + [-50.0] * 26)  # Vd = 32
    logp = logits.log_softmax(-1).clamp(min=-30)
    top = logp.sort(descending=True).values[:20]
    p20 = top.exp() / top.exp().sum()
    want = torch.cat([top[:10], torch.stack([top[0] - top[1], top[0] - top[2], top[0] - top[4]]), top[:1].exp(),
                      -(p20 * p20.log()).sum()[None]])
    torch.testing.assert_close(rank_features(logits), want)
    small = rank_features(torch.tensor([2.0, 1.0, 0.0]))  # Vd = 3 < 20: padded with the floor
    assert small.shape == (15,) and small[3:10].eq(-30).all() and torch.isfinite(small).all()


def test_rank_labels_by_hand():
    draft = torch.tensor([[9.0, 8, 7, 6, 5, 4, 3, 2, 1, 0, -1, -2]])  # token j has rank j + 1
    for star, cls in [(0, 0), (1, 1), (3, 1), (4, 2), (9, 2), (10, 3), (11, 3)]:
        target = torch.full((1, 12), -5.0)
        target[0, star] = 5.0
        assert rank_labels(draft, target).item() == cls, star


def test_ordinal_targets_by_hand():
    y = ordinal_targets(torch.tensor([1]), 4)[0]
    raw = torch.tensor([1 / (1 + 1 + 1) ** 2, 1.0, 1 / (1 + 1) ** 2, 1 / (1 + 2) ** 2])  # c = 0 (below t) costs double
    torch.testing.assert_close(y, raw / raw.sum())


def test_the_rank_loss_by_hand():
    torch.manual_seed(0)
    n, a, k, v = 1, 3, 4, 12
    draft_logits = torch.arange(v, 0, -1).float().expand(n, a, k, v).clone()  # token j has rank j + 1
    stars = torch.tensor([[[0, 2, 5, 11], [0, 0, 1, 0], [7, 0, 0, 0]]])  # classes [0,1,2,3], [0,0,1,0], [2,0,0,0]
    target_logits = F.one_hot(stars, v).float() * 10
    z = torch.randn(n, a, k, 4)
    z[0, 0] = torch.tensor([[5.0, 0, 0, 0], [0, 5, 0, 0], [0, 0, 0, 5], [5, 0, 0, 0]])  # p: 0, 1, 3, 0 -> miss at 2
    z[0, 1] = torch.tensor([[5.0, 0, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0]])  # p: 0,0,0,0 -> miss at 2
    z[0, 2] = torch.tensor([[0, 0, 5.0, 0], [0, 5, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0]])  # p: 2,1,.. -> miss at 1
    valid = torch.ones(n, a, k, dtype=torch.bool)
    draft = DraftOutput(draft_logits, torch.zeros(n, a, k, dtype=torch.long), valid,
                        torch.zeros(n, a, dtype=torch.long), aux={"rank": z})
    ctx = StepContext(target_logits=target_logits)
    got = RankOrdinal(cap=2.0)(draft, ctx)
    t = [[0, 1, 2, 3], [0, 0, 1, 0], [2, 0, 0, 0]]
    p = [[0, 1, 3, 0], [0, 0, 0, 0], [2, 1, 0, 0]]
    counted = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]]  # up to and including the first rank mistake
    counts = [0] * 4
    for row_t, row_m in zip(t, counted):
        for label, m in zip(row_t, row_m):
            counts[label] += m  # class 0: 4, class 1: 2, class 2: 2
    want = torch.zeros(n, a, k)
    for i in range(a):
        for j in range(k):
            if not counted[i][j]:
                continue
            tt, pp = t[i][j], p[i][j]
            kern = torch.tensor([1 / (1 + abs(c - tt) + max(tt - c, 0)) ** 2 for c in range(4)])
            y = kern / kern.sum()
            ce = -(y * z[0, i, j].log_softmax(-1)).sum()
            dist = 1 + abs(tt - pp) + max(tt - pp, 0)
            freq = min(1.0, 2.0 / counts[tt])
            want[0, i, j] = dist * freq * ce
    torch.testing.assert_close(got, want)
    assert got[0, 0, 2] > 0 and got[0, 0, 3] == 0 and got[0, 2, 1] > 0 and got[0, 2, 2] == 0
    # an invalid slot ends the prefix
    valid[0, 1, 1] = False  # the same tensor as draft.valid
    cut = RankOrdinal(cap=2.0)(draft, ctx)
    assert cut[0, 1, 1:].eq(0).all() and cut[0, 1, 0] > 0


def test_settings_are_checked_in_one_sentence(diverse_target):
    with pytest.raises(ValueError, match="drafter.block_size must be an int >= 1"):
        SpecBlockDrafter(block_size=0)
    with pytest.raises(ValueError, match="drafter.num_layers must be an int >= 1"):
        SpecBlockDrafter(num_layers=0)
    with pytest.raises(ValueError, match="drafter.rank_width must be an int >= 1"):
        SpecBlockDrafter(rank_width=0)
    with pytest.raises(ValueError, match="drafter.blocks must be an int >= 1"):
        SpecBlockDrafter(blocks=0)
    with pytest.raises(ValueError, match=r"drafter.block_size=10 must be a multiple of drafter.blocks=3.*e\.g\. 9"):
        SpecBlockDrafter(block_size=10, blocks=3)
    with pytest.raises(ValueError, match="loss.cap must be > 0"):
        RankOrdinal(cap=0)
    plain = DraftOutput(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, dtype=torch.long),
                        torch.ones(1, 1, 2, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="SpecBlockDrafter"):
        RankOrdinal()(plain, StepContext(target_logits=torch.zeros(1, 1, 2, 4)))
    d = sb(diverse_target)
    with pytest.raises(ValueError, match="needs the prefill's token ids"):
        d.begin(torch.zeros(1, 2, len(d.target_layers) * diverse_target.hidden_size))


def specblock_loss() -> Mixture:
    return Mixture([
        Objective(KL(), PositionProduct([Geometric(0.8), ValidPrefix()])),
        Objective(RankOrdinal()),
    ], [1.0, 1.0])


def test_the_specblock_loss_trains_the_drafter_and_the_rank_head(diverse_target, prompts):
    torch.manual_seed(0)
    d = SpecBlockDrafter(block_size=K, num_layers=2, rank_width=32)
    d.bind(diverse_target)
    rows = [p + argmax_reference(diverse_target, p, MAX_NEW) for p in prompts]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(p) : len(row)] = True
    batch = {"input_ids": ids, "loss_mask": mask, "anchor_seed": torch.arange(len(rows))}
    out = diverse_target(ids, layers=d.target_layers, logits=False)
    feats, last = out.features, out.last_hidden
    objective = specblock_loss()
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    curve = []
    for _ in range(12):
        draft = d(batch, feats)
        pos = (draft.anchors[..., None] + torch.arange(K)).clamp(max=ids.shape[1] - 1)  # (N, A, K) the shift
        ctx = StepContext(
            target_hidden=last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).view(*pos.shape, -1),
            target_head=lambda h: d.vocab.logits(h, diverse_target.lm_head),
        )
        terms = objective(draft, ctx)
        opt.zero_grad()
        (terms.num / terms.den).backward()
        assert d.rank_head.up.weight.grad.abs().sum() > 0 and d.query.grad.abs().sum() > 0
        opt.step()
        curve.append(float(terms.metrics["mixture/0"]))
    assert curve[-1] < 0.7 * curve[0], curve

    # with the drafter fixed, the rank loss alone teaches the rank head the rank classes of the draft
    def accuracy() -> float:
        with torch.no_grad():
            draft = d(batch, feats, anchors).materialize()
            labels = rank_labels(draft.logits, target_logits)
            return float((draft.aux["rank"].argmax(-1) == labels)[draft.valid].float().mean())

    anchors = d.sample_anchors(batch)
    draft = d(batch, feats, anchors)
    pos = (draft.anchors[..., None] + torch.arange(K)).clamp(max=ids.shape[1] - 1)
    target_logits = d.vocab.logits(last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).view(
        *pos.shape, -1), diverse_target.lm_head)
    with torch.no_grad():
        d.rank_head.out.bias.zero_()
        d.rank_head.out.bias[3] = 3.0  # start by predicting "beyond 10" everywhere: the worst start
    before = accuracy()
    head_opt = torch.optim.AdamW(d.rank_head.parameters(), lr=1e-2)
    for _ in range(40):
        draft = d(batch, feats, anchors)
        terms = Objective(RankOrdinal())(draft, StepContext(target_logits=target_logits))
        head_opt.zero_grad()
        (terms.num / terms.den).backward()
        head_opt.step()
    assert accuracy() > before + 0.05, (before, accuracy())  # measured: 0.38 -> 0.48


# --------------------------------------------------------------------------------------------------- the tree


def test_rank_tree_by_hand():
    q = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.6, 0.2, 0.1, 0.05, 0.05], [0.9, 0.04, 0.03, 0.02, 0.01]])
    # classes 1, 0, 0: four children at depth 1, one child each at depths 2 and 3
    tokens, parents = rank_tree(q, torch.tensor([1, 0, 0]), nodes=64)
    assert tokens.tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0]
    assert parents.tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    # class 3 at depth 2 stops every branch there
    tokens, parents = rank_tree(q, torch.tensor([1, 3, 0]), nodes=64)
    assert tokens.tolist() == [0, 1, 2, 3] and parents.tolist() == [0, 0, 0, 0]
    assert rank_tree(q, torch.tensor([3, 0, 0]), nodes=64)[0].numel() == 0
    # the node budget keeps the most valuable nodes, parents first
    tokens, parents = rank_tree(q, torch.tensor([0, 1, 0]), nodes=4)
    paths = [()]
    for tok, par in zip(tokens.tolist(), parents.tolist()):
        paths.append(paths[par] + (tok,))
    values = {p: math.prod(float(q[d, t]) for d, t in enumerate(p)) for p in paths[1:]}
    assert sorted(values) == sorted([(0,), (0, 0), (0, 0, 0), (0, 1)])  # 0.5, 0.3, 0.27, 0.1 beat 0.09 ...
    # the class 2 width (10) is capped by the vocabulary
    tokens, _ = rank_tree(q[:1], torch.tensor([2]), nodes=64)
    assert tokens.tolist() == [0, 1, 2, 3, 4]


def test_the_tree_follows_the_rank_head(diverse_target):
    d = sb(diverse_target, k=3)
    feats = features_of(diverse_target, d, a_batch(diverse_target)["input_ids"][:1])
    ids = a_batch(diverse_target)["input_ids"][:1]
    state = d.begin(feats[:, :6], ids[:, :6])
    anchor = ids[0, 6:7]
    hidden = d.first_block(state, anchor).normed[0]
    logits = d.head(hidden)
    for forced, want_width in [(0, [1, 1, 1]), (1, [4, 4, 4])]:
        with torch.no_grad():
            d.rank_head.out.bias.zero_()
            d.rank_head.out.bias[forced] = 1e4
        proposal = d.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=200))
        tokens, parents = rank_tree(logits.softmax(-1), torch.full((3,), forced), 200)
        assert proposal.tokens.tolist() == d.vocab.to_target(tokens).tolist()
        assert proposal.parents.tolist() == parents.tolist()
        assert proposal.num_drafted == sum(math.prod(want_width[: i + 1]) for i in range(3))
    proposal = d.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=5, depth=2))
    assert proposal.num_drafted == 5 and int(proposal.ancestors().sum(-1).max()) - 1 <= 2


# ---------------------------------------------------------------------------------------- decoding guarantees


@pytest.fixture(scope="module")
def accepted_drafter(family, diverse_target, prompts):
    drafter = trained(family, diverse_target, prompts, k=K)
    with torch.no_grad():  # an untrained rank head: make it ask for 4 children per node (classes 1)
        drafter.rank_head.out.bias.zero_()
        drafter.rank_head.out.bias[1] = 1e4
    return drafter


@pytest.mark.parametrize("tree", [TreeConfig(nodes=12), TreeConfig(nodes=5, depth=2)])
def test_greedy_tree_decoding_equals_the_argmax_loop(accepted_drafter, diverse_target, prompts, tree):
    assert_greedy_tree_is_the_argmax_loop(accepted_drafter, diverse_target, prompts, tree)


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)


def test_sampled_tree_decoding_is_lossless(family, small_target):
    drafter = build(family, small_target, k=2)
    with torch.no_grad():
        drafter.rank_head.out.bias.zero_()
        drafter.rank_head.out.bias[1] = 1e4  # 4 children per node: several candidates at every node
    counts, first = tree_empirical(small_target, drafter)
    assert_matches(counts, exact_joint(small_target, PROMPT, T1), small_target.vocab_size, 3, "specblock tree")
    assert any(a == 0 for a in first) and any(a > 0 for a in first), first[:50]


def test_save_and_load_round_trip(accepted_drafter, diverse_target, prompts, tmp_path):
    folder = save_drafter(accepted_drafter, tmp_path / "drafter", "random")
    loaded = load_drafter(folder, target=diverse_target)
    assert type(loaded) is SpecBlockDrafter
    assert loaded.config_dict() == accepted_drafter.config_dict()
    assert loaded.config_dict()["rank_width"] == 32 and loaded.config_dict()["num_layers"] == 2
    for (key, a), (_, b) in zip(loaded.state_dict().items(), accepted_drafter.state_dict().items()):
        assert torch.equal(a, b), key
    tree = TreeConfig(nodes=8)
    for prompt in prompts[:2]:
        assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded, plan=tree).tokens == generate(
            diverse_target, prompt, MAX_NEW, drafter=accepted_drafter, plan=tree
        ).tokens
