"""Decoding: greedy speculative == greedy plain, lossless sampling, the acceptance rules, SamplingConfig."""

import itertools
import math

import pytest
import torch

from lightning_spec import SamplingConfig, generate
from lightning_spec.data import prompt_ids
from lightning_spec.decoding import verify

GREEDY = SamplingConfig()
MAX_NEW = 24


# ------------------------------------------------------------------------------------------------ helpers


def random_prompts(vocab: int, lengths=(1, 6, 13), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_prompts(target) -> list[list[int]]:
    chat = [
        prompt_ids(target.tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}]),
        prompt_ids(target.tokenizer, [{"role": "user", "content": "2 + 2 = ?"}]),
    ]
    return chat + random_prompts(256, lengths=(1, 9), seed=1)


@pytest.fixture(params=["tiny", "diverse"])
def target_and_prompts(request, tiny_target, diverse_target):
    if request.param == "tiny":
        return tiny_target, tiny_prompts(tiny_target)
    return diverse_target, random_prompts(diverse_target.vocab_size)


def expected_reference_accepts(prompt_len: int, block_size: int, max_new: int) -> list[int]:
    """The accept lengths a correct engine reports with ``ReferenceDrafter`` (see conftest): the corrupted
    slot of the round anchored at n is j = 7n mod (K + 2); the last round is cut to the token budget."""
    n, committed, out = prompt_len - 1, 0, []
    while committed < max_new:
        accepted = min((7 * n) % (block_size + 2), block_size)
        new = min(accepted + 1, max_new - committed)
        out.append(min(accepted, new))
        committed += new
        n += accepted + 1
    return out


def check_accounting(gen, max_new: int, block_size: int) -> None:
    assert gen.rounds == len(gen.accept_lengths)
    assert all(0 <= a <= block_size for a in gen.accept_lengths)
    # every round commits accepted + 1 tokens, except a last round cut short by EOS or the budget,
    # which reports min(accepted, committed) and so counts one token more than it committed
    slack = sum(gen.accept_lengths) + gen.rounds - len(gen.tokens)
    assert slack in (0, 1)
    assert gen.mal == pytest.approx(len(gen.tokens) / gen.rounds)


# ---------------------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_greedy_speculative_equals_plain_untrained_block_drafter(target_and_prompts, block_size, make_block_drafter):
    target, prompts = target_and_prompts
    drafter = make_block_drafter(target, block_size=block_size)
    for prompt in prompts:
        plain = generate(target, prompt, MAX_NEW, GREEDY)
        spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        assert spec.tokens == plain.tokens
        assert plain.rounds == len(plain.tokens) and plain.accept_lengths == [0] * plain.rounds
        check_accounting(spec, MAX_NEW, block_size)


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_greedy_speculative_equals_plain_partly_right_drafter(target_and_prompts, block_size, make_reference_drafter):
    target, prompts = target_and_prompts
    seen = set()
    for prompt in prompts:
        plain = generate(target, prompt, MAX_NEW, GREEDY)
        drafter = make_reference_drafter(target, block_size, prompt + plain.tokens)
        spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        assert spec.tokens == plain.tokens
        check_accounting(spec, MAX_NEW, block_size)
        # the engine accepted exactly the uncorrupted leading run of every round
        # (the budget is what plain decoding committed: EOS can end it before MAX_NEW)
        assert spec.accept_lengths == expected_reference_accepts(len(prompt), block_size, len(plain.tokens))
        seen.update(spec.accept_lengths)
    # acceptance is neither always 0 nor always K: both the correction and the bonus paths ran
    assert 0 in seen and block_size in seen
    assert block_size == 1 or seen & set(range(1, block_size))  # and a partial acceptance


def test_drafter_context_equals_a_fresh_prefill(diverse_target, make_reference_drafter):
    """After any sequence of rounds, the drafter's incremental context is the one a fresh ``begin`` builds from
    the target features of exactly the committed tokens (the engine extends with the right features)."""
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(7,), seed=3)[0]
    plain = generate(target, prompt, MAX_NEW, GREEDY)
    drafter = make_reference_drafter(target, 3, prompt + plain.tokens)
    spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
    full = torch.tensor(prompt + spec.tokens)[None]
    assert len(drafter.snapshots) == spec.rounds
    lengths = [length for length, _ in drafter.snapshots]
    assert lengths[0] == len(prompt) - 1 and len(set(lengths)) == len(lengths)
    for length, keys in drafter.snapshots:
        fresh = drafter.begin(target(full[:, :length], layers=drafter.target_layers, logits=False).features)
        assert fresh.length == length
        for got, want in zip(keys, fresh.keys):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [3, 8])
