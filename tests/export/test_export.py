"""Leaving the framework: ``lightning-spec export`` writes a drafter in the speculators format (which vLLM serves) or
SGLang's layouts, and ``load_drafter`` reads such a folder back — ours, or one the speculators library wrote.

- an exported drafter reloads to the same weights, the same greedy tokens and the same offline rounds, in every
  format and family that has a codec; without our sidecar (a folder another tool wrote) it still does;
- the fields serving engines read carry their conventions (feature layer numbering, d2t, DFlash's block size and
  bidirectional block, EAGLE-3's un-normed residual);
- families or options a format cannot express are refused in one sentence, nothing written;
- a drafter the speculators library itself wrote loads as our Eagle3Drafter and fine-tunes with ``init_from``; its
  DSpark and MTP load as our DSparkDrafter and MTPDrafter and compute what the library's modules compute;
- reading a folder never runs code from it.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers.decoding import MAX_NEW
from helpers.families import FAMILIES, trained
from helpers.fits import fit_checkpoint, quiet_trainer
from helpers.speculators_layouts import build_folder, reference
from safetensors.torch import load_file

from lightning_spec import SamplingConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import codec_for, export_drafter, vllm_speculative_config
from lightning_spec.cli import main
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import (
    Anchors,
    DFlash2Drafter,
    DFlashDrafter,
    DSparkDrafter,
    Eagle3Drafter,
    MedusaDrafter,
    MTPDrafter,
    PEagleDrafter,
)
from lightning_spec.drafters.block import ParallelBlockDrafter
from lightning_spec.errors import UserError
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Objective

EXPORTABLE = {  # name -> (drafter, the formats that hold it)
    "eagle3": (lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48), ("speculators", "sglang")),
    "eagle3_own_head": (lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48, own_head=True),
                        ("speculators", "sglang")),
    "eagle3_1": (lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48, fc_norm=True,
                                         norm_output=True), ("speculators",)),
    "eagle3_norm_before_fc": (lambda k: Eagle3Drafter(block_size=k, num_anchors=64, draft_vocab_size=48,
                                                      norm_before_fc=True, norm_output=True), ("speculators",)),
    "peagle": (lambda k: PEagleDrafter(block_size=k, num_anchors=64, draft_vocab_size=48, mask_token_id=5,
                                       norm_before_fc=True), ("speculators",)),
    "dflash": (lambda k: DFlashDrafter(block_size=k, num_layers=2, num_anchors=64, draft_vocab_size=48, qk_norm=True,
                                      mask_token_id=5), ("speculators", "sglang")),
    "dflash2": (lambda k: DFlash2Drafter(block_size=k, num_layers=2, num_anchors=64, qk_norm=True, mask_token_id=5,
                                         conv_group_size=8, selector_rank=8, selector_top_k=4), ("speculators",)),
    "dspark": (lambda k: DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, draft_vocab_size=48, qk_norm=True,
                                       mask_token_id=5, markov_rank=16), ("speculators",)),
    "dspark_rnn": (lambda k: DSparkDrafter(block_size=k, num_layers=1, num_anchors=64, draft_vocab_size=48,
                                           qk_norm=True, mask_token_id=5, markov="rnn", markov_rank=16),
                   ("speculators",)),
    "mtp": (lambda k: MTPDrafter(block_size=k, num_anchors=64, qk_norm=True, normed_chain=True), ("speculators",)),
}
ROUND_TRIPS = [(name, fmt) for name, (_, formats) in EXPORTABLE.items() for fmt in formats]


@pytest.fixture(scope="module")
def speculators_folder(tmp_path_factory) -> Path:
    """An EAGLE-3 folder in the layout speculators 0.9.0 wrote (tests/fixtures/speculators_eagle3_tiny: its config.json
    and each tensor's name, shape and dtype, the vocabulary maps' values); the float tensors, random in the
    library's file too, are drawn (tests/helpers/speculators_layouts.py) so that no weights are committed."""
    return build_folder("eagle3", tmp_path_factory.mktemp("speculators") / "eagle3")


