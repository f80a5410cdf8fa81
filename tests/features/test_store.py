"""The feature store: shards written once and read back lazily, refused when written for something else, counted
without a pass over its keys, and a fit that trains from it (written by a fit or by `lightning-spec features`)
exactly as from the target's own forwards."""

import json

import pytest
import torch
from helpers.fits import TINY, metric_history

from lightning_spec.features.store import SHARD_DIR, FeatureStore, StoreSpec, read_spec


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


def test_a_store_json_that_names_the_dropped_holds_and_producer_fields_still_opens(tmp_path):
    """Stores written while ``StoreSpec`` had ``holds`` and ``producer`` (every one held both tensors, written by our
    target forward) open and read as before; a new store.json no longer names them."""
    store = FeatureStore.open(tmp_path, spec())
    store.put(0, *example(0))
    store.flush()
    raw = json.loads((tmp_path / "store.json").read_text())
    assert "holds" not in raw and "producer" not in raw
    raw.update(holds=["features", "last_hidden"], producer="lightning_spec")
    (tmp_path / "store.json").write_text(json.dumps(raw))
    assert read_spec(tmp_path) == spec()
    features, last = FeatureStore.open(tmp_path, spec()).get(0)
    assert torch.equal(features, example(0)[0].half()) and torch.equal(last, example(0)[1].half())


class Unlisted(dict):
    """A dict whose keys cannot be listed (membership, reads and writes still work)."""

    def __iter__(self):
        raise AssertionError("the store listed every key")

    keys = values = items = __iter__


def test_the_store_counts_its_examples_without_listing_them(tmp_path):
    """``len(store)`` is asked every optimizer step (the training clock's uncached examples): a count kept by ``put``
    and by indexing each shard once (as opening a store does), never a pass over every key; an example two writers
    raced on counts once."""
    first = FeatureStore.open(tmp_path, spec(), writer="rank0")
    second = FeatureStore.open(tmp_path, spec(), writer="rank1")
    for i in (0, 1, 2):
        first.put(i, *example(i))
    for i in (2, 3):  # example 2 by both writers
        second.put(i, *example(i))
    first.put(1, *example(1))  # held already: not counted again
    assert len(first) == 3 and len(second) == 2
    first.flush()
    second.flush()  # indexes the first writer's shard too
    assert len(first) == 3 and len(second) == 4
    first.refresh()
    reopened = FeatureStore.open(tmp_path, spec())
    for store in (first, second, reopened):
        store._where, store._pending = Unlisted(store._where), Unlisted(store._pending)
        assert len(store) == 4 and not store.complete
        store.put(4, *example(4))
        store.put(0, *example(0))
        assert len(store) == 5 and store.complete
    memory = FeatureStore(spec())  # feature_cache: memory, everything pending
    memory._pending = Unlisted(memory._pending)
    for i in (0, 1, 1):
        memory.put(i, *example(i))
    assert len(memory) == 2


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


def test_training_from_the_store_equals_training_from_live_target_forwards(tiny_target, tmp_path):
    """One step's loss and gradients from stored features against the same step with fresh target forwards: equal
    to the store's fp16 rounding, whether the store was written by the fit's first step (in memory) or ahead of it
    by ``lightning-spec features`` (``write_store``, batched longest first, on disk), the fit then running no target
    forward for its features."""
    from types import SimpleNamespace

    from helpers.data import sequences

    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.features.command import write_store
    from lightning_spec.loaders import collate
    from lightning_spec.module import DraftModule
    from lightning_spec.objectives import KL, ExpDecay, Objective

    examples = sequences(4, seed=3)
    data = SimpleNamespace(train_dataset=examples, fingerprint="d1", pad_id=0)  # what write_store reads of the data
    lines: list[str] = []

    def step(written_by: str | None):
        torch.manual_seed(0)
        module = DraftModule(DFlashDrafter(block_size=3, num_layers=1, num_anchors=6), Objective(KL(), ExpDecay(4.0)),
                             target=tiny_target)
        batch, spec = collate(examples, pad_id=0), module.feature_source.store_spec(module.target_spec, "d1", 4)
        if written_by == "fit":  # the first step computes and stores the rows, every later step reads them
            module.feature_source = module.feature_source.with_store(FeatureStore(spec))
            module.target_features(batch, use_cache=True)
        elif written_by == "command":  # two batches (3 + 1) of their own widths, then the fit opens the folder
            write_store(module, data, str(tmp_path / "store"), batch_size=3, progress=False, echo=lines.append)
            store = FeatureStore.open(tmp_path / "store", spec)
            module.feature_source = module.feature_source.with_store(store)
        module.feature_source.take_work()
        _, terms = module.draft_step(module.seeded(batch, 0), use_cache=written_by is not None)
        assert module.feature_source.take_work() == (0.0, 0)  # no target forward for stored (or live) features
        terms.num.backward()
        loss = float(terms.num.detach() / terms.den)
        rows = [module.feature_source.store.get(i) for i in range(4)] if written_by else None
        return loss, {k: p.grad.clone() for k, p in module.drafter.named_parameters()}, rows

    live_loss, live_grads, _ = step(None)
    stored = {by: step(by) for by in ("fit", "command")}
    assert lines[0].startswith("features: 4 of 4 examples to compute (0 stored)")
    assert lines[1].startswith("features: 4 of 4 examples stored in ")
    for by, (stored_loss, stored_grads, _) in stored.items():
        assert stored_loss == pytest.approx(live_loss, rel=1e-3), by
        for key, grad in live_grads.items():
            # fp16 keeps 11 significant bits (relative rounding <= 2^-11 per feature value): each parameter's
            # gradient moves by about that much as a whole (single elements that cancel to ~0 may move more)
            error = float((stored_grads[key] - grad).norm() / grad.norm().clamp_min(1e-12))
            assert error < 3e-3, (by, key, error)
        assert stored_loss != live_loss  # the store's rounding is really in the path: the check has power
    for (fit_f, fit_h), (cli_f, cli_h) in zip(stored["fit"][2], stored["command"][2], strict=True):
        assert fit_f.dtype == cli_f.dtype == torch.float16 and fit_f.shape == cli_f.shape
        # the same rows through one door; other batch widths may move a value by one fp16 rounding step at most
        torch.testing.assert_close(cli_f, fit_f, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(cli_h, fit_h, rtol=1e-3, atol=1e-6)


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