@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 11])
def test_max_new_tokens_is_exact(diverse_target, make_reference_drafter, block_size, max_new):
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(5,), seed=4)[0]
    plain = generate(target, prompt, MAX_NEW, GREEDY)
    drafter = make_reference_drafter(target, block_size, prompt + plain.tokens)
    spec = generate(target, prompt, max_new, GREEDY, drafter=drafter)
    assert spec.tokens == plain.tokens[:max_new]
    assert len(generate(target, prompt, max_new, GREEDY).tokens) == max_new
    assert spec.accept_lengths == expected_reference_accepts(len(prompt), block_size, max_new)
    if max_new:
        check_accounting(spec, max_new, block_size)


@pytest.mark.parametrize("drafter_kind", ["none", "untrained", "partly_right"])
def test_eos_stops_generation(diverse_target, make_block_drafter, make_reference_drafter, monkeypatch, drafter_kind):
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(6,), seed=5)[0]
    plain = generate(target, prompt, MAX_NEW, GREEDY).tokens
    stop = next(i for i in range(6, MAX_NEW) if plain[i] not in plain[:i])  # a token greedy first emits late
    drafter = {
        "none": None,
        "untrained": make_block_drafter(target, block_size=4),
        "partly_right": make_reference_drafter(target, 4, prompt + plain),
    }[drafter_kind]
    monkeypatch.setattr(target.model.generation_config, "eos_token_id", plain[stop])
    assert target.eos_token_ids == [plain[stop]]
    gen = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
    assert gen.tokens == plain[: stop + 1]  # EOS included, nothing after it
    check_accounting(gen, MAX_NEW, 4)


def test_eos_on_the_packaged_tiny_target(tiny_target, monkeypatch):
    """tiny-random repeats the last prompt token greedily: make that token the EOS and the answer is one token."""
    prompt = tiny_prompts(tiny_target)[0]
    first = generate(tiny_target, prompt, 4, GREEDY).tokens[0]
    assert tiny_target.eos_token_ids == [tiny_target.tokenizer.eos_token_id]
    monkeypatch.setattr(tiny_target.model.generation_config, "eos_token_id", first)
    monkeypatch.setattr(tiny_target.model.config, "eos_token_id", first)
    eos_ids = tiny_target.eos_token_ids
    assert first in eos_ids
    assert generate(tiny_target, prompt, 16, GREEDY).tokens == [first]


def test_generate_input_forms_and_errors(diverse_target, make_block_drafter, tiny_target):
    prompt = random_prompts(diverse_target.vocab_size, lengths=(6,), seed=6)[0]
    want = generate(diverse_target, prompt, 5).tokens
    assert generate(diverse_target, torch.tensor(prompt), 5).tokens == want
    assert generate(diverse_target, torch.tensor([prompt]), 5).tokens == want
    with pytest.raises(ValueError, match="one prompt"):
        generate(diverse_target, torch.tensor([prompt, prompt]), 5)
    with pytest.raises(ValueError, match="non-empty"):
        generate(diverse_target, [], 5)
    with pytest.raises(ValueError, match="different target"):
        generate(diverse_target, prompt, 5, drafter=make_block_drafter(tiny_target))


# -------------------------------------------------------------------------------------- lossless sampling

NEW = 3  # joint distribution of the first 3 tokens: bonus (all accepted) and residual paths both matter
PROMPT = [1, 5, 3, 0]


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    """Vocabulary 8, so the joint distribution of 3 tokens (512 outcomes) can be enumerated exactly."""
    target = make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)
    assert target.eos_token_ids == []  # no early stop: every run yields exactly NEW tokens
    return target


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


def empirical(target, sampling, drafter, runs: int, seed0: int = 0):
    """Counts of the first NEW tokens over ``runs`` seeded generations, and the first round's accept lengths."""
    v = target.vocab_size
    counts = torch.zeros(v**NEW, dtype=torch.float64)
    first_accepts = []
    for i in range(runs):
        gen = generate(target, PROMPT, NEW, sampling, drafter=drafter, seed=seed0 + i)
        assert len(gen.tokens) == NEW
        counts[sum(t * v ** (NEW - 1 - j) for j, t in enumerate(gen.tokens))] += 1
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


def test_exact_joint_sums_to_one(small_target):
    for sampling in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_k=3)):
        joint = exact_joint(small_target, PROMPT, sampling)
        assert joint.sum().item() == pytest.approx(1.0, abs=1e-6)  # p is float32
    assert int((exact_joint(small_target, PROMPT, SamplingConfig(temperature=1.0, top_k=3)) > 0).sum()) <= 27


def test_plain_sampling_matches_the_exact_distribution(small_target):
    sampling = SamplingConfig(temperature=1.0)
    counts, _ = empirical(small_target, sampling, None, runs=600, seed0=10_000)
    stat, bound = chi_square(counts, exact_joint(small_target, PROMPT, sampling))
    assert stat < bound, (stat, bound)


