"""Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the tokens a verification round
commits are distributed exactly as the target's own samples.

Two levels:
- one round, exactly: every draft of K tokens drawn from q, every accept/reject branch and the residual or
  bonus draw, enumerated in float64 and compared with p to 1e-10 (``test_one_round_is_exactly_lossless``);
  ``verify.rejection_accept`` is run on every branch with fixed uniforms, so it is the package's rule that
  is enumerated, not a copy of it;
- the whole decoding loop, statistically: χ² tests of ``generate`` against the exact distribution of a tiny
  target.
"""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.sampling import NEW, PROMPT, assert_matches, chi_square, empirical, exact_joint

from lightning_spec import SamplingConfig
from lightning_spec.decoding import verify

F64 = torch.float64

# ------------------------------------------------------------------------------------ one round, exactly


class FixedDraws:
    """Stands in for ``torch`` inside verify.py: ``rand`` returns the given uniforms and ``multinomial``
    records the distribution it is asked to draw from (returning token 0). Everything else is torch."""

    def __init__(self) -> None:
        self.uniforms: torch.Tensor | None = None
        self.drawn_from: torch.Tensor | None = None

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def rand(self, size, generator=None, device=None) -> torch.Tensor:
        assert self.uniforms is not None and self.uniforms.shape == (size,)
        return self.uniforms.clone()

    def multinomial(self, dist, num_samples, generator=None) -> torch.Tensor:
        self.drawn_from = dist.to(F64)
        return torch.zeros(num_samples, dtype=torch.long)


def random_round(k: int, vocab: int, sampling: SamplingConfig, draft_vocab: list[int] | None, seed: int):
    """A causal target and a draft distribution for one round, both under ``sampling``.

    ``cond[t]`` (V,)*(t+1): p(v | s_1..s_t), the target's distribution after the anchor and t more tokens (the
    verify forward's row t depends on the drafts x_1..x_t only). ``q`` (K, V): the draft distributions, zero
    outside ``draft_vocab`` (a reduced draft vocabulary, as ``DFlashDrafter`` scatters it). Both are
    renormalised in float64 so that the identities hold to float64 precision.
    """
    g = torch.Generator().manual_seed(seed)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        p = sampling.probs(logits).to(F64)
        return p / p.sum(-1, keepdim=True)

    cond = [probs(torch.randn(vocab**t, vocab, generator=g)).view((vocab,) * (t + 1)) for t in range(k + 1)]
    ids = torch.tensor(draft_vocab if draft_vocab is not None else range(vocab))
    q = torch.zeros(k, vocab, dtype=F64)
    q[:, ids] = probs(torch.randn(k, len(ids), generator=g))
    return cond, q


def rule_distribution(p: torch.Tensor, q: torch.Tensor, accepted: int) -> torch.Tensor:
    """The distribution of the token committed after ``accepted`` drafts: norm((p_a - q_a)+) at a rejection,
    p_K for the bonus. The residual is checked to carry mass, so verify.py's p-fallback never applies."""
    if accepted == q.shape[0]:
        return p[accepted]
    residual = (p[accepted] - q[accepted]).clamp_min(0)
    assert residual.sum() > 1e-6
    return residual / residual.sum()


def enumerate_round(cond, q, draws: FixedDraws):
    """P(the round commits exactly s_1..s_{a+1}) for a = 0..K, as tensors (V,)*(a+1), by enumeration.

    For every draft x ~ q and every branch a (the first a drafts accepted, then a rejection, or all K and
    the bonus), the branch probability is Π_{t<a} r_t · (1 - r_a) with r_t = min(1, p_t(x_t) / q_t(x_t)).
    ``verify.rejection_accept`` runs each branch on boundary uniforms (u_t just below r_t to accept, u_a = r_t
    to reject, u = 0 after the rejection), so its threshold must be r_t exactly; it must return a, and the
    distribution it draws the committed token from must be the rule's.
    """
    k, vocab = q.shape
    commits = [torch.zeros((vocab,) * (a + 1), dtype=F64) for a in range(k + 1)]
    drafts = branches = 0
    for x in itertools.product(range(vocab), repeat=k):
        draft = torch.tensor(x)
        prob_x = math.prod(float(q[t, x[t]]) for t in range(k))
        if prob_x == 0:
            continue
        drafts += 1
        p = torch.stack([cond[t][x[:t]] for t in range(k + 1)])  # (K + 1, V): the verify forward's rows
        r = [min(1.0, float(p[t, x[t]]) / float(q[t, x[t]])) for t in range(k)]  # the rule, written here
        reach = prob_x
        for a in range(k + 1):
            prob = reach * ((1 - r[a]) if a < k else 1.0)
            if prob > 0:
                u = [math.nextafter(r[t], 0.0) for t in range(a)]  # accepted: just below r_t
                if a < k:
                    u += [r[a]] + [0.0] * (k - a - 1)  # rejected at a: exactly r_a; later uniforms must not count
                draws.uniforms, draws.drawn_from = torch.tensor(u, dtype=F64), None
                accepted, _ = verify.rejection_accept(draft, q, p)
                assert accepted == a, (x, r, a)
                want = rule_distribution(p, q, a)
                # verify.py draws in float32: equal to the rule up to that rounding
                torch.testing.assert_close(draws.drawn_from, want, atol=1e-6, rtol=0)
                commits[a][x[:a]] += prob * want
                branches += 1
            if a < k:
                reach *= r[a]
    return commits, drafts, branches


