"""Eagle3Drafter (EAGLE-3, Li et al. 2025, arXiv 2503.01840): the chain written out by hand, entry by entry, against
the batched training-time test and against decoding; the input conventions ([e(x_n) ; g_{n-1}] for slot 1, the
drafter's own hidden state after it); the committed entries after a round; one layer call per step whatever the
number of anchors; the chain attention against a dense masked attention (value and gradient)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_spec import SamplingConfig
from lightning_spec.drafters import Anchors, Eagle3Drafter
from lightning_spec.drafters.layers import chain_attention, low_mid_high_layers, rope

K = 4
GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)


LAYOUTS = {  # EAGLE-3 as published, EAGLE-3.1 (a norm per feature layer), speculators' trainer default (one norm)
    "eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_output": True},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def drafter(request, diverse_target):
    """An untrained EAGLE-3 drafter on a reduced draft vocabulary (so draft ids and target ids differ), as published
    and with EAGLE-3.1's options."""
    torch.manual_seed(0)
    d = Eagle3Drafter(block_size=K, draft_vocab_size=48, **LAYOUTS[request.param])
    d.bind(diverse_target)
    d.vocab.set_from_counts(torch.rand(diverse_target.vocab_size))
    with torch.no_grad():  # larger weights than the 0.02 init, so every entry visibly matters
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            elif "norm" in name:  # norms away from 1, so a norm applied to the wrong input shows
                p.uniform_(0.5, 1.5)
    return d.eval()


@pytest.fixture(scope="module")
def sequence(diverse_target, drafter):
    torch.manual_seed(1)
    ids = torch.randint(0, diverse_target.vocab_size, (1, 16))
    feats = diverse_target(ids, layers=drafter.target_layers, logits=False).features  # (1, S, F)
    return ids, feats


def by_hand(d, ids, feats, n, inputs):
    """Slot logits (K, Vd) of the round anchored at n, written out entry by entry with one dense attention per slot.

    Entries: committed position p < n is [e(x_p) ; g_{p-1}] (g_{-1} = 0); slot t is at position n + t - 1 with
    [e(inputs[t - 1]) ; u_t], u_1 = g_{n-1} and u_t = the layer's output at slot t - 1 (inputs[0] = x_n), normed by
    the final norm under EAGLE-3.1's ``norm_output``; g = fc(features), each feature layer normed first under
    ``fc_norm`` and the concatenation under ``norm_before_fc``."""
    layer, theta = d.layer, d.rope_theta
    x = feats[0]  # (S, len(target_layers) * H)
    if d.norm_before_fc:
        x = d.input_norm(x)
    if d.fc_norm:
        h = x.shape[-1] // len(d.target_layers)
        x = torch.cat([d.fc_norms[i](x[:, i * h : (i + 1) * h]) for i in range(len(d.target_layers))], -1)
    g = d.fc(x)  # (S, H)
    zero = torch.zeros_like(g[0])
    entries = [(int(ids[0, p]), g[p - 1] if p else zero, p) for p in range(n)]
    u, out = g[n - 1] if n else zero, []
    for t in range(1, d.block_size + 1):
        entries.append((int(inputs[t - 1]), u, n + t - 1))
        x = torch.stack([torch.cat([layer.input_norm(d.target.embed_tokens.weight[tok]), layer.hidden_norm(h)])
                         for tok, h, _ in entries])  # (E, 2H)
        pos = torch.tensor([p for _, _, p in entries])
        heads, kv, dim = layer.heads, layer.kv_heads, layer.head_dim
        q = rope(layer.q_proj(x[-1:]).view(1, heads, dim).transpose(0, 1), pos[-1:], theta)  # (Hq, 1, D)
        k = rope(layer.k_proj(x).view(-1, kv, dim).transpose(0, 1), pos, theta)  # (Hkv, E, D)
        v = layer.v_proj(x).view(-1, kv, dim).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        attn = ((q @ k.transpose(-1, -2)) / dim**0.5).softmax(-1) @ v  # (Hq, 1, D)
        h = u + layer.o_proj(attn.reshape(-1))
        y = layer.post_norm(h)
        h = h + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
        out.append(d.head(d.norm(h)))
        u = d.norm(h) if d.norm_output else h
    return torch.stack(out)  # (K, Vd)


def test_default_layers_are_low_mid_high():
    assert low_mid_high_layers(30) == [1, 14, 26]  # SmolLM2-135M
    assert low_mid_high_layers(36) == [1, 17, 32]  # Qwen3-8B (SpecForge's aux layers)
    assert low_mid_high_layers(2) == [0, 1]  # a 2-layer test target: clipped and deduplicated


