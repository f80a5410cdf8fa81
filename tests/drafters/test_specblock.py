"""SpecBlock (Shi et al. 2026, arXiv 2605.07243): fused slot inputs, the layer-wise shift, the rank head and its
ordinal loss, the rank-sized tree, and block TTT with tree growth by block expansion.

- the fused inputs and the layer-wise shift by hand; the slot mask (a later slot's query never reaches an earlier
  slot; a later position never reaches an earlier one);
- the training forward at an anchor equals the block ``propose`` drafts on the decoding cache;
- the 15 rank features and the rank labels by hand; ``RankOrdinal`` by hand (kernel, distance weight, frequency
  reweighting, first-mistake cut); the SpecBlock mixture trains the drafter and the rank head;
- the tree from given rank classes by hand; greedy tree decoding equals the argmax loop with a trained drafter;
  sampled tree decoding is distributed as the target (χ²); chain decoding is held to the family guarantees in
  tests/drafters/test_families.py (whose SpecBlock runs two blocks); save/load; one-sentence errors;
- block TTT: more blocks add no weights and leave block 1 as it was; a later block's inputs by hand (the previous
  block's state at slot M - 1, the token x_{n+M}, its rotary positions); which entries it sees; every training row
  is the block decoding starts at that M; in eval mode the forward is the chain ``propose`` drafts, slot for slot
  and distribution for distribution; training draws M per anchor and block from the example's seed; the module
  reads the target's logits at each row's own positions;
- trees by block expansion: the builder by hand for given rank classes, on the drafter (each expanded block is the
  one started on its node's token), greedy tree decoding = the argmax loop, sampled tree decoding lossless (χ²),
  offline rounds (chain and replayed tree) = the engine's, save/load with three blocks.
"""

import math
from dataclasses import replace
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from helpers.decoding import MAX_NEW, argmax_reference, random_prompts
from helpers.families import FAMILIES, build, trained
from helpers.sampling import PROMPT, assert_matches, exact_joint
from helpers.trees import assert_greedy_tree_is_the_argmax_loop, tree_empirical

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import save_drafter
from lightning_spec.drafters import Anchors, DraftOutput, SpecBlockDrafter
from lightning_spec.drafters.specblock_rank import block_tree, rank_features, rank_labels, rank_tree
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Geometric, Mixture, Objective, PositionProduct, RankOrdinal, ValidPrefix
from lightning_spec.objectives.rank import ordinal_targets

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
K = 3


@pytest.fixture(scope="module")
def family():
    """SpecBlockDrafter's entry in helpers/families.py (tests/drafters/test_families.py holds it to every guarantee)."""
    assert "specblock" in FAMILIES
    return "specblock"


@pytest.fixture(scope="module")
def prompts(diverse_target):
    return random_prompts(diverse_target.vocab_size)


def sb(target, k: int = 3, layers: int = 2, seed: int = 0, **kwargs) -> SpecBlockDrafter:
    torch.manual_seed(seed)
    drafter = SpecBlockDrafter(block_size=k, num_layers=layers, rank_width=32, **kwargs)
    drafter.bind(target)
    with torch.no_grad():  # weights far from the init (the shift included), so every path carries signal
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


def a_batch(target, s: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, s), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}


def features_of(target, drafter, ids):
    return target(ids, layers=drafter.target_layers, logits=False).features


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
                        torch.zeros(n, a, dtype=torch.long), target_logits=target_logits, aux={"rank": z})
    got = RankOrdinal(cap=2.0)(draft)
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
    valid[0, 1, 1] = False
    draft.valid = valid
    cut = RankOrdinal(cap=2.0)(draft)
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
                        torch.ones(1, 1, 2, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long),
                        target_logits=torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="SpecBlockDrafter"):
        RankOrdinal()(plain)
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
        draft.target_hidden = last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).view(
            *pos.shape, -1)
        draft.target_head = lambda h: d.vocab.logits(h, diverse_target.lm_head)
        terms = objective(draft)
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
        draft.target_logits = target_logits
        terms = Objective(RankOrdinal())(draft)
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
        assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded, tree=tree).tokens == generate(
            diverse_target, prompt, MAX_NEW, drafter=accepted_drafter, tree=tree
        ).tokens


# ------------------------------------------------------------------------------------------------ block TTT
B, KB = 3, 2  # three blocks of two slots: a round drafts six tokens


