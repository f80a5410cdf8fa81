"""DFlashDrafter internals: the per-block attention against one dense masked attention, and its options."""

import pytest
import torch
import torch.nn.functional as F

from lightning_spec.drafters import DFlashDrafter
from lightning_spec.drafters.layers import block_attention


def dense_reference(q, ctx_k, ctx_v, k_blk, v_blk, ctx_mask, block_len):
    """The DFlash training attention written the obvious way: one SDPA over [context; all blocks] with a mask
    that lets each block see its allowed context and itself only."""
    n, hq, q_len, _ = q.shape
    r = hq // ctx_k.shape[1]
    k = torch.cat([ctx_k, k_blk], 2).repeat_interleave(r, 1)
    v = torch.cat([ctx_v, v_blk], 2).repeat_interleave(r, 1)
    blk = torch.arange(q_len) // block_len
    own = (blk[:, None] == blk[None, :]).expand(n, -1, -1)
    ctx = ctx_mask if ctx_mask is not None else torch.ones(n, q_len, ctx_k.shape[2], dtype=torch.bool)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.cat([ctx, own], -1)[:, None])


@pytest.mark.parametrize("blocks,block_len", [(1, 5), (4, 5), (7, 9)])
def test_block_attention_equals_one_dense_masked_attention(blocks, block_len):
    torch.manual_seed(0)
    n, hq, hkv, s, d = 2, 6, 2, 11, 8  # grouped-query: 3 query heads per kv head
    q_len = blocks * block_len
    rand = lambda *shape: torch.randn(*shape, dtype=torch.float64)
    q = rand(n, hq, q_len, d).requires_grad_()
    ctx_k, ctx_v, k_blk, v_blk = rand(n, hkv, s, d), rand(n, hkv, s, d), rand(n, hkv, q_len, d), rand(n, hkv, q_len, d)
    anchors = torch.randint(0, s, (n, blocks))
    anchors[0, 0] = 0  # a block with no context at all: it attends to itself only
    ctx_mask = torch.arange(s)[None, None] < anchors.repeat_interleave(block_len, 1)[..., None]  # (N, Q, S)
    for mask in (ctx_mask, None):
        got = block_attention(q, ctx_k, ctx_v, k_blk, v_blk, mask, block_len)
        want = dense_reference(q, ctx_k, ctx_v, k_blk, v_blk, mask, block_len)
        assert got.shape == (n, hq, q_len, d)
        torch.testing.assert_close(got, want)
        g_got, = torch.autograd.grad(got.square().sum(), q)
        g_want, = torch.autograd.grad(want.square().sum(), q)
        torch.testing.assert_close(g_got, g_want)


def test_init_from_target_copies_the_last_target_layers(tiny_target):
    drafter = DFlashDrafter(block_size=3, num_layers=2, init_from_target=True)
    drafter.bind(tiny_target)
    for layer, src in zip(drafter.layers, tiny_target.base.layers[-2:]):
        assert torch.equal(layer.q_proj.weight, src.self_attn.q_proj.weight)
        assert torch.equal(layer.down_proj.weight, src.mlp.down_proj.weight)
        assert torch.equal(layer.post_norm.weight, src.post_attention_layernorm.weight)
    plain = DFlashDrafter(block_size=3, num_layers=1)
    plain.bind(tiny_target)
    assert not torch.equal(plain.layers[0].q_proj.weight, tiny_target.base.layers[-1].self_attn.q_proj.weight)


def test_init_from_target_with_another_mlp_width_names_the_field(tiny_target):
    drafter = DFlashDrafter(block_size=3, intermediate_size=24, init_from_target=True)
    with pytest.raises(ValueError, match=r"drafter.init_from_target.*intermediate_size"):
        drafter.bind(tiny_target)