def test_shapes_and_fusion(drafter, diverse_target, sequence):
    ids, feats = sequence
    h = diverse_target.hidden_size
    assert drafter.target_layers == [0, 1] and feats.shape[-1] == 2 * h
    assert drafter.fc.weight.shape == (h, 2 * h)  # len(target_layers) * H -> H
    assert drafter.layer.q_proj.weight.shape[1] == 2 * h  # attention input [embedding ; hidden]
    batch = {"input_ids": ids.expand(2, -1), "loss_mask": torch.ones(2, ids.shape[1], dtype=torch.bool)}
    out = drafter(batch, feats.expand(2, -1, -1), Anchors.all(torch.tensor([[0, 5, 9], [2, 3, 14]])))
    assert out.hidden.shape == (2, 3, K, h)
    assert out.logits.shape == (2, 3, K, 48)
    assert not out.valid[1, 2, 1:].any()  # 14 + 1 is the last position: slots 2.. are past the end


@pytest.mark.parametrize("n", [0, 1, 6, 11])
def test_training_forward_is_the_chain_written_out(drafter, sequence, n):
    ids, feats = sequence
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    got = drafter(batch, feats, Anchors.all(torch.tensor([[n, 3]]))).logits[0, 0]  # (K, Vd)
    want = by_hand(drafter, ids, feats, n, ids[0, n : n + K])  # teacher-forced: the data's tokens as drafts
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [0, 6, 11])
def test_decoding_is_the_chain_written_out(drafter, sequence, n):
    ids, feats = sequence
    state = drafter.begin(feats[:, :n], ids[:, :n])
    greedy = drafter.propose(state, ids[0, n : n + 1], GREEDY)
    want = by_hand(drafter, ids, feats, n, torch.cat([ids[0, n : n + 1], greedy.tokens[:-1]]))
    assert greedy.tokens.tolist() == drafter.vocab.to_target(want.argmax(-1)).tolist()
    sampled = drafter.propose(state, ids[0, n : n + 1], T1, torch.Generator().manual_seed(0))
    want = by_hand(drafter, ids, feats, n, torch.cat([ids[0, n : n + 1], sampled.tokens[:-1]]))
    torch.testing.assert_close(sampled.probs, drafter.vocab.scatter(want.softmax(-1)), atol=1e-5, rtol=1e-5)
    assert torch.all(sampled.probs[torch.arange(K), sampled.tokens] > 0)


def test_slot_one_reads_the_feature_before_the_anchor(drafter, sequence):
    """Anchor n: slot 1 is [e(x_n) ; g_{n-1}]; the anchor's own features and later ones are never read, so slots
    t > 1 take their hidden input from the drafter (with the hand-written chain: its output at slot t - 1)."""
    ids, feats = sequence
    n = 7
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    anchors = Anchors.all(torch.tensor([[n]]))
    base = drafter(batch, feats, anchors).logits
    later = feats.clone()
    later[:, n:] += 5.0
    torch.testing.assert_close(drafter(batch, later, anchors).logits, base)
    before = feats.clone()
    before[:, n - 1] += 5.0
    assert not torch.allclose(drafter(batch, before, anchors).logits[0, 0, 0], base[0, 0, 0])
    # slot t reads the tokens x_n..x_{n+t-1} only: changing x_{n+2} leaves slots 1 and 2 alone, moves slot 3
    other = ids.clone()
    other[0, n + 2] = (other[0, n + 2] + 1) % drafter.target.vocab_size
    moved = drafter({"input_ids": other, "loss_mask": batch["loss_mask"]}, feats, anchors).logits
    torch.testing.assert_close(moved[0, 0, :2], base[0, 0, :2])
    assert not torch.allclose(moved[0, 0, 2], base[0, 0, 2])


def test_a_round_commits_entries_built_from_true_features(drafter, diverse_target, sequence):
    """After a round that accepts some drafts, the drafts' own entries are gone and the committed positions hold
    the entries a fresh prefill of the committed prefix builds (re-run with the target's real features)."""
    ids, _ = sequence
    n = 6
    state = drafter.begin(diverse_target(ids[:, :n], layers=drafter.target_layers, logits=False).features, ids[:, :n])
    prop = drafter.propose(state, ids[0, n : n + 1], GREEDY)
    committed = torch.cat([ids[0, : n + 1], prop.tokens[:2]])[None]  # the anchor and two accepted drafts
    verified = torch.cat([ids[0, : n + 1], prop.tokens])[None]  # what the target verified
    feats = diverse_target(verified, layers=drafter.target_layers, logits=False).features[:, n:]  # (1, K + 1, F)
    drafter.extend(state, feats, [0, 1, 2])
    full = diverse_target(committed, layers=drafter.target_layers, logits=False).features
    fresh = drafter.begin(full, committed)
    assert state.length == fresh.length == n + 3
    torch.testing.assert_close(state.keys, fresh.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.values, fresh.values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.last, fresh.last, atol=1e-5, rtol=1e-5)
    after = drafter.propose(state, ids[0, :1], GREEDY).tokens
    assert after.tolist() == drafter.propose(fresh, ids[0, :1], GREEDY).tokens.tolist()


def test_all_anchors_of_a_step_run_in_one_layer_call(drafter, sequence):
    ids, feats = sequence
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    calls = []
    hook = drafter.layer.q_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    try:
        for anchors in ([[3]], [list(range(12))]):
            calls.clear()
            drafter(batch, feats, Anchors.all(torch.tensor(anchors)))
            assert calls == [len(anchors[0])] * K  # one query call per TTT step, all anchors at once
    finally:
        hook.remove()


