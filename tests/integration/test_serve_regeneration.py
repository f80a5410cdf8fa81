"""Regeneration through real vLLM (the CPU build in .venv-serve, `make serve-setup`): skipped where that venv is absent
(CI builds it only for `make serve-check`). vLLM serves SmolLM2 on 127.0.0.1 (benchmarks/serve_target.py); the
server engine's greedy answers, first turns and later ones, are our engine's tokens, and a wrong model name is one
sentence."""

import sys
from pathlib import Path

import pytest

from lightning_spec import SamplingConfig
from lightning_spec.data import prompt_ids
from lightning_spec.data.engines import LocalEngine, ServerEngine, ServerError
from lightning_spec.data.prompts import select_prompts
from lightning_spec.data.rollout_writer import Draw, generate_rollouts

ROOT = Path(__file__).resolve().parents[2]
SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SERVE_PYTHON.exists(), reason="no .venv-serve (make serve-setup) on this machine")]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_target import start, stop

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    args = argparse.Namespace(python=str(SERVE_PYTHON), target="smollm2-135m-instruct", name=None, port=8093,
                              dtype="float32", max_model_len=2048, max_num_seqs=8, kv_gb=2, start_timeout=600,
                              log=str(log))
    proc, url = start(args)
    yield url
    stop(proc)


def test_vllm_regenerates_the_tokens_of_our_engine_turn_by_turn(vllm, tmp_path):
    from lightning_spec import load_target

    target = load_target("smollm2-135m-instruct")
    two_turns = [{"id": "two", "domain": "chat", "subdomain": "t", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another one?"}]}]
    prompts = select_prompts(target.tokenizer, ["mt-bench"], 4, 0)
    prompts.append({**two_turns[0], "prompt_ids": prompt_ids(target.tokenizer, two_turns[0]["messages"][:1])})
    draw = Draw(SamplingConfig(), n_per_prompt=1, max_new_tokens=24)
    ours = generate_rollouts(target, prompts, draw, tmp_path / "ours", engine=LocalEngine(target), progress=False)
    served = generate_rollouts(target, prompts, draw, tmp_path / "vllm", engine=ServerEngine(vllm, concurrency=4),
                               progress=False)
    same = sum(a["response_ids"] == b["response_ids"] for a, b in zip(ours, served))
    assert same >= len(prompts) - 1, [(a["response_ids"], b["response_ids"]) for a, b in zip(ours, served)]
    two = served.to_list()[-1]
    assert two["turns"] == (2 if two["finished"] else 1)  # the second turn runs when the first ended with EOS
    if two["turns"] == 2:
        assert [m["role"] for m in two["messages"]] == ["user", "assistant", "user", "assistant"]
        assert two["messages"][2]["content"] == "And another one?"
    with pytest.raises(ServerError, match=r"serves \['smollm2-135m-instruct'\], not --server_model 'gpt-4'"):
        ServerEngine(vllm, model="gpt-4")