@pytest.fixture(scope="module")
def trained_exportable(diverse_target, prompts):
    """name -> a drafter accepted in a good share of rounds, its draft vocabulary (where reduced) a non-prefix set,
    DSpark's confidence temperatures calibrated-looking (not 1); trained once per module, on first use."""
    cache = {}

    def get(name: str):
        if name in cache:
            return cache[name]
        FAMILIES[f"export_{name}"] = EXPORTABLE[name][0]
        counts = torch.zeros(diverse_target.vocab_size)
        counts[torch.tensor([t for p in prompts for t in p])] += 1
        counts += torch.rand(diverse_target.vocab_size, generator=torch.Generator().manual_seed(0))
        try:
            drafter = trained(f"export_{name}", diverse_target, prompts, k=3)
        finally:
            del FAMILIES[f"export_{name}"]
        if not drafter.vocab.full:
            drafter.vocab.set_from_counts(counts)  # before training would be usual; any set works for a round trip
            drafter.on_vocab_chosen()
        if isinstance(drafter, DSparkDrafter):
            drafter.confidence_temperature.copy_(torch.tensor([0.7, 1.3, 2.0]))
        cache[name] = drafter
        return drafter

    return get


@pytest.fixture(params=list(EXPORTABLE))
def exportable(request, trained_exportable):
    """(name, the trained drafter) for every exportable family and option set."""
    return request.param, trained_exportable(request.param)


def decode_all(target, drafter, prompts):
    return [generate(target, p, MAX_NEW, drafter=drafter).tokens for p in prompts]


@pytest.mark.parametrize("name,fmt", ROUND_TRIPS)
def test_export_round_trip_is_exact(name, fmt, trained_exportable, diverse_target, prompts, tmp_path):
    drafter = trained_exportable(name)
    folder = export_drafter(drafter, tmp_path / name, fmt, target_spec="random").folder
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


@pytest.mark.parametrize("name", [name for name in EXPORTABLE if name != "mtp"])  # MTP reads no aux layers, no d2t
def test_serving_fields_carry_the_conventions(name, trained_exportable, diverse_target, tmp_path):
    drafter = trained_exportable(name)
    config = json.loads((export_drafter(drafter, tmp_path / "s", "speculators").folder / "config.json").read_text())
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    # vLLM numbers an aux hidden state by the layer it enters: our layer outputs + 1
    aux = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
    assert aux == [layer + 1 for layer in drafter.target_layers]
    if name == "dflash2":  # the full vocabulary, which the speculators library's DFlash2 holds without a map
        assert "d2t" not in tensors and "t2d" not in tensors and drafter.vocab.full
    else:
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]  # target id = i + d2t[i]
        assert torch.equal(ids, drafter.vocab.ids) and int(tensors["t2d"].sum()) == ids.numel()
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size
    layer = config["transformer_layer_config"]
    assert layer["hidden_size"] == diverse_target.hidden_size and layer["vocab_size"] == diverse_target.vocab_size
    if name.startswith("eagle3"):
        assert config["norm_before_residual"] is False  # vLLM's default is true: the field must be written
        assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
        # EAGLE-3.1's flags as set, each with the keys vLLM 0.32 loads for it
        flags = (drafter.norm_before_fc, drafter.fc_norm, drafter.norm_output)
        assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == flags
        assert ("input_norm.weight" in tensors) is drafter.norm_before_fc
        assert sorted(k for k in tensors if k.startswith("fc_norm.")) == (
            [f"fc_norm.{i}.weight" for i in range(len(drafter.target_layers))] if drafter.fc_norm else [])
    elif name == "dflash":
        assert config["block_size"] == drafter.block_size + 1 and config["sample_from_anchor"] is False
        assert config["sliding_window_non_causal"] is True  # vLLM reads false as "every layer causal"
        assert layer["model_type"] == "qwen3" and "layers.1.self_attn.q_norm.weight" in tensors
        mask = torch.load(tmp_path / "s" / "mask_embedding.pt", weights_only=True)
        assert mask["mask_token_id"] == 5 and torch.equal(mask["embedding"], drafter.mask_embedding[0].detach())
    elif name == "dflash2":  # DFlash's folder plus the four fields vLLM's update_dflash2 reads, and their tensors
        assert config["architectures"] == ["DFlash2DraftModel"] and config["speculators_model_type"] == "dflash2"
        assert config["block_size"] == drafter.block_size + 1 and config["sample_from_anchor"] is False
        assert {k: config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
            "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
        for i in range(2):
            assert tensors[f"layers.{i}.attention_conv.base_kernel"].shape == (2, 2, diverse_target.hidden_size)
            assert f"layers.{i}.mlp_conv.kernel_projection.weight" in tensors
        sel = drafter.selector
        assert torch.equal(tensors["candidate_selector.predecessor_codebook"], sel.predecessor_codebook.weight.detach())
        assert tensors["candidate_selector.successor_codebook"].shape == (diverse_target.vocab_size, 8)
        projection = tensors["candidate_selector.hidden_projection.weight"]
        assert torch.equal(projection, sel.hidden_projection.weight.detach())
    elif name == "peagle":  # vLLM 0.32's peagle type: the EAGLE-3 layout plus what its parallel drafting reads
        assert config["speculators_model_type"] == "peagle" and config["parallel_drafting"] is True
        assert config["speculators_config"]["algorithm"] == "peagle" and "fc_norm" not in config
        assert config["mask_token_id"] == 5 and config["norm_before_fc"] is True and "input_norm.weight" in tensors
        assert torch.equal(tensors["mask_hidden"], drafter.mask_hidden.detach())  # (1, F): before fc, as vLLM's
        assert tensors["mask_hidden"].shape == (1, drafter.fc.in_features)
    if name in ("eagle3_1", "eagle3_norm_before_fc", "peagle", "dflash2"):  # SGLang's: EAGLE-3 and DFlash as published
        own = name in ("peagle", "dflash2")  # no SGLang codec at all
        says = "formats that can: speculators" if own else "export it in the speculators format"
        with pytest.raises(UserError, match=says):
            export_drafter(drafter, tmp_path / "g", "sglang")
        return
    if not name.startswith(("eagle3", "dflash")):
        return  # the families only the speculators format holds: test_dspark_and_mtp_fields_carry_the_conventions
    sglang = export_drafter(drafter, tmp_path / "g", "sglang").folder
    names = load_file(str(sglang / "model.safetensors"))
    if name.startswith("eagle3"):
        assert "midlayer.self_attn.q_proj.weight" in names and torch.equal(names["hot_token_id"], drafter.vocab.ids)
    else:
        dflash = json.loads((sglang / "config.json").read_text())["dflash_config"]
        assert dflash == {"mask_token_id": 5, "target_layer_ids": drafter.target_layers}


@pytest.mark.parametrize("flag,key,name", [("norm_before_fc", "input_norm.weight", "eagle3_norm_before_fc"),
                                           ("fc_norm", "fc_norm.0.weight", "eagle3_1")])
def test_an_eagle3_1_flag_that_disagrees_with_its_weights_is_refused(flag, key, name, trained_exportable,
                                                                       diverse_target, tmp_path):
    """vLLM drops ``input_norm.*`` without a word when ``norm_before_fc`` is false (vllm #38111): a folder whose flag
    and weights disagree would serve a different drafter than the one trained, so reading it refuses."""
    folder = export_drafter(trained_exportable(name), tmp_path / "s", "speculators").folder
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, flag: False}))
    with pytest.raises(UserError, match=f"says {flag}: false and has {key}"):
        load_drafter(folder, target=diverse_target)