def test_begin_without_token_ids_names_the_argument(drafter, sequence):
    _, feats = sequence
    with pytest.raises(ValueError, match="input_ids"):
        drafter.begin(feats[:, :4])


def test_config_rebuilds_the_drafter(drafter):
    again = Eagle3Drafter(**drafter.config_dict())
    assert again.config_dict() == drafter.config_dict()
    with pytest.raises(ValueError, match="drafter.block_size"):
        Eagle3Drafter(block_size=0)


def test_chain_attention_equals_a_dense_masked_attention():
    """Each chain's query over the shared entries it may see plus its own entries, against one SDPA over
    [shared ; every chain's own entries] with a mask; value and gradient, float64."""
    torch.manual_seed(0)
    n, hq, hkv, s, a, j, d = 2, 6, 2, 9, 5, 3, 8
    rand = lambda *shape: torch.randn(*shape, dtype=torch.float64)
    q = rand(n, hq, a, d).requires_grad_()
    ctx_k, ctx_v = rand(n, hkv, s, d), rand(n, hkv, s, d)
    own_k, own_v = rand(n, hkv, a, j, d).requires_grad_(), rand(n, hkv, a, j, d)
    mask = torch.arange(s) <= torch.randint(0, s, (n, a))[..., None]  # (N, A, S)
    got = chain_attention(q, ctx_k, ctx_v, mask, own_k, own_v)
    r = hq // hkv
    k = torch.cat([ctx_k, own_k.flatten(2, 3)], 2).repeat_interleave(r, 1)  # (N, Hq, S + A*J, D)
    v = torch.cat([ctx_v, own_v.flatten(2, 3)], 2).repeat_interleave(r, 1)
    own = torch.arange(a)[:, None] == torch.arange(a).repeat_interleave(j)[None]  # (A, A*J)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([mask, own.expand(n, -1, -1)], -1)[:, None])
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, own_k))
    for g_got, g_want in zip(grads, torch.autograd.grad(want.square().sum(), (q, own_k))):
        torch.testing.assert_close(g_got, g_want)
    no_own = chain_attention(q, ctx_k, ctx_v, None, own_k[:, :, :, :0], own_v[:, :, :, :0])
    torch.testing.assert_close(no_own, F.scaled_dot_product_attention(
        q, ctx_k.repeat_interleave(r, 1), ctx_v.repeat_interleave(r, 1)))


def test_decoding_reuses_stacked_weights_and_head_rows_until_they_change(diverse_target):
    """Decoding stacks q/k/v and gate/up into one product each and gathers the head's draft-vocabulary rows once
    (``fused_weight``, ``DraftVocab.head_weight``): a slot then equals the separate products, the cached tensors are
    reused from slot to slot, rebuilt after an optimizer step or a new vocabulary, and training (gradients on)
    never reads them, so its gradients reach every projection."""
    torch.manual_seed(0)
    d = Eagle3Drafter(block_size=K, draft_vocab_size=48)
    d.bind(diverse_target)
    d.vocab.set_from_counts(torch.rand(diverse_target.vocab_size))
    ids = torch.randint(0, diverse_target.vocab_size, (1, 12))
    feats = diverse_target(ids, layers=d.target_layers, logits=False).features
    hidden = diverse_target.config.hidden_size
    layer, emb, u, pos = d.layer, torch.randn(1, 3, hidden), torch.randn(1, 3, hidden), torch.arange(3)[None]
    with torch.no_grad():
        stacked = layer.qkv(emb, u, pos, d.rope_theta)
        cached = {name: held[1] for name, held in layer.fused.items()}
        rows = d.vocab.head_weight(diverse_target.lm_head)
        assert set(cached) == {"qkv"} and d.vocab.head_weight(diverse_target.lm_head) is rows
    separate = layer.qkv(emb, u, pos, d.rope_theta)  # gradients on: the separate products
    for a, b in zip(stacked, separate):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)
    state = d.begin(feats, ids)
    with torch.no_grad():
        d.propose(state, ids[0, -1:], GREEDY)
        assert layer.fused["qkv"][1] is cached["qkv"] and set(layer.fused) == {"qkv", "gate_up"}
        layer.q_proj.weight.add_(1.0)  # an update: the stacked weight is rebuilt from the new values
        rebuilt = layer.qkv(emb, u, pos, d.rope_theta)
        assert layer.fused["qkv"][1] is not cached["qkv"] and not torch.allclose(rebuilt[0], stacked[0])
        d.vocab.set_from_counts(torch.rand(diverse_target.vocab_size))
        assert not torch.equal(d.vocab.head_weight(diverse_target.lm_head), rows)
    out = d({"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}, feats)
    out.head(out.hidden, None).logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in (layer.q_proj.weight, layer.k_proj.weight, layer.gate_proj.weight))
