"""SpecBlock drafters for its tests (tests/drafters/test_specblock.py, test_specblock_ttt.py): weights moved far from
the init, a random batch, the target's features."""

import torch

from lightning_spec.drafters import SpecBlockDrafter


def sb(target, k: int = 3, layers: int = 2, seed: int = 0, **kwargs) -> SpecBlockDrafter:
    """A SpecBlockDrafter of ``k`` slots bound to ``target``, in eval mode, every weight moved by N(0, 0.2²)."""
    torch.manual_seed(seed)
    drafter = SpecBlockDrafter(block_size=k, num_layers=layers, rank_width=32, **kwargs)
    drafter.bind(target)
    with torch.no_grad():  # weights far from the init (the shift included), so every path carries signal
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


def a_batch(target, s: int = 12, seed: int = 0):
    """Two random sequences of length ``s``, every position supervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, s), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}


def features_of(target, drafter, ids):
    return target(ids, layers=drafter.target_layers, logits=False).features
