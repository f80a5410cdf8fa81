"""Kill and resume: `fit --ckpt_path last.ckpt` after a SIGKILL reproduces the uninterrupted run and continues its
MLflow run; resuming from a checkpoint written after any training step (mid-epoch or at an epoch's end) too, and
a mid-epoch resume of a fit whose domain weights are re-computed within the epoch draws what the uninterrupted one
draws.

The tiny target has 12 training examples: batch 4 gives 3 optimizer steps per epoch, and 8 steps run epochs 0-2.
With ``val_check_interval=2`` validation (and the default checkpoint, ``last.ckpt``) comes after the 2nd batch
of every epoch: steps 2, 5 and 8.
"""

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers.fits import TINY, callback, fit, metric_history, mlflow_runs
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_spec.callbacks import DomainReweighting, EvaluationCallback
from lightning_spec.cli import run_cli
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import BlockDrafter
from lightning_spec.features.store import FeatureStore, read_spec
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Objective
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
    killed = fit(tmp_path, *COMMON, callback("helpers.fits.KillAt", step=6), "--model.feature_cache=disk",
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


# ---------------------------------------------------------------------------- mid-epoch resume with domain weights
#
# A fit whose sampler draws by domain weights that DomainReweighting re-computes within the epoch: 38 training
# examples in chat and code, batch 8 (5 batches an epoch), a validation after every 2nd batch (steps 2, 4, 7, 9,
# 12), and a per-domain MAL that is a function of the step alone, so a resumed run measures what the original did.
# Resumed from the checkpoint after step 8 (3 batches into epoch 1), it must draw the rest of epoch 1 in the order
# drawn at the epoch's start, with the weights of step 4 (the loader's replay), while the weights in force, and
# DomainReweighting's smoothed ones, are those of step 7 (the data module's and the callback's restored state).

WEIGHTED_STEPS, RESUME_AT = 12, 8


class StepMAL(EvaluationCallback):
    """Per-domain MAL as a function of the global step: chat and code take turns at being the worse one."""

    name = "step-mal"

    def __init__(self) -> None:
        super().__init__(before_training=True)

    def mal_prefixes(self) -> set[str]:
        return {"val/mal"}

    def evaluate(self, trainer, module, before_training=False):
        step = trainer.global_step
        return {"val/mal/chat": 1.0 + step % 3, "val/mal/code": 1.0 + 0.5 * ((step + 1) % 4)}


class Draws(L.Callback):
    """(step, the examples of the batch, the data module's domain weights) of every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], dict | None]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch["index"].tolist(), trainer.datamodule.domain_weights))


def weighted_fit(tmp: Path, target, ckpt_path: Path | None = None):
    def chats(n: int, domain: str) -> list[str]:
        return [json.dumps({"domain": domain, "messages": [{"role": "user", "content": f"{domain} {i}+{i + 2}?"},
                                                            {"role": "assistant", "content": f"It is {2 * i + 2}."}]})
                for i in range(n)]

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "train.jsonl").write_text("\n".join(chats(32, "chat") + chats(16, "code")) + "\n")
    (tmp / "eval.jsonl").write_text("\n".join(json.dumps({"domain": d, "messages": [{"role": "user", "content": d}]})
                                              for d in ("chat", "code")) + "\n")
    dm = SpecDataModule(target="tiny-random", train_sources=[str(tmp / "train.jsonl")],
                        eval_sources=[str(tmp / "eval.jsonl")], train_limit=None, max_length=64, batch_size=8,
                        val_fraction=0.2, eval_prompts_per_domain=1, seed=0)
    torch.manual_seed(0)
    module = DraftModule(BlockDrafter(block_size=2, num_layers=1, num_anchors=4), Objective(KL()), target=target)
    reweight, draws = DomainReweighting(beta=2.0, floor=0.05, smoothing=0.5), Draws()
    steps = ModelCheckpoint(dirpath=tmp / "steps", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                        val_check_interval=2, max_steps=WEIGHTED_STEPS, default_root_dir=tmp,
                        callbacks=[reweight, StepMAL(), draws, steps])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*validation runs within epochs.*")
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    assert trainer.global_step == WEIGHTED_STEPS
    return dm, reweight, draws


def test_a_mid_epoch_resume_with_domain_reweighting_draws_what_the_uninterrupted_run_draws(tmp_path, tiny_target):
    dm, reweight, draws = weighted_fit(tmp_path / "whole", tiny_target)
    ckpt = tmp_path / "whole" / "steps" / f"step={RESUME_AT}.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    (loader,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (loader["epoch"], loader["batches"]) == (1, 3)  # mid-epoch
    # the weights were re-computed before the checkpoint (before training, steps 2, 4, 7), the last time after
    # epoch 1's order was drawn: the interrupted pass drew with other weights than those now in force
    assert [s for s, _ in reweight.history if s < RESUME_AT] == [0, 2, 4, 7]
    in_force = state["SpecDataModule"]["domain_weights"]
    assert loader["domain_weights"] is not None and loader["domain_weights"] != in_force

    dm2, resumed, draws2 = weighted_fit(tmp_path / "resumed", tiny_target, ckpt_path=ckpt)
    after = [d for d in draws.seen if d[0] >= RESUME_AT]
    assert [d[0] for d in draws2.seen] == [d[0] for d in after]  # steps 8..11, none twice, none skipped
    for (step, got, got_weights), (_, want, want_weights) in zip(draws2.seen, after, strict=True):
        assert got == want, f"step {step}: the resumed run drew other examples"
        assert got_weights == pytest.approx(want_weights), f"step {step}: other domain weights in force"
    assert [s for s, _ in resumed.history] == [s for s, _ in reweight.history]
    for (step, got), (_, want) in zip(resumed.history, reweight.history, strict=True):
        assert got == pytest.approx(want), f"step {step}: other domain weights"
    assert dm2.domain_weights == pytest.approx(dm.domain_weights)
