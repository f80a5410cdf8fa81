"""``FastForward`` (lightning_spec/fast_forward.py): the decoding forward on a static cache gives transformers'
outputs, for every architecture it claims, and every path a round takes through it.

Against the same target run through transformers (``decode="transformers"``): the prefill's logits and features
(the last layer's feature included, which transformers records after the final norm), a chain verify over the
cache, a tree verify, the cache after a tree's compaction, a prompt longer than the cache's first capacity, and
whole greedy decodings. Then what the fast path must not do: run a model it does not cover (Qwen3-MoE falls back
and says why), keep weights that moved, or keep a second copy of the fused projections. The bf16 kernel path
(oneDNN on reordered weights) is checked against the aten path to rounding.
"""

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_spec import generate
from lightning_spec.errors import UserError
from lightning_spec.fast_forward import FastForward, StaticCache
from lightning_spec.target import Target
from lightning_spec.target_loading import load_target

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "llama-tied-mha": lambda: LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_key_value_heads": 4,
                                                               "tie_word_embeddings": True})),
    "qwen2-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),  # biases on q, k, v
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),  # q/k norm; head_dim * heads != hidden
}
TOL = dict(atol=2e-5, rtol=2e-5)


def pair(name: str) -> tuple[Target, Target]:
    """(the model on the fast path, a deep copy of it on transformers' forward), same weights."""
    torch.manual_seed(0)
    model = MODELS[name]()
    reference = Target(copy.deepcopy(model), decode="transformers")
    return Target(model), reference


@pytest.fixture(scope="module", params=list(MODELS))
def targets(request):
    fast, reference = pair(request.param)
    assert fast.fast_decoding is None, fast.fast_decoding
    assert isinstance(fast.new_cache(), StaticCache) and not isinstance(reference.new_cache(), StaticCache)
    return fast, reference


def ids(n: int, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


def test_prefill_chain_and_tree_verify_give_transformers_outputs(targets):
    fast, reference = targets
    layers = [0, 1]  # the last layer's feature is recorded after the final norm, as transformers does
    caches = [fast.new_cache(), reference.new_cache()]
    prefill = [t(ids(11), layers=layers, cache=c) for t, c in zip(targets, caches)]
    chain = [t(ids(5, seed=1), layers=[1], cache=c) for t, c in zip(targets, caches)]  # a verify block
    for t, c in zip(targets, caches):
        t.crop(c, 11)
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    tree = [t(ids(4, seed=2), layers=[0], cache=c, positions=depth, tree_mask=tree_mask)
            for t, c in zip(targets, caches)]
    for mine, theirs in (prefill, chain, tree):
        torch.testing.assert_close(mine.logits, theirs.logits, **TOL)
        torch.testing.assert_close(mine.features, theirs.features, **TOL)
        torch.testing.assert_close(mine.last_hidden, theirs.last_hidden, **TOL)
    # after keeping the tree's path [0, 1, 3] the next token sees what a chain of those three would have left
    for t, c in zip(targets, caches):
        t.keep(c, 11, [0, 1, 3])
    nxt = [t(ids(1, seed=3), cache=c).logits for t, c in zip(targets, caches)]
    torch.testing.assert_close(nxt[0], nxt[1], **TOL)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 15


def test_greedy_decoding_is_transformers_greedy_decoding(targets):
    fast, reference = targets
    for seed, length in ((0, 1), (1, 7), (2, 300)):  # 300 tokens pass the static cache's first capacity (256)
        prompt = ids(length, seed=seed)[0].tolist()
        assert generate(fast, prompt, 12).tokens == generate(reference, prompt, 12).tokens


def test_a_model_it_does_not_cover_runs_transformers_forward_and_says_why():
    torch.manual_seed(0)
    moe = Target(Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=16, decoder_sparse_step=1)))
    assert moe.fast_decoding == "model type 'qwen3_moe' (supported: llama, qwen2, qwen3, mistral)"
    assert not isinstance(moe.new_cache(), StaticCache)
    assert len(generate(moe, [1, 2, 3], 4).tokens) == 4
    with pytest.raises(ValueError, match="FastForward cannot run this model: model type 'qwen3_moe'"):
        FastForward(moe.model)
    assert Target(LlamaForCausalLM(LlamaConfig(**SHAPE)), decode="transformers").fast_decoding == \
        "decode='transformers'"
    with pytest.raises(UserError, match="target decode must be one of fast, transformers, got 'quick'"):
        load_target("tiny-random", decode="quick")


def test_projections_are_fused_in_place_and_a_moved_model_is_fused_again():
    """The fused weights are the model's own storage (no second copy), and a dtype change rebuilds the forward."""
    fast, reference = pair("llama")
    cache = fast.new_cache()
    attn, mlp = fast.base.layers[0].self_attn, fast.base.layers[0].mlp
    fused = fast._fast.layers[0]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused["qkv"].weight.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == fused["gate_up"].weight.untyped_storage().data_ptr()
    assert fast.fingerprint == reference.fingerprint  # the same values under the model's parameter names
    before = fast._fast
    fast(ids(4), cache=cache)
    fast.model.to(torch.float64)
    reference.model.to(torch.float64)
    cache = fast.new_cache()
    assert fast._fast is not before and cache.kv.dtype == torch.float64
    torch.testing.assert_close(fast(ids(6), cache=cache).logits, reference(ids(6), cache=reference.new_cache()).logits,
                               **TOL)  # transformers norms in fp32 whatever the dtype


def test_the_bf16_kernel_path_agrees_with_aten():
    """oneDNN on reordered weights, the bf16 CPU path ``kernels='auto'`` picks, gives the aten path's outputs to bf16
    rounding, over a prefill and the 1-token and block rounds after it."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    plain = FastForward(copy.deepcopy(model), kernels="aten")
    onednn = FastForward(model)
    assert onednn.kernels == "onednn" and plain.kernels == "aten"
    caches = [plain.new_cache(), onednn.new_cache()]
    past = 0
    for n in (9, 1, 5, 1):
        x = ids(n, seed=n)
        outs = [f.logits(f(x, c, torch.arange(past, past + n), None)[0]) for f, c in zip((plain, onednn), caches)]
        torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=0.05, rtol=0.05)
        past += n