def rows_of(out, a: int) -> torch.Tensor:
    """A training-mode output's block starts per anchor (N, A, B) (row b of anchor a is row a * B + b)."""
    return out.anchors.view(out.anchors.shape[0], a, -1)


def decoded(d, target, ids, n: int, starts: list[int]):
    """The blocks decoding runs after the committed ids[:n] when block j + 1 starts at position ``starts[j]``
    (starts[0] = n): per block, its draft logits (K, Vd) and rank logits (K, 4)."""
    state = d.begin(features_of(target, d, ids)[:, :n], ids[:, :n])
    rows = d.first_block(state, ids[0, n : n + 1])
    out = []
    for j, start in enumerate(starts):
        if j:
            slot = torch.tensor([start - starts[j - 1] - 1])
            rows = d.next_blocks(state, rows, torch.tensor([0]), slot, ids[0, start : start + 1])
        logits = d.head(rows.normed[0])
        out.append((logits, d.rank_logits(rows.normed[0], logits)))
    return out


def test_more_blocks_add_no_weights_and_leave_block_one_as_it_was(diverse_target):
    """B = 1 is the drafter of before: three blocks hold the same tensors (a B = 1 checkpoint loads), and their
    chain's first K slots are the single block's."""
    one, three = sb(diverse_target, k=KB), sb(diverse_target, k=B * KB, blocks=B)
    assert one.block_size == KB and (three.block_size, three.slots) == (B * KB, KB)
    assert {k: v.shape for k, v in one.state_dict().items()} == {k: v.shape for k, v in three.state_dict().items()}
    three.load_state_dict(one.state_dict())
    batch = a_batch(diverse_target)
    feats = features_of(diverse_target, one, batch["input_ids"])
    anchors = Anchors.all(torch.tensor([[0, 4, 9], [2, 3, 7]]))
    a, b = one(batch, feats, anchors), three(batch, feats, anchors)
    assert b.logits.shape[2] == B * KB
    torch.testing.assert_close(b.logits[:, :, :KB], a.logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(b.labels[:, :, :KB], a.labels)
    assert (b.logits[:, :, KB:] - a.logits.repeat(1, 1, B - 1, 1)).abs().max() > 1e-3  # later blocks differ
    # a checkpoint written before ``blocks`` existed rebuilds a single-block drafter
    config = {k: v for k, v in one.config_dict().items() if k != "blocks"}
    assert SpecBlockDrafter(**config).blocks == 1 and three.config_dict()["blocks"] == B


def test_a_later_block_starts_from_the_previous_blocks_state_and_the_token_there(diverse_target):
    """By hand, in training mode: block j + 1 of anchor n is fused from block j's last-layer state (before the final
    norm) at slot M_j - 1 and the data's token x_{n+o} (o = M_1 + ... + M_j), at rotary positions n + o + 1 + k."""
    d = sb(diverse_target, k=B * KB, blocks=B).train()
    batch = {**a_batch(diverse_target, s=14), "anchor_seed": torch.tensor([3, 4])}
    ids = batch["input_ids"]
    feats = features_of(diverse_target, d, ids)
    calls = []
    fused, run = d.fused, d.run

    def record_fused(condition, tokens):
        calls.append({"condition": condition, "tokens": tokens})
        return fused(condition, tokens)

    def record_run(h, pos, mask, cache=None):
        out = run(h, pos, mask, cache)
        calls[-1].update(pos=pos, hidden=out[0])
        return out

    anchors = Anchors.all(torch.tensor([[1, 5], [0, 6]]))
    with patch.object(d, "fused", record_fused), patch.object(d, "run", record_run):
        out = d(batch, feats, anchors)
    starts = rows_of(out, 2)  # (N, A, B)
    assert len(calls) == B
    before = F.pad(feats, (0, 0, 1, 0))[:, :-1]
    torch.testing.assert_close(calls[0]["condition"], d.condition_proj(before))  # block 1: the target features
    for j in range(1, B):
        call, prev = calls[j], calls[j - 1]["hidden"]  # the previous block's states (N, S or A, K, H)
        for i in range(2):
            for a in range(2):
                n, start = int(anchors.positions[i, a]), int(starts[i, a, j])
                m = start - int(starts[i, a, j - 1])
                assert 1 <= m <= KB
                row = n if j == 1 else a  # block 1 ran over every position, later blocks over the anchors
                torch.testing.assert_close(call["condition"][i, a], prev[i, row, m - 1])
                assert int(call["tokens"][i, a]) == int(ids[i, start])
                assert call["pos"].view(2, 2, KB)[i, a].tolist() == [start + 1 + k for k in range(KB)]
                want = ids[i, start + 1 : start + 1 + KB]
                labels = out.labels.view(2, 2, B, KB)[i, a, j]
                assert labels[: want.numel()].tolist() == want.tolist()


def with_own_entry_moved(rows, slot: int):
    """A copy of decoding ``rows`` whose own entry at ``slot`` (every layer's value) is moved."""
    values = [v.clone() for v in rows.values]
    k = rows.normed.shape[1]
    for v in values:
        v[:, :, v.shape[2] - k + slot] += 1.0  # the row's own entries are its last K
    return replace(rows, values=values)


def test_a_later_block_counts_only_where_its_start_token_is_a_label(diverse_target):
    """No filter on whether the previous block was right, but a block whose start token is no label (here an
    unsupervised token) is a state decoding never reaches: its row, and the rows after it, are not valid."""
    d = sb(diverse_target, k=B * KB, blocks=B).train()
    batch = {**a_batch(diverse_target, s=20), "anchor_seed": torch.tensor([3, 4])}
    feats = features_of(diverse_target, d, batch["input_ids"])
    anchors = Anchors.all(torch.tensor([[1, 5], [0, 6]]))
    starts = rows_of(d(batch, feats, anchors), 2)
    hole = int(starts[0, 1, 1])  # block 2 of the second anchor of row 0 starts here
    batch["loss_mask"] = batch["loss_mask"].clone()
    batch["loss_mask"][0, hole] = False
    valid = d(batch, feats, anchors).valid.view(2, 2, B, KB)
    assert not valid[0, 1, 1:].any() and valid[1].all()
    labels_after_the_hole = batch["loss_mask"][0, hole + 1 : hole + 1 + KB]
    assert labels_after_the_hole.all()  # the block's own labels are supervised: the start token decides
    assert valid[0, 1, 0, : hole - 5 - 1].all()  # block 1 up to the slot before the hole


def test_which_entries_a_later_block_sees(diverse_target):
    """Block 2 started after slot M - 1 of block 1 sees block 1's slots < M and not the later ones; its slot k sees
    the committed slots <= k only (the rule of block 1)."""
    d = sb(diverse_target, k=3 * 2, blocks=2)  # K = 3
    ids = a_batch(diverse_target)["input_ids"][:1]
    state = d.begin(features_of(diverse_target, d, ids[:, :6]), ids[:, :6])
    rows = d.first_block(state, ids[0, 6:7])

    def block2(rows, state, m):
        return d.next_blocks(state, rows, torch.tensor([0]), torch.tensor([m - 1]), ids[0, 9:10]).normed[0]

    for m in (1, 2, 3):
        base = block2(rows, state, m)
        for slot in range(3):
            moved = with_own_entry_moved(rows, slot)
            changed = (block2(moved, state, m) - base).abs().max() > 1e-4
            assert changed == (slot < m), (m, slot)
    # a committed slot-2 entry reaches slot 2 of a later block only
    base = block2(rows, state, 2)
    state.values = [v.clone() for v in state.values]
    for v in state.values:
        v[:, :, 2::3] += 1.0  # every committed position's slot 2
    moved = block2(rows, state, 2)
    torch.testing.assert_close(moved[:2], base[:2])
    assert (moved[2] - base[2]).abs().max() > 1e-4


@pytest.mark.parametrize("seed", [0, 1])
def test_every_training_row_is_the_block_decoding_starts_at_its_m(diverse_target, seed):
    """Training mode: row (anchor n, block j) is the block decoding runs when block j starts at that row's anchor,
    each block started after slot M - 1 of the one before on the data's token: same logits, same rank logits."""
    d = sb(diverse_target, k=B * KB, blocks=B).train()
    batch = {**a_batch(diverse_target, s=16), "anchor_seed": torch.tensor([seed, seed + 7])}
    ids = batch["input_ids"]
    anchors = Anchors.all(torch.tensor([[0, 2, 5, 8], [1, 3, 4, 9]]))
    out = d(batch, features_of(diverse_target, d, ids), anchors).materialize()
    starts = rows_of(out, 4)
    d.eval()
    for i in range(2):
        for a in range(4):
            blocks = decoded(d, diverse_target, ids[i : i + 1], int(anchors.positions[i, a]), starts[i, a].tolist())
            for j, (logits, rank) in enumerate(blocks):
                torch.testing.assert_close(out.logits[i, a * B + j], logits, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out.aux["rank"][i, a * B + j], rank, atol=1e-5, rtol=1e-5)


def test_training_draws_where_later_blocks_start(diverse_target):
    """M ~ U{1..K} per anchor and block, from the example's seed: another seed gives other M, every M in 1..K
    occurs, an example gets the same M in any batch; eval mode chains the blocks (M = K)."""
    d = sb(diverse_target, k=B * KB, blocks=B).train()
    batch = a_batch(diverse_target, s=40)
    feats = features_of(diverse_target, d, batch["input_ids"])
    anchors = Anchors.all(torch.arange(0, 30, 2).expand(2, -1))

    def m_of(seeds, rows=slice(None)):
        part = {"input_ids": batch["input_ids"][rows], "loss_mask": batch["loss_mask"][rows], "anchor_seed": seeds}
        starts = rows_of(d(part, feats[rows], Anchors.all(anchors.positions[rows])), anchors.positions.shape[1])
        return starts.diff(dim=-1)  # (N, A, B - 1)

    m = m_of(torch.tensor([1, 2]))
    assert set(m.unique().tolist()) == set(range(1, KB + 1))
    assert not torch.equal(m[0], m[1]) and not torch.equal(m, m_of(torch.tensor([3, 4])))
    assert torch.equal(m, m_of(torch.tensor([1, 2])))
    # an example's M do not depend on its batch (its neighbours, its padding): DDP ranks agree with one process
    assert torch.equal(m_of(torch.tensor([2]), slice(1, 2))[0], m[1])
    short = {"input_ids": batch["input_ids"][:1, :32], "loss_mask": batch["loss_mask"][:1, :32],
             "anchor_seed": torch.tensor([1])}
    out = d(short, feats[:1, :32], Anchors.all(anchors.positions[:1]))
    assert torch.equal(rows_of(out, anchors.positions.shape[1]).diff(dim=-1)[0], m[0])
    # without a seed: the global generator
    torch.manual_seed(0)
    plain = d(batch, feats, anchors).anchors
    torch.manual_seed(0)
    assert torch.equal(plain, d(batch, feats, anchors).anchors)
    d.eval()
    out = d(batch, feats, anchors)
    assert torch.equal(out.anchors, anchors.positions) and out.labels.shape[-1] == B * KB


def test_the_module_reads_the_targets_logits_at_each_blocks_own_positions(diverse_target):
    """Training mode through the module: every row's target logits are those at its start + t - 1, so each block is
    trained toward the tokens it predicts, and the loss trains all blocks."""
    torch.manual_seed(0)
    drafter = SpecBlockDrafter(block_size=B * KB, blocks=B, num_layers=2, rank_width=32, num_anchors=5)
    module = DraftModule(drafter, Objective(KL(), PositionProduct([Geometric(0.8), ValidPrefix()])),
                         target=diverse_target).train()
    batch = {**a_batch(diverse_target, s=20), "anchor_seed": torch.tensor([0, 1])}
    draft, terms = module.draft_step(batch, use_cache=False)
    last = diverse_target(batch["input_ids"], logits=False).last_hidden
    pos = (draft.anchors[..., None] + torch.arange(KB)).clamp(max=19)  # (N, A*B, K)
    want = drafter.head(last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).view(*pos.shape, -1))
    torch.testing.assert_close(draft.target_logits, want)
    assert draft.valid.shape == (2, 5 * B, KB)
    terms.num.backward()
    assert drafter.query.grad.abs().sum() > 0 and drafter.condition_norm.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------ block TTT: chains given acceptance


