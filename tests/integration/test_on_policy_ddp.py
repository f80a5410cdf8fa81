"""On-policy training under DDP: 2 CPU ranks (gloo) each decode half of every refresh's prompts, gather the
examples in prompt order, and so hold the same replay buffer as 1 process; the sampler then shards it like any
training split, and the two runs train alike (real `lightning-spec fit` subprocesses on the tiny target)."""

import json
from pathlib import Path

import pytest
import torch
from helpers.fits import callback, metric_history

STEPS = 5
ROLLOUTS = callback("lightning_spec.callbacks.OnPolicyRollouts", buffer_size=8, refresh_every=2,
                    rollouts_per_refresh=4, max_new_tokens=10)
OBJECTIVE = "--model.objective=" + json.dumps({"class_path": "lightning_spec.objectives.DraftOPD"})


def ddp_jobs(root: Path) -> list[tuple[Path, list[str], int]]:
    """This file's fits for the one launch of tests/integration/conftest.py (``ddp_fits``): 1 process with batch 4,
    2 ranks with batch 2 each."""
    tmp = root / "opd"
    common = [f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0", "--data.max_length=160", ROLLOUTS,
              OBJECTIVE, "--model.feature_cache=off"]
    return [
        (tmp / "one", [*common, "--data.batch_size=4", callback("helpers.fits.BufferProbe", out=str(tmp / "one"))], 1),
        (tmp / "two", [*common, "--data.batch_size=2", "--trainer.strategy=ddp", "--trainer.devices=2",
                       callback("helpers.fits.BufferProbe", out=str(tmp / "two"))], 2),
    ]


@pytest.fixture(scope="module")
def runs(ddp_fits):
    return ddp_fits / "opd" / "one", ddp_fits / "opd" / "two"


def load(run: Path, rank: int) -> dict:
    return json.loads((run / f"buffer{rank}.json").read_text())


def test_both_ranks_hold_the_buffer_of_one_process(runs):
    one, two = runs
    r1, a, b = load(one, 0), load(two, 0), load(two, 1)
    assert a["world_size"] == b["world_size"] == 2
    assert a["buffer"] == b["buffer"] == r1["buffer"]  # gathered in prompt order: independent of the rank count
    assert sorted(e["index"] for e in r1["buffer"]) == list(range(8, 16))  # 8 at the start, 4 at steps 2 and 4
    assert [s for s, _ in r1["history"]] == [s for s, _ in a["history"]] == [0, 2, 4]
    for whole, x, y in zip(r1["batches"], a["batches"], b["batches"]):
        assert whole["index"] == [i for pair in zip(x["index"], y["index"]) for i in pair]
        assert whole["drawn_step"] == [i for pair in zip(x["drawn_step"], y["drawn_step"]) for i in pair]


def test_both_ranks_train_like_one_process(runs):
    one, two = runs
    curve1, curve2 = metric_history(one, "train/loss"), metric_history(two, "train/loss")
    assert len(curve1) == len(curve2) == STEPS
    torch.testing.assert_close(torch.tensor([v for _, v in curve2]), torch.tensor([v for _, v in curve1]),
                               rtol=1e-4, atol=1e-5)
    staleness = metric_history(one, "train/staleness")
    assert staleness and max(v for _, v in staleness) > 0
