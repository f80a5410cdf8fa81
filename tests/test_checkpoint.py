"""Checkpoints: what is described can be rebuilt, a drafter binds to the user's own target, and a file is data.

A checkpoint or an exported folder comes from someone else: reading one must never run code from it.
"""

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from lightning_spec import generate, load_drafter, load_target
from lightning_spec.checkpoint import CKPT_KEY, build, describe
from lightning_spec.drafters import FAMILIES, RENAMED, D2SDDrafter, DFlashDrafter, Drafter
from lightning_spec.objectives import Objective

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVE_YAMLS = sorted((ROOT / "experiments" / "objectives").glob("*.yaml"))


def objective_from_yaml(path: Path) -> Objective:
    """The objective block of an experiment YAML, instantiated the way the CLI does (jsonargparse)."""
    source = yaml.safe_load(path.read_text())
    block = source.get("model", {}).get("objective")
    if block is None:
        pytest.skip(f"{path.name} has no objective block")
    parser = ArgumentParser()
    parser.add_argument("--objective", type=Objective)
    return parser.instantiate(parser.parse_object({"objective": block})).objective


@pytest.mark.parametrize("path", OBJECTIVE_YAMLS, ids=[p.stem for p in OBJECTIVE_YAMLS])
def test_every_shipped_objective_is_rebuilt_from_its_description(path):
    """``describe`` used to record ``vars(obj)``: E2E, WTV, EAL and EDR were described with fields their
    ``__init__`` rejects (their parts), so a run could not be rebuilt from its own hyperparameters."""
    objective = objective_from_yaml(path)
    described = describe(objective)
    rebuilt = build(described)
    assert type(rebuilt) is type(objective)
    assert describe(rebuilt) == described
    json.dumps(described)  # plain values only: MLflow params and checkpoints hold it


def test_build_refuses_classes_outside_the_package():
    with pytest.raises(ValueError, match="not a lightning_spec class"):
        build({"class_path": "os.system", "init_args": {"command": "echo pwned"}})
    with pytest.raises(ValueError, match="does not have"):
        build({"class_path": "lightning_spec.objectives.NoSuchPart"})


# -------------------------------------------------------------------------------- binding to the user's target
@pytest.mark.parametrize("kind", ["ckpt", "folder"])
def test_load_drafter_binds_to_the_target_the_user_loaded(saved_drafter, tiny_target, kind):
    """README: ``target = load_target(name); drafter = load_drafter(path); generate(target, ..., drafter)``
    failed with "bound to a different target": load_drafter built its own second copy of the target."""
    import gc

    from lightning_spec.target import _LIVE

    original, ckpt, folder = saved_drafter
    gc.collect()
    before = len(_LIVE)
    drafter = load_drafter(ckpt if kind == "ckpt" else folder)
    # a live target with the recorded fingerprint (tiny_target, or another copy of its weights that earlier tests
    # still hold), never a second copy loaded for the drafter
    assert drafter.target.fingerprint == tiny_target.fingerprint and len(_LIVE) == before
    prompt = [5, 6, 7, 8]
    out = generate(tiny_target, prompt, 6, drafter=drafter)
    assert out.tokens == generate(tiny_target, prompt, 6).tokens
    for a, b in zip(drafter.state_dict().values(), original.state_dict().values()):
        assert torch.equal(a, b)


def test_generate_accepts_a_drafter_bound_to_another_copy_of_the_same_weights(saved_drafter, tiny_target):
    _, ckpt, _ = saved_drafter
    copy = load_target("tiny-random")  # a second Target object over equal weights
    assert copy is not tiny_target and copy.fingerprint == tiny_target.fingerprint
    drafter = load_drafter(ckpt, target=copy)
    out = generate(tiny_target, [5, 6, 7, 8], 6, drafter=drafter)
    assert out.tokens == generate(tiny_target, [5, 6, 7, 8], 6).tokens
    assert drafter.target is tiny_target  # re-bound to the target it decodes with


def test_generate_refuses_a_drafter_of_other_weights(saved_drafter, make_random_llama):
    _, ckpt, _ = saved_drafter
    drafter = load_drafter(ckpt)
    other = make_random_llama(vocab_size=320, hidden_size=64)
    with pytest.raises(ValueError, match="different target"):
        generate(other, [5, 6, 7], 4, drafter=drafter)


