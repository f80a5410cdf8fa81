"""Kill and resume: `fit --ckpt_path last.ckpt` after a SIGKILL reproduces the uninterrupted run and continues its
MLflow run; resuming from a checkpoint written after any training step (mid-epoch or at an epoch's end) too.

The tiny target has 12 training examples: batch 4 gives 3 optimizer steps per epoch, and 8 steps run epochs 0-2.
With ``val_check_interval=2`` validation (and the default checkpoint, ``last.ckpt``) comes after the 2nd batch
of every epoch: steps 2, 5 and 8.
"""

import sys
from pathlib import Path

import pytest
import torch
from fit_probe import TINY, callback, fit, metric_history, mlflow_runs

from lightning_spec.cli import run_cli
from lightning_spec.features.store import FeatureStore, read_spec
from lightning_spec.tracking import MLFLOW_RUN_KEY

STEPS = 8
COMMON = [f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=2"]


def drafter_state(path: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}


def assert_same_drafter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for key in want:
        # measured: bitwise equal here; the tolerance only leaves room for another BLAS
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """8 steps in one go, keeping a checkpoint after every step (steps/step=<k>.ckpt)."""
    cwd = tmp_path_factory.mktemp("resume") / "uninterrupted"
    steps = callback("lightning.pytorch.callbacks.ModelCheckpoint", dirpath=str(cwd / "steps"), filename="{step}",
                     every_n_train_steps=1, save_top_k=-1)
    run = fit(cwd, *COMMON, steps)
    assert run.returncode == 0, run.stderr[-3000:]
    return cwd


def test_killed_run_resumes_from_last_ckpt_into_the_same_mlflow_run(uninterrupted, tmp_path):
    """The killed and resumed run keep their features in a feature store (the uninterrupted one in memory): what
    was stored before the kill is read back, nothing is computed twice, and the drafter is the same."""
    store = tmp_path / "store"
    killed = fit(tmp_path, *COMMON, callback("fit_probe.KillAt", step=6), "--model.feature_cache=disk",
                 f"--model.feature_store={store}")
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL after step 6, before step 7
    (last,) = tmp_path.rglob("last.ckpt")
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 5 and ckpt["epoch"] == 1  # the validation checkpoint, 2 batches into epoch 1
    loader_state = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state == [{"epoch": 1, "batches": 2, "domain_weights": None}]
    client, (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "RUNNING" and ckpt[MLFLOW_RUN_KEY] == run.info.run_id  # died without finishing

    shards = sorted((store / "shards").glob("*.safetensors"))
    assert len(FeatureStore.open(store, read_spec(store))) == 12  # flushed at the end of epoch 0 and at checkpoints
    resumed = fit(tmp_path, *COMMON, f"--ckpt_path={last}", "--model.feature_cache=disk",
                  f"--model.feature_store={store}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr  # Lightning restarts a non-stateful loader's epoch and warns
    client, runs = mlflow_runs(tmp_path)
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # one run, continued
    assert runs[0].info.status == "FINISHED"
    for key in ["train/loss", "val/mal", "val/temp1/mal", "val/loss"]:
        want = metric_history(uninterrupted, key)
        got = metric_history(tmp_path, key)
        # step 6's metrics were logged before the kill and again after the resume (from step 5): same values
        assert sorted(set(s for s, _ in got)) == [s for s, _ in want], key
        for step, value in got:
            assert value == pytest.approx(dict(want)[step], rel=1e-5, abs=1e-6), (key, step)
    assert [s for s, _ in metric_history(tmp_path, "val/mal")] == [0, 2, 5, 8]
    assert len({round(v, 3) for _, v in metric_history(tmp_path, "train/loss")}) > 4  # the loss moves
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == STEPS  # rewritten at the end
    assert_same_drafter(drafter_state(last), drafter_state(uninterrupted / "steps" / f"step={STEPS}.ckpt"))
    assert sorted((store / "shards").glob("*.safetensors")) == shards  # the resumed run computed no feature again


@pytest.mark.parametrize(("step", "trained"), [(3, {"epoch": 0, "batches": 3}), (4, {"epoch": 1, "batches": 1})],
                         ids=["end-of-epoch", "mid-epoch"])
def test_resume_from_a_step_checkpoint_gives_the_uninterrupted_drafter(uninterrupted, tmp_path, monkeypatch, step,
                                                                       trained):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    ckpt = uninterrupted / "steps" / f"step={step}.ckpt"
    loops = torch.load(ckpt, map_location="cpu", weights_only=False)["loops"]["fit_loop"]
    # the batches trained in the epoch, no more (the sized loader is never fetched ahead)
    assert loops["state_dict"]["combined_loader"] == [{**trained, "domain_weights": None}]
    run_cli(["fit", "-c", str(TINY), *COMMON, "--trainer.logger=false", "--trainer.enable_progress_bar=false",
             f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={ckpt}"])
    (last,) = tmp_path.rglob("last.ckpt")
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == STEPS
    assert_same_drafter(drafter_state(last), drafter_state(uninterrupted / "steps" / f"step={STEPS}.ckpt"))
