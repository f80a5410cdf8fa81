"""Training regimes as stages and parts of the one DraftModule: ``model.init_from`` (weights of a trained drafter,
a fresh optimizer), the parent a checkpoint records, and the frozen reference drafter an objective may ask for."""

import lightning as L
import pytest
import torch
from helpers.fits import quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_spec.checkpoint import CKPT_KEY, save_drafter
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.drafters import DFlashDrafter
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, ExpDecay, Objective


def drafter_like(**overrides) -> DFlashDrafter:
    return DFlashDrafter(**{**dict(block_size=3, num_layers=1, num_anchors=8, draft_vocab_size=100), **overrides})


def test_init_from_starts_from_the_weights_and_records_the_parent(trained_fit, data_files, tmp_path):
    module, path, _ = trained_fit
    want = module.drafter.state_dict()
    for source in (path, save_drafter(module.drafter, tmp_path / "export")):
        child = DraftModule(drafter_like(num_anchors=4), Objective(KL()), target="tiny-random", init_from=str(source))
        got = child.drafter.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # a second stage trains from there with its own optimizer and step count, and its checkpoint names its parent
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    child = DraftModule(drafter_like(), Objective(KL(), ExpDecay(2.0)), target="tiny-random", init_from=str(path))
    trainer = quiet_trainer(max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path,
                            callbacks=[ModelCheckpoint(dirpath=tmp_path / "stage2", save_last=True)])
    trainer.fit(child, datamodule=dm)
    assert trainer.global_step == 2
    ckpt = torch.load(tmp_path / "stage2" / "last.ckpt", map_location="cpu", weights_only=True)
    parent = ckpt[CKPT_KEY]["parent"]
    assert parent["path"] == str(path) and parent["drafter_class"].endswith("DFlashDrafter")
    assert parent["parent"] is None  # the first stage started from scratch
    assert ckpt["hyper_parameters"]["init_from"] == str(path)
    moved = ckpt["state_dict"]
    assert any(not torch.equal(moved["drafter." + k], v) for k, v in want.items() if v.is_floating_point())
    # a third stage sees the whole lineage
    grandchild = DraftModule(drafter_like(), Objective(KL()), target="tiny-random",
                             init_from=str(tmp_path / "stage2" / "last.ckpt"))
    assert grandchild._parent["parent"]["path"] == str(path)


def test_init_from_refuses_another_class_or_shape_in_one_sentence(trained_fit):
    _, path, _ = trained_fit
    with pytest.raises(ValueError, match=r"model.init_from .* holds a .*DFlashDrafter but model.drafter is a"):
        from lightning_spec.drafters import MedusaDrafter

        DraftModule(MedusaDrafter(block_size=3), Objective(KL()), target="tiny-random", init_from=str(path))
    with pytest.raises(ValueError, match=r"does not fit model.drafter .*init_args it was trained with"):
        DraftModule(drafter_like(num_layers=2), Objective(KL()), target="tiny-random", init_from=str(path))
    with pytest.raises(ValueError, match="does not exist"):
        DraftModule(drafter_like(), Objective(KL()), target="tiny-random", init_from=str(path) + ".missing")


class NeedsReference(Objective):
    needs_reference = True


def test_the_reference_drafter_is_the_frozen_start_at_the_same_anchors(trained_fit):
    module, path, dm = trained_fit
    child = DraftModule(drafter_like(), NeedsReference(KL()), target="tiny-random", init_from=str(path))
    batch = child.seeded(next(iter(torch.utils.data.DataLoader([dm.train_dataset[i] for i in range(4)], batch_size=4,
                                                               collate_fn=dm._collate))), 0)
    draft, ctx = child.draft_and_context(batch, use_cache=False)
    assert torch.allclose(ctx.reference_logits, draft.logits.detach())  # nothing trained yet
    with torch.no_grad():
        for p in child.drafter.parameters():
            p.add_(0.1)
    draft, ctx = child.draft_and_context(batch, use_cache=False)
    assert not torch.allclose(ctx.reference_logits, draft.logits.detach())
    assert not any(k.startswith("_reference") for k in child.state_dict())
    assert all(not p.requires_grad for p in child._reference.drafter.parameters())
    L.seed_everything(0)


def test_edr_finetune_regime_starts_from_a_trained_drafter(trained_fit, data_files, tmp_path):
    """experiments/regimes/edr_finetune.yaml on the tiny target: one epoch of EDR from a first stage's weights."""
    from lightning_spec.objectives import EDR
    from lightning_spec.sampling import SamplingConfig

    _, path, _ = trained_fit
    dm = SpecDataModule(target="tiny-random", train_sources=[data_files["train"]], eval_sources=[data_files["eval"]],
                        train_limit=None, max_length=64, batch_size=4, val_fraction=0.2)
    module = DraftModule(drafter_like(), EDR(SamplingConfig(temperature=1.0), max_anchors=4), target="tiny-random",
                         init_from=str(path), lr=1e-4, min_lr_ratio=1.0)
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == len(dm.train_dataloader()) >= 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert "train/edr_expected_rounds" in trainer.callback_metrics