# ------------------------------------------------------------------------------- files saved under old names
# the drafter_class paths that files written before the one-file-per-family layout record -> the family now
OLD_PATHS = {
    "lightning_spec.drafters.block.BlockDrafter": "dflash", "lightning_spec.drafters.d2sd.VPDrafter": "d2sd",
    "lightning_spec.drafters.domino.DFlyDrafter": "dfly", "lightning_spec.drafters.heads.MedusaDrafter": "medusa",
    "lightning_spec.drafters.heads.MTPDrafter": "mtp",
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_a_file_saved_under_an_old_class_path_loads_as_the_family_now(old, tiny_target, tmp_path):
    """Issue 25 moved the families into a file each: checkpoints and exported folders written before record the old
    module path (``drafters/block.py``'s BlockDrafter, ``heads.py``'s Medusa and MTP, ``domino.py``'s DFly, the
    D²SD drafter's old name). They still load, as the same family, with the same weights."""
    from lightning_spec.checkpoint import save_drafter

    cls = FAMILIES[OLD_PATHS[old]]
    torch.manual_seed(0)
    drafter = cls(block_size=3)
    drafter.bind(tiny_target)
    folder = save_drafter(drafter, tmp_path / "old", "tiny-random")
    meta = json.loads((folder / "drafter.json").read_text())
    (folder / "drafter.json").write_text(json.dumps({**meta, "drafter_class": old}))
    loaded = load_drafter(folder, target=tiny_target)
    assert type(loaded) is cls
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))


def test_old_names_are_kept_only_where_saved_files_name_them():
    """Each alias maps a path no module defines any more to a registered family, and a config naming the package's
    old class names (Lightning's saved config.yaml of a run) still builds that family."""
    import importlib

    paths = {f"{c.__module__}.{c.__qualname__}" for c in FAMILIES.values()}
    for old, new in RENAMED.items():
        module, _, name = old.rpartition(".")
        try:
            gone = not hasattr(importlib.import_module(module), name)
        except ImportError:
            gone = True
        assert gone and new in paths, (old, new)
    parser = ArgumentParser()
    parser.add_argument("--drafter", type=Drafter)
    for old, cls in (("BlockDrafter", DFlashDrafter), ("VPDrafter", D2SDDrafter)):
        cfg = parser.parse_object({"drafter": {"class_path": f"lightning_spec.drafters.{old}",
                                               "init_args": {"block_size": 3}}})
        assert type(parser.instantiate(cfg).drafter) is cls


# ==================================================================== loading is a security boundary
class Boom:
    def __reduce__(self):
        return (Path.touch, (Path("PWNED"),))


def test_a_checkpoint_that_pickles_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:
        pickle.dump({CKPT_KEY: {}, "payload": Boom()}, f)
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_drafter(path)
    assert not (tmp_path / "PWNED").exists()


def test_an_exported_folder_cannot_name_a_callable(saved_drafter, tmp_path, monkeypatch):
    """``"drafter_class": "os.system"`` in drafter.json ran a shell command in load_drafter."""
    monkeypatch.chdir(tmp_path)
    _, _, folder = saved_drafter
    meta = json.loads((folder / "drafter.json").read_text())
    meta["drafter_class"] = "os.system"
    meta["drafter_config"] = {"command": "touch PWNED"}
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    meta["drafter_class"] = "lightning_spec.objectives.KL"  # ours, but not a drafter
    meta["drafter_config"] = {}
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    assert not (tmp_path / "PWNED").exists()
    # a name is looked up among the drafter classes, never imported: a module of ours the file names stays unloaded
    sys.modules.pop("lightning_spec.sweeps.plots", None)
    meta["drafter_class"] = "lightning_spec.sweeps.plots.Anything"
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    assert "lightning_spec.sweeps.plots" not in sys.modules


def test_load_drafter_of_a_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter(tmp_path / "nope.ckpt")
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        load_drafter(empty)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_drafter(junk)
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, other)
    with pytest.raises(ValueError, match="not a lightning_spec checkpoint"):
        load_drafter(other)
    with pytest.raises(ValueError, match="without drafter.json"):
        load_drafter(tmp_path)
