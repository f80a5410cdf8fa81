"""Target: the GQA attention shortcut load_target installs must give exactly transformers' outputs; the target dtype
(``auto``: bf16 where the CPU has native bf16 matrix instructions) and its one-sentence error."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_spec import load_target
from lightning_spec.assets import resolve_target_folder
from lightning_spec.target import Target
from lightning_spec.target_loading import resolve_dtype


def reference_target() -> Target:
    """The same weights through transformers' own SDPA attention (its repeat_kv path)."""
    model = AutoModelForCausalLM.from_pretrained(resolve_target_folder("tiny-random"), attn_implementation="sdpa")
    return Target(model)


def test_load_target_uses_the_shared_kv_attention():
    assert load_target("tiny-random").model.config._attn_implementation == "lightning_spec_sdpa"


def test_shared_kv_attention_matches_transformers_sdpa():
    fast, ref = load_target("tiny-random"), reference_target()
    assert ref.model.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (3, 24))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding: the masked multi-token path
    mask[2, 20:] = 0
    a, b = fast(ids, layers=[0, 1], attention_mask=mask), ref(ids, layers=[0, 1], attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(a.logits[real], b.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.features[real], b.features[real], rtol=1e-5, atol=1e-5)
    # a verify block of 5 tokens against a warm cache (the speculative decoding path)
    ca, cb = fast.new_cache(), ref.new_cache()
    fast(ids[:1, :16], cache=ca), ref(ids[:1, :16], cache=cb)
    va, vb = fast(ids[:1, 16:21], cache=ca, layers=[1]), ref(ids[:1, 16:21], cache=cb, layers=[1])
    torch.testing.assert_close(va.logits, vb.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(va.features, vb.features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("caps,want", [({"avx512_bf16": True}, torch.bfloat16), ({"amx_bf16": True}, torch.bfloat16),
                                       ({"avx512_bf16": False, "amx_bf16": False}, torch.float32)])
def test_auto_dtype_is_bf16_where_the_cpu_multiplies_it_natively(monkeypatch, caps, want):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert resolve_dtype("auto", "cpu") == want
    assert load_target("tiny-random", dtype="auto").lm_head.weight.dtype == want


def test_target_dtype_is_checked_in_one_sentence():
    assert resolve_dtype("bfloat16") == torch.bfloat16 and resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="target_dtype must be float32, bfloat16, float16 or auto, got 'fp32'"):
        load_target("tiny-random", dtype="fp32")


def test_an_unknown_target_name_lists_the_packaged_names():
    """``load_target("no-such-name")`` reported a network error."""
    with pytest.raises(ValueError, match=r"not a packaged name \(smollm2-135m-instruct, tiny-random\)"):
        load_target("no-such-name")
    with pytest.raises(ValueError, match="not a packaged name"):
        load_target("no-such-org/no-such-model")  # HF_HUB_OFFLINE=1 in the tests: no download is tried


@pytest.mark.parametrize("layers", [True, False], ids=["whole", "heads-only"])
def test_a_load_resolves_the_target_spec_once(monkeypatch, layers):
    """``load_target`` resolves its spec to a folder and checks its remote code once (``TargetSource``), and the
    tokenizer, the heads-only read and an export reuse that folder (``Target.folder``) instead of resolving again."""
    import lightning_spec.target_loading as loading

    calls = {"resolve": 0, "remote_code": 0}

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(loading, "resolve_target_folder", counted("resolve", loading.resolve_target_folder))
    monkeypatch.setattr(loading, "refuse_remote_code", counted("remote_code", loading.refuse_remote_code))
    target = load_target("tiny-random", layers=layers)
    assert calls == {"resolve": 1, "remote_code": 1}
    assert target.folder == resolve_target_folder("tiny-random") and target.tokenizer is not None
    if layers:  # a cast copy was loaded from the same place
        assert target.cast(torch.bfloat16).folder == target.folder
    source = loading.TargetSource.of("tiny-random")
    assert loading.load_tokenizer(source) is not None and calls["resolve"] == 2  # a resolved source: no third


def test_the_fingerprint_is_the_weights_not_the_folder_they_were_loaded_from(monkeypatch, tmp_path):
    """Rollouts kept in the repository (regenerated/) are checked against the fingerprint of the target that trains
    on them: the same weights loaded from another cache folder (another machine, another $HOME) must match. The
    earlier fingerprint, which hashed the config's folder path, still matches on the machine that recorded it."""
    from lightning_spec.data.rollouts import check_compatible
    from lightning_spec.sampling import SamplingConfig

    here = load_target("tiny-random")
    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(tmp_path / "elsewhere"))
    there = load_target("tiny-random")
    assert here.config._name_or_path != there.config._name_or_path
    assert here.fingerprint == there.fingerprint  # the same weights, wherever they were built
    assert here.fingerprints[1] != there.fingerprints[1]  # the earlier fingerprint hashed the path
    there.config.attribute_a_later_release_adds, there.config.transformers_version = 1, "99.0"
    there._fingerprints = None
    assert there.fingerprint == here.fingerprint  # nor does a transformers upgrade change it
    greedy = SamplingConfig()
    for recorded in here.fingerprints:  # a rollouts folder of either age, on the machine that drew it
        check_compatible({"target_fingerprint": recorded, "target": "tiny-random", "sampling": greedy.to_dict()},
                         here, greedy)
    with pytest.raises(ValueError, match="were drawn from target"):
        check_compatible({"target_fingerprint": here.fingerprints[1], "target": "tiny-random",
                          "sampling": greedy.to_dict()}, there, greedy)
    with torch.no_grad():
        there.model.lm_head.weight[0, 0] += 1.0
    there._fingerprints = None
    assert there.fingerprint != here.fingerprint  # and other weights are another target
