"""The exact joint distribution of a target's first tokens and the χ² checks that a sampler draws from it (lossless
speculative sampling: tests/decoding/test_lossless_sampling.py; every family's and every tree's sampling tests)."""

import itertools
import math

import torch

from lightning_spec import SamplingConfig, generate

NEW = 3  # joint distribution of the first 3 tokens: bonus (all accepted) and residual paths both matter
PROMPT = [1, 5, 3, 0]


def exact_joint(target, prompt: list[int], sampling: SamplingConfig, new: int = NEW) -> torch.Tensor:
    """P(x_1..x_new | prompt) = Π_i p(x_i | prompt, x_<i) for every outcome, by enumeration: (V**new,)."""
    v = target.vocab_size
    prefixes = torch.tensor(list(itertools.product(range(v), repeat=new - 1)), dtype=torch.long)  # (V^(n-1), n-1)
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    logits = target(ids).logits[:, len(prompt) - 1 :].double()  # (V^(n-1), n, V)
    p = sampling.probs(logits).double()
    joint = torch.ones(len(prefixes), dtype=torch.float64)
    for i in range(new - 1):
        joint = joint * p[:, i].gather(1, prefixes[:, i : i + 1])[:, 0]
    out = joint[:, None] * p[:, new - 1]  # (V^(n-1), V): outcome index = prefix index * V + last token
    return out.reshape(-1)


def empirical(target, sampling, drafter, runs: int, seed0: int = 0, new: int = NEW, plan=None):
    """Counts of the first ``new`` tokens over ``runs`` seeded generations (decoded with ``plan``, None: the
    drafter's chain), and the first round's accept lengths."""
    v = target.vocab_size
    counts = torch.zeros(v**new, dtype=torch.float64)
    first_accepts = []
    for i in range(runs):
        gen = generate(target, PROMPT, new, sampling, drafter=drafter, seed=seed0 + i, plan=plan)
        assert len(gen.tokens) == new
        counts[sum(t * v ** (new - 1 - j) for j, t in enumerate(gen.tokens))] += 1
        first_accepts.append(gen.accept_lengths[0])
    return counts, first_accepts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic with outcomes of expected count < 5 pooled into one cell, and its rejection bound.

    The bound is the chi-square quantile at p = 1e-6 (Wilson-Hilferty approximation, z = 4.75, accurate to a
    few percent for df >= 5): a correct sampler fails it about once in a million runs, and the seeds here are
    fixed anyway, so the test is deterministic. Any outcome with positive count but zero probability is an
    immediate failure (infinite statistic).
    """
    n = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return math.inf, 0.0
    expected = n * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 4.75
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, bound


def assert_matches(counts: torch.Tensor, exact: torch.Tensor, vocab: int, new: int, label) -> None:
    """χ² on the joint of the ``new`` tokens, and on each token's marginal (V cells: far more power per sample
    against a bias at one position, e.g. the bonus slot)."""
    stat, bound = chi_square(counts, exact)
    assert stat < bound, (label, "joint", stat, bound)
    shape = (vocab,) * new
    for i in range(new):
        dims = [d for d in range(new) if d != i]
        stat, bound = chi_square(counts.view(shape).sum(dims), exact.view(shape).sum(dims))
        assert stat < bound, (label, f"token {i}", stat, bound)