@pytest.mark.parametrize("name", ["dspark", "dspark_rnn", "mtp"])
def test_dspark_and_mtp_fields_carry_the_conventions(name, trained_exportable, diverse_target, tmp_path):
    drafter = trained_exportable(name)
    folder = export_drafter(drafter, tmp_path / "s", "speculators").folder
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    layer = config["transformer_layer_config"]
    assert config["speculators_model_type"] == name.split("_")[0] and layer["model_type"] == "qwen3"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.block_size
    if name == "mtp":
        h = diverse_target.hidden_size
        proj = drafter.mtp[0].proj.weight.detach()  # ours over [state; embedding], the format's the other way
        assert torch.equal(tensors["mtp_layers.0.input_proj.weight"], torch.cat([proj[:, h:], proj[:, :h]], 1))
        assert layer["num_hidden_layers"] == diverse_target.num_layers  # the verifier's: its last state is read
        assert "lm_head.weight" not in tensors and "embed_tokens.weight" not in tensors  # the target's, shared
        return
    k, vocab = drafter.block_size, diverse_target.vocab_size
    assert config["block_size"] == k and config["sample_from_anchor"] is True  # the anchor's slot predicts
    assert config["markov_head_type"] == drafter.markov and config["markov_rank"] == 16
    w1 = tensors["markov_head.markov_w1.weight"]  # (V, r): a row per target token
    ours = drafter.sequential.embed.weight.detach()  # (Vd + 1, r): a row per draft token, one for the rest
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[drafter.vocab.ids] = True
    assert torch.equal(w1[drafter.vocab.ids], ours[:-1]) and bool((w1[~inside] == ours[-1]).all())
    # vLLM's DSpark embeds the masks with the table's row of mask_token_id: the learned vector is that row
    embed = tensors["embed_tokens.weight"]
    assert torch.equal(embed[5], drafter.mask_embedding[0].detach())
    assert torch.equal(embed[:5], diverse_target.embed_tokens.weight[:5].detach())
    temps = json.loads((folder / "dspark_calibration.json").read_text())["confidence_temperature"]
    assert temps == pytest.approx([0.7, 1.3, 2.0])
    assert ("markov_head.joint_proj.weight" in tensors) == (name == "dspark_rnn")
    assert tensors["confidence_head.proj.weight"].shape == (1, diverse_target.hidden_size + 16)


