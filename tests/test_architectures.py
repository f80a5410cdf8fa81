"""Any target a user brings: three decoder architectures, the target options, and head-only loading.

Each architecture is a tiny random model saved to a folder (as a user's own model would be) and loaded by
``load_target(folder)``: Llama; Qwen3, whose attention norms queries and keys per head (``q_norm``/``k_norm``) and
whose head_dim is not hidden / heads; and Qwen3-MoE, whose MLP is a router over experts. For each, every drafter
family binds, takes a training step with a finite loss and a gradient, decodes greedy output identical to plain
greedy decoding, and round-trips through export in every format that can express it (the same greedy tokens
after ``load_drafter`` of the folder). Head-only loading (``layers=False``) gives the same fingerprint, embedding
and LM head as the whole model with every decoder layer on the meta device.
"""

import json

import pytest
import torch
from helpers.families import FAMILIES, own_objective
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from lightning_spec import generate, load_drafter, load_target
from lightning_spec.assets import byte_chat_tokenizer
from lightning_spec.checkpoint import FORMATS, export_drafter
from lightning_spec.target import TargetOptions

SHAPE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),  # q/k norm; head_dim * heads != hidden
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=16, decoder_sparse_step=1)),
}
PROMPTS = [[5, 17, 40, 9], [60, 2, 33, 71, 8, 12]]
NEW = 12


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch_target(request, tmp_path_factory):
    """(architecture, its model's folder with the packaged byte tokenizer, the target loaded from the folder)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    ARCHITECTURES[request.param]().save_pretrained(folder)
    byte_chat_tokenizer().save_pretrained(folder)
    return request.param, folder, load_target(str(folder))


def one_step(drafter, target) -> None:
    """One optimizer step of CE (SelectorCE for DFlash2) on a random sequence: the loss is finite and a gradient
    flows."""
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))  # (N, S)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    features = target(ids, layers=drafter.target_layers, logits=False).features  # (N, S, F)
    drafter.train()
    terms = own_objective(drafter)(drafter(batch, features))
    loss = terms.num / terms.den
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
    torch.optim.SGD(drafter.parameters(), lr=1e-3).step()
    drafter.zero_grad(set_to_none=True)
    drafter.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_decodes_and_exports_on_the_architecture(family, arch_target, tmp_path):
    arch, folder, target = arch_target
    torch.manual_seed(0)
    drafter = FAMILIES[family](3)
    drafter.bind(target)
    one_step(drafter, target)
    plain = [generate(target, p, NEW).tokens for p in PROMPTS]
    assert [generate(target, p, NEW, drafter=drafter).tokens for p in PROMPTS] == plain, (arch, family)
    exported = 0
    for fmt, module in FORMATS.items():
        if drafter.family not in module.CODECS:
            continue
        try:
            module.CODECS[drafter.family].check(drafter)
        except ValueError:
            continue  # an option set this format cannot express (the *_served families are the ones it can)
        out = export_drafter(drafter, tmp_path / fmt, fmt, target_spec=str(folder)).folder
        loaded = load_drafter(out, target=target)
        assert [generate(target, p, NEW, drafter=loaded).tokens for p in PROMPTS] == plain
        assert [generate(target, p, NEW, drafter=loaded).accept_lengths for p in PROMPTS] == [
            generate(target, p, NEW, drafter=drafter).accept_lengths for p in PROMPTS
        ]
        exported += 1
    if family.endswith("_served") or family == "eagle3":
        assert exported, f"{family} exports to the speculators format on {arch}"


def test_head_only_loading_reads_the_heads_and_nothing_else(arch_target):
    arch, folder, whole = arch_target
    if arch == "qwen3_moe":  # transformers fuses the stored per-expert tensors on load: names differ from the files'
        with pytest.warns(UserWarning, match="safetensors names differ.*loading it whole"):
            assert load_target(str(folder), layers=False).has_layer_weights
        return
    heads = load_target(str(folder), layers=False)
    assert not heads.has_layer_weights and whole.has_layer_weights
    assert all(p.is_meta for layer in heads.base.layers for p in layer.parameters())
    assert heads.fingerprints == whole.fingerprints  # streamed tensor by tensor, the same recipes (now and before)
    assert torch.equal(heads.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(heads.embed_tokens.weight, whole.embed_tokens.weight)
    with pytest.raises(ValueError, match="without its layer weights"):
        heads(torch.tensor([[1, 2, 3]]))


def test_load_drafter_reads_only_the_targets_heads(arch_target, tmp_path):
    """``export`` and ``load_drafter`` without a target in memory: the recorded target comes back head-only, and the
    drafter then decodes with the user's whole target (same fingerprint) exactly as before."""
    import gc

    from lightning_spec.checkpoint import save_drafter
    from lightning_spec.target import live_target

    arch, _, _ = arch_target
    if arch == "qwen3_moe":
        pytest.skip("Qwen3-MoE's stored expert tensors are fused on load: load_drafter reads it whole (warned above)")
    torch.manual_seed(1)  # weights of this test only: no other live target shares them
    folder = tmp_path / arch
    ARCHITECTURES[arch]().save_pretrained(folder)
    byte_chat_tokenizer().save_pretrained(folder)
    whole = load_target(str(folder))
    drafter = FAMILIES["eagle3"](3)
    drafter.bind(whole)
    saved = save_drafter(drafter, tmp_path / "d", str(folder))
    fingerprint, want = whole.fingerprint, generate(whole, PROMPTS[0], NEW, drafter=drafter).tokens
    del whole, drafter
    gc.collect()
    assert live_target(fingerprint) is None  # load_drafter must read the recorded target itself
    loaded = load_drafter(saved)
    assert not loaded.target.has_layer_weights and loaded.target.fingerprint == fingerprint
    target = load_target(str(folder))
    assert generate(target, PROMPTS[0], NEW, drafter=loaded).tokens == want == generate(target, PROMPTS[0], NEW).tokens


