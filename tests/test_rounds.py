"""The round chain (``rounds.py``, EDR: Zhao & Cai 2026, arXiv 2610.10411): ``chain_dp``'s recursions (forward
occupancies, backward values, Eq. 12) against brute-force enumeration of every acceptance pattern and Monte Carlo,
the vectorised DP against the plain loop, and its vectorisation checked structurally (the torch calls and Python
lines it runs grow like log S, not S). EDR's theorems and anchor sampler: tests/objectives/test_edr.py."""

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from helpers.rounds import chain_dp_reference, generations
from torch.overrides import TorchFunctionMode

import lightning_spec
from lightning_spec.decoding.rounds import chain, chain_dp

# ------------------------------------------------------------------ an independent reading of the chain


def enumerate_chain(accept, cost, mask, k):
    """Every acceptance pattern of every generation of one sequence, with its probability.

    accept[n][h], cost[n][h]: A and c of slot h of the round anchored at n. Returns E[#rounds],
    E[1 + Σ c over verified slots + 1 per bonus that starts a round] (summed over generations) and the
    probability of verifying each (n, h).
    """
    rounds = value = 0.0
    visits = {}

    def play(n, end, prob, n_rounds, paid):  # a round starts at anchor n
        nonlocal rounds, value
        n_rounds += 1
        outcomes = [(prob, paid, None)]  # (probability, cost so far, next anchor or None = generation over)
        final = []
        for h in range(k):
            t = n + 1 + h
            nxt = []
            for p, c, _ in outcomes:
                visits[(n, h)] = visits.get((n, h), 0.0) + p
                if t == end:  # the last token: generation over whatever the verdict
                    final.append((p, c, None))
                    continue
                a = accept[n][h]
                final.append((p * (1 - a), c + cost[n][h], t))  # rejected: the next round starts at t
                nxt.append((p * a, c + cost[n][h], None))
            outcomes = nxt
        for p, c, _ in outcomes:  # all K accepted: the bonus token at n + K + 1
            b = n + k + 1
            final.append((p, c + (1 if b < end else 0), b if b < end else None))
        for p, c, nxt in final:
            if p == 0:
                continue
            if nxt is None:
                rounds += p * n_rounds
                value += p * (1 + c)
            else:
                play(nxt, end, p, n_rounds, c)

    for first, end in generations(mask):
        play(first, end, 1.0, 0, 0.0)
    return rounds, value, visits


def simulate(accept, mask, k, runs, seed=0):
    """Monte Carlo of the Markov chain: mean rounds over ``runs`` decodings of the sequence."""
    rng = random.Random(seed)
    total = 0
    for _ in range(runs):
        for first, end in generations(mask):
            n = first
            while True:
                total += 1
                nxt = None
                for h in range(k):
                    t = n + 1 + h
                    if t == end:
                        break
                    if rng.random() >= accept[n][h]:
                        nxt = t
                        break
                else:
                    nxt = n + k + 1 if n + k + 1 < end else None
                if nxt is None:
                    break
                n = nxt
    return total / runs


