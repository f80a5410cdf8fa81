"""Loads exported folders with the speculators library's own classes and reports, per folder, what it found: the
class it chose from config.json, the weights it missed or did not expect, and the shipped tensors it holds with
other values. Run in the serving venv (which has speculators) by tests/test_export.py:

    .venv-serve/bin/python tests/data/speculators_load.py FOLDER [FOLDER ...]   # prints one JSON object
"""

import json
import sys

import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel


def check(folder: str) -> dict:
    """Its EAGLE-3 class does not pass ``output_loading_info`` on, so the keys are compared here: a weight is missing
    when the model has it, the file does not, and the library does not fill it from the verifier itself."""
    model = SpeculatorModel.from_pretrained(folder)
    state = model.state_dict()
    shipped = load_file(f"{folder}/model.safetensors")
    filled = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()) | {"verifier_lm_head.weight"}
    return {
        "class": type(model).__name__,
        "missing": sorted(k for k in state if k not in shipped and k not in filled),
        "unexpected": sorted(k for k in shipped if k not in state),
        "mismatched": sorted(k for k, v in shipped.items() if k in state and state[k].shape != v.shape),
        "changed": sorted(k for k, v in shipped.items()
                          if k in state and state[k].shape == v.shape and not torch.equal(state[k].to(v.dtype), v)),
        "speculative_tokens": model.config.speculators_config.proposal_methods[0].speculative_tokens,
    }


if __name__ == "__main__":
    print(json.dumps({folder: check(folder) for folder in sys.argv[1:]}))