# ------------------------------------------------------------------------------------------- target options
def test_target_options_reach_the_model_and_the_tokenizer():
    target = load_target("tiny-random", options={"attn_implementation": "eager", "revision": "main",
                                                 "chat_template_kwargs": {"flavour": "x"}})
    assert target.model.config._attn_implementation == "eager"
    assert target.chat_template_kwargs == {"flavour": "x"}
    assert target.options.to_dict() == {"revision": "main", "attn_implementation": "eager",
                                        "chat_template_kwargs": {"flavour": "x"}}
    assert TargetOptions().to_dict() == {}
    with pytest.raises(ValueError, match=r"model.target_options has unknown keys \['thinking'\]"):
        TargetOptions.of({"thinking": False})


REMOTE_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class HouseConfig(LlamaConfig):
    model_type = "house-llama"


class HouseForCausalLM(LlamaForCausalLM):
    config_class = HouseConfig
'''


@pytest.fixture
def remote_code_folder(tmp_path):
    """A model folder whose classes are its own code (``auto_map``), as hub models with custom code ship."""
    torch.manual_seed(0)
    folder = tmp_path / "house"
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)
    byte_chat_tokenizer().save_pretrained(folder)
    (folder / "modeling_house.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="house-llama", architectures=["HouseForCausalLM"],
                  auto_map={"AutoConfig": "modeling_house.HouseConfig",
                            "AutoModelForCausalLM": "modeling_house.HouseForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_remote_code_is_refused_without_trust_remote_code(remote_code_folder):
    with pytest.raises(ValueError, match=r"needs the Python code in its folder \(modeling_house.HouseForCausalLM.*"
                                         r"set model.target_options.trust_remote_code: true"):
        load_target(str(remote_code_folder))
    target = load_target(str(remote_code_folder), options={"trust_remote_code": True})
    assert type(target.model).__name__ == "HouseForCausalLM"
    assert generate(target, PROMPTS[0], 4).tokens  # it runs
