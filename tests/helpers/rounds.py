"""The generations of a sequence, as the round recursions read them, and the recursions themselves written as the
paper's plain loops (tests/test_rounds.py, tests/objectives/test_edr.py)."""

import torch
from torch import Tensor

from lightning_spec.decoding.rounds import Chain, ChainValues


def generations(mask: list[bool]) -> list[tuple[int, int]]:
    """(first anchor, last position) of every maximal supervised run; position 0 is never predicted."""
    out, t = [], 1
    while t < len(mask):
        if mask[t]:
            end = t
            while end + 1 < len(mask) and mask[end + 1]:
                end += 1
            out.append((t - 1, end))
            t = end + 1
        else:
            t += 1
    return out


def chain_dp_reference(accept: Tensor, cost: Tensor, ch: Chain) -> ChainValues:
    """The same quantities by the plain loops of the paper's pseudo-code (EDR Alg. 1 and App. C.2).
    For parity tests and timing only: a Python loop over positions, far too slow for training batches."""
    a_all, c_all = accept.double().tolist(), cost.double().tolist()
    n, s, k = accept.shape
    value, start = torch.zeros(n, s, dtype=torch.float64), torch.zeros(n, s, dtype=torch.float64)
    reach, adv = torch.zeros(n, s, k, dtype=torch.float64), torch.zeros(n, s, k, dtype=torch.float64)
    ok, first, bonus = ch.start_ok.tolist(), ch.first.tolist(), ch.bonus.tolist()
    exists, term = ch.exists.tolist(), ch.terminal.tolist()
    for i in range(n):
        v = [0.0] * (s + k + 2)
        for a0 in reversed(range(s)):  # backward
            if not ok[i][a0]:
                continue
            cont = 1.0 + v[a0 + k + 1] if bonus[i][a0] else 0.0
            for h in reversed(range(k)):
                if not exists[i][a0][h] or term[i][a0][h]:
                    cont = 0.0  # the generation has ended: nothing after it costs anything
                    continue
                t = a0 + 1 + h
                a, c = a_all[i][a0][h], c_all[i][a0][h]
                adv[i, a0, h] = cont - v[t]
                cont = c + a * cont + (1 - a) * v[t]
            v[a0] = cont
        mass_in = [0.0] * (s + k + 2)
        for a0 in range(s):  # forward
            if first[i][a0]:
                mass_in[a0] += 1.0
            if not ok[i][a0]:
                continue
            mass = 1.0
            for h in range(k):
                if not exists[i][a0][h]:
                    mass = 0.0
                    break
                reach[i, a0, h] = mass
                if term[i][a0][h]:
                    mass = 0.0
                    break
                a = a_all[i][a0][h]
                mass_in[a0 + 1 + h] += mass_in[a0] * mass * (1 - a)
                mass *= a
            if bonus[i][a0]:
                mass_in[a0 + k + 1] += mass_in[a0] * mass
        value[i] = torch.tensor(v[:s], dtype=torch.float64)
        start[i] = torch.tensor(mass_in[:s], dtype=torch.float64)
    start = start * ch.start_ok
    first_d = ch.first.double()
    return ChainValues(
        value=value,
        start=start,
        reach=reach,
        occupancy=start[..., None] * reach,
        advantage=adv,
        rounds=(first_d * (1 + value)).sum(-1),
        generations=first_d.sum(-1),
        tokens=(first_d * ch.length.double()).sum(-1),
    )
