"""Medusa heads and DeepSeek-V3 MTP modules (lightning_spec/drafters/heads.py): the pieces by hand, the anchor
convention (both read h_{n-1}; Medusa never reads the anchor), teacher forcing == chain drafting, module reuse,
the attention scope, the papers' losses as objective parts, and gradients.

The decoding guarantees (greedy == reference, lossless sampling, offline == engine rounds, save/load) are held for
both families by tests/test_families.py.
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_spec import SamplingConfig
from lightning_spec.drafters import Anchors, MedusaDrafter, MTPDrafter
from lightning_spec.drafters.block import DraftLayer, rope
from lightning_spec.objectives import CE, Geometric, Objective, Uniform

T1 = SamplingConfig(temperature=1.0)


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
    torch.testing.assert_close(drafter.slot_logits(state), out.logits[0, 0], rtol=1e-5, atol=1e-5)


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
    from lightning_spec.drafters.heads import ResBlock

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
def test_mtp_two_slots_by_hand(diverse_target):
    """One module, two slots: u_k = M[RMSNorm(h'_{k-1}); RMSNorm(Emb(x_{n+k-1}))], the block (slot 2 attends to slot
    1's entry and its own, RoPE at slots 0 and 1), the output norm and the LM head (DeepSeek-V3 Eq. 21-23)."""
    drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=2, num_modules=1)
    ids, feats, batch = sequence(diverse_target)
    n = 5
    out = drafter(batch, feats, anchors(n))
    m = drafter.mtp[0]
    b = m.block
    eps = diverse_target.config.rms_norm_eps
    emb, w = diverse_target.embed_tokens.weight, diverse_target.lm_head.weight
    heads, kv, d = b.heads, b.kv_heads, b.head_dim
    keys, values, h = [], [], feats[0, n - 1]
    for k in range(2):
        u = m.proj.weight @ torch.cat([rms(h, m.hnorm.weight, eps), rms(emb[ids[0, n + k]], m.enorm.weight, eps)])
        x = rms(u, b.input_norm.weight, eps)
        pos = torch.tensor([k])
        q = rope((b.q_proj.weight @ x).view(heads, 1, d), pos, drafter.rope_theta)  # (heads, 1, D)
        keys.append(rope((b.k_proj.weight @ x).view(kv, 1, d), pos, drafter.rope_theta))
        values.append((b.v_proj.weight @ x).view(kv, 1, d))
        kk = torch.cat(keys, 1).repeat_interleave(heads // kv, 0)  # (heads, k + 1, D)
        vv = torch.cat(values, 1).repeat_interleave(heads // kv, 0)
        attn = ((q @ kk.transpose(1, 2)) / d**0.5).softmax(-1) @ vv  # (heads, 1, D)
        h = u + b.o_proj.weight @ attn.reshape(-1)
        x = rms(h, b.post_norm.weight, eps)
        h = h + b.down_proj.weight @ (F.silu(b.gate_proj.weight @ x) * (b.up_proj.weight @ x))
        torch.testing.assert_close(out.logits[0, 0, k], w @ rms(h, m.out_norm.weight, eps), rtol=1e-4, atol=1e-4)


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
    greedy = drafter.propose(state, ids[0, n : n + 1], SamplingConfig(), None)
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


def test_mtp_blocks_attend_to_their_own_module_entries_of_the_round(diverse_target):
    """One module: slot k attends to slots 1..k, so its queries and keys matter from slot 2 on. A module that runs at
    one slot only attends to itself, a softmax over one key: it has no query and key projections, and its
    attention equals the full block's with any of them."""
    _, feats, batch = sequence(diverse_target)
    drafter = bound(MTPDrafter, diverse_target, scale=0.2, block_size=3, num_modules=1)
    before = drafter(batch, feats, anchors(3, 7)).logits
    with torch.no_grad():
        drafter.mtp[0].block.q_proj.weight.mul_(-2.0)
        drafter.mtp[0].block.k_proj.weight.mul_(3.0)
    after = drafter(batch, feats, anchors(3, 7)).logits
    torch.testing.assert_close(after[:, :, 0], before[:, :, 0])
    assert (after[:, :, 1:] - before[:, :, 1:]).abs().max() > 1e-3

    per_slot = bound(MTPDrafter, diverse_target, scale=0.2, block_size=3, num_modules=3)
    assert not any(m.attends or hasattr(m.block, "q_proj") or hasattr(m.block, "k_proj") for m in per_slot.mtp)
    reused = bound(MTPDrafter, diverse_target, block_size=3, num_modules=2)
    assert [m.attends for m in reused.mtp] == [False, True] and hasattr(reused.mtp[1].block, "q_proj")
    # the single-position shortcut is the full block with a query and a key of its own
    m = per_slot.mtp[0]
    b = m.block
    full = DraftLayer(diverse_target.hidden_size, b.heads, b.kv_heads, b.head_dim, b.gate_proj.out_features,
                      b.input_norm.eps)
    missing = full.load_state_dict(b.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["k_proj.weight", "q_proj.weight"]  # random: they cannot matter
    u, pos = torch.randn(5, 1, diverse_target.hidden_size), torch.zeros(5, 1, dtype=torch.long)
    h, entries = m.run_block(u, pos, None, per_slot.rope_theta)
    assert entries is None
    empty = torch.zeros(5, b.kv_heads, 0, b.head_dim)
    torch.testing.assert_close(h, full(u, pos, empty, empty, None, 1, per_slot.rope_theta)[:, 0])


def test_mtp_gradients_run_through_the_unrolled_chain(make_random_llama):
    """Finite differences through all K slots, and the last slot's loss reaches the first module: h'_{k-1}
    is not detached between slots (DeepSeek-V3 keeps the causal chain of depths)."""
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
