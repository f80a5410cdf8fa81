"""Leaving the framework: ``lightning-spec export`` writes a drafter in the speculators format (which vLLM serves) or
SGLang's layouts, and ``load_drafter`` reads such a folder back — ours, or one the speculators library wrote.

- an exported drafter reloads to the same weights, the same greedy tokens and the same offline rounds, in every
  format and family that has a codec; without our sidecar (a folder another tool wrote) it still does;
- the fields serving engines read carry their conventions (feature layer numbering, d2t, DFlash's block size and
  bidirectional block, EAGLE-3's un-normed residual);
- families or options a format cannot express are refused in one sentence, nothing written;
- a drafter the speculators library itself wrote loads as our Eagle3Drafter and fine-tunes with ``init_from``;
- reading a folder never runs code from it.
"""

import json
from pathlib import Path

import pytest
import torch
from fit_probe import fit_checkpoint
from safetensors.torch import load_file
from test_decoding import MAX_NEW
from test_families import FAMILIES, trained
from test_module import data_files, quiet_trainer  # noqa: F401 (fixture)

from lightning_spec import SamplingConfig, generate, load_drafter, offline_rounds
from lightning_spec.cli import main
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import BlockDrafter, DSparkDrafter, Eagle3Drafter
from lightning_spec.export import export_drafter
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Objective

LAYOUT = Path(__file__).parent / "data" / "speculators_eagle3_tiny"  # what the speculators library wrote
EXPORTABLE = {
    "eagle3": lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48),
    "eagle3_own_head": lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48, own_head=True),
    "dflash": lambda k: BlockDrafter(block_size=k, num_layers=2, num_anchors=64, draft_vocab_size=48, qk_norm=True,
                                     mask_token_id=5),
}


