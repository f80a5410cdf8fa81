"""Offline evaluation's independent reading: expected rounds by walking every acceptance pattern; and drafters
saved to folders, as the evaluation command reads them."""

import torch

from lightning_spec.checkpoint import save_drafter
from lightning_spec.drafters import DFlashDrafter


def enumerate_rounds(accept, first, last, k, drafted=None):
    """E[#rounds] and E[#rounds verifying / accepting slot h] by walking every acceptance pattern: a round
    anchored at n verifies n+1.. in order; a rejection at t starts the next round at t; K acceptances commit
    the bonus n+K+1, which starts the next round; the round that verifies (or commits) ``last`` is the final.
    ``drafted[n]``: the slots a variable-length drafter submits from anchor n (``accept`` is 0 past them); a slot
    it does not submit is neither reached nor accepted."""
    total = [0.0]
    reached, accepted = [0.0] * k, [0.0] * k

    def walk(n, prob, rounds):
        rounds += 1
        alive = prob  # probability of reaching slot h with all before it accepted
        for h in range(k):
            t = n + 1 + h
            a = accept[n][h]
            if drafted is None or h < drafted[n]:
                reached[h] += alive
                accepted[h] += alive * a
            if t == last:  # the final token: generation ends whatever the verdict
                total[0] += alive * rounds
                return
            if alive * (1 - a) > 0:
                walk(t, alive * (1 - a), rounds)  # rejected: x_t is the correction, next round anchored at t
            alive *= a
        if alive > 0:
            bonus = n + k + 1
            if bonus == last:
                total[0] += alive * rounds
            else:
                walk(bonus, alive, rounds)

    walk(first, 1.0, 0)
    return total[0], reached, accepted


def saved_drafters(target, tmp_path, seeds=(0, 1)):
    paths = []
    for seed in seeds:
        torch.manual_seed(seed)
        drafter = DFlashDrafter(block_size=3, num_layers=1)
        drafter.bind(target)
        paths.append(str(save_drafter(drafter, tmp_path / f"drafter{seed}", target_spec="tiny-random")))
    return paths