def test_what_a_format_cannot_express_is_refused_in_one_sentence(diverse_target, tmp_path):
    medusa = MedusaDrafter(block_size=3)
    medusa.bind(diverse_target)
    with pytest.raises(ValueError, match=r"A MedusaDrafter cannot be written in the speculators format \(this "
                                         r"package has no codec for it in any format yet; the exportable families "
                                         r"are DFlash2Drafter, DFlashDrafter, DSparkDrafter, Eagle3Drafter, "
                                         r"MTPDrafter, PEagleDrafter\)\."):
        export_drafter(medusa, tmp_path / "x")
    narrow = DFlash2Drafter(block_size=3, qk_norm=True, mask_token_id=1, conv_group_size=8, draft_vocab_size=48,
                            selector_top_k=4)
    narrow.bind(diverse_target)
    with pytest.raises(ValueError, match=r"cannot be written as DFlash2: train it with drafter\.draft_vocab_size: "
                                         r"null \(vLLM's selector codebooks"):
        export_drafter(narrow, tmp_path / "narrow")
    dspark = DSparkDrafter(block_size=3, num_layers=1, markov_rank=8, qk_norm=True, mask_token_id=1)
    dspark.bind(diverse_target)
    with pytest.raises(ValueError, match=r"A DSparkDrafter cannot be written in the sglang format \(formats that "
                                         r"can: speculators;"):
        export_drafter(dspark, tmp_path / "x", "sglang")
    dspark = DSparkDrafter(block_size=3, num_layers=1, markov_rank=8, mask_token_id=1)
    dspark.bind(diverse_target)
    with pytest.raises(ValueError, match=r"This DSparkDrafter cannot be written as DSpark: train it with "
                                         r"drafter\.qk_norm: true .*dspark_export\.yaml"):
        export_drafter(dspark, tmp_path / "x")
    for options, field in (({"num_modules": 2}, "num_modules"), ({"qk_norm": False}, "qk_norm"),
                           ({"normed_chain": False}, "normed_chain"), ({"draft_vocab_size": 48}, "draft_vocab_size")):
        mtp = MTPDrafter(block_size=3, **{"qk_norm": True, "normed_chain": True, **options})
        mtp.bind(diverse_target)
        with pytest.raises(ValueError, match=rf"cannot be written as speculators MTP: train it with drafter\.{field}"):
            export_drafter(mtp, tmp_path / field)
        assert not (tmp_path / field).exists()
    for options, field in (({"context_shortcut": True, "qk_norm": True, "mask_token_id": 1}, "context_shortcut"),
                           ({"qk_norm": True}, "mask_token_id"), ({"mask_token_id": 1}, "qk_norm"),
                           ({"qk_norm": True, "mask_token_id": 1, "length_head": True}, "length_head")):
        block = DFlashDrafter(block_size=3, num_layers=1, **options)
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
                                     "draft_vocab_size": 64, "intermediate_size": 128, "own_head": True,
                                     "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    tensors = load_file(str(speculators_folder / "model.safetensors"))
    assert torch.equal(drafter.lm_head.detach(), tensors["lm_head.weight"])  # its own trained head, kept
    assert torch.equal(drafter.layer.q_proj.weight.detach(), tensors["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(drafter.vocab.ids, torch.arange(64) + tensors["d2t"])
    out = generate(tiny_target, [1, 5, 9, 14, 200, 7], 12, drafter=drafter)
    assert out.tokens == generate(tiny_target, [1, 5, 9, 14, 200, 7], 12).tokens  # lossless with a foreign drafter


def test_a_speculators_drafter_fine_tunes_with_init_from(speculators_folder, data_files):
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


def test_a_speculators_dspark_loads_as_ours_and_computes_as_the_library(tmp_path, tiny_target):
    """The library's DSpark (rnn head, full vocabulary; it ships no mask vector: the target's embedding of the mask
    token is the mask) imports as our DSparkDrafter whose heads compute the library's numbers."""
    folder = build_folder("dspark", tmp_path / "dspark")
    drafter = load_drafter(folder, target=tiny_target)
    assert isinstance(drafter, DSparkDrafter)
    config = drafter.config_dict()
    assert {k: config[k] for k in ("block_size", "target_layers", "markov", "markov_rank", "qk_norm", "mask_token_id",
                                   "draft_vocab_size")} == {"block_size": 4, "target_layers": [0, 1], "markov": "rnn",
                                                            "markov_rank": 8, "qk_norm": True, "mask_token_id": 5,
                                                            "draft_vocab_size": None}
    assert torch.equal(drafter.mask_embedding[0].detach(), tiny_target.embed_tokens.weight[5].detach())
    ref = reference("dspark")
    prev, hidden = torch.tensor(ref["prev"]), torch.tensor(ref["hidden"])  # (2, K), (2, K, H)
    with torch.no_grad():
        emb = drafter.sequential.embed(drafter.rows(prev))  # (2, K, r)
        bias = drafter.sequential.out(drafter.sequential.unroll(emb, hidden))  # (2, K, V)
        conf = drafter.conf_logit(hidden, emb)  # (2, K)
    assert torch.allclose(bias[..., :16], torch.tensor(ref["bias_first16"]), atol=1e-5)
    assert bias.argmax(-1).tolist() == ref["bias_argmax"]
    assert torch.allclose(conf, torch.tensor(ref["confidence_logits"]), atol=1e-5)
    prompt = [1, 5, 9, 14, 200, 7]
    assert generate(tiny_target, prompt, 12, drafter=drafter).tokens == generate(tiny_target, prompt, 12).tokens
    # a fine-tune starts from it (the EDR protocol), the mask vector again the target's embedding of token 5
    module = DraftModule(DSparkDrafter(**config), Objective(KL()), target="tiny-random", init_from=str(folder))
    assert torch.equal(module.drafter.sequential.rnn.weight, drafter.sequential.rnn.weight)
    assert torch.equal(module.drafter.mask_embedding, drafter.mask_embedding)


def test_a_speculators_mtp_loads_as_ours_and_computes_as_the_library(tmp_path, tiny_target):
    """The library's MTP imports as our MTPDrafter; slot 1 gives the library's step-0 logits. Its inputs begin with
    the zero state (tests/fixtures/make_speculators_dspark_mtp.py): the library's entry t reads (h_t, x_{t+1}), ours at
    position p reads (h_{p-1}, x_p) with h_{-1} = 0, so the shifted sequence makes the two the same entries."""
    drafter = load_drafter(build_folder("mtp", tmp_path / "mtp"), target=tiny_target)
    assert isinstance(drafter, MTPDrafter)
    assert drafter.config_dict() == {"block_size": 3, "num_modules": 1, "num_anchors": 64, "draft_vocab_size": None,
                                     "intermediate_size": 128, "qk_norm": True, "normed_chain": True}
    ref = reference("mtp")
    ids, hidden = torch.tensor(ref["input_ids"])[1:], torch.tensor(ref["hidden"])[1:]  # ours: x_p, h_p
    t = len(ref["logits_argmax"])
    anchors = Anchors(torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool))  # n = t: slot 1 reads h_{n-1}, x_n
    with torch.no_grad():
        out = drafter({"input_ids": ids[None], "loss_mask": torch.ones(1, ids.numel())}, hidden[None], anchors)
        logits = out.logits[0, :, 0]  # (T, V): slot 1 of each anchor
    assert torch.allclose(logits[:, :16], torch.tensor(ref["logits_first16"]), atol=1e-4)
    assert torch.allclose(logits.logsumexp(-1), torch.tensor(ref["logsumexp"]), atol=1e-4)
    assert logits.argmax(-1).tolist() == ref["logits_argmax"]
    prompt = [1, 5, 9, 14, 200, 7]
    assert generate(tiny_target, prompt, 12, drafter=drafter).tokens == generate(tiny_target, prompt, 12).tokens


SERVE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-serve" / "bin" / "python"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def untrained_exports(tmp_path: Path, target, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """name -> the speculators folder of every ``EXPORTABLE`` drafter but ``skip``, untrained on ``target``: a
    reduced vocabulary drawn at random, a block drafter's mask moved off its start (the token's row)."""
    folders = {}
    for name, (make, _) in EXPORTABLE.items():
        if name in skip:
            continue
        torch.manual_seed(0)
        drafter = make(3)
        drafter.bind(target)
        if not drafter.vocab.full:
            drafter.vocab.set_from_counts(torch.rand(target.vocab_size))
            drafter.on_vocab_chosen()
        if isinstance(drafter, ParallelBlockDrafter):
            with torch.no_grad():
                drafter.mask_embedding.add_(0.1)
        folders[name] = str(export_drafter(drafter, tmp_path / name, "speculators").folder)
    return folders


def test_the_speculators_library_loads_every_export(tmp_path, tiny_target):
    """Every family we write in the speculators format loads with the library's own classes: no weight missing or
    unexpected, every shipped tensor held as written but one: the library loads the verifier's embedding over a
    shipped one, so DSpark's learned mask vector, written into the mask token's row for vLLM, is the target's
    embedding there (docs/serving.md, "DSpark and MTP", says so). Runs where the serving venv exists
    (`make serve-setup`)."""
    import subprocess

    if not SERVE_PYTHON.is_file():
        pytest.skip("the serving venv (.venv-serve, `make serve-setup`) that has the speculators library is absent")
    # P-EAGLE is written for vLLM's parallel drafting (EAGLE-3 + mask_hidden); the library's own P-EAGLE class reads
    # another config (para_depths, ptd_token_id): vLLM is the check there
    folders = untrained_exports(tmp_path, tiny_target, skip=("peagle",))
    run = subprocess.run([str(SERVE_PYTHON), str(FIXTURES / "speculators_load.py"), *folders.values()],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    classes = {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
               "dspark": "DSparkDraftModel", "mtp": "MTPDraftModel"}
    for name, folder in folders.items():
        report = found[folder]
        assert report["class"] == classes[name.split("_")[0]], (name, report)
        assert not (report["missing"] or report["unexpected"] or report["mismatched"]), (name, report)
        assert report["changed"] == (["embed_tokens.weight"] if name.startswith("dspark") else []), (name, report)
        assert report["speculative_tokens"] == 3


def test_reading_a_serving_folder_runs_no_code_from_it(exportable, diverse_target, tmp_path, monkeypatch):
    """speculators folders carry config.py and auto_map (remote code); a sidecar could name any class."""
    monkeypatch.chdir(tmp_path)
    _, drafter = exportable
    folder = export_drafter(drafter, tmp_path / "d", "speculators", target_spec="random").folder
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
    drafter = DFlashDrafter(block_size=3, num_layers=1, qk_norm=True, mask_token_id=1)
    drafter.bind(diverse_target)
    fit_checkpoint(drafter, tmp_path / "a.ckpt", "random")
    # load_drafter binds the live target of the recorded weights (diverse_target), so "random" never loads
    main(["export", "--ckpt", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "out"), "--target_path", "/models/t"])
    out = capsys.readouterr().out
    assert "wrote DFlashDrafter (K=3) as speculators" in out and '"method": "dflash"' in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/t"
    sidecar = json.loads((tmp_path / "out" / "lightning_spec.json").read_text())
    assert sidecar["parent"]["path"] == str(tmp_path / "a.ckpt") and sidecar["format"] == "speculators"
    # a family vLLM does not serve from the format says so instead of printing a call that fails
    mtp = MTPDrafter(block_size=2, qk_norm=True, normed_chain=True)
    mtp.bind(diverse_target)
    fit_checkpoint(mtp, tmp_path / "m.ckpt", "random")
    main(["export", "--ckpt", str(tmp_path / "m.ckpt"), "--out", str(tmp_path / "mtp")])
    out = capsys.readouterr().out
    assert "wrote MTPDrafter (K=2)" in out and "vLLM 0.32 has no loader for the speculators MTP format" in out


def test_a_tied_target_full_vocabulary_head_exports(tmp_path):
    """A full-vocabulary EAGLE-3 head on a target with tied embeddings (SmolLM2's) is the embedding tensor itself:
    the head is written, the embedding is not (vLLM shares the target's when the folder has none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_spec.target import Target

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    target = Target(LlamaForCausalLM(config), name="tied")
    drafter = Eagle3Drafter(block_size=2)
    drafter.bind(target)
    folder = export_drafter(drafter, tmp_path / "tied", "speculators").folder
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], target.embed_tokens.weight) and "embed_tokens.weight" not in tensors
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


