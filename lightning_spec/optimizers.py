"""The drafter's optimizer: AdamW (the default), or Muon on the hidden matrices with AdamW on everything else.

Muon (Jordan et al. 2024; torch.optim.Muon, torch >= 2.9) replaces each 2-D weight's momentum update by its nearest
semi-orthogonal matrix (five Newton-Schulz steps), so every direction of the matrix moves at the same rate. It is
defined for hidden matrices only: norms, biases, embedding tables and LM heads stay with AdamW, as in Moonshot's
recipe and in the speculators trainer, which made Muon its default in RFC #979 (Muon group at 10x the base LR
there, with ``match_rms_adamw``). Here ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to the RMS AdamW's
would have (0.2 * sqrt(max(rows, cols))), so one LR serves both groups by default (``muon_lr`` overrides it).

Lightning's loop, the LR schedule and checkpoints expect one optimizer; ``MuonAdamW`` steps the two as one, its
param groups the two optimizers' own (the schedule's LR multiplier reaches both).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_spec.errors import UserError

OPTIMIZERS = ("adamw", "muon")
HEAD_LIKE = ("lm_head", "embed", "mask")  # names of 2-D parameters that are tables or heads, not hidden matrices


def hidden_matrices(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``module``'s trainable parameters split into (hidden matrices, the rest): a hidden matrix is 2-D with both
    sides > 1, not an ``nn.Embedding`` table and not named like a head, a table or a mask vector (``HEAD_LIKE``)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    matrices, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        hidden = p.dim() == 2 and min(p.shape) > 1 and id(p) not in tables and not any(s in name for s in HEAD_LIKE)
        (matrices if hidden else rest).append(p)
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon over ``matrices`` and AdamW over ``rest`` (matrices of ``rest`` with ``weight_decay``, vectors without),
    stepped together; ``param_groups`` are the two optimizers' groups themselves, so an LR schedule scales both."""

    def __init__(self, matrices: list[nn.Parameter], rest: list[nn.Parameter], lr: float, muon_lr: float,
                 weight_decay: float, betas: tuple[float, float]) -> None:
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        decay = [p for p in rest if p.dim() >= 2]
        no_decay = [p for p in rest if p.dim() < 2]
        self.adamw = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)
        super().__init__([*matrices, *rest], {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise UserError("this checkpoint's optimizer state is not Muon + AdamW; resume it with the optimizer it "
                            "was trained with (model.optimizer).")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def scale_gradients(module: nn.Module, scale: float) -> None:
    """Multiply every gradient of ``module``'s parameters by ``scale`` in place (one fused op per device)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale)


def check_optimizer_settings(lr: float, weight_decay: float, betas, warmup_ratio: float, min_lr_ratio: float,
                             optimizer: str = "adamw", muon_lr: float | None = None) -> None:
    """Refuse, naming the field, what the optimizer or the schedule would reject later (or silently misuse)."""
    checks = [
        (math.isfinite(lr) and lr > 0, "model.lr", lr, "a learning rate > 0, e.g. 1e-3"),
        (math.isfinite(weight_decay) and weight_decay >= 0, "model.weight_decay", weight_decay, "a value >= 0"),
        (len(betas) == 2 and all(0 <= b < 1 for b in betas), "model.betas", betas, "two values in [0, 1)"),
        (0 <= warmup_ratio < 1, "model.warmup_ratio", warmup_ratio, "a share of the steps in [0, 1)"),
        (0 <= min_lr_ratio <= 1, "model.min_lr_ratio", min_lr_ratio, "a share of model.lr in [0, 1]"),
    ]
    for ok, field, value, wanted in checks:
        if not ok:
            raise UserError(f"{field} is {value}; it must be {wanted}.")
    if optimizer not in OPTIMIZERS:
        raise UserError(f"model.optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}.")
    if muon_lr is not None and not (math.isfinite(muon_lr) and muon_lr > 0):
        raise UserError(f"model.muon_lr is {muon_lr}; it must be a learning rate > 0, or null for model.lr.")


def build_optimizer(module: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    muon_lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``module``'s trainable parameters: ``adamw`` (weight decay on matrices only) or
    ``muon`` (``MuonAdamW``; ``muon_lr`` None: ``lr``)."""
    if name == "adamw":
        matrices, vectors = [], []
        for p in module.parameters():
            if p.requires_grad:
                (matrices if p.dim() >= 2 else vectors).append(p)
        return torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                                  {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=betas)
    if name == "muon":
        matrices, rest = hidden_matrices(module)
        if not matrices:
            raise UserError("model.optimizer muon found no hidden matrix to train in this drafter; use adamw.")
        return MuonAdamW(matrices, rest, lr, lr if muon_lr is None else muon_lr, weight_decay, betas)
    raise UserError(f"model.optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}.")
