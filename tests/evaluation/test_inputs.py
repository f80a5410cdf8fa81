"""The inputs of an evaluation, opened once at the edge (``evaluation/inputs.py``): the rollouts opener shared by
``evaluate``, ``offline_report`` and the ``OfflineEvaluation`` callback refuses a bad set in one sentence, and the
evaluators refuse a path where they take a loaded object, saying how to load it."""

import pytest
import torch

from lightning_spec import SamplingConfig, offline_rounds
from lightning_spec.data.rollout_writer import generate_rollouts
from lightning_spec.data.rollouts import RolloutSet, load_rollout_set
from lightning_spec.evaluation.inputs import open_rollouts
from lightning_spec.evaluation.offline import offline_report

T1 = SamplingConfig(temperature=1.0)


def one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0, message
    return message


@pytest.fixture(scope="module")
def folder(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("inputs") / "r"
    prompts = [{"id": f"p{i}", "domain": "ab"[i % 2], "subdomain": "", "prompt_ids": [5 + i, 6, 7]} for i in range(4)]
    generate_rollouts(tiny_target, prompts, T1, 2, 4, out, seed=0, batch_size=4, progress=False)
    return out


def test_open_rollouts_checks_spreads_and_returns_the_recorded_sampling(tiny_target, folder):
    data, sampling = open_rollouts(folder, tiny_target, max_rollouts=3)
    assert isinstance(data, RolloutSet) and len(data) == 3 and sampling == T1
    assert sorted(set(data.domains)) == ["a", "b"] and len(set(data.prompt_keys)) == 3  # spread: first samples first
    again, _ = open_rollouts(load_rollout_set(folder), tiny_target, T1)  # a set already read: the same rows
    assert len(again) == 8 and again.source == str(folder)


def test_open_rollouts_refuses_a_bad_set_in_one_sentence(tiny_target, make_random_llama, folder):
    other = make_random_llama(vocab_size=tiny_target.vocab_size, hidden_size=32, seed=5)
    with pytest.raises(ValueError) as err:
        open_rollouts(folder, other)
    assert "fingerprint" in one_sentence(err)
    with pytest.raises(ValueError) as err:
        open_rollouts(folder, tiny_target, SamplingConfig())
    assert "sampling" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:  # pairs record no sampling config: the caller's own option is named
        open_rollouts([([1, 2], [3])], tiny_target, sampling_name="OfflineEvaluation.sampling")
    assert "needs sampling" in one_sentence(err) and "OfflineEvaluation.sampling" in str(err.value)
    with pytest.raises(ValueError) as err:
        open_rollouts([([1, 2], [tiny_target.vocab_size])], tiny_target, T1)
    assert "vocabulary" in one_sentence(err)


def test_the_offline_evaluator_refuses_paths_and_says_how_to_load_them(tiny_target, make_block_drafter, folder):
    drafter = make_block_drafter(tiny_target, block_size=2)
    with pytest.raises(ValueError) as err:
        offline_report(tiny_target, drafter, str(folder))
    assert f"load_rollout_set('{folder}')" in one_sentence(err)
    with pytest.raises(ValueError) as err:
        offline_rounds(tiny_target, "runs/a/last.ckpt", load_rollout_set(folder))
    assert "load_drafter('runs/a/last.ckpt', target=target)" in one_sentence(err)
    with pytest.raises(ValueError) as err:
        offline_rounds("tiny-random", drafter, [([1, 2], [3])], T1)
    assert "load_target('tiny-random')" in one_sentence(err)
    # loaded once at the edge, the same rounds as from the rows in memory
    rows = [(p, r) for p, r in zip(load_rollout_set(folder).prompt_ids, load_rollout_set(folder).response_ids)]
    assert torch.equal(offline_rounds(tiny_target, drafter, load_rollout_set(folder)),
                       offline_rounds(tiny_target, drafter, rows, T1))
    # the public API's edge (DESIGN.md): offline_rounds also takes the folder itself, and loads it
    assert torch.equal(offline_rounds(tiny_target, drafter, str(folder)), offline_rounds(tiny_target, drafter, rows, T1))
