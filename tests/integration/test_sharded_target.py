"""A target larger than one device: its decoder layers sharded across the ranks (``Target.shard_layers``, FSDP2
``fully_shard`` per layer; ``model.shard_target`` under DDP), on 2 CPU ranks with gloo.

- In two spawned ranks: each holds half of every layer's weights, the features of a batch are bit-identical to the
  whole target's, and a drafter's training step on them gives the same gradients; a callback that decodes on one
  rank's prompts is refused.
- Through Lightning: ``fit`` with 2 DDP ranks and ``model.shard_target: true`` gives the loss curve and the drafter
  of the same fit with the target whole on each rank.
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.fits import callback, free_port, metric_history

STEPS = 4


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from lightning_spec import load_target
    from lightning_spec.callbacks.base import refuse_sharded_target
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.objectives import CE, Objective

    target = load_target("tiny-random")
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=3, num_anchors=8)
    drafter.bind(target)
    ids = torch.randint(0, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(rank))  # (N, S)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}

    def step():
        out = target(ids, layers=drafter.target_layers, logits=False)
        torch.manual_seed(1)  # the same anchors in both steps
        terms = Objective(CE())(drafter(batch, out.features))
        drafter.zero_grad()
        (terms.num / terms.den).backward()
        return out.features, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    whole_features, whole_grads = step()
    fingerprint = target.fingerprint
    target.shard_layers()
    weight = target.base.layers[0].self_attn.q_proj.weight
    sharded_features, sharded_grads = step()
    try:
        refuse_sharded_target(SimpleNamespace(target=target), "SpecDecodeValidation")
        refused = ""
    except ValueError as err:
        refused = str(err)
    torch.save({"local_rows": weight.to_local().shape[0] if isinstance(weight, DTensor) else None,
                "rows": weight.shape[0], "features_equal": torch.equal(whole_features, sharded_features),
                "grads_equal": whole_grads.keys() == sharded_grads.keys()
                and all(torch.equal(whole_grads[k], sharded_grads[k]) for k in whole_grads),
                "fingerprint_kept": target.fingerprint == fingerprint, "refused": refused},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_sharded_target_gives_the_same_features_and_gradients(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["local_rows"] == r["rows"] // 2  # each rank holds half of the layer's rows between forwards
        assert r["features_equal"] and r["grads_equal"] and r["fingerprint_kept"]
        assert "SpecDecodeValidation decodes on each rank's own prompts" in r["refused"]


def test_shard_target_needs_features_computed_every_step(tiny_target):
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule

    with pytest.raises(ValueError, match="model.shard_target .* set model.feature_cache: off"):
        DraftModule(DFlashDrafter(block_size=3), target=tiny_target, shard_target=True)


def ddp_jobs(root: Path) -> list[tuple[Path, list[str], int]]:
    """This file's fits for the one launch of tests/integration/conftest.py (``ddp_fits``): 2 ranks with the whole
    target, 2 ranks with its decoder layers sharded."""
    tmp = root / "sharded"
    common = [f"--trainer.max_steps={STEPS}", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
              "--trainer.callbacks=[]", "--model.feature_cache=off", "--data.batch_size=2", "--trainer.strategy=ddp",
              "--trainer.devices=2"]
    return [(tmp / "whole", [*common, callback("helpers.fits.Probe", out=str(tmp / "whole" / "probe"))], 2),
            (tmp / "sharded", [*common, "--model.shard_target=true",
                               callback("helpers.fits.Probe", out=str(tmp / "sharded" / "probe"))], 2)]


def test_fit_with_a_sharded_target_trains_like_the_whole_target(ddp_fits):
    tmp_path = ddp_fits / "sharded"
    assert "target: decoder layers sharded over 2 ranks" in (tmp_path / "sharded" / "fit-rank0.log").read_text()
    assert "sharded over" not in (tmp_path / "whole" / "fit-rank0.log").read_text()
    a, b = metric_history(tmp_path / "whole", "train/loss"), metric_history(tmp_path / "sharded", "train/loss")
    assert len(a) == STEPS and a == b
    for rank in (0, 1):
        w = torch.load(tmp_path / "whole" / "probe" / f"rank{rank}.pt")["final"]
        s = torch.load(tmp_path / "sharded" / "probe" / f"rank{rank}.pt")["final"]
        assert w.keys() == s.keys() and all(torch.equal(w[k], s[k]) for k in w)
