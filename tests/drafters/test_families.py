"""The guarantees, held for every drafter family through the drafter contract alone.

For each family in ``FAMILIES`` (a constructor taking K):
- greedy speculative output equals an independent no-cache argmax loop, with a drafter trained until it is
  accepted (so acceptance, rejection and the bonus all run);
- under sampling at T = 1 the output distribution is the target's (χ² against the enumerated joint of a
  vocabulary-8 target), and a deliberately broken acceptance rule fails the same check;
- offline greedy rounds equal the engine's greedy rounds exactly (the training forward drafts what ``propose``
  drafts);
- a saved drafter loads back to the same weights and the same greedy output.

A new family registered in ``lightning_spec.drafters.FAMILIES`` must add at least one configuration to ``FAMILIES``
in tests/helpers/families.py (a test here says so); the DDP equivalence is parametrised over the families in
tests/integration/test_ddp.py.
"""

import pytest
import torch
from helpers.decoding import MAX_NEW, argmax_reference
from helpers.families import FAMILIES, build, trained
from helpers.sampling import NEW, PROMPT, assert_matches, chi_square, empirical, exact_joint

from lightning_spec import SamplingConfig, generate, load_drafter, offline_rounds
from lightning_spec.checkpoint import save_drafter
from lightning_spec.decoding import verify

GREEDY, T1 = SamplingConfig(), SamplingConfig(temperature=1.0)


def test_every_registered_family_is_tested_here():
    """The registry decides which families exist: each has a configuration in helpers/families.py, named after it
    (``dflash``, ``dflash_served``, ...), whose drafter is exactly the registered class."""
    from lightning_spec.drafters import FAMILIES as REGISTRY

    for name, make in FAMILIES.items():
        family = type(make(2)).family
        assert name == family or name.startswith(family + "_"), name
        assert type(make(2)) is REGISTRY[family], name
    assert {type(make(2)).family for make in FAMILIES.values()} == set(REGISTRY)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def accepted_drafter(family, diverse_target, prompts):
    return trained(family, diverse_target, prompts, k=3)


def test_greedy_speculative_equals_the_reference(accepted_drafter, diverse_target, prompts):
    rounds = accepting = 0
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=accepted_drafter)
        assert out.tokens == argmax_reference(diverse_target, prompt, MAX_NEW)
        rounds += out.rounds
        accepting += sum(a > 0 for a in out.accept_lengths)
        assert all(d <= accepted_drafter.block_size for d in out.draft_lengths)
    assert accepting >= rounds // 4, (accepting, rounds)  # the drafter is accepted: the test has teeth


def test_offline_greedy_rounds_equal_the_engine(accepted_drafter, diverse_target, prompts):
    pairs, real = [], []
    for prompt in prompts:
        out = generate(diverse_target, prompt, MAX_NEW, drafter=accepted_drafter)
        pairs.append((prompt, out.tokens))
        real.append(float(out.rounds))
    offline = offline_rounds(diverse_target, accepted_drafter, pairs, GREEDY)
    assert offline.tolist() == real


@pytest.fixture(scope="module")
def small_target(make_random_llama):
    return make_random_llama(vocab_size=8, hidden_size=16, init=0.5, seed=0)


def test_sampling_is_lossless(family, small_target):
    drafter = build(family, small_target, k=2)
    counts, first = empirical(small_target, T1, drafter, runs=1000)
    assert_matches(counts, exact_joint(small_target, PROMPT, T1), small_target.vocab_size, NEW, family)
    assert any(a < 2 for a in first) and any(a > 0 for a in first), first[:50]  # both paths of the rule ran


def test_a_broken_rule_fails_the_sampling_check(family, small_target, monkeypatch):
    monkeypatch.setattr(verify, "acceptance_probability", lambda p_x, q_x: (q_x / p_x.clamp_min(1e-30)).clamp(max=1))
    drafter = build(family, small_target, k=2)
    counts, _ = empirical(small_target, T1, drafter, runs=600)
    stat, bound = chi_square(counts, exact_joint(small_target, PROMPT, T1))
    assert stat > bound, (stat, bound)


def test_save_and_load_round_trip(accepted_drafter, diverse_target, prompts, tmp_path):
    folder = save_drafter(accepted_drafter, tmp_path / "drafter", "random")
    loaded = load_drafter(folder, target=diverse_target)
    assert type(loaded) is type(accepted_drafter)
    assert loaded.config_dict() == accepted_drafter.config_dict()
    for (key, a), (_, b) in zip(loaded.state_dict().items(), accepted_drafter.state_dict().items()):
        assert torch.equal(a, b), key
    for prompt in prompts[:2]:
        assert generate(diverse_target, prompt, MAX_NEW, drafter=loaded).tokens == generate(
            diverse_target, prompt, MAX_NEW, drafter=accepted_drafter
        ).tokens
    sampled = generate(diverse_target, prompts[0], 6, T1, drafter=loaded, seed=0)
    assert sampled.tokens == generate(diverse_target, prompts[0], 6, T1, drafter=accepted_drafter, seed=0).tokens


def test_a_trained_drafter_shared_across_tests_is_the_one_training_gives(diverse_target, prompts):
    """``helpers.families.trained`` trains once per process and hands later callers the same weights in a drafter
    of their own: those weights are what training afresh gives, bit for bit, and a caller's changes stay its own."""
    from helpers.families import fit_to_greedy_continuations

    first, again = trained("dflash", diverse_target, prompts, k=3), trained("dflash", diverse_target, prompts, k=3)
    fresh = fit_to_greedy_continuations(diverse_target, build("dflash", diverse_target, 3), prompts)
    assert again is not first
    for name, value in fresh.state_dict().items():
        assert torch.equal(first.state_dict()[name], value) and torch.equal(again.state_dict()[name], value), name
    with torch.no_grad():
        next(again.parameters()).add_(1.0)
    assert torch.equal(next(trained("dflash", diverse_target, prompts, k=3).parameters()),
                       next(first.parameters()))