@pytest.fixture(scope="module")
def ttt_drafter(diverse_target, prompts):
    """Three blocks of two slots trained a little (CE in training mode: M drawn) until drafts are accepted."""
    make = {"specblock_b3": lambda k: SpecBlockDrafter(block_size=B * k, blocks=B, num_layers=2, rank_width=32)}
    with patch.dict(FAMILIES, make):
        return trained("specblock_b3", diverse_target, prompts, k=KB)


def test_in_eval_mode_the_forward_is_the_chain_propose_drafts(ttt_drafter, diverse_target, prompts):
    """Teacher forcing given acceptance, for all B x K slots: wherever ``propose``'s drafts before slot t are the
    data's, its slot t is the forward's argmax (greedy) and it draws it from the forward's distribution (T = 1)."""
    d = ttt_drafter
    compared = [0] * (B * KB)
    for prompt in prompts:
        seq = prompt + argmax_reference(diverse_target, prompt, MAX_NEW)
        ids = torch.tensor([seq])
        feats = features_of(diverse_target, d, ids)
        anchors = torch.arange(len(prompt) - 1, len(seq) - B * KB - 1)[None]
        out = d({"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}, feats, Anchors.all(anchors))
        assert out.logits.shape[2] == B * KB
        for a, n in enumerate(anchors[0].tolist()):
            gold = seq[n + 1 : n + 1 + B * KB]
            state = d.begin(feats[:, :n], ids[:, :n])
            greedy = d.propose(state, ids[0, n : n + 1], GREEDY).tokens.tolist()
            sampled = d.propose(state, ids[0, n : n + 1], T1, torch.Generator().manual_seed(n))
            q = T1.probs(out.logits[0, a])  # (B*K, Vd)
            for t in range(B * KB):
                if greedy[:t] == gold[:t]:
                    assert greedy[t] == int(d.vocab.to_target(out.logits[0, a, t].argmax()))
                    compared[t] += 1
                if sampled.tokens[:t].tolist() == gold[:t]:
                    torch.testing.assert_close(sampled.probs[t], d.vocab.scatter(q[t]), atol=1e-5, rtol=1e-5)
    assert all(c > 0 for c in compared), compared  # acceptance reached the last block


def test_offline_rounds_equal_the_engines_with_three_blocks(ttt_drafter, diverse_target, prompts):
    """Greedy: the offline chain rounds (the eval-mode forward) and the replayed tree rounds are the engine's."""
    tree = TreeConfig(nodes=10, top_k=2)
    for kind in (None, tree):
        pairs, real = [], []
        for prompt in prompts:
            out = generate(diverse_target, prompt, MAX_NEW, drafter=ttt_drafter, tree=kind)
            pairs.append((prompt, out.tokens))
            real.append(float(out.rounds))
            assert out.tokens == argmax_reference(diverse_target, prompt, MAX_NEW)
        assert sum(real) < sum(len(tokens) for _, tokens in pairs)  # drafts were accepted
        assert offline_rounds(diverse_target, ttt_drafter, pairs, GREEDY, tree=kind).tolist() == real


def test_save_and_load_round_trip_with_three_blocks(ttt_drafter, diverse_target, prompts, tmp_path):
    loaded = load_drafter(save_drafter(ttt_drafter, tmp_path / "drafter", "random"), target=diverse_target)
    assert (loaded.blocks, loaded.slots, loaded.block_size) == (B, KB, B * KB)
    assert loaded.config_dict() == ttt_drafter.config_dict()
    for (key, a), (_, b) in zip(loaded.state_dict().items(), ttt_drafter.state_dict().items()):
        assert torch.equal(a, b), key
    for tree in (None, TreeConfig(nodes=8)):
        for prompt in prompts[:2]:
            assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded, tree=tree).tokens == generate(
                diverse_target, prompt, MAX_NEW, drafter=ttt_drafter, tree=tree).tokens
    sampled = generate(diverse_target, prompts[0], 8, T1, drafter=loaded, seed=0)
    assert sampled.tokens == generate(diverse_target, prompts[0], 8, T1, drafter=ttt_drafter, seed=0).tokens


# ---------------------------------------------------------------------------------- trees by block expansion


def fake_blocks(q1, c1, later):
    """``block_tree`` callbacks over given distributions: block 1 (q1 (K, V), classes c1 (K,)); every later block
    from ``later[token]`` = (q (K, V), classes (K,)) by its start token. Records each expansion."""
    calls = []

    def first():
        return q1[None], c1[None], "rows"

    def expand(rows, which, slots, tokens):
        calls.append((which.tolist(), slots.tolist(), tokens.tolist()))
        q, c = zip(*(later[t] for t in tokens.tolist()))
        return torch.stack(q), torch.stack(c), "rows"

    return first, expand, calls


def paths_of(tokens, parents):
    paths = [()]
    for tok, par in zip(tokens.tolist(), parents.tolist()):
        paths.append(paths[par] + (tok,))
    return paths[1:]


def test_block_tree_by_hand():
    q1 = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.6, 0.2, 0.1, 0.05, 0.05]])
    qa = torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05], [0.9, 0.04, 0.03, 0.02, 0.01]])
    qb = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05], [0.8, 0.1, 0.05, 0.03, 0.02]])
    later = {0: (qa, torch.tensor([0, 0])), 1: (qb, torch.tensor([1, 0]))}
    # block 1: slot 0 sure (1 child), slot 1 unsure (class 1: 4 children); the 2 best of those start block 2,
    # the last level, which grows all its slots: under token 0 a chain, under token 1 four children of one each
    first, expand, calls = fake_blocks(q1, torch.tensor([0, 1]), later)
    tokens, parents = block_tree(first, expand, blocks=2, depth=4, nodes=64, top_k=2)
    assert calls == [([0, 0], [1, 1], [0, 1])]
    want = [(0,), (0, 0), (0, 1), (0, 2), (0, 3), (0, 0, 0), (0, 0, 0, 0)]
    want += [(0, 1, t) for t in range(4)] + [(0, 1, t, 0) for t in range(4)]
    assert paths_of(tokens, parents) == want and all(p < i + 1 for i, p in enumerate(parents.tolist()))
    # the node budget: the most valuable nodes; a start the budget cannot keep starts no block
    value = {p: math.prod(float((q1 if d < 2 else qa if p[1] == 0 else qb)[d % 2, t]) for d, t in enumerate(p))
             for p in want}
    for nodes, starts in [(3, [0, 1]), (2, [0])]:  # with 2 nodes, (0, 1) has (0,) and (0, 0) before it
        first, expand, calls = fake_blocks(q1, torch.tensor([0, 1]), later)
        tokens, parents = block_tree(first, expand, blocks=2, depth=4, nodes=nodes, top_k=4)
        assert calls == [([0] * len(starts), [1] * len(starts), starts)]
        assert sorted(paths_of(tokens, parents)) == sorted(sorted(want, key=lambda p: -value[p])[:nodes])
    assert (0, 0, 0) in sorted(want, key=lambda p: -value[p])[:3]  # a later block's node beats block 1's (0, 1)
    # a block that is sure everywhere continues at its end; the depth limit stops expansions
    first, expand, calls = fake_blocks(q1, torch.tensor([0, 0]), later)
    tokens, parents = block_tree(first, expand, blocks=3, depth=6, nodes=64, top_k=4)
    assert calls == [([0], [1], [0]), ([0], [1], [0])] and paths_of(tokens, parents)[-1] == (0,) * 6
    first, expand, calls = fake_blocks(q1, torch.tensor([0, 0]), later)
    assert block_tree(first, expand, blocks=3, depth=2, nodes=64, top_k=4)[0].tolist() == [0, 0] and not calls
    # class 3 ends the branch: nothing to expand
    first, expand, calls = fake_blocks(q1, torch.tensor([3, 0]), later)
    assert block_tree(first, expand, blocks=2, depth=4, nodes=64, top_k=4)[0].numel() == 0 and not calls
    # a block stops at its first unsure slot, wherever it is: slot 2 of a 3-slot block 1 is never grown
    q3 = torch.cat([q1, q1[:1]])
    later3 = {t: (q3, torch.tensor([0, 0, 0])) for t in range(4)}
    first, expand, calls = fake_blocks(q3, torch.tensor([0, 1, 0]), later3)
    tokens, parents = block_tree(first, expand, blocks=2, depth=5, nodes=64, top_k=1)
    assert calls == [([0], [1], [0])]
    assert paths_of(tokens, parents) == [(0,), (0, 0), (0, 1), (0, 2), (0, 3), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]
    # one block: the rank tree
    first, expand, calls = fake_blocks(q1, torch.tensor([0, 1]), later)
    assert [t.tolist() for t in block_tree(first, expand, 1, 2, 64, 4)] == [
        t.tolist() for t in rank_tree(q1, torch.tensor([0, 1]), 64)]