ROUNDS = {  # name: (sampling, K, V, draft vocabulary)
    "T1_K3": (SamplingConfig(temperature=1.0), 3, 6, None),
    "T0.8_top_k3_K3": (SamplingConfig(temperature=0.8, top_k=3), 3, 6, None),
    "T0.7_top_p0.8_K3": (SamplingConfig(temperature=0.7, top_p=0.8), 3, 6, None),
    "top_k4_top_p0.9_draft_vocab4_K3": (SamplingConfig(temperature=1.0, top_k=4, top_p=0.9), 3, 6, [0, 2, 3, 5]),
    "T1_draft_vocab3_K4": (SamplingConfig(temperature=1.0), 4, 5, [1, 2, 4]),
}


@pytest.mark.parametrize("name", list(ROUNDS))
def test_one_round_is_exactly_lossless(monkeypatch, name):
    """The first committed token is distributed as p_1, and the committed prefix, continued by sampling the
    target, gives exactly the target's joint distribution of K + 1 tokens (to 1e-10, float64).

    Catches, each by a wide margin (verify.py mutated in a copy of the package): a residual (p - 0.8 q)+
    instead of (p - q)+; an acceptance min(1, p/q)^0.7; the bonus drawn from p_{K-1} instead of p_K.
    """
    sampling, k, vocab, draft_vocab = ROUNDS[name]
    cond, q = random_round(k, vocab, sampling, draft_vocab, seed=len(name))
    draws = FixedDraws()
    monkeypatch.setattr(verify, "torch", draws)
    commits, drafts, branches = enumerate_round(cond, q, draws)
    assert branches > 1.5 * drafts  # many drafts have several live branches

    # every round commits at least one token: the first is distributed as p(. | anchor)
    first = commits[0] + sum(c.flatten(1).sum(-1) for c in commits[1:])  # (V,)
    torch.testing.assert_close(first, cond[0], atol=1e-10, rtol=0)
    # each branch has positive probability: rejections at every slot and the bonus
    assert all(float(c.sum()) > 1e-4 for c in commits)

    # the joint of K + 1 tokens: the round's prefix continued by the target's own conditionals
    target_joint = cond[0]
    for t in range(1, k + 1):
        target_joint = target_joint[..., None] * cond[t]  # (V,)*(t+1)
    round_joint = torch.zeros_like(target_joint)
    for a, committed in enumerate(commits):
        joint = committed
        for t in range(a + 1, k + 1):
            joint = joint[..., None] * cond[t]
        round_joint += joint
    torch.testing.assert_close(round_joint.sum(), torch.tensor(1.0, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(round_joint, target_joint, atol=1e-10, rtol=0)  # so every shorter prefix too


# ------------------------------------------------------------------------------- the whole loop, by χ²
#
# ``generate`` end to end (drafting, verification, cache cropping, the token budget), seeded runs against the
# exact distribution of the first tokens. Two targets: a real tiny Llama (the real cache; ~4 ms a run) and
# ``HistoryTarget``, a stand-in whose forward costs microseconds, so its checks afford 10x the samples.


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    """Vocabulary 8, so the joint distribution of 3 tokens (512 outcomes) can be enumerated exactly."""
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    assert target.eos_token_ids == []  # no early stop: every run yields exactly NEW tokens
    return target


class TokenCache:
    """The cache of ``HistoryTarget``: the token ids the engine has fed it, nothing else."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def get_seq_length(self) -> int:
        return len(self.ids)


class HistoryTarget:
    """Stands in for ``Target`` in ``generate``: the next-token logits are a fixed random function of the whole
    history (every token since the start), and the cache holds the history itself. So any slip in the engine's
    cache bookkeeping (a crop one token off, a lost anchor) changes the distribution of what it samples. A
    forward costs microseconds, where the tiny Llama's costs a millisecond.
    """

    eos_token_ids: list[int] = []
    device = torch.device("cpu")

    def __init__(self, vocab_size: int, seed: int = 0, scale: float = 1.5) -> None:
        self.vocab_size, self.seed, self.scale = vocab_size, seed, scale
        self.model = self  # generate checks drafter.target.model
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    def next_logits(self, history: tuple[int, ...]) -> torch.Tensor:  # (V,)
        if history not in self._logits:
            g = torch.Generator().manual_seed(hash((self.seed, *history)) % 2**62)
            self._logits[history] = torch.randn(self.vocab_size, generator=g) * self.scale
        return self._logits[history]

    def __call__(self, input_ids: torch.Tensor, layers=(), cache=None, logits: bool = True, positions=None,
                 tree_mask=None):
        assert tree_mask is None and (positions is None or positions.tolist() == list(range(input_ids.shape[1])))
        rows = []
        for row in input_ids.tolist():  # without a cache every row starts a fresh history
            history = cache.ids if cache is not None else []
            rows.append([])
            for token in row:
                history.append(token)
                rows[-1].append(self.next_logits(tuple(history)))
        n, t = input_ids.shape
        return SimpleNamespace(logits=torch.stack([torch.stack(r) for r in rows]), features=torch.zeros(n, t, 1))

    @staticmethod
    def check_layers(layers: list[int]) -> None:
        pass  # any layer: its features are zeros

    def new_cache(self) -> TokenCache:
        return TokenCache()

    @staticmethod
    def crop(cache: TokenCache, length: int) -> None:
        del cache.ids[length:]

    @staticmethod
    def keep(cache: TokenCache, past: int, path: list[int]) -> None:
        cache.ids[past:] = [cache.ids[past + i] for i in path]


def test_exact_joint_sums_to_one(small_target):
    for sampling in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_k=3)):
        joint = exact_joint(small_target, PROMPT, sampling)
        assert joint.sum().item() == pytest.approx(1.0, abs=1e-6)  # p is float32
    assert int((exact_joint(small_target, PROMPT, SamplingConfig(temperature=1.0, top_k=3)) > 0).sum()) <= 27


def test_plain_sampling_matches_the_exact_distribution(small_target):
    sampling = SamplingConfig(temperature=1.0)
    counts, _ = empirical(small_target, sampling, None, runs=600, seed0=10_000)
    assert_matches(counts, exact_joint(small_target, PROMPT, sampling), small_target.vocab_size, NEW, "plain")


# (config, runs). About 4 ms a run; the broken rule below is caught at ~30x the bound with 600 runs.
SAMPLINGS = {
    "T1": (SamplingConfig(temperature=1.0), 1500),
    "T1_top_k3": (SamplingConfig(temperature=1.0, top_k=3), 1000),
    "T0.7_top_p0.8": (SamplingConfig(temperature=0.7, top_p=0.8), 1000),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_speculative_sampling_is_lossless(small_target, make_fixed_drafter, name):
    """The whole loop on the real tiny Llama and its cache, K = 2.

    On mutated copies of the package: the cache cropped one token short fails all three configurations, the
    bonus drawn from p_{K-1} fails top-k and top-p, an acceptance min(1, p/q)^0.7 fails T = 1 (the exact
    one-round test above catches all of these and the residual (p - 0.8 q)+ everywhere)."""
    sampling, runs = SAMPLINGS[name]
    drafter = make_fixed_drafter(small_target, block_size=2)
    counts, first = empirical(small_target, sampling, drafter, runs)
    assert_matches(counts, exact_joint(small_target, PROMPT, sampling), small_target.vocab_size, NEW, name)
    # both paths of the rule ran many times: a rejection (residual draw) and a full acceptance (bonus draw)
    assert sum(a < 2 for a in first) > runs // 100 and sum(a == 2 for a in first) > runs // 100, first[:50]


# (config, draft vocabulary or None = all, runs): K = 3, the joint of 4 tokens (1296 outcomes, so a round that
# accepts all 3 drafts commits its bonus inside the window). About 0.2 ms a run.
HISTORY_NEW = 4
HISTORY_SAMPLINGS = {
    "T1": (SamplingConfig(temperature=1.0), None, 10_000),
    "T1_top_k3": (SamplingConfig(temperature=1.0, top_k=3), None, 8_000),
    "T0.7_top_p0.8": (SamplingConfig(temperature=0.7, top_p=0.8), None, 8_000),
    "T1_draft_vocab4": (SamplingConfig(temperature=1.0), [0, 1, 3, 4], 8_000),
}


@pytest.mark.parametrize("name", list(HISTORY_SAMPLINGS))
def test_speculative_sampling_is_lossless_many_samples(make_fixed_drafter, name):
    """The whole loop with K = 3 over ~10,000 runs, on a target whose every logit depends on the whole history.

    On mutated copies of the package: the cache cropped one token short and an acceptance min(1, p/q)^0.7 fail
    all four configurations, the bonus drawn from p_{K-1} and the residual (p - 0.8 q)+ three of four."""
    sampling, draft_vocab, runs = HISTORY_SAMPLINGS[name]
    target = HistoryTarget(vocab_size=6, seed=1)
    drafter = make_fixed_drafter(target, block_size=3, scale=1.5)
    if draft_vocab is not None:  # q is zero outside the draft vocabulary
        outside = [v for v in range(target.vocab_size) if v not in draft_vocab]
        drafter.logits[:, outside] = float("-inf")
    counts, first = empirical(target, sampling, drafter, runs, new=HISTORY_NEW)
    assert_matches(counts, exact_joint(target, PROMPT, sampling, HISTORY_NEW), target.vocab_size, HISTORY_NEW, name)
    assert sum(a < 3 for a in first) > runs // 50 and sum(a == 3 for a in first) > runs // 50, first[:50]


def test_broken_acceptance_rule_fails_the_same_check(small_target, make_fixed_drafter, monkeypatch):
    """The check has power: accepting with min(1, q/p) instead of min(1, p/q) is caught by a wide margin."""
    monkeypatch.setattr(verify, "acceptance_probability", lambda p_x, q_x: (q_x / p_x.clamp_min(1e-30)).clamp(max=1.0))
    sampling = SAMPLINGS["T1"][0]
    drafter = make_fixed_drafter(small_target, block_size=2)
    counts, _ = empirical(small_target, sampling, drafter, runs=600)
    stat, bound = chi_square(counts, exact_joint(small_target, PROMPT, sampling))
    assert stat > 3 * bound, (stat, bound)


# ------------------------------------------------------------------------------------ acceptance rules


def test_greedy_accept():
    t = torch.tensor
    assert verify.greedy_accept(t([5, 6, 7]), t([5, 6, 9, 2])) == (2, 9)  # correction at the first mismatch
    assert verify.greedy_accept(t([5, 6, 7]), t([5, 6, 7, 4])) == (3, 4)  # all accepted: the bonus
    assert verify.greedy_accept(t([1, 6, 7]), t([5, 6, 7, 4])) == (0, 5)  # later matches do not count
    assert verify.greedy_accept(t([], dtype=torch.long), t([8])) == (0, 8)  # plain decoding


def one_hot(v: int, i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), v).double()


def test_rejection_accept_all_accepted_draws_the_bonus_from_the_last_p():
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0]])
    # p >= q at both draft tokens (ratio 1): always accepted; the bonus comes from p[K] = one-hot(3)
    p = torch.stack([torch.tensor([0.1, 0.9, 0.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 0.0]), one_hot(4, 3).float()])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert verify.rejection_accept(torch.tensor([1, 2]), q, p, g) == (2, 3)


def test_rejection_accept_residual_path():
    # slot 1: q puts 0.9 on the draft token 1 where p has 0.3 -> accept with 1/3;
    # on rejection draw from norm([p - q]_+) = [0.5, 0, 0.5, 0]: token 1 (and 3) can never come back
    p = torch.tensor([[0.4, 0.3, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.9, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    results = [verify.rejection_accept(torch.tensor([1]), q, p, g) for _ in range(3000)]
    accepted = sum(a for a, _ in results) / len(results)
    assert accepted == pytest.approx(1 / 3, abs=0.035)  # 5 sigma of a binomial(3000, 1/3)
    corrections = [tok for a, tok in results if a == 0]
    assert set(corrections) == {0, 2}
    assert sum(tok == 0 for tok in corrections) / len(corrections) == pytest.approx(0.5, abs=0.05)
    # the overall first token is distributed as p[0]: P(1) = 1/3 * 0.9 = 0.3
    first = [1 if a == 1 else tok for a, tok in results]
    assert sum(tok == 1 for tok in first) / len(first) == pytest.approx(0.3, abs=0.035)


def test_rejection_accept_tiny_residual_falls_back_to_p():
    # p == q, and a draft token neither gives mass: always rejected, residual mass 0 <= 1e-8 -> sample p
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = p[:1].clone()
    g = torch.Generator().manual_seed(0)
    results = [verify.rejection_accept(torch.tensor([3]), q, p, g) for _ in range(2000)]
    assert all(a == 0 for a, _ in results)
    tokens = torch.tensor([tok for _, tok in results])
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    torch.testing.assert_close(freq, p[0].double(), atol=0.05, rtol=0)
    # a one-hot p == q: the fallback returns p's token, never NaN or an error
    p1 = torch.stack([one_hot(4, 2), one_hot(4, 0)]).float()
    assert verify.rejection_accept(torch.tensor([1]), p1[:1].clone(), p1, g) == (0, 2)


def test_rejection_accept_plain_decoding_samples_p():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify.rejection_accept(torch.zeros(0, dtype=torch.long), p.new_zeros(0, 4), p) == (0, 2)


