"""Writes tests/data/speculators_dspark_tiny/ and speculators_mtp_tiny/: the layouts of a DSpark drafter (rnn Markov
head, full vocabulary) and an MTP drafter that the speculators library itself (0.9.0) builds and saves for the
packaged ``tiny-random`` target: config.json as the library wrote it (its config.py hook deleted, the verifier path
replaced by the packaged name), tensors.json (each tensor's name, shape and dtype; the values of the integer and
boolean ones), and reference.json: what the library's own modules compute with the weights tests/speculators_layouts
``draw`` gives them, on inputs recorded there, so tests/test_export.py checks our import against the library's
arithmetic, not only its names:

- DSpark: the Markov head's per-slot bias over the block (``MarkovHead.block_bias``, the rnn recurrence) and the
  confidence head's logits on [h; W1[x]], for given previous tokens and backbone states;
- MTP: step 0 of ``MTPDraftModel.forward`` (the layer over [RMSNorm(e(x_{t+1})); RMSNorm(h_t)], the target's head).
  Its inputs start with a zero state: the library's entry t reads (h_t, x_{t+1}), ours at position p reads
  (h_{p-1}, x_p) with h_{-1} = 0, so prefixing the zero state makes the library's entries ours one for one.

Run in the serving venv, which has speculators (`make serve-setup`), with the tiny target's folder:

    .venv-serve/bin/python tests/data/make_speculators_dspark_mtp.py ~/.cache/lightning_spec/targets/tiny-random-*
"""

import json
import sys
from pathlib import Path

import torch
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.dspark import DSparkDraftModel
from speculators.models.dspark.model_definitions import ConfidenceHead, MarkovHead
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
from speculators.proposals import GreedyTokenProposalConfig
from transformers import AutoConfig, Qwen3Config

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from speculators_layouts import draw, save_layout  # noqa: E402 (tests/ is not a package)

RANK, BLOCK, STEPS = 8, 4, 3


def sub(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def dspark(target: str) -> None:
    out = HERE / "speculators_dspark_tiny"
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    vocab = config.vocab_size
    model = DSparkDraftModel.from_training_args(
        config, t2d=torch.ones(vocab, dtype=torch.bool), d2t=torch.zeros(vocab, dtype=torch.long),
        draft_vocab_size=vocab, verifier_name_or_path=target, target_layer_ids=[1, 2], block_size=BLOCK,
        mask_token_id=5, markov_rank=RANK, markov_head_type="rnn",
    )
    weights = draw(save_layout(model, out))
    head = MarkovHead(verifier_vocab_size=vocab, draft_vocab_size=vocab, markov_rank=RANK,
                      hidden_size=config.hidden_size, head_type="rnn")
    head.load_state_dict(sub(weights, "markov_head."))
    conf = ConfidenceHead(config.hidden_size + RANK)
    conf.load_state_dict(sub(weights, "confidence_head."))
    gen = torch.Generator().manual_seed(1)
    prev = torch.randint(0, vocab, (2, BLOCK), generator=gen)  # the previous token of each slot (anchor first)
    hidden = torch.randn(2, BLOCK, config.hidden_size, generator=gen)  # the backbone's states h_k
    with torch.no_grad():
        emb = head.prev_embeddings(prev)
        bias = head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)  # (2, K, V)
        logits = conf(torch.cat([hidden, emb], -1))  # (2, K)
    ref = {"prev": prev.tolist(), "hidden": hidden.tolist(), "bias_first16": bias[..., :16].tolist(),
           "bias_argmax": bias.argmax(-1).tolist(), "confidence_logits": logits.tolist()}
    (out / "reference.json").write_text(json.dumps(ref) + "\n")


def mtp(target: str) -> None:
    out = HERE / "speculators_mtp_tiny"
    llama = AutoConfig.from_pretrained(target)
    layer = Qwen3Config(  # the library's MTP layers are Qwen3 layers; the verifier's shape
        vocab_size=llama.vocab_size, hidden_size=llama.hidden_size, intermediate_size=llama.intermediate_size,
        num_hidden_layers=llama.num_hidden_layers, num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads, head_dim=llama.head_dim, rms_norm_eps=llama.rms_norm_eps,
        max_position_embeddings=llama.max_position_embeddings, rope_parameters=dict(llama.rope_parameters),
        tie_word_embeddings=False,
    )
    config = MTPSpeculatorConfig(
        transformer_layer_config=layer,
        speculators_config=SpeculatorsConfig(
            algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(target),
        ),
    )
    model = MTPDraftModel(config)
    weights = draw(save_layout(model, out))
    missing = model.load_state_dict(weights, strict=False).missing_keys
    assert set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}, missing
    model.load_verifier_weights()  # the target's embedding and head
    model.eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, llama.vocab_size, (1, 9), generator=gen)
    hidden = torch.randn(1, 9, llama.hidden_size, generator=gen)
    hidden[:, 0] = 0  # the zero state before position 0 (see the module docstring)
    with torch.no_grad():
        step0 = model(input_ids=ids, hidden_states=hidden)[0][0][0]  # (T, V), T = 9 - STEPS - 1
    ref = {"input_ids": ids[0].tolist(), "hidden": hidden[0].tolist(), "logits_first16": step0[:, :16].tolist(),
           "logits_argmax": step0.argmax(-1).tolist(), "logsumexp": step0.logsumexp(-1).tolist()}
    (out / "reference.json").write_text(json.dumps(ref) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    dspark(sys.argv[1])
    mtp(sys.argv[1])