def test_the_quickstart_drafter_exports_and_loads_back(tmp_path, monkeypatch, tiny_target):
    """`make quickstart`, then `lightning-spec export` on its checkpoint, then `load_drafter` of the folder: the path
    a newcomer takes first. The quickstart's own drafter settings on the tiny target (tests/fixtures/docs_tiny.yaml
    shrinks only the target, data and steps), and the same greedy tokens from the checkpoint and the export."""
    import sys

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    try:
        main(["fit", "-c", str(root / "experiments" / "quickstart.yaml"), "-c",
              str(root / "tests" / "fixtures" / "docs_tiny.yaml")])
    except SystemExit as exit_:
        assert not exit_.code
    (ckpt,) = tmp_path.glob("runs/*/*/checkpoints/last.ckpt")
    try:
        main(["export", "--ckpt", str(ckpt), "--out", "served"])
    except SystemExit as exit_:
        assert not exit_.code
    assert json.loads((tmp_path / "served" / "config.json").read_text())["speculators_model_type"] == "dflash"
    # its provenance: the fit's command and config from the checkpoint, the export's own command, the weights' hash
    from lightning_spec.provenance import PROVENANCE_FILE, sha256_file

    record = json.loads((tmp_path / "served" / PROVENANCE_FILE).read_text())
    fit, export = record["fit"], record["written_by"]
    assert fit["command"].startswith("lightning-spec fit -c ") and "quickstart.yaml" in fit["command"]
    assert "block_size: 8" in fit["config"] and export["command"].startswith("lightning-spec export")
    assert record["weights_sha256"] == sha256_file(tmp_path / "served" / "model.safetensors")
    trained_drafter, served = load_drafter(ckpt, target=tiny_target), load_drafter(tmp_path / "served",
                                                                                   target=tiny_target)
    prompts = [[5, 17, 40, 9], [60, 2, 33, 71, 8, 12]]
    for prompt in prompts:
        want = generate(tiny_target, prompt, 16, drafter=trained_drafter)
        got = generate(tiny_target, prompt, 16, drafter=served)
        assert got.tokens == want.tokens == generate(tiny_target, prompt, 16).tokens
        assert got.accept_lengths == want.accept_lengths