def test_the_tree_grows_by_block_expansion(diverse_target):
    """On the drafter: sure everywhere, the tree is the greedy chain of B x K; unsure at slot 0, the children there
    each start a block of their own (the block ``next_blocks`` drafts on that child's token)."""
    d = sb(diverse_target, k=2 * 3, blocks=2)  # K = 3
    ids = a_batch(diverse_target)["input_ids"][:1]
    state = d.begin(features_of(diverse_target, d, ids[:, :6]), ids[:, :6])
    anchor = ids[0, 6:7]
    with torch.no_grad():
        d.rank_head.out.bias.zero_()
        d.rank_head.out.bias[0] = 1e4
    proposal = d.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=200))
    assert proposal.tokens.tolist() == d.propose(state, anchor, GREEDY).tokens.tolist()
    assert proposal.parents.tolist() == list(range(6))
    with torch.no_grad():
        d.rank_head.out.bias.zero_()
        d.rank_head.out.bias[1] = 1e4
    proposal = d.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=500, top_k=2))
    paths = paths_of(proposal.tokens, proposal.parents)
    depth = [sum(len(p) == i for p in paths) for i in range(1, 5)]
    assert depth == [4, 2 * 4, 2 * 16, 2 * 64]  # 4 children, 2 of them expanded, each a 3-slot block of width 4
    rows = d.first_block(state, anchor)
    first = d.head(rows.normed[0]).softmax(-1)  # (K, Vd)
    assert [p[0] for p in paths[:4]] == d.vocab.to_target(first[0].topk(4).indices).tolist()
    for child in [p for p in paths if len(p) == 1][:2]:
        block = d.next_blocks(state, rows, torch.tensor([0]), torch.tensor([0]), torch.tensor(child))
        kids = [p[1] for p in paths if len(p) == 2 and p[0] == child[0]]
        assert kids == d.vocab.to_target(d.head(block.normed[0])[0].topk(4).indices).tolist()
    capped = d.propose_tree(state, anchor, GREEDY, TreeConfig(nodes=9, depth=3, top_k=2))
    assert capped.num_drafted == 9 and int(capped.ancestors().sum(-1).max()) - 1 <= 3


