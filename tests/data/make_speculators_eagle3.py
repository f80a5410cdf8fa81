"""Writes tests/data/speculators_eagle3_tiny/: the layout of an EAGLE-3 drafter built and saved by the speculators
library itself (speculators 0.9.0) for the packaged ``tiny-random`` target (2 layers, hidden 64, vocabulary 320),
with a 64-token draft vocabulary: its config.json as the library wrote it, and ``tensors.json``, each tensor's name,
shape and dtype in the library's model.safetensors (and the values of the integer and boolean ones: the vocabulary
maps). No weights are committed: tests/test_export.py fills the float tensors with seeded random values (the
library's were random too) and imports the folder as our Eagle3Drafter.

Run in the serving venv, which has speculators (`make serve-setup`), with the tiny target's folder:

    .venv-serve/bin/python tests/data/make_speculators_eagle3.py ~/.cache/lightning_spec/targets/tiny-random-*

Its config.py (speculators' remote-code hook) is deleted, and the verifier path is replaced by the packaged name so
the file names no machine's home folder.
"""

import sys
from pathlib import Path

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent.parent))
from speculators_layouts import save_layout  # noqa: E402 (tests/ is not a package)

OUT = Path(__file__).parent / "speculators_eagle3_tiny"


def main(target: str) -> None:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = 1  # the draft layer count, as speculators' trainer sets it
    vocab, draft = config.vocab_size, 64
    ids = torch.randperm(vocab)[:draft].sort().values  # a draft vocabulary that is not a prefix: d2t has work to do
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft)
    model = Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, draft_vocab_size=draft, norm_before_residual=False,
        verifier_name_or_path=target, target_layer_ids=[1, 2], ttt_steps=3,
    )
    save_layout(model, OUT)


if __name__ == "__main__":
    main(sys.argv[1])
