"""Every experiments/objectives/*.yaml: an overlay on the quickstart holding only the objective, that merges as
meant, instantiates the way the CLI builds it, and trains a few steps on the tiny target; and EDR's metrics reach
the logger under a Trainer."""

from pathlib import Path

import pytest
import torch
import yaml
from helpers.objectives import instantiate_objective
from helpers.overlays import QUICKSTART, config_files, printed_config, printed_of

from lightning_spec.drafters import DFlashDrafter
from lightning_spec.loaders import collate
from lightning_spec.module import DraftModule
from lightning_spec.objectives import EDR

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- every objective YAML, end to end

OBJECTIVE_YAMLS = sorted((ROOT / "experiments" / "objectives").glob("*.yaml"))
REQUIRED = {
    "ce_uniform", "ce_decay", "kl_decay", "rkl_decay", "tv_decay", "jsd_decay", "lk_lambda", "lk_alpha", "auf",
    "valid_prefix", "dpace", "e2e", "eal", "wtv", "edr", "dspark_mix",
}


def test_every_required_objective_has_a_yaml():
    assert REQUIRED <= {p.stem for p in OBJECTIVE_YAMLS}


def test_objective_overlays_hold_only_the_objective():
    """Each is an overlay on the quickstart holding model.objective and nothing else, an objective other than the
    quickstart's, and a header naming the command that runs it."""
    quick = yaml.safe_load(QUICKSTART.read_text())
    for path in OBJECTIVE_YAMLS:
        cfg = yaml.safe_load(path.read_text())
        assert list(cfg) == ["model"] and list(cfg["model"]) == ["objective"], path.name
        assert cfg["model"]["objective"] != quick["model"]["objective"], path.name
        assert config_files(path) == [QUICKSTART, path]


@pytest.mark.parametrize("path", OBJECTIVE_YAMLS, ids=[p.stem for p in OBJECTIVE_YAMLS])
def test_objective_overlay_merges_onto_the_quickstart(path):
    """``fit -c quickstart.yaml -c objectives/<name>.yaml`` is the quickstart with model.objective replaced whole
    by the overlay's: nothing else moves, and no init_args of the quickstart's objective survive into it (a class
    change keeps the init_args the new class shares, e.g. ``normalize``: an overlay states those)."""
    merged = printed_config(QUICKSTART, path)
    replaced = yaml.safe_load(QUICKSTART.read_text())
    replaced["model"]["objective"] = yaml.safe_load(path.read_text())["model"]["objective"]
    assert merged == printed_of(replaced)
    quick = printed_config(QUICKSTART)
    del merged["model"]["objective"], quick["model"]["objective"]
    assert merged == quick


def tiny_batch(seed: int = 0) -> dict:
    """Byte-token 'conversations': a prompt, an answer ending in <|im_end|> (id 257), a second answer."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(3):
        length = 26 + 4 * i
        ids = torch.randint(0, 256, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[4 + i : 14] = True
        ids[13] = 257
        mask[17:] = True
        examples.append({"input_ids": ids, "loss_mask": mask, "domain_id": 0, "index": i})
    batch = collate(examples, pad_id=0)
    del batch["index"]
    return batch


@pytest.mark.parametrize("path", OBJECTIVE_YAMLS, ids=[p.stem for p in OBJECTIVE_YAMLS])
def test_objective_yaml_trains_on_the_tiny_target(path, tiny_target):
    objective = instantiate_objective(path)
    torch.manual_seed(0)
    module = DraftModule(DFlashDrafter(block_size=4, num_layers=1, num_anchors=8), objective, target=tiny_target)
    opt = torch.optim.SGD(module.drafter.parameters(), lr=1e-2)
    batch = tiny_batch()
    for _ in range(3):
        opt.zero_grad()
        _, terms = module.draft_step(batch, use_cache=False)
        assert torch.isfinite(terms.value) and float(terms.den) > 0
        (terms.num / terms.den).backward()
        grads = [p.grad for p in module.drafter.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        opt.step()
    if isinstance(objective, EDR):
        assert {"edr_expected_rounds", "edr_mal"} <= set(terms.metrics)
        rounds = float(terms.metrics["edr_expected_rounds"])
        assert 1 <= rounds <= 17  # between 1 and the longest answer's length


def test_edr_metrics_reach_the_logger(tiny_target):
    """The module hook end to end under a Trainer: EDR chooses the anchors, train/edr_* are logged."""
    import lightning as L
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    module = DraftModule(DFlashDrafter(block_size=4, num_layers=1, num_anchors=8), EDR(max_anchors=6),
                         target=tiny_target)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, max_steps=2, log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader([tiny_batch(0), tiny_batch(1)], batch_size=None))
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/edr_expected_rounds", "train/edr_mal"} <= set(metrics)
    assert float(metrics["train/edr_mal"]) >= 1
