"""Medusa heads and DeepSeek-V3 MTP modules (lightning_spec/drafters/medusa.py, mtp.py): the pieces by hand, the anchor
convention (both read h_{n-1}; Medusa never reads the anchor), teacher forcing == chain drafting, module reuse,
the attention scope, the papers' losses as objective parts, and gradients.

The decoding guarantees (greedy == reference, lossless sampling, offline == engine rounds, save/load) are held for
both families by tests/drafters/test_families.py.
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_spec import SamplingConfig
from lightning_spec.drafters import Anchors, MedusaDrafter, MTPDrafter
from lightning_spec.drafters.layers import rope
from lightning_spec.objectives import CE, Geometric, Objective, Uniform

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)


def bound(cls, target, seed: int = 0, scale: float = 0.0, **kwargs):
    """A drafter bound to ``target``; ``scale`` > 0 redraws every weight from N(0, scale) so that no piece is an
    identity or a zero (the initialisation makes Medusa's blocks identities)."""
    torch.manual_seed(seed)
    drafter = cls(**kwargs)
    drafter.bind(target)
    if scale:
        with torch.no_grad():
            for p in drafter.parameters():
                p.normal_(0.0, scale)
    return drafter.eval()


def sequence(target, length: int = 12, seed: int = 0):
    """ids (1, S), the last layer's features (1, S, H) and a fully supervised batch."""
    ids = torch.randint(0, target.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    feats = target(ids, layers=[target.num_layers - 1], logits=False).features
    return ids, feats, {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def anchors(*positions):
    return Anchors.all(torch.tensor([positions]))


# --------------------------------------------------------------------------------------------- convention
def test_both_families_read_the_last_layer_which_is_the_final_normed_state(diverse_target):
    ids, feats, _ = sequence(diverse_target)
    for cls in (MedusaDrafter, MTPDrafter):
        drafter = bound(cls, diverse_target, block_size=2)
        assert drafter.target_layers == [diverse_target.num_layers - 1]
    out = diverse_target(ids, layers=[diverse_target.num_layers - 1])
    torch.testing.assert_close(out.features, out.last_hidden)  # the state the LM head reads


def test_bad_arguments_are_one_sentence():
    with pytest.raises(ValueError, match="drafter.num_modules"):
        MTPDrafter(block_size=2, num_modules=3)
    with pytest.raises(ValueError, match="drafter.num_modules"):
        MTPDrafter(block_size=2, num_modules=0)
    with pytest.raises(ValueError, match="drafter.block_size"):
        MedusaDrafter(block_size=0)
    with pytest.raises(ValueError, match="drafter.num_layers"):
        MedusaDrafter(num_layers=0)


# ------------------------------------------------------------------------------------------------- Medusa
def test_medusa_heads_by_hand(diverse_target):
    """Slot k of anchor n is the LM head of ResBlock_k(h_{n-1}) = h + SiLU(W_k h + b_k) (Medusa §2.1.1), h_{-1} = 0."""
    drafter = bound(MedusaDrafter, diverse_target, scale=0.2, block_size=3)
    _, feats, batch = sequence(diverse_target)
    out = drafter(batch, feats, anchors(0, 4, 7))
    assert out.hidden.shape == (1, 3, 3, diverse_target.hidden_size)
    assert out.logits.shape == (1, 3, 3, diverse_target.vocab_size)
    w = diverse_target.lm_head.weight
    for j, n in enumerate((0, 4, 7)):
        h = feats[0, n - 1] if n else torch.zeros_like(feats[0, 0])
        for k, head in enumerate(drafter.medusa):
            lin = head[0].linear
            torch.testing.assert_close(out.logits[0, j, k], w @ (h + F.silu(lin.weight @ h + lin.bias)))


def test_medusa_heads_start_as_the_target_head_so_they_first_predict_the_anchor(diverse_target):
    """W_1 = 0 at init (the paper's): every head is the LM head on h_{n-1}, whose prediction is x_n, the anchor."""
    drafter = bound(MedusaDrafter, diverse_target, block_size=2)
    ids, feats, batch = sequence(diverse_target)
    out = drafter(batch, feats, anchors(3, 6))
    target_logits = diverse_target(ids).logits[0, [2, 5]]  # (2, V): the target's logits for x_3 and x_6
    for k in range(2):
        torch.testing.assert_close(out.logits[0, :, k], target_logits, rtol=1e-5, atol=1e-5)


def test_medusa_ignores_the_anchor_and_proposes_what_forward_gives(diverse_target):
    drafter = bound(MedusaDrafter, diverse_target, scale=0.2, block_size=3)
    ids, feats, batch = sequence(diverse_target)
    n = 6
    out = drafter(batch, feats, anchors(n))
    other = dict(batch, input_ids=batch["input_ids"].clone())
    other["input_ids"][0, n] = (ids[0, n] + 1) % diverse_target.vocab_size
    torch.testing.assert_close(drafter(other, feats, anchors(n)).logits, out.logits)  # the anchor is not read
    state = drafter.begin(feats[:, :n], ids[:, :n])  # the prefill of prompt ids[: n + 1]: positions 0..n-1
    g = torch.Generator().manual_seed(0)
    first = drafter.propose(state, ids[0, n : n + 1], T1, g)
    second = drafter.propose(state, torch.tensor([3]), T1, g)
    torch.testing.assert_close(first.probs, second.probs)
    torch.testing.assert_close(first.probs, out.logits[0, 0].softmax(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(drafter.position_logits(state), out.logits[0, 0], rtol=1e-5, atol=1e-5)


def test_medusa_extend_keeps_the_state_before_the_next_anchor(diverse_target):
    drafter = bound(MedusaDrafter, diverse_target, block_size=2)
    ids, feats, _ = sequence(diverse_target)
    state = drafter.begin(feats[:, :4], ids[:, :4])
    drafter.extend(state, feats[:, 4:8], [0, 1, 2])  # nodes at positions 4, 5, 6, 7; 4..6 committed
    torch.testing.assert_close(state.last, feats[:, 6])  # the next anchor is position 7
    one_token = drafter.begin(feats[:, :0], ids[:, :0])  # a one-token prompt: nothing precedes the anchor
    assert torch.equal(one_token.last, torch.zeros(1, feats.shape[-1]))


def test_medusa_zero_initialised_blocks_still_learn():
    """ResBlock gradients by finite differences (float64), and W_1 = 0 does not block them (SiLU'(0) = 1/2)."""
    from lightning_spec.drafters.medusa import ResBlock

    torch.manual_seed(0)
    block = ResBlock(6).double()
    with torch.no_grad():
        block.linear.weight.normal_(0, 0.5)
        block.linear.bias.normal_(0, 0.5)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block, (x,))
    fresh = ResBlock(6)
    fresh(torch.randn(4, 6)).pow(2).sum().backward()
    assert fresh.linear.weight.grad.abs().sum() > 0 and fresh.linear.bias.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------- MTP
def mtp_block(drafter, m, u, pos, context):
    """Module m's block (DeepSeek-V3 Eq. 22) on entry u (H,) at position ``pos``, attending to ``context`` (a list
    of (entry, position), u itself last) with one dense softmax."""
    b, theta = drafter.mtp[m].block, drafter.rope_theta
    eps, heads, kv, d = b.input_norm.eps, b.heads, b.kv_heads, b.head_dim
    xs = torch.stack([rms(e, b.input_norm.weight, eps) for e, _ in context])  # (E, H)
    where = torch.tensor([p for _, p in context])  # (E,)
    q = rope((b.q_proj.weight @ xs[-1]).view(heads, 1, d), torch.tensor([pos]), theta)  # (heads, 1, D)
    k = rope((xs @ b.k_proj.weight.T).view(-1, kv, d).transpose(0, 1), where, theta)  # (kv, E, D)
    v = (xs @ b.v_proj.weight.T).view(-1, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    attn = ((q @ k.transpose(1, 2)) / d**0.5).softmax(-1) @ v  # (heads, 1, D)
    h = u + b.o_proj.weight @ attn.reshape(-1)
    x = rms(h, b.post_norm.weight, eps)
    return h + b.down_proj.weight @ (F.silu(b.gate_proj.weight @ x) * (b.up_proj.weight @ x))


def mtp_by_hand(drafter, ids, feats, n, inputs):
    """Slot logits (K, V) of the round anchored at n, entry by entry, one dense attention per entry.

    Streams over the committed positions p < n: s^0_p = h_p (the feature), module k's entry
    u^k_p = M_k[RMSNorm(s^{k-1}_{p-1}); RMSNorm(Emb(x_p))] (s_{-1} = 0) and s^k_p = TRM_k over u^k_0..u^k_p. Round:
    slot t runs module m = min(t, D) at position n + t - 1 on [the previous slot's output (h_{n-1} for t = 1);
    inputs[t - 1]] and attends to module m's stream entries at p < n, its anchor entry u^m_n (m >= 2; module 1's
    is slot 1 itself) and its entries of the round."""
    d_mods, w = drafter.num_modules, drafter.target.lm_head.weight
    emb = drafter.target.embed_tokens.weight
    zero = torch.zeros_like(feats[0, 0])

    def entry(m, below, token):
        mod = drafter.mtp[m]
        eps = mod.hnorm.eps
        return mod.proj.weight @ torch.cat([rms(below, mod.hnorm.weight, eps), rms(emb[token], mod.enorm.weight, eps)])

    states, streams = [[feats[0, p] for p in range(n)]], []  # states[d][p] = s^d_p; streams[m] = [(u, p)]
    for m in range(d_mods):
        below = [zero] + states[m]  # s^m at p - 1, p = 0..n
        us = [(entry(m, below[p], int(ids[0, p])), p) for p in range(n)]
        streams.append(us)
        states.append([mtp_block(drafter, m, u, p, us[: p + 1]) for u, p in us])
    own = [[] for _ in range(d_mods)]
    for m in range(1, d_mods):  # the anchor's entries: committed inputs, s^m_{n-1} and x_n
        own[m].append((entry(m, states[m][n - 1] if n else zero, int(inputs[0])), n))
    h, out = states[0][n - 1] if n else zero, []
    for t in range(1, drafter.block_size + 1):
        m = min(t, d_mods) - 1
        u = entry(m, h, int(inputs[t - 1]))
        own[m].append((u, n + t - 1))
        h = mtp_block(drafter, m, u, n + t - 1, streams[m] + own[m])
        out.append(w @ rms(h, drafter.mtp[m].out_norm.weight, drafter.mtp[m].out_norm.eps))
    return torch.stack(out)  # (K, V)


@pytest.mark.parametrize("num_modules,n", [(1, 0), (1, 6), (2, 1), (2, 7), (3, 0), (3, 5), (4, 9)])
def test_mtp_training_forward_is_the_chain_written_out(diverse_target, num_modules, n):
    """Every slot of the batched teacher-forced forward (streams once per sequence, one call per slot for all
    anchors) is the hand-written chain with the data's tokens as its inputs."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=4, num_modules=num_modules)
    ids, feats, batch = sequence(diverse_target, length=14)
    got = drafter(batch, feats, anchors(n, 3, 10)).logits[0, 0]  # (K, V)
    torch.testing.assert_close(got, mtp_by_hand(drafter, ids, feats, n, ids[0, n : n + 4]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_modules,n", [(1, 0), (1, 6), (2, 5), (3, 4)])
def test_mtp_decoding_is_the_chain_written_out_before_and_after_a_round(diverse_target, num_modules, n):
    """propose (greedy and sampled) drafts from the hand-written chain on its own tokens; after a round that accepts
    two drafts, ``extend`` leaves the state a hand-written chain over the committed sequence sees (the drafts'
    entries dropped, the committed positions run through the streams with the target's features)."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=4, num_modules=num_modules)
    ids, feats, _ = sequence(diverse_target, length=14)
    state = drafter.begin(feats[:, :n], ids[:, :n])
    greedy = drafter.propose(state, ids[0, n : n + 1], GREEDY)
    want = mtp_by_hand(drafter, ids, feats, n, torch.cat([ids[0, n : n + 1], greedy.tokens[:-1]]))
    assert greedy.tokens.tolist() == want.argmax(-1).tolist()
    sampled = drafter.propose(state, ids[0, n : n + 1], T1, torch.Generator().manual_seed(0))
    want = mtp_by_hand(drafter, ids, feats, n, torch.cat([ids[0, n : n + 1], sampled.tokens[:-1]]))
    torch.testing.assert_close(sampled.probs, want.softmax(-1), atol=1e-5, rtol=1e-5)

    verified = torch.cat([ids[0, : n + 1], sampled.tokens])[None]  # the anchor and its K drafts, verified
    f2 = diverse_target(verified, layers=drafter.target_layers, logits=False).features
    drafter.extend(state, f2[:, n:], [0, 1, 2])  # the anchor and two drafts committed
    assert state.length == n + 3
    anchor = verified[0, n + 3 : n + 4]  # the next anchor (here the third draft, as if it were the correction)
    again = drafter.propose(state, anchor, T1, torch.Generator().manual_seed(1))
    seq = torch.cat([verified[0, : n + 4], again.tokens])[None]
    want = mtp_by_hand(drafter, seq, f2, n + 3, torch.cat([anchor, again.tokens[:-1]]))
    torch.testing.assert_close(again.probs, want.softmax(-1), atol=1e-5, rtol=1e-5)


def test_mtp_extend_equals_a_fresh_prefill_of_the_committed_prefix(diverse_target):
    drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=3, num_modules=2)
    ids, _, _ = sequence(diverse_target)
    n = 5
    layers = drafter.target_layers
    state = drafter.begin(diverse_target(ids[:, :n], layers=layers, logits=False).features, ids[:, :n])
    prop = drafter.propose(state, ids[0, n : n + 1], GREEDY)
    verified = torch.cat([ids[0, : n + 1], prop.tokens])[None]
    drafter.extend(state, diverse_target(verified, layers=layers, logits=False).features[:, n:], [0, 1])
    committed = verified[:, : n + 2]
    fresh = drafter.begin(diverse_target(committed, layers=layers, logits=False).features, committed)
    assert state.length == fresh.length == n + 2 and state.nodes == []
    for got, want in ((state.keys, fresh.keys), (state.values, fresh.values), (state.last, fresh.last)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mtp_attends_to_the_committed_positions(diverse_target):
    """Module k at anchor n attends to its stream's entries before n: features and tokens at positions < n - 1
    move every slot (they reach slot 1 only through attention, since its input is h_{n-1} and x_n); the anchor's
    own feature and everything after it are never read; slot t reads the tokens x_n..x_{n+t-1} only."""
    ids, feats, batch = sequence(diverse_target)
    n = 7
    for num_modules in (1, 3):
        drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=3, num_modules=num_modules)
        base = drafter(batch, feats, anchors(n)).logits[0, 0]  # (K, V)
        earlier = feats.clone()
        earlier[:, : n - 1] += 1.0
        moved = drafter(batch, earlier, anchors(n)).logits[0, 0]
        assert ((moved - base).abs().amax(-1) > 1e-4).all(), num_modules
        early_ids = ids.clone()
        early_ids[0, 2] = (early_ids[0, 2] + 1) % diverse_target.vocab_size
        moved = drafter(dict(batch, input_ids=early_ids), feats, anchors(n)).logits[0, 0]
        assert ((moved - base).abs().amax(-1) > 1e-4).all(), num_modules
        later = feats.clone()
        later[:, n:] += 5.0
        torch.testing.assert_close(drafter(batch, later, anchors(n)).logits[0, 0], base)
        later_ids = ids.clone()
        later_ids[0, n + 2] = (later_ids[0, n + 2] + 1) % diverse_target.vocab_size
        moved = drafter(dict(batch, input_ids=later_ids), feats, anchors(n)).logits[0, 0]
        torch.testing.assert_close(moved[:2], base[:2])
        assert (moved[2] - base[2]).abs().max() > 1e-4


def test_mtp_streams_run_once_and_each_slot_is_one_call_for_all_anchors(diverse_target):
    """The modules' committed states are computed once per sequence whatever the number of anchors, and every slot
    is one batched block call over the anchors (counted on the query projections)."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.1, block_size=4, num_modules=2)
    _, feats, batch = sequence(diverse_target)
    calls = []
    hooks = [module.block.q_proj.register_forward_hook(lambda mod, i, o, m=m: calls.append((m, i[0].shape[1])))
             for m, module in enumerate(drafter.mtp)]
    try:
        for positions in ([3], list(range(11))):
            calls.clear()
            drafter(batch, feats, anchors(*positions))
            a, s = len(positions), feats.shape[1]
            # module 1's stream (module 2's stream needs keys and values only), then slots 1..4 (2..4 on module 2)
            assert calls == [(0, s), (0, a), (1, a), (1, a), (1, a)]
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("num_modules", [1, 2, 4])
def test_mtp_teacher_forcing_is_chain_drafting_given_acceptance(diverse_target, num_modules):
    """The sequence continued by the drafter's own sampled chain: forward (realised tokens = drafted ones) gives
    every slot the distribution ``propose`` drew it from."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.1, block_size=4, num_modules=num_modules)
    ids, feats, _ = sequence(diverse_target)
    n = 6
    state = drafter.begin(feats[:, :n], ids[:, :n])
    proposal = drafter.propose(state, ids[0, n : n + 1], T1, torch.Generator().manual_seed(1))
    seq = torch.cat([ids[0, : n + 1], proposal.tokens])[None]  # (1, n + 1 + K)
    f2 = diverse_target(seq, layers=drafter.target_layers, logits=False).features
    out = drafter({"input_ids": seq, "loss_mask": torch.ones_like(seq, dtype=torch.bool)}, f2, anchors(n))
    torch.testing.assert_close(out.logits[0, 0].softmax(-1), proposal.probs, rtol=1e-4, atol=1e-6)
    assert out.valid.all()
    greedy = drafter.propose(state, ids[0, n : n + 1], GREEDY, None)
    assert greedy.probs is None and greedy.tokens.shape == (4,)


def test_mtp_later_slots_reuse_the_last_module(diverse_target):
    """D = 2, K = 4: slot 1 runs module 1, slots 2..4 module 2 (what serving engines do with an MTP-1 checkpoint)."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.1, block_size=4, num_modules=2)
    assert len(drafter.mtp) == 2
    _, feats, batch = sequence(diverse_target)
    before = drafter(batch, feats, anchors(2, 5)).logits
    with torch.no_grad():
        drafter.mtp[1].proj.weight.mul_(1.5)
    after = drafter(batch, feats, anchors(2, 5)).logits
    torch.testing.assert_close(after[:, :, 0], before[:, :, 0])  # slot 1: module 1 only
    for k in (1, 2, 3):  # every later slot runs the changed module
        assert (after[:, :, k] - before[:, :, k]).abs().max() > 1e-3, k


def test_mtp_begin_without_token_ids_names_the_argument(diverse_target):
    drafter = bound(MTPDrafter, diverse_target, block_size=2)
    _, feats, _ = sequence(diverse_target)
    with pytest.raises(ValueError, match="input_ids"):
        drafter.begin(feats[:, :4])


def test_mtp_gradients_run_through_the_unrolled_chain(make_random_llama):
    """Finite differences through the streams and all K slots, and the last slot's loss reaches the first module:
    h'_{k-1} is not detached between slots (DeepSeek-V3 keeps the causal chain of depths)."""
    target = make_random_llama(vocab_size=8, hidden_size=16, seed=1)
    target.model.double()
    drafter = bound(MTPDrafter, target, scale=0.2, block_size=3, num_modules=2).double()
    ids, _, batch = sequence(target, length=8)
    feats = target(ids, layers=drafter.target_layers, logits=False).features.clone().requires_grad_(True)
    # the RMSNorms compute in float32 (base.rms_norm), hence the coarse step and tolerances
    fn = lambda f: drafter(batch, f, anchors(1, 4)).logits  # noqa: E731
    assert torch.autograd.gradcheck(fn, (feats,), eps=1e-3, atol=1e-3, rtol=1e-2)
    out = drafter(batch, feats.detach(), anchors(1, 4))
    F.cross_entropy(out.logits[0, :, 2], out.labels[0, :, 2]).backward()
    assert drafter.mtp[0].proj.weight.grad.abs().sum() > 0  # slot 3 (module 2) trains module 1 through h'_1


# ----------------------------------------------------------------------------------------- the papers' losses
def per_slot_ce(out):
    return F.cross_entropy(out.logits.flatten(0, 2), out.labels.flatten(), reduction="none").view(out.labels.shape)


def test_medusa_loss_is_ce_with_geometric_weights(diverse_target):
    """Medusa: L = Σ_k 0.8^k CE_k; ``CE`` + ``Geometric(0.8)`` normalised by the weights gives the same up to the
    constant Σ_k 0.8^k (the factor 0.8 between 0.8^k and 0.8^(t-1) cancels)."""
    drafter = bound(MedusaDrafter, diverse_target, scale=0.2, block_size=4)
    _, feats, batch = sequence(diverse_target)
    out = drafter(batch, feats, anchors(1, 3, 6))
    assert out.valid.all()
    ce = per_slot_ce(out).mean(1)[0]  # (K,) CE_k averaged over anchors
    lam = 0.8 ** torch.arange(1, 5, dtype=torch.float32)
    value = Objective(CE(), Geometric(0.8), normalize="weight")(out).value
    torch.testing.assert_close(value, (lam * ce).sum() / lam.sum())


def test_mtp_loss_is_the_depth_average_of_ce(diverse_target):
    """DeepSeek-V3: L_MTP = (λ/D) Σ_k CE_k; ``CE`` + ``Uniform`` with ``normalize: slots`` is its 1/D average."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.1, block_size=3)
    _, feats, batch = sequence(diverse_target)
    out = drafter(batch, feats, anchors(1, 3, 6))
    assert out.valid.all()
    value = Objective(CE(), Uniform(), normalize="slots")(out).value
    torch.testing.assert_close(value, per_slot_ce(out).mean(1)[0].mean())
