"""The feature store: shards written once and read back lazily, refused when written for something else, and a
fit that trains from it exactly as from the target's own forwards."""

import json

import pytest
import torch
from helpers.fits import TINY, metric_history

from lightning_spec.features.store import SHARD_DIR, FeatureStore, StoreSpec, check_holds, read_spec


def spec(**changes) -> StoreSpec:
    base = dict(target="tiny", target_fingerprint="abc", layers=[0, 1], data_fingerprint="d1", dtype="float32",
                hidden_size=4, examples=5)
    return StoreSpec(**{**base, **changes})


def example(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    length = 3 + i
    return torch.randn(length, 8, generator=g), torch.randn(length, 4, generator=g)


def test_shards_of_several_writers_read_back_exactly(tmp_path):
    first = FeatureStore.open(tmp_path, spec(), writer="rank0")
    second = FeatureStore.open(tmp_path, spec(), writer="rank1")
    for i in (0, 2, 4):
        first.put(i, *example(i))
    for i in (1, 3):
        second.put(i, *example(i))
    assert not list((tmp_path / SHARD_DIR).glob("*.safetensors"))  # buffered until a shard fills or a flush
    first.flush()
    second.flush()
    (tmp_path / SHARD_DIR / "rank9-x-00000.safetensors.tmp123").write_bytes(b"torn")  # a killed writer's leftover
    assert len(first) == 3
    first.refresh()  # sees the other writer's shard
    reopened = FeatureStore.open(tmp_path, spec())
    for store in (first, reopened):
        assert len(store) == 5 and store.complete and all(i in store for i in range(5))
        for i in range(5):
            features, last = store.get(i)
            want_f, want_h = example(i)
            assert features.dtype == last.dtype == torch.float16  # fp32 targets are stored in fp16
            assert torch.equal(features, want_f.half()) and torch.equal(last, want_h.half())
    assert reopened._pending == {}  # read from disk, row range by row range: nothing held in memory


def test_a_full_buffer_writes_a_shard_and_bf16_targets_store_bf16(tmp_path):
    store = FeatureStore.open(tmp_path, spec(dtype="bfloat16"), shard_bytes=100)
    store.put(0, *example(0))  # 3 x (8 + 4) bf16 values = 72 bytes
    assert not list((tmp_path / SHARD_DIR).glob("*"))
    store.put(1, *example(1))
    assert len(list((tmp_path / SHARD_DIR).glob("*.safetensors"))) == 1 and store._pending == {}
    assert store.get(1)[0].dtype == torch.bfloat16 and torch.equal(store.get(1)[0], example(1)[0].bfloat16())


def test_a_store_of_other_weights_layers_data_or_dtype_is_refused(tmp_path):
    FeatureStore.open(tmp_path, spec())
    for changes, named in [({"target_fingerprint": "zzz"}, "target weights"), ({"layers": [1]}, "layers"),
                           ({"data_fingerprint": "d2"}, "data"), ({"dtype": "bfloat16"}, "dtype")]:
        with pytest.raises(ValueError, match=rf"model.feature_store '{tmp_path}' holds features of .*\({named}"):
            FeatureStore.open(tmp_path, spec(**changes))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files, not a feature store"):
        FeatureStore.open(other, spec(), field_name="--out")
    assert read_spec(tmp_path) == spec()  # nothing rewritten by the refusals


def test_two_ranks_creating_one_store_at_once_both_open_it(tmp_path, monkeypatch):
    """DDP ranks open a new store together: one may find no spec yet and then see the other's spec (or its temporary
    file) in the folder; that is the same store being created, not other files (a race seen in
    tests/integration/test_ddp.py)."""
    import lightning_spec.features.store as store_module

    FeatureStore.open(tmp_path, spec())  # the other rank's spec, written
    (tmp_path / "store.json.tmp4242").write_text("{}")  # and its temporary file of a second write, not yet renamed
    monkeypatch.setattr(store_module, "read_spec", lambda directory: None)  # this rank looked before it was there
    assert FeatureStore.open(tmp_path, spec()).spec == spec()


def test_a_store_without_the_final_hidden_state_refuses_objectives_that_need_the_distribution(tmp_path):
    layers_only = spec(holds=["features"], producer="vllm")
    check_holds(layers_only, needs_distribution=False, objective="CE", directory=tmp_path)
    with pytest.raises(ValueError, match="holds the target's layer features only .* Objective needs the target's"):
        check_holds(layers_only, needs_distribution=True, objective="Objective", directory=tmp_path)
    store = FeatureStore.open(tmp_path, layers_only)
    store.put(0, *example(0))
    store.flush()
    assert FeatureStore.open(tmp_path, spec()).get(0)[1] is None  # the folder's own spec decides what it holds


def test_features_that_overflow_float16_are_refused_in_one_sentence():
    store = FeatureStore(spec())
    with pytest.raises(ValueError, match="exceed float16's range.* model.feature_dtype: bfloat16"):
        store.put(0, torch.full((2, 8), 1e6), torch.zeros(2, 4))


# ------------------------------------------------------------------------------------------------ in a fit
def test_fit_writes_the_store_in_its_first_epoch_and_a_second_fit_reads_it(tmp_path, monkeypatch):
    """Two fits of the tiny YAML on one store: the second finds every training example stored, so its target never
    runs for training features (only for validation and decoding), and it trains exactly like the first. Both run in
    this process (what is shared is the store's folder, not a process)."""
    from lightning_spec.cli import run_cli

    store = tmp_path / "store"
    common = ["--model.feature_cache=disk", f"--model.feature_store={store}", "--trainer.max_steps=12",
              "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=100", "--trainer.callbacks=[]",
              "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]

    def fit(cwd):
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        run_cli(["fit", "-c", str(TINY), *common], exit_on_error=False)

    fit(tmp_path / "a")
    written = read_spec(store)
    shards = sorted((store / SHARD_DIR).glob("*.safetensors"))
    assert written.examples > 0 and shards
    assert len(FeatureStore.open(store, written)) == written.examples  # the whole training split after 12 steps
    mtimes = {p: p.stat().st_mtime_ns for p in shards}
    fit(tmp_path / "b")
    assert sorted((store / SHARD_DIR).glob("*.safetensors")) == shards  # nothing computed, nothing written
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    assert metric_history(tmp_path / "a", "train/loss") == metric_history(tmp_path / "b", "train/loss")


def test_training_from_the_store_equals_training_from_live_target_forwards(tiny_target):
    """One step's loss and gradients from stored features against the same step with fresh target forwards: equal
    to the store's fp16 rounding."""
    from helpers.data import sequences

    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.loaders import collate
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import KL, ExpDecay, Objective

    def step(use_store: bool):
        torch.manual_seed(0)
        module = DraftModule(DFlashDrafter(block_size=3, num_layers=1, num_anchors=6), Objective(KL(), ExpDecay(4.0)),
                             target=tiny_target)
        module._features = FeatureStore(spec(examples=4)) if use_store else None
        batch = collate(sequences(4, seed=3), pad_id=0)
        if use_store:
            module.target_features(batch, use_cache=True)  # written, then every step reads the store
        _, terms = module.draft_step(module.seeded(batch, 0), use_cache=use_store)
        terms.num.backward()
        loss = float(terms.num.detach() / terms.den)
        return loss, {k: p.grad.clone() for k, p in module.drafter.named_parameters()}

    (live_loss, live_grads), (stored_loss, stored_grads) = step(False), step(True)
    assert stored_loss == pytest.approx(live_loss, rel=1e-3)
    for key, grad in live_grads.items():
        # fp16 keeps 11 significant bits (relative rounding <= 2^-11 per feature value): each parameter's gradient
        # moves by about that much as a whole (single elements that cancel to ~0 may move more, relatively)
        error = float((stored_grads[key] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < 3e-3, (key, error)
    assert stored_loss != live_loss  # the store's rounding is really in the path: the check has power


def test_the_features_command_writes_the_store_a_fit_reads(tmp_path, monkeypatch, capsys):
    from lightning_spec.cli import main

    out = tmp_path / "store"
    main(["features", "-c", "experiments/tiny.yaml", f"--out={out}", "--progress=false"])
    err = capsys.readouterr().err
    assert "features: " in err and "tokens; target 'tiny-random' in float32" in err and " to write to " in err
    written = read_spec(out)
    assert len(FeatureStore.open(out, written)) == written.examples
    main(["features", "-c", "experiments/tiny.yaml", f"--out={out}", "--progress=false"])  # resumes: nothing left
    assert f"0 of {written.examples} examples to compute ({written.examples} stored)" in capsys.readouterr().err

    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("U", (), {"free": 10})())
    with pytest.raises(SystemExit):
        main(["features", "-c", "experiments/tiny.yaml", f"--out={tmp_path / 'full'}", "--progress=false"])
    assert "has 10 B free; free space or point --out" in capsys.readouterr().err
    json.loads((out / "store.json").read_text())  # the store's description stays readable JSON
