"""Every drafter artifact says where it came from (``provenance.py``, issue 47): the fit's checkpoint holds the
fit's command, resolved config, package versions and commit; every folder written from it a ``provenance.json``
with that record, the command that wrote the folder, the target's fingerprint and the weights' SHA-256; and the
recorded config alone rebuilds the same weights."""

import json
from pathlib import Path

import torch
import yaml
from helpers.cli import exit_code

from lightning_spec.checkpoint import load_drafter, read_checkpoint, recorded_fit, save_drafter, write_model_folder
from lightning_spec.provenance import PROVENANCE_FILE, PROVENANCE_KEY, input_checksums, run_record, sha256_file

ROOT = Path(__file__).resolve().parents[1]
FIT = ["fit", "-c", str(ROOT / "experiments" / "tiny.yaml"), "--trainer.max_steps=2", "--trainer.callbacks=[]",
       "--trainer.limit_val_batches=0", "--trainer.val_check_interval=null", "--trainer.logger=false",
       "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_a_drafter_rebuilt_from_its_recorded_config_has_the_same_weights_checksum(in_tmp, monkeypatch):
    assert exit_code([*FIT, "--trainer.default_root_dir=first"]) == 0
    (first,) = (in_tmp / "first").rglob("last.ckpt")
    fit = read_checkpoint(first)[PROVENANCE_KEY]
    assert fit["command"].startswith("lightning-spec fit -c ") and "--trainer.max_steps=2" in fit["command"]
    assert {"torch", "transformers", "lightning", "lightning_spec", "python"} <= set(fit["versions"])
    assert fit["versions"]["torch"] == torch.__version__.split("+")[0] or fit["versions"]["torch"] == torch.__version__
    assert fit["commit"] is None or len(fit["commit"]["sha"]) == 40  # a checkout records its commit
    config = yaml.safe_load(fit["config"])
    assert config["trainer"]["max_steps"] == 2 and config["model"]["target"] == "tiny-random"
    assert isinstance(config["seed_everything"], int)  # the seed drawn, so a rebuild draws the same anchors

    folder = save_drafter(load_drafter(first), in_tmp / "first-folder", fit=recorded_fit(first))
    record = json.loads((folder / PROVENANCE_FILE).read_text())
    assert record["fit"] == fit and record["weights_file"] == "drafter.pt"
    assert record["weights_sha256"] == sha256_file(folder / "drafter.pt")
    assert record["target_fingerprint"] == load_drafter(folder).target.fingerprint
    assert recorded_fit(folder) == fit  # a folder passes its fit's record on

    target = load_drafter(first).target
    reads, load = [], torch.load  # the logged model's folder reads the checkpoint once: record, weights and fit
    with monkeypatch.context() as patched:
        patched.setattr(torch, "load", lambda *a, **k: reads.append(a[0]) or load(*a, **k))
        model = write_model_folder(first, in_tmp / "model", target, "tiny-random")
    assert [Path(r) for r in reads] == [first]
    assert json.loads((model.folder / PROVENANCE_FILE).read_text())["fit"] == fit

    (in_tmp / "recorded.yaml").write_text(fit["config"])
    assert exit_code(["fit", "--config", "recorded.yaml", "--trainer.default_root_dir=second"]) == 0
    (second,) = (in_tmp / "second").rglob("last.ckpt")
    rebuilt = save_drafter(load_drafter(second), in_tmp / "second-folder", fit=recorded_fit(second))
    assert json.loads((rebuilt / PROVENANCE_FILE).read_text())["weights_sha256"] == record["weights_sha256"]


def test_a_run_record_and_input_checksums(tmp_path, monkeypatch):
    from lightning_spec import provenance

    monkeypatch.setattr(provenance, "COMMAND", ["lightning-spec", "evaluate", "--drafters", "[a b]"])
    record = run_record("x: 1\n")
    assert record["command"] == "lightning-spec evaluate --drafters '[a b]'" and record["config"] == "x: 1\n"
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "f.ckpt").write_bytes(b"abc")
    sums = input_checksums([str(tmp_path / "w"), str(tmp_path / "f.ckpt"), "ngram"])
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # SHA-256 of b"abc"
    assert sums == {str(tmp_path / "w"): abc, str(tmp_path / "f.ckpt"): abc, "ngram": None}