@pytest.fixture(scope="module")
def speculators_folder(tmp_path_factory) -> Path:
    """An EAGLE-3 folder in the layout speculators 0.9.0 wrote (tests/data: its config.json, and each tensor's name,
    shape and dtype, the vocabulary maps' values): the float tensors, random in the library's file too, are drawn
    here (seeded; norms near 1, matrices N(0, 0.2)) so that no weights are committed."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("speculators") / "eagle3"
    folder.mkdir()
    (folder / "config.json").write_text((LAYOUT / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, entry in json.loads((LAYOUT / "tensors.json").read_text()).items():
        dtype = getattr(torch, entry["dtype"])
        if "values" in entry:
            tensors[name] = torch.tensor(entry["values"], dtype=dtype).reshape(entry["shape"])
        elif len(entry["shape"]) == 1:
            tensors[name] = (0.5 + torch.rand(entry["shape"], generator=gen)).to(dtype)
        else:
            tensors[name] = (0.2 * torch.randn(entry["shape"], generator=gen)).to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def prompts(diverse_target):
    from test_decoding import random_prompts

    return random_prompts(diverse_target.vocab_size)


@pytest.fixture(scope="module", params=list(EXPORTABLE))
def exportable(request, diverse_target, prompts):
    """(name, a drafter accepted in a good share of rounds, its draft vocabulary a reduced non-prefix set)."""
    FAMILIES[f"export_{request.param}"] = EXPORTABLE[request.param]
    counts = torch.zeros(diverse_target.vocab_size)
    counts[torch.tensor([t for p in prompts for t in p])] += 1
    counts += torch.rand(diverse_target.vocab_size, generator=torch.Generator().manual_seed(0))
    try:
        drafter = trained(f"export_{request.param}", diverse_target, prompts, k=3)
    finally:
        del FAMILIES[f"export_{request.param}"]
    drafter.vocab.set_from_counts(counts)  # before training would be usual; any set works for the round trip
    drafter.on_vocab_chosen()
    return request.param, drafter


def decode_all(target, drafter, prompts):
    return [generate(target, p, MAX_NEW, drafter=drafter).tokens for p in prompts]


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_export_round_trip_is_exact(exportable, fmt, diverse_target, prompts, tmp_path):
    name, drafter = exportable
    folder = export_drafter(drafter, tmp_path / name, fmt, target_spec="random")
    assert {"config.json", "model.safetensors", "lightning_spec.json"} <= {p.name for p in folder.iterdir()}
    loaded = load_drafter(folder, target=diverse_target)
    assert type(loaded) is type(drafter) and loaded.config_dict() == drafter.config_dict()
    want = drafter.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    tokens = decode_all(diverse_target, drafter, prompts)
    assert decode_all(diverse_target, loaded, prompts) == tokens
    pairs = list(zip(prompts, tokens))
    greedy = SamplingConfig()
    rounds = offline_rounds(diverse_target, drafter, pairs, greedy)
    assert torch.equal(offline_rounds(diverse_target, loaded, pairs, greedy), rounds)
    assert rounds.sum() < sum(map(len, tokens))  # drafts are accepted: the check compares real acceptance

    # a folder another tool wrote has no sidecar: its config.json alone rebuilds a drafter that decodes the same
    (folder / "lightning_spec.json").unlink()
    foreign = load_drafter(folder, target=diverse_target)
    assert decode_all(diverse_target, foreign, prompts) == tokens


def test_serving_fields_carry_the_conventions(exportable, diverse_target, tmp_path):
    name, drafter = exportable
    config = json.loads((export_drafter(drafter, tmp_path / "s", "speculators") / "config.json").read_text())
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    # vLLM numbers an aux hidden state by the layer it enters: our layer outputs + 1
    aux = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
    assert aux == [layer + 1 for layer in drafter.target_layers]
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]  # target id = i + d2t[i]
    assert torch.equal(ids, drafter.vocab.ids) and int(tensors["t2d"].sum()) == ids.numel()
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size
    layer = config["transformer_layer_config"]
    assert layer["hidden_size"] == diverse_target.hidden_size and layer["vocab_size"] == diverse_target.vocab_size
    if name.startswith("eagle3"):
        assert config["norm_before_residual"] is False  # vLLM's default is true: the field must be written
        assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    else:
        assert config["block_size"] == drafter.block_size + 1 and config["sample_from_anchor"] is False
        assert config["sliding_window_non_causal"] is True  # vLLM reads false as "every layer causal"
        assert layer["model_type"] == "qwen3" and "layers.1.self_attn.q_norm.weight" in tensors
        mask = torch.load(tmp_path / "s" / "mask_embedding.pt", weights_only=True)
        assert mask["mask_token_id"] == 5 and torch.equal(mask["embedding"], drafter.mask_embedding[0].detach())
    sglang = export_drafter(drafter, tmp_path / "g", "sglang")
    names = load_file(str(sglang / "model.safetensors"))
    if name.startswith("eagle3"):
        assert "midlayer.self_attn.q_proj.weight" in names and torch.equal(names["hot_token_id"], drafter.vocab.ids)
    else:
        dflash = json.loads((sglang / "config.json").read_text())["dflash_config"]
        assert dflash == {"mask_token_id": 5, "target_layer_ids": drafter.target_layers}


def test_what_a_format_cannot_express_is_refused_in_one_sentence(diverse_target, tmp_path):
    dspark = DSparkDrafter(block_size=3, num_layers=1, markov_rank=8)
    dspark.bind(diverse_target)
    with pytest.raises(ValueError, match=r"A DSparkDrafter cannot be written in the speculators format \(this "
                                         r"package has no codec for it in any format yet; the exportable families "
                                         r"are BlockDrafter, Eagle3Drafter\)\."):
        export_drafter(dspark, tmp_path / "x")
    for options, field in (({"context_shortcut": True, "qk_norm": True, "mask_token_id": 1}, "context_shortcut"),
                           ({"qk_norm": True}, "mask_token_id"), ({"mask_token_id": 1}, "qk_norm"),
                           ({"qk_norm": True, "mask_token_id": 1, "length_head": True}, "length_head")):
        block = BlockDrafter(block_size=3, num_layers=1, **options)
        block.bind(diverse_target)
        with pytest.raises(ValueError, match=rf"cannot be written as DFlash: train it with .*drafter\.{field}"):
            export_drafter(block, tmp_path / field, "sglang")
        assert not (tmp_path / field).exists()  # nothing half-written
    with pytest.raises(ValueError, match=r"export --format 'gguf' is not one of \['sglang', 'speculators'\]"):
        export_drafter(block, tmp_path / "y", "gguf")


def test_a_drafter_written_by_the_speculators_library_loads_as_ours(speculators_folder, tiny_target):
    drafter = load_drafter(speculators_folder, target=tiny_target)
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.config_dict() == {"block_size": 3, "target_layers": [0, 1], "num_anchors": 64,
                                     "draft_vocab_size": 64, "intermediate_size": 128, "own_head": True}
    tensors = load_file(str(speculators_folder / "model.safetensors"))
    assert torch.equal(drafter.lm_head.detach(), tensors["lm_head.weight"])  # its own trained head, kept
    assert torch.equal(drafter.layer.q_proj.weight.detach(), tensors["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(drafter.vocab.ids, torch.arange(64) + tensors["d2t"])
    out = generate(tiny_target, [1, 5, 9, 14, 200, 7], 12, drafter=drafter)
    assert out.tokens == generate(tiny_target, [1, 5, 9, 14, 200, 7], 12).tokens  # lossless with a foreign drafter


def test_a_speculators_drafter_fine_tunes_with_init_from(speculators_folder, data_files):  # noqa: F811 (fixture)
    """The EDR protocol fine-tunes released drafters: a speculators folder starts a fit like our own checkpoint."""
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    like = dict(block_size=3, target_layers=[0, 1], num_anchors=8, draft_vocab_size=64, intermediate_size=128,
                own_head=True)
    module = DraftModule(Eagle3Drafter(**like), Objective(KL()), target="tiny-random",
                         init_from=str(speculators_folder))
    start = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    assert torch.equal(start["lm_head"], load_file(str(speculators_folder / "model.safetensors"))["lm_head.weight"])
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2
    after = module.drafter.state_dict()
    assert torch.equal(after["vocab.ids"], start["vocab.ids"])  # the file's draft vocabulary, not re-chosen
    assert not torch.equal(after["lm_head"], start["lm_head"])
    assert not torch.equal(after["fc.weight"], start["fc.weight"])
    with pytest.raises(ValueError, match=r"model.init_from .* does not fit model.drafter .*own_head"):
        DraftModule(Eagle3Drafter(**{**like, "own_head": False}), Objective(KL()), target="tiny-random",
                    init_from=str(speculators_folder))


def test_reading_a_serving_folder_runs_no_code_from_it(exportable, diverse_target, tmp_path, monkeypatch):
    """speculators folders carry config.py and auto_map (remote code); a sidecar could name any class."""
    monkeypatch.chdir(tmp_path)
    _, drafter = exportable
    folder = export_drafter(drafter, tmp_path / "d", "speculators", target_spec="random")
    (folder / "config.py").write_text("import pathlib\npathlib.Path('PWNED').touch()\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"": "config.Anything"}
    (folder / "config.json").write_text(json.dumps(config))
    sidecar = json.loads((folder / "lightning_spec.json").read_text())
    sidecar.update(drafter_class="os.system", drafter_config={"command": "touch PWNED"})
    (folder / "lightning_spec.json").write_text(json.dumps(sidecar))
    loaded = load_drafter(folder, target=diverse_target)  # the sidecar names no class of this codec: ignored
    assert type(loaded) is type(drafter) and not (tmp_path / "PWNED").exists()
    config["speculators_model_type"] = "os.system"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds a config.json of no layout this package reads"):
        load_drafter(folder, target=diverse_target)
    assert not (tmp_path / "PWNED").exists()


def test_export_command_writes_a_folder_from_a_fit_checkpoint(diverse_target, tmp_path, capsys):
    drafter = BlockDrafter(block_size=3, num_layers=1, qk_norm=True, mask_token_id=1)
    drafter.bind(diverse_target)
    fit_checkpoint(drafter, tmp_path / "a.ckpt", "random")
    # load_drafter binds the live target of the recorded weights (diverse_target), so "random" never loads
    main(["export", "--ckpt", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "out"), "--target_path", "/models/t"])
    out = capsys.readouterr().out
    assert "wrote BlockDrafter (K=3) as speculators" in out and '"method": "dflash"' in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/t"
    sidecar = json.loads((tmp_path / "out" / "lightning_spec.json").read_text())
    assert sidecar["parent"]["path"] == str(tmp_path / "a.ckpt") and sidecar["format"] == "speculators"


def test_a_tied_target_full_vocabulary_head_exports(tmp_path):
    """A full-vocabulary EAGLE-3 head on a target with tied embeddings (SmolLM2's) is the embedding tensor itself:
    safetensors refused to write it twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_spec.target import Target

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    target = Target(LlamaForCausalLM(config), name="tied")
    drafter = Eagle3Drafter(block_size=2)
    drafter.bind(target)
    folder = export_drafter(drafter, tmp_path / "tied", "speculators")
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], tensors["embed_tokens.weight"])
    loaded = load_drafter(folder, target=target)
    assert decode_all(target, loaded, [[1, 2, 3]]) == decode_all(target, drafter, [[1, 2, 3]])


def test_an_own_head_starts_from_the_target_rows_of_the_chosen_vocabulary(diverse_target):
    """``fit`` chooses a reduced vocabulary after ``bind``: the own head must follow the chosen rows."""
    drafter = Eagle3Drafter(block_size=2, draft_vocab_size=16, own_head=True)
    drafter.bind(diverse_target)
    counts = torch.zeros(diverse_target.vocab_size)
    counts[torch.arange(40, 56)] = 1.0  # not the ids 0..15 the head was built on
    drafter.vocab.set_from_counts(counts)
    drafter.on_vocab_chosen()
    assert torch.equal(drafter.vocab.ids, torch.arange(40, 56))
    assert torch.equal(drafter.lm_head.detach(), diverse_target.lm_head.weight[40:56].detach())