@pytest.mark.parametrize("family,ships_embedding", [("eagle3", False), ("dflash", False), ("dspark", True)])
def test_the_served_folder_repeats_the_targets_embedding_only_where_it_differs(family, ships_embedding, tmp_path,
                                                                             trained_exportable):
    """EAGLE-3 and DFlash borrow the target's embedding unchanged, so the folder leaves it out (vLLM 0.32 shares the
    target's when the draft checkpoint has none: ``has_own_embed_tokens``); DSpark ships its own table, whose mask
    row is learned."""
    drafter = trained_exportable(family)
    tensors = load_file(str(export_drafter(drafter, tmp_path / family, "speculators").folder / "model.safetensors"))
    assert ("embed_tokens.weight" in tensors) is ships_embedding



def test_the_serving_config_names_what_vllm_needs(trained_exportable, tmp_path):
    """``vllm_speculative_config``: the one place the export, the MLflow card and serve_check take vLLM's
    speculative_config from; P-EAGLE needs parallel_drafting on top of EAGLE-3's method, MTP has none."""
    assert vllm_speculative_config(trained_exportable("eagle3"), tmp_path) == {
        "method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3}
    assert vllm_speculative_config(trained_exportable("peagle"), tmp_path) == {
        "method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3, "parallel_drafting": True}
    assert vllm_speculative_config(trained_exportable("mtp"), tmp_path) is None


@pytest.mark.parametrize("family,fmt", [("eagle3", "speculators"), ("mtp", "speculators"), ("eagle3", "sglang")])
def test_export_returns_what_it_wrote(trained_exportable, tmp_path, family, fmt):
    """``export_drafter`` returns the codec it wrote with, the verifier its config names and vLLM's
    speculative_config of the folder (speculators only; None where vLLM runs no method of the family), so no caller
    looks the codec up again."""
    drafter = trained_exportable(family)
    exported = export_drafter(drafter, tmp_path / "out", fmt, target_path="/models/target")
    assert exported.folder == tmp_path / "out" and (exported.folder / "config.json").is_file()
    assert exported.codec is codec_for(drafter, fmt) and exported.verifier == "/models/target"
    want = vllm_speculative_config(drafter, exported.folder) if fmt == "speculators" else None
    assert exported.serving == want and (want is None) == (family == "mtp" or fmt == "sglang")


def test_a_peagle_folder_is_vllms_peagle_type_and_the_earlier_layout_still_reads(trained_exportable, tmp_path):
    """vLLM 0.32 finds the mask token of a parallel-drafting EAGLE-3 only in its own ``peagle`` type (an ``eagle3``
    folder with ``mask_token_id`` beside it fails to start: "the draft model config must have ... mask_token_id"),
    so P-EAGLE exports as ``peagle``; a folder written before as ``eagle3`` + ``parallel_drafting`` still loads, and
    ``fc_norm``, which vLLM's peagle reader drops, is refused in one sentence."""
    drafter = trained_exportable("peagle")
    folder = export_drafter(drafter, tmp_path / "new", "speculators").folder
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    earlier = {**config, "speculators_model_type": "eagle3", "fc_norm": False, "norm_output": False,
               "speculators_config": {**config["speculators_config"], "algorithm": "eagle3"}}
    (folder / "config.json").write_text(json.dumps(earlier))
    (folder / "lightning_spec.json").unlink()  # as a foreign folder: read from config.json alone
    back = load_drafter(folder, target=drafter.target)
    assert isinstance(back, PEagleDrafter) and back.mask_token_id == 5 and back.norm_before_fc
    assert torch.equal(back.mask_hidden, drafter.mask_hidden)
    normed = PEagleDrafter(block_size=3, num_anchors=64, draft_vocab_size=48, mask_token_id=5, fc_norm=True)
    normed.bind(drafter.target)
    normed.vocab.set_from_counts(torch.rand(drafter.target.vocab_size))
    normed.on_vocab_chosen()
    with pytest.raises(UserError, match=r"PEagleDrafter\(fc_norm=True\) has no field in the speculators peagle"):
        export_drafter(normed, tmp_path / "normed", "speculators")


def test_a_dflash2_folder_without_its_selector_fields_is_refused(trained_exportable, diverse_target, tmp_path):
    """A DFlash2 folder whose config.json lost a selector or convolution field (a tool that rewrote it as DFlash) is
    refused naming the field, never read as a DFlash2 with defaults."""
    folder = export_drafter(trained_exportable("dflash2"), tmp_path / "d", "speculators").folder
    config = json.loads((folder / "config.json").read_text())
    for field in ("selector_top_k", "conv_group_size"):
        dropped = {k: v for k, v in config.items() if k != field}
        (folder / "config.json").write_text(json.dumps(dropped))
        with pytest.raises(UserError, match=rf"is a DFlash2 folder without {field} in config.json"):
            load_drafter(folder, target=diverse_target)


def test_what_vllm_builds_of_every_export_is_what_the_folder_says(tmp_path, tiny_target):
    """vLLM 0.32's own speculators reader (no engine) turns every folder we write into the speculative and draft
    configs ``served_fields`` expects, field by field: a field vLLM would drop or rewrite fails here before a serve.
    Runs where the serving venv exists (`make serve-setup`)."""
    import subprocess

    from lightning_spec.checkpoint import served_fields, served_mismatches

    if not SERVE_PYTHON.is_file():
        pytest.skip("the serving venv (.venv-serve, `make serve-setup`) that has vLLM is absent")
    folders = untrained_exports(tmp_path, tiny_target, skip=("mtp",))  # vLLM has no method for speculators MTP
    run = subprocess.run([str(SERVE_PYTHON), str(FIXTURES / "vllm_built_config.py"), *folders.values()],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for name, folder in folders.items():
        expected = served_fields(folder)
        assert expected and served_mismatches(expected, found[folder]) == [], (name, found[folder])


def test_a_dropped_or_rewritten_served_field_is_named_in_one_sentence(trained_exportable, tmp_path):
    """The check serve-check runs on what vLLM built: dropping DFlash2's selector field or rewriting its architecture
    (what an older vLLM did: DFlash2 read as DFlash) is caught, each in a sentence naming the field."""
    from lightning_spec.checkpoint import served_fields, served_mismatches

    folder = export_drafter(trained_exportable("dflash2"), tmp_path / "d", "speculators").folder
    expected = served_fields(folder)
    built: dict = {}
    for path, value in expected.items():  # exactly what the folder says, nested as vLLM's configs are
        node = built
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    assert served_mismatches(expected, built) == []
    del built["draft"]["dflash_config"]["selector_top_k"]
    built["draft"]["architectures"] = ["DFlashDraftModel"]
    assert served_mismatches(expected, built) == [
        "vLLM built draft.architectures = ['DFlashDraftModel'] where the folder says ['DFlash2DraftModel']: it "
        "rewrote the field.",
        "vLLM built no draft.dflash_config.selector_top_k (the folder says 4): it dropped the field.",
    ]