# (config, runs). About 2 ms a run; the broken rule below is caught at ~30x the bound with 600 runs, so these
# sizes leave the check plenty of power while keeping the file at seconds.
SAMPLINGS = {
    "T1": (SamplingConfig(temperature=1.0), 1500),
    "T1_top_k3": (SamplingConfig(temperature=1.0, top_k=3), 1000),
    "T0.7_top_p0.8": (SamplingConfig(temperature=0.7, top_p=0.8), 1000),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_speculative_sampling_is_lossless(small_target, make_fixed_drafter, name):
    sampling, runs = SAMPLINGS[name]
    drafter = make_fixed_drafter(small_target, block_size=2)
    counts, first = empirical(small_target, sampling, drafter, runs)
    exact = exact_joint(small_target, PROMPT, sampling)
    stat, bound = chi_square(counts, exact)
    assert stat < bound, (name, stat, bound)
    # both paths of the rule ran many times: a rejection (residual draw) and a full acceptance (bonus draw)
    assert sum(a < 2 for a in first) > runs // 100 and sum(a == 2 for a in first) > runs // 100, first[:50]


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


# ------------------------------------------------------------------------------------------ SamplingConfig

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0]


def softmax_by_hand(values: list[float]) -> list[float]:
    e = [math.exp(x) for x in values]
    return [x / sum(e) for x in e]


def probs_of(config: SamplingConfig) -> list[float]:
    return config.probs(torch.tensor(LOGITS)).tolist()


def test_sampling_greedy_is_one_hot():
    config = SamplingConfig()
    assert config.greedy
    assert probs_of(config) == [1.0, 0.0, 0.0, 0.0, 0.0]
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert config.sample(config.probs(logits)).tolist() == [1, 0]


def test_sampling_temperature():
    assert probs_of(SamplingConfig(temperature=2.0)) == pytest.approx(softmax_by_hand([x / 2 for x in LOGITS]))
    assert probs_of(SamplingConfig(temperature=1.0)) == pytest.approx(softmax_by_hand(LOGITS))


def test_sampling_top_k():
    e = softmax_by_hand([2.0, 1.0])
    assert probs_of(SamplingConfig(temperature=1.0, top_k=2)) == pytest.approx([*e, 0, 0, 0])
    e = softmax_by_hand([4.0, 2.0])  # temperature 0.5 doubles the logits
    assert probs_of(SamplingConfig(temperature=0.5, top_k=2)) == pytest.approx([*e, 0, 0, 0])
    assert probs_of(SamplingConfig(temperature=1.0, top_k=50)) == pytest.approx(softmax_by_hand(LOGITS))


def test_sampling_top_p():
    # softmax(LOGITS) = [0.563, 0.207, 0.126, 0.076, 0.028]; cumulative 0.563, 0.770, 0.896, ...
    assert probs_of(SamplingConfig(temperature=1.0, top_p=0.5)) == pytest.approx([1, 0, 0, 0, 0])
    assert probs_of(SamplingConfig(temperature=1.0, top_p=0.7)) == pytest.approx([*softmax_by_hand([2, 1]), 0, 0, 0])
    assert probs_of(SamplingConfig(temperature=1.0, top_p=0.8)) == pytest.approx(
        [*softmax_by_hand([2, 1, 0.5]), 0, 0]
    )


def test_sampling_top_k_before_top_p():
    # after top-k 3 the kept probs are [0.629, 0.231, 0.140] (cumulative 0.860 at two tokens), so top_p 0.85
    # keeps two tokens; top-p on the unfiltered distribution would keep three (0.770 < 0.85)
    got = probs_of(SamplingConfig(temperature=1.0, top_k=3, top_p=0.85))
    assert got == pytest.approx([*softmax_by_hand([2, 1]), 0, 0, 0])


def test_sampling_batched_rows_sum_to_one():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    for config in (SamplingConfig(), SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)):
        probs = config.probs(logits)
        assert probs.shape == logits.shape
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
        assert config.sample(probs, torch.Generator().manual_seed(0)).shape == (2, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_sampling_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingConfig(**kwargs)


# ------------------------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_greedy_speculative_equals_plain_smollm2(make_block_drafter):
    from lightning_spec import load_target

    target = load_target("smollm2-135m-instruct")
    drafter = make_block_drafter(target, block_size=4, num_layers=1, draft_vocab_size=None)
    for question in ("What is the capital of France?", "Write a Python function that reverses a string."):
        prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": question}])
        plain = generate(target, prompt, 16, GREEDY)
        spec = generate(target, prompt, 16, GREEDY, drafter=drafter)
        assert spec.tokens == plain.tokens
        check_accounting(spec, 16, 4)
