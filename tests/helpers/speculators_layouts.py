"""Drafter folders in the layouts the speculators library (0.9.0) writes, rebuilt from tests/fixtures without weights.

``tests/fixtures/speculators_<name>_tiny/`` keeps what the library wrote for the packaged ``tiny-random`` target: its
config.json, and tensors.json (each tensor's name, shape and dtype, and the values of the integer and boolean ones:
the vocabulary maps). ``draw`` fills the float tensors with seeded random values (the library's were random too);
the generator scripts beside them draw the same values (same rule, same torch) to record, in reference.json, what
the library's own modules compute with those weights. Imported by the tests and, in the serving venv, by the
generators (``save_layout``), so it needs nothing but torch and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def draw(manifest: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The tensors of a tensors.json manifest: recorded values as they are; float tensors drawn in manifest order
    from one generator seeded 0 (vectors 0.5 + U(0, 1), near a norm's ones; matrices N(0, 0.2²))."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, entry in manifest.items():
        dtype = getattr(torch, entry["dtype"])
        if "values" in entry:
            tensors[name] = torch.tensor(entry["values"], dtype=dtype).reshape(entry["shape"])
        elif len(entry["shape"]) == 1:
            tensors[name] = (0.5 + torch.rand(entry["shape"], generator=gen)).to(dtype)
        else:
            tensors[name] = (0.2 * torch.randn(entry["shape"], generator=gen)).to(dtype)
    return tensors


def save_layout(model, out: Path) -> dict[str, dict]:
    """What a generator keeps of a drafter the library saved to ``out`` (``model.save_pretrained``): config.json (its
    config.py hook and auto_map dropped, the verifier path replaced by the packaged name, so it names no machine's
    home folder) and tensors.json; the weights file is deleted. Returns the manifest."""
    from safetensors.torch import load_file

    model.save_pretrained(out)
    (out / "config.py").unlink(missing_ok=True)
    weights = out / "model.safetensors"
    manifest = {}
    for name, t in load_file(str(weights)).items():
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        if not t.is_floating_point():
            entry["values"] = t.tolist()
        manifest[name] = entry
    (out / "tensors.json").write_text(json.dumps(manifest) + "\n")
    weights.unlink()
    config = json.loads((out / "config.json").read_text())
    config.pop("auto_map", None)
    config["speculators_config"]["verifier"]["name_or_path"] = "tiny-random"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return manifest


def build_folder(name: str, dest: Path) -> Path:
    """``dest`` made the folder the library wrote for ``tests/fixtures/speculators_<name>_tiny`` (weights drawn)."""
    from safetensors.torch import save_file

    layout = FIXTURES / f"speculators_{name}_tiny"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text((layout / "config.json").read_text())
    save_file(draw(json.loads((layout / "tensors.json").read_text())), str(dest / "model.safetensors"))
    return dest


def reference(name: str) -> dict:
    """What the library's modules computed with the drawn weights (tests/fixtures/speculators_<name>_tiny)."""
    return json.loads((FIXTURES / f"speculators_{name}_tiny" / "reference.json").read_text())
