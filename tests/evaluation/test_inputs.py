"""The inputs of an evaluation, opened once at the edge (``evaluation/inputs.py``): the rollouts opener shared by
``evaluate``, ``offline_report`` and the ``OfflineEvaluation`` callback refuses a bad set in one sentence, and the
evaluators refuse a path where they take a loaded object, saying how to load it."""

import pytest
import torch
from helpers.cli import exit_code

from lightning_spec import SamplingConfig, offline_rounds
from lightning_spec.data.rollout_writer import Draw, generate_rollouts
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
    generate_rollouts(tiny_target, prompts, Draw(T1, 2, 4, seed=0), out, batch_size=4, progress=False)
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
    assert torch.equal(offline_rounds(tiny_target, drafter, str(folder)),
                       offline_rounds(tiny_target, drafter, rows, T1))


# ------------------------------------------------------------------------------- offline_rounds, bad rows
@pytest.fixture(scope="module")
def drafter(tiny_target):
    from lightning_spec.drafters import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(block_size=3, num_layers=1)
    drafter.bind(tiny_target)
    return drafter.eval()


@pytest.mark.parametrize(
    "rows, match",
    [
        ([("hello", [1, 2])], r"rollout 0's prompt is a str 'hello', not one sequence of token ids; pass a list"),
        ([([1, 2], [3]), ([1, 2], 5)], r"rollout 1's response is a int 5, not one sequence of token ids"),
        ([([1, 2], [3.5, 1.0])], r"rollout 0's response is a list .*, not one sequence of token ids"),
        ([([1, 2], [[3], [4]])], r"rollout 0's response is a list .*, not one sequence of token ids"),
        ([([1, 2], [3], [4])], r"rollout 0 is a tuple of length 3; each rollout is a \(prompt_ids, response_ids\)"),
        ([{"prompt_ids": [1, 2]}], r"rollout 0 is a mapping without response_ids"),
        ([[1, 2, 3]], r"rollout 0 is a list of length 3; each rollout is a \(prompt_ids, response_ids\) pair"),
        ("hello", r"hello is not a rollouts folder \(no rollouts.json\); make one with `lightning-spec rollouts"),
        ({"prompt_ids": [[1]], "response_ids": [[2]]}, r"rollouts is a dict; pass a rollouts folder"),
        ([([1, 2], [3, 320])], r"rollout 0's response holds token id 320, outside the target's vocabulary 0\.\.319"),
        ([([1, 2], [-1, 3])], r"rollout 0's response holds token id -1, outside the target's vocabulary 0\.\.319"),
        ([([1, 999], [3])], r"rollout 0's prompt holds token id 999, outside the target's vocabulary 0\.\.319"),
    ],
)
def test_offline_rounds_refuses_rows_that_are_not_token_ids(tiny_target, drafter, rows, match):
    """Mismatched row types, nested batches and out-of-vocabulary ids were a ValueError from ``int()``, a
    KeyError, or an IndexError from inside torch's embedding."""
    with pytest.raises(ValueError, match=match):
        offline_rounds(tiny_target, drafter, rows, T1)


def test_offline_rounds_reads_a_tokenizer_output_as_a_prompt(tiny_target, drafter):
    """A BatchEncoding (``tokenizer(text)``, also with ``return_tensors="pt"``) is read as its ``input_ids``."""
    tok = tiny_target.tokenizer
    response = [5, 6, 7, 8]
    plain = offline_rounds(tiny_target, drafter, [(tok("hello there")["input_ids"], response)], T1)
    assert torch.equal(offline_rounds(tiny_target, drafter, [(tok("hello there"), response)], T1), plain)
    as_tensor = tok("hello there", return_tensors="pt")
    assert torch.equal(offline_rounds(tiny_target, drafter, [(as_tensor, torch.tensor(response))], T1), plain)
    with pytest.raises(ValueError, match=r"rollout 0's prompt is a list .*, not one sequence of token ids"):
        offline_rounds(tiny_target, drafter, [(tok(["a batch", "of two"]), response)], T1)


# ------------------------------------------------------------------------------------- evaluate, bad checkpoint
@pytest.mark.parametrize("content", [None, b"", b"garbage"])
def test_offline_evaluate_of_a_missing_or_broken_checkpoint_is_one_line(in_tmp, capsys, tiny_target, content):
    """``evaluate`` with a missing or empty checkpoint ended in FileNotFoundError / EOFError."""
    generate_rollouts(tiny_target, [[5, 6, 7]], Draw(T1, n_per_prompt=1, max_new_tokens=4), in_tmp / "rollouts",
                      progress=False)
    ckpt = in_tmp / "drafter.ckpt"
    if content is not None:
        ckpt.write_bytes(content)
    code = exit_code(["evaluate", "--drafters", f"[{ckpt}]", "--rollouts", str(in_tmp / "rollouts")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("lightning-spec: error: ") and str(ckpt) in err[-1]
    assert not any("Traceback" in line for line in err)