def random_case(seed, s, k, holes=True):
    g = torch.Generator().manual_seed(seed)
    mask = [False] * s
    for t in range(2, s):
        mask[t] = True
    if holes and s > 6:
        mask[s // 2] = False  # two generations
    accept = torch.rand(1, s, k, generator=g, dtype=torch.float64)
    cost = torch.rand(1, s, k, generator=g, dtype=torch.float64)
    return mask, accept, cost


# ------------------------------------------------------------------------------ (a) the recursions are right


@pytest.mark.parametrize("s,k,seed", [(5, 1, 0), (6, 2, 1), (8, 2, 2), (8, 3, 3), (7, 3, 4), (8, 1, 5)])
def test_dp_equals_enumeration_of_acceptance_patterns(s, k, seed):
    mask, accept, cost = random_case(seed, s, k)
    ch = chain(torch.tensor([mask]), k)
    a_list, c_list = accept[0].tolist(), cost[0].tolist()
    # rounds given the rollout: the cost of a slot is its realised rejection R = 1 - A (Prop. 1)
    r_list = [[1 - a for a in row] for row in a_list]
    rounds, _, visits = enumerate_chain(a_list, r_list, mask, k)
    realised = chain_dp(accept, 1 - accept, ch)
    assert float(realised.rounds[0]) == pytest.approx(rounds, rel=1e-12)
    assert float(realised.start.sum()) == pytest.approx(rounds, rel=1e-12)  # Σ_n ω_{n,n+1} = τ(x)
    # any local cost: 1 + Σ ω c (Thm 1 reading) equals the path average of 1 + Σ c
    _, value, _ = enumerate_chain(a_list, c_list, mask, k)
    assert float(chain_dp(accept, cost, ch).rounds[0]) == pytest.approx(value, rel=1e-12)
    # occupancies ω_{n,t} are the probabilities of verifying (n, t)
    occ = torch.zeros(s, k, dtype=torch.float64)
    for (n, h), p in visits.items():
        occ[n, h] = p
    torch.testing.assert_close(realised.occupancy[0], occ, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("s,k,seed", [(8, 2, 7), (8, 3, 8)])
def test_dp_equals_monte_carlo(s, k, seed):
    mask, accept, _ = random_case(seed, s, k)
    exact = float(chain_dp(accept, 1 - accept, chain(torch.tensor([mask]), k)).rounds[0])
    runs = 20000
    mc = simulate(accept[0].tolist(), mask, k, runs, seed)
    assert abs(mc - exact) < 5 * math.sqrt(exact * 2 / runs) + 1e-3  # generous: rounds vary by ≲ a few


def test_values_are_consistent_with_the_forward_pass():
    """V at the first anchor (backward) equals Σ ω c (forward), and V_{n,n+1} = in-round value at slot 0."""
    mask, accept, cost = random_case(11, 40, 4)
    ch = chain(torch.tensor([mask]), 4)
    v = chain_dp(accept, cost, ch)
    live = (ch.exists & ~ch.terminal).double()
    bonus_occ = v.start * v.reach[..., -1] * accept[..., -1] * ch.bonus  # rounds that reach the bonus
    forward = v.generations + (v.occupancy * cost * live).sum((1, 2)) + bonus_occ.sum(-1)
    torch.testing.assert_close(v.rounds, forward, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("s,k", [(30, 3), (57, 4), (64, 7)])
def test_vectorised_dp_matches_the_reference_loop(s, k):
    g = torch.Generator().manual_seed(s)
    mask = torch.rand(3, s, generator=g) < 0.85
    mask[:, :3] = False
    mask[0, 0] = True  # a sequence supervised from its first token
    accept, cost = torch.rand(3, s, k, generator=g), torch.rand(3, s, k, generator=g)
    ch = chain(mask, k)
    fast, ref = chain_dp(accept, cost, ch), chain_dp_reference(accept, cost, ch)
    for name in ("value", "start", "reach", "occupancy", "advantage", "rounds", "generations", "tokens"):
        torch.testing.assert_close(getattr(fast, name), getattr(ref, name), rtol=1e-10, atol=1e-10, msg=name)


def test_dp_at_4k_tokens_matches_the_reference_loop():
    """L = 4096, K = 7: the parity still holds at training lengths."""
    s, k = 4096, 7
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, s, dtype=torch.bool)
    mask[:, :64] = False
    accept, cost = torch.rand(1, s, k, generator=g), torch.rand(1, s, k, generator=g)
    ch = chain(mask, k)
    fast, ref = chain_dp(accept, cost, ch), chain_dp_reference(accept, cost, ch)
    torch.testing.assert_close(fast.value, ref.value, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fast.start, ref.start, rtol=1e-9, atol=1e-9)


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def work_of_the_dp(n: int, s: int, k: int) -> tuple[int, int]:
    """(torch calls, Python lines executed in the package) of ``chain`` + ``chain_dp`` on an (n, s) batch."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n, s, dtype=torch.bool)
    mask[:, :5] = False
    accept, cost = torch.rand(n, s, k, generator=g), torch.rand(n, s, k, generator=g)
    package = str(Path(lightning_spec.__file__).parent)
    lines = 0

    def count_lines(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count_lines

    def trace(frame, event, arg):
        return count_lines if frame.f_code.co_filename.startswith(package) else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        with TorchCalls() as calls:
            chain_dp(accept, cost, chain(mask, k))
    finally:
        sys.settrace(previous)
    return calls.calls, lines


def test_dp_is_vectorised_over_positions_and_sequences():
    """Structural, not a wall time: the torch calls and the Python lines that the DP executes grow like
    log2(S / (K + 1)) (the parallel scan), not like S, and do not depend on the batch size N. A Python loop over
    anchors or sequences, in torch ops or in plain floats, multiplies them by the length.

    Catches ``chain_dp`` replaced by the plain loop of ``chain_dp_reference`` (checked on a mutated copy of the
    package: 57k torch calls and 421k lines for one sequence of 4096, three times that for three)."""
    short, long, batch = work_of_the_dp(1, 256, 7), work_of_the_dp(1, 4096, 7), work_of_the_dp(3, 4096, 7)
    assert long == batch  # no loop over sequences
    for few, many in zip(short, long):  # 16x the positions: 4 more scan steps, a few dozen more calls and lines
        assert many < 1.5 * few, (short, long)
        assert many < 4096 // 8, (short, long)  # far fewer than one per position


