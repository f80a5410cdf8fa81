"""The drafter's optimizers (``lightning_spec/optimizers.py``): AdamW, and Muon on the hidden matrices with AdamW on
the rest, stepped as one optimizer under Lightning, its state saved and restored whole."""

import copy

import pytest
import torch
from helpers.data import sequences
from helpers.fits import quiet_trainer
from torch.utils.data import DataLoader

from lightning_spec.drafters import DFlashDrafter, Eagle3Drafter
from lightning_spec.errors import UserError
from lightning_spec.loaders import collate
from lightning_spec.module import DraftModule
from lightning_spec.objectives import KL, Objective
from lightning_spec.optimizers import MuonAdamW, build_optimizer, hidden_matrices


def names(module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in module.named_parameters() if id(p) in ids}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_target):
    eagle = Eagle3Drafter(block_size=3, own_head=True, fc_norm=True)
    eagle.bind(tiny_target)
    matrices, rest = hidden_matrices(eagle)
    assert {"fc.weight", "layer.q_proj.weight", "layer.down_proj.weight"} <= names(eagle, matrices)
    assert {"lm_head", "norm.weight", "fc_norms.0.weight", "layer.input_norm.weight"} <= names(eagle, rest)
    dflash = DFlashDrafter(block_size=3, num_layers=1)  # its own mask vector, a (1, H) table row
    dflash.bind(tiny_target)
    matrices, rest = hidden_matrices(dflash)
    assert not any("mask" in n for n in names(dflash, matrices)) and any("mask" in n for n in names(dflash, rest))
    assert len(matrices) + len(rest) == sum(p.requires_grad for p in dflash.parameters())


def module(target, optimizer: str) -> DraftModule:
    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=3, num_layers=1, num_anchors=64)
    return DraftModule(drafter, Objective(KL()), target=target, optimizer=optimizer, lr=1e-2, warmup_ratio=0.0)


def first_update(target, optimizer: str) -> dict[str, torch.Tensor]:
    m = module(target, optimizer)
    before = {k: v.detach().clone() for k, v in m.drafter.named_parameters()}
    batch = collate(sequences(8), pad_id=0)
    del batch["index"]
    quiet_trainer(max_steps=1).fit(m, train_dataloaders=DataLoader([batch], batch_size=None))
    return {k: v.detach() - before[k] for k, v in m.drafter.named_parameters()}


def spread(update: torch.Tensor) -> float:
    """The largest singular value over the eighth largest (the gradients here have rank >= 8)."""
    s = torch.linalg.svdvals(update.double())
    return float(s[0] / s[7])


def test_a_muon_step_moves_each_hidden_matrix_along_an_orthogonalised_direction(tiny_target):
    """Muon's first update of a matrix is its orthogonalised gradient: its leading singular values alike
    (Newton-Schulz lands them in about [0.7, 1.2]; measured spread ~1.1); AdamW's first update is lr * sign(gradient),
    whose singular values spread (measured 4.5-6.4). Vectors move as AdamW moves them under both."""
    muon, adamw = first_update(tiny_target, "muon"), first_update(tiny_target, "adamw")
    for matrix in ("fc.weight", "layers.0.down_proj.weight"):
        assert spread(muon[matrix]) < 1.5 < 3.0 < spread(adamw[matrix]), matrix
    norm = next(k for k in muon if k.endswith("input_norm.weight"))
    torch.testing.assert_close(muon[norm], adamw[norm])


def test_muon_state_saves_and_restores_whole(tiny_target):
    """What a resumed fit does (Lightning saves ``state_dict`` and loads it into a fresh optimizer): the restored
    optimizer steps exactly as the one that kept running."""
    torch.manual_seed(0)
    d = DFlashDrafter(block_size=3, num_layers=1)
    d.bind(tiny_target)
    twin = DFlashDrafter(block_size=3, num_layers=1)
    twin.bind(tiny_target)
    twin.load_state_dict(d.state_dict())

    def grads(drafter, seed):
        g = torch.Generator().manual_seed(seed)
        for p in drafter.parameters():
            p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None

    running = build_optimizer(d, "muon", 1e-2, 0.1, (0.9, 0.95))
    assert isinstance(running, MuonAdamW)
    for seed in range(2):
        grads(d, seed)
        running.step()
    twin.load_state_dict(d.state_dict())
    restored = build_optimizer(twin, "muon", 1e-2, 0.1, (0.9, 0.95))
    restored.load_state_dict(copy.deepcopy(running.state_dict()))  # a checkpoint's copy, not the live tensors
    for seed in (2, 3):
        for drafter, opt in ((d, running), (twin, restored)):
            grads(drafter, seed)
            opt.step()
    for (k, a), b in zip(d.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    with pytest.raises(UserError, match="not Muon \\+ AdamW"):
        restored.load_state_dict(torch.optim.AdamW(d.parameters()).state_dict())


def test_an_unknown_optimizer_is_one_sentence(tiny_target):
    with pytest.raises(UserError, match="model.optimizer must be one of adamw, muon, got 'sgd'"):
        module(tiny_target, "sgd")
    with pytest.raises(UserError, match="model.muon_lr is -1"):
        DraftModule(DFlashDrafter(block_size=3), target=tiny_target, optimizer="muon", muon_lr=-1)