def test_greedy_block_expansion_trees_decode_as_the_argmax_loop(ttt_drafter, diverse_target, prompts):
    with torch.no_grad():  # ask for 4 children per depth, so blocks are expanded from every branching slot
        bias = ttt_drafter.rank_head.out.bias.clone()
        ttt_drafter.rank_head.out.bias.zero_()
        ttt_drafter.rank_head.out.bias[1] = 1e4
    try:
        assert_greedy_tree_is_the_argmax_loop(ttt_drafter, diverse_target, prompts, TreeConfig(nodes=12, top_k=3))
    finally:
        with torch.no_grad():
            ttt_drafter.rank_head.out.bias.copy_(bias)
    assert_greedy_tree_is_the_argmax_loop(ttt_drafter, diverse_target, prompts, TreeConfig(nodes=6, top_k=2))


def test_sampled_block_expansion_trees_are_lossless(small_target):
    torch.manual_seed(0)
    drafter = SpecBlockDrafter(block_size=B * KB, blocks=B, num_layers=2, rank_width=32)
    drafter.bind(small_target)
    drafter.eval()
    with torch.no_grad():
        drafter.rank_head.out.bias.zero_()
        drafter.rank_head.out.bias[1] = 1e4  # several candidates at every node, blocks expanded under them
    counts, first = tree_empirical(small_target, drafter)
    assert_matches(counts, exact_joint(small_target, PROMPT, T1), small_target.vocab_size, 3, "specblock ttt tree")
    assert any(a == 0 for a in first) and any(a > 0 for a in first), first[:50]


def test_edr_refuses_a_training_forward_with_one_row_per_block_in_one_sentence(diverse_target):
    """EDR reads one chain of ``block_size`` slots per anchor from the training forward; with blocks > 1 training
    mode returns one row per block, so the statistics pass says so instead of failing on a reshape."""
    from lightning_spec.rounds import every_anchor, target_table

    d = sb(diverse_target, k=4, blocks=2).train()
    batch = a_batch(diverse_target)
    out = diverse_target(batch["input_ids"], layers=d.target_layers, logits=False)
    table = target_table(out.last_hidden, diverse_target.lm_head, batch["input_ids"], batch["loss_mask"], T1,
                         d.vocab, diverse_target.eos_token_ids)
    with pytest.raises(ValueError, match="not one chain of block_size=4 per anchor.*objective without EDR"):
        every_anchor(lambda anchors: d(batch, out.features, anchors), batch["loss_mask"], table, 4, T1, 4)
    d.eval()  # eval mode: the chain, which EDR's statistics and the offline evaluator read
    every_anchor(lambda anchors: d(batch, out.features, anchors), batch["loss_mask"], table, 4, T1, 4)
