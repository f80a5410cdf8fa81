"""SpecBlock (Shi et al. 2026, arXiv 2605.07243) with more than one block: block TTT and tree growth by block
expansion. One block (the fused inputs, the rank head and its loss, the rank-sized tree): test_specblock.py.

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
from helpers.decoding import MAX_NEW, argmax_reference
from helpers.families import FAMILIES, trained
from helpers.sampling import PROMPT, assert_matches, exact_joint
from helpers.specblock import a_batch, features_of, sb
from helpers.trees import assert_greedy_tree_is_the_argmax_loop, tree_empirical

from lightning_spec import SamplingConfig, TreeConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import save_drafter
from lightning_spec.drafters import Anchors, SpecBlockDrafter
from lightning_spec.drafters.specblock_rank import block_tree, rank_tree
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Geometric, Objective, PositionProduct, ValidPrefix

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)
K = 3


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)


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
    draft, ctx = module.draft_and_context(batch, use_cache=False)
    terms = module.objective(draft, ctx)
    last = diverse_target(batch["input_ids"], logits=False).last_hidden
    pos = (draft.anchors[..., None] + torch.arange(KB)).clamp(max=19)  # (N, A*B, K)
    want = drafter.head(last.gather(1, pos.flatten(1)[..., None].expand(-1, -1, last.shape[-1])).view(*pos.shape, -1))
    torch.testing.assert_close(ctx.target_logits, want)
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
            out = generate(diverse_target, prompt, MAX_NEW, drafter=ttt_drafter, plan=kind)
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
            assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded, plan=tree).tokens == generate(
                diverse_target, prompt, MAX_NEW, drafter=ttt_drafter, plan=tree).tokens
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
    from lightning_spec.decoding.rounds import every_anchor, target_table

    d = sb(diverse_target, k=4, blocks=2).train()
    batch = a_batch(diverse_target)
    out = diverse_target(batch["input_ids"], layers=d.target_layers, logits=False)
    table = target_table(out.last_hidden, diverse_target.lm_head, batch["input_ids"], batch["loss_mask"], T1,
                         d.vocab, diverse_target.eos_token_ids)
    with pytest.raises(ValueError, match="not one chain of block_size=4 per anchor.*objective without EDR"):
        every_anchor(lambda anchors: d(batch, out.features, anchors), batch["loss_mask"], table, 4, T1, 4)
    d.eval()  # eval mode: the chain, which EDR's statistics and the offline evaluator read
    every_anchor(lambda anchors: d(batch, out.features, anchors), batch["loss_mask"], table, 4, T1, 4)
