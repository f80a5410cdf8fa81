"""Decoding: greedy speculative decoding equals an independent greedy reference, the engine's accounting (token
budget, EOS, accept lengths), and SamplingConfig. Lossless sampling lives in test_lossless_sampling.py."""

import math

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference, random_prompts
from helpers.families import fit_to_greedy_continuations

from lightning_spec import SamplingConfig, generate
from lightning_spec.data import prompt_ids

GREEDY = SamplingConfig()


# ------------------------------------------------------------------------------------------------ helpers


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
#
# Every greedy test compares with ``argmax_reference``, which shares no code with the engine (no cache, no
# verification, no drafter): a bug that breaks plain and speculative decoding alike (plain decoding is the same
# engine with K = 0) cannot hide behind a comparison of the engine with itself. The drafters are accepted in a
# good share of rounds, so what the target's cache keeps after an acceptance is what is checked.


def transformers_greedy(target, prompt: list[int], max_new: int) -> list[int]:
    """transformers' ``generate(do_sample=False)``, cut after the first EOS (it pads the rest)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    new, eos = out[0, len(prompt) :].tolist(), set(target.eos_token_ids)
    return next((new[: i + 1] for i, tok in enumerate(new) if tok in eos), new)


def test_argmax_reference_equals_transformers_generate(diverse_target, tiny_target):
    cases = ((diverse_target, random_prompts(diverse_target.vocab_size)), (tiny_target, tiny_prompts(tiny_target)))
    for target, prompts in cases:
        for prompt in prompts:
            assert argmax_reference(target, prompt, MAX_NEW) == transformers_greedy(target, prompt, MAX_NEW)


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_greedy_speculative_equals_the_reference_untrained_drafter(target_and_prompts, block_size, make_block_drafter):
    """Plain decoding and an (almost never accepted) untrained drafter both reproduce the no-cache reference.

    Catches a target cache cropped one token short in the engine (``past + accepted`` instead of
    ``past + 1 + accepted``): the anchor drops out of the cache, and plain decoding diverges from the reference.
    """
    target, prompts = target_and_prompts
    drafter = make_block_drafter(target, block_size=block_size)
    for prompt in prompts:
        want = argmax_reference(target, prompt, MAX_NEW)
        plain = generate(target, prompt, MAX_NEW, GREEDY)
        spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        assert plain.tokens == want and spec.tokens == want
        assert plain.rounds == len(plain.tokens) and plain.accept_lengths == [0] * plain.rounds
        check_accounting(spec, MAX_NEW, block_size)


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_greedy_speculative_equals_the_reference_partly_right_drafter(
    target_and_prompts, block_size, make_reference_drafter
):
    """``ReferenceDrafter`` proposes the reference continuation with one slot corrupted per round, so it is
    accepted for 0..K tokens by design, and the accept lengths are known in advance.

    Catches the cache cropped one token short (``past + accepted``): tokens and accept lengths both differ.
    """
    target, prompts = target_and_prompts
    seen = set()
    for prompt in prompts:
        want = argmax_reference(target, prompt, MAX_NEW)
        drafter = make_reference_drafter(target, block_size, prompt + want)
        spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        assert spec.tokens == want
        check_accounting(spec, MAX_NEW, block_size)
        # the engine accepted exactly the uncorrupted leading run of every round
        # (the budget is what the reference committed: EOS can end it before MAX_NEW)
        assert spec.accept_lengths == expected_reference_accepts(len(prompt), block_size, len(want))
        seen.update(spec.accept_lengths)
    # acceptance is neither always 0 nor always K: both the correction and the bonus paths ran
    assert 0 in seen and block_size in seen
    assert block_size == 1 or seen & set(range(1, block_size))  # and a partial acceptance


def train_on_greedy_continuations(target, prompts, block_size: int, make_block_drafter, steps: int = 35):
    """A real ``DFlashDrafter`` trained (CE, AdamW) on the target's own greedy continuations of ``prompts``: it
    learns them well enough to be accepted in a good share of rounds, not so well that it never misses.
    Every supervised position is an anchor (``num_anchors`` exceeds the length), so training is deterministic."""
    drafter = make_block_drafter(target, block_size=block_size, num_anchors=64)
    return fit_to_greedy_continuations(target, drafter, prompts, steps)


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_greedy_speculative_equals_the_reference_trained_block_drafter(diverse_target, block_size, make_block_drafter):
    """The real ``DFlashDrafter``, trained until it is accepted, reproduces the no-cache reference.

    Catches the target cache cropped one token short (``past + accepted``, checked on a mutated copy of the
    package), as any slip in what the target's cache keeps after an acceptance would be. (A drafter-side slip
    only costs acceptance, never tokens: ``test_drafter_context_equals_a_fresh_prefill`` checks that side.)
    """
    target = diverse_target
    prompts = random_prompts(target.vocab_size)
    drafter = train_on_greedy_continuations(target, prompts, block_size, make_block_drafter)
    accepts = []
    for prompt in prompts:
        spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        assert spec.tokens == argmax_reference(target, prompt, MAX_NEW)
        check_accounting(spec, MAX_NEW, block_size)
        accepts += spec.accept_lengths
    # the drafter is accepted in a good share of rounds, and rejected in others
    assert max(accepts) > 0 and sum(a > 0 for a in accepts) >= 0.25 * len(accepts), accepts
    assert min(accepts) < block_size, accepts


def test_drafter_context_equals_a_fresh_prefill(diverse_target, make_reference_drafter):
    """After any sequence of rounds, the drafter's incremental context is the one a fresh ``begin`` builds from
    the target features of exactly the committed tokens (the engine extends with the right features)."""
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(7,), seed=3)[0]
    want = argmax_reference(target, prompt, MAX_NEW)
    drafter = make_reference_drafter(target, 3, prompt + want)
    spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
    assert spec.tokens == want
    full = torch.tensor(prompt + spec.tokens)[None]
    assert len(drafter.snapshots) == spec.rounds
    lengths = [length for length, _ in drafter.snapshots]
    assert lengths[0] == len(prompt) - 1 and len(set(lengths)) == len(lengths)
    for length, keys in drafter.snapshots:
        fresh = drafter.begin(target(full[:, :length], layers=drafter.target_layers, logits=False).features)
        assert fresh.length == length
        for got, want_key in zip(keys, fresh.keys):
            torch.testing.assert_close(got, want_key, atol=1e-4, rtol=1e-4)


def rounds_against_a_fresh_begin(target, drafter, prompts, monkeypatch) -> tuple[list[str], list[int]]:
    """Greedy decoding of ``prompts`` with ``drafter``, every round compared with the round a drafter without
    incremental state would play: ``begin`` on the target features of the whole committed prefix, then ``propose``.

    Returns the rounds whose proposal or acceptance differs ("prompt p, round r: ...") and the accept lengths of the
    rounds after the first (those that follow an ``extend``)."""
    proposals = []
    propose = drafter.propose

    def spy(state, anchor, sampling, generator=None):
        proposal = propose(state, anchor, sampling, generator)
        proposals.append(proposal.tokens.tolist())
        return proposal

    wrong, later = [], []
    for p, prompt in enumerate(prompts):
        proposals.clear()
        with monkeypatch.context() as patch:
            patch.setattr(drafter, "propose", spy)
            spec = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
        want = argmax_reference(target, prompt, MAX_NEW)
        assert spec.tokens == want  # lossless whatever the drafter's state
        full = prompt + want
        n = len(prompt) - 1  # the anchor's position in round 0
        for r, (got, accepted) in enumerate(zip(proposals, spec.accept_lengths)):
            prefix = torch.tensor(full[:n], dtype=torch.long)[None]  # (1, n): the committed tokens before the anchor
            features = target(prefix, layers=drafter.target_layers, logits=False).features if n else \
                torch.zeros(1, 0, len(drafter.target_layers) * target.hidden_size)  # (1, n, F)
            fresh = drafter.begin(features, prefix)
            reference = propose(fresh, torch.tensor(full[n : n + 1]), GREEDY).tokens.tolist()
            matched = next((i for i, t in enumerate(reference) if n + 1 + i >= len(full) or t != full[n + 1 + i]),
                           len(reference))
            last = r == spec.rounds - 1  # cut to the token budget: its acceptance is capped
            if got != reference or (not last and accepted != matched):
                wrong.append(f"prompt {p}, round {r}: drafted {got}, accepted {accepted}; a fresh begin drafts "
                             f"{reference}, accepted {matched}")
            if r > 0 and not last:
                later.append(accepted)
            n += accepted + 1
    return wrong, later


@pytest.mark.parametrize("family", ["dflash", "eagle3"])
def test_acceptance_after_extend_stays_at_a_fresh_begins(diverse_target, make_block_drafter, monkeypatch, family):
    """End to end, a trained drafter's every round after ``extend`` drafts, and is accepted, exactly as a drafter
    built afresh on the committed prefix: a slip in the features ``extend`` commits (shifted by a position, say)
    costs acceptance but never tokens, so only this comparison sees it (the guard test below checks that)."""
    from lightning_spec.drafters import Eagle3Drafter

    target = diverse_target
    prompts = random_prompts(target.vocab_size)
    torch.manual_seed(0)
    drafter = make_block_drafter(target, block_size=3, num_anchors=64) if family == "dflash" else \
        Eagle3Drafter(block_size=3, num_anchors=64)
    drafter.bind(target)
    drafter = fit_to_greedy_continuations(target, drafter, prompts, steps=35)
    wrong, later = rounds_against_a_fresh_begin(target, drafter, prompts, monkeypatch)
    assert not wrong, "\n".join(wrong)
    assert sum(a > 0 for a in later) >= 0.25 * len(later), later  # acceptance after extend is not trivially 0

    # the guard: the same drafter extended with the features of the position before each committed node
    extend = drafter.extend
    monkeypatch.setattr(drafter, "extend", lambda state, features, path: extend(state, features.roll(1, 1), path))
    wrong, _ = rounds_against_a_fresh_begin(target, drafter, prompts, monkeypatch)
    assert wrong, "shifted features in extend went unnoticed"


@pytest.mark.parametrize("block_size", [3, 8])
@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 11])
def test_max_new_tokens_is_exact(diverse_target, make_reference_drafter, block_size, max_new):
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(5,), seed=4)[0]
    want = argmax_reference(target, prompt, MAX_NEW)
    drafter = make_reference_drafter(target, block_size, prompt + want)
    spec = generate(target, prompt, max_new, GREEDY, drafter=drafter)
    assert spec.tokens == want[:max_new]
    assert generate(target, prompt, max_new, GREEDY).tokens == want[:max_new]
    assert spec.accept_lengths == expected_reference_accepts(len(prompt), block_size, max_new)
    if max_new:
        check_accounting(spec, max_new, block_size)


@pytest.mark.parametrize("drafter_kind", ["none", "untrained", "partly_right"])
def test_eos_stops_generation(diverse_target, make_block_drafter, make_reference_drafter, monkeypatch, drafter_kind):
    target = diverse_target
    prompt = random_prompts(target.vocab_size, lengths=(6,), seed=5)[0]
    full = argmax_reference(target, prompt, MAX_NEW)
    stop = next(i for i in range(6, MAX_NEW) if full[i] not in full[:i])  # a token greedy first emits late
    drafter = {
        "none": None,
        "untrained": make_block_drafter(target, block_size=4),
        "partly_right": make_reference_drafter(target, 4, prompt + full),
    }[drafter_kind]
    monkeypatch.setattr(target.model.generation_config, "eos_token_id", full[stop])
    assert target.eos_token_ids == [full[stop]]
    assert argmax_reference(target, prompt, MAX_NEW) == full[: stop + 1]
    gen = generate(target, prompt, MAX_NEW, GREEDY, drafter=drafter)
    assert gen.tokens == full[: stop + 1]  # EOS included, nothing after it
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
def test_greedy_speculative_equals_the_reference_smollm2(make_block_drafter, make_reference_drafter):
    """The real SmolLM2 target against transformers' ``generate``, with an untrained drafter and with
    ``ReferenceDrafter`` (accepted for 0..K tokens per round). Catches the cache cropped one token short."""
    from lightning_spec import load_target

    target = load_target("smollm2-135m-instruct")
    untrained = make_block_drafter(target, block_size=4, num_layers=1, draft_vocab_size=None)
    for question in ("What is the capital of France?", "Write a Python function that reverses a string."):
        prompt = prompt_ids(target.tokenizer, [{"role": "user", "content": question}])
        want = transformers_greedy(target, prompt, 16)
        assert generate(target, prompt, 16, GREEDY).tokens == want
        spec = generate(target, prompt, 16, GREEDY, drafter=untrained)
        assert spec.tokens == want
        check_accounting(spec, 16, 4)
        spec = generate(target, prompt, 16, GREEDY, drafter=make_reference_drafter(target, 4, prompt + want))
        assert spec.tokens == want
        assert spec.accept_lengths == expected_reference_accepts(len(prompt), 4, len(want))
        check_accounting(spec, 16, 4)


# ------------------------------------------------------------------------------ the arguments, one sentence
@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 2, 400], "token id 400, outside the target's vocabulary 0..319"),  # tiny-random: vocab 320
        ([1, -3, 2], "token id -3"),
        ([1.5, 2.0], "must be token ids"),
        ([], "non-empty"),
        ("hello", "must be token ids"),
    ],
)
def test_generate_refuses_bad_token_ids(tiny_target, ids, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_target, ids, 4)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_generate_refuses_a_bad_token_budget(tiny_target, bad):
    """``max_new_tokens=-1`` silently returned nothing."""
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        generate(tiny_target, [1, 2, 3], bad)


def test_generate_takes_sampling_as_a_dict(tiny_target):
    as_dict = generate(tiny_target, [1, 2, 3], 5, sampling={"temperature": 1.0, "top_k": 4}, seed=3)
    as_config = generate(tiny_target, [1, 2, 3], 5, sampling=SamplingConfig(temperature=1.0, top_k=4), seed=3)
    assert as_dict.tokens == as_config.tokens
    with pytest.raises(ValueError, match="unknown keys"):
        generate(tiny_target, [1, 2, 3], 5, sampling={"temp": 1.0})
    with pytest.raises(TypeError, match="SamplingConfig or a dict"):
        generate(tiny_target, [1, 2, 3], 5, sampling=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": -1.0}, "temperature must be a finite number"),
        ({"top_p": math.nan}, "top_p must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": -1}, "top_k must be an int"),
    ],
)
def test_sampling_config_refuses_values_torch_would_choke_on(kwargs, match):
    """``SamplingConfig(temperature=nan)`` was accepted and failed later inside torch."""
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
