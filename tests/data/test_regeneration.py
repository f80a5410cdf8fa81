"""Regeneration through a serving engine: an OpenAI-compatible server (a stand-in on the tiny target here; real vLLM
in tests/integration/test_serve_regeneration.py where .venv-serve exists) draws the target's answers with many
requests in flight, every assistant turn given the regenerated history, resumably after a kill -9, and says in one
sentence when the server is down or serves another model."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.openai_standin import StandIn

from lightning_spec import SamplingConfig
from lightning_spec.data import prompt_ids
from lightning_spec.data.engines import LocalEngine, ServerEngine, ServerError, user_turns
from lightning_spec.data.rollout_writer import Draw, generate_rollouts
from lightning_spec.data.rollouts import load_rollouts
from lightning_spec.target import Target

ROOT = Path(__file__).resolve().parents[2]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
     {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "the end"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "times 3?"},
     {"role": "assistant", "content": "12"}, {"role": "user", "content": "and minus one?"}],
    [{"role": "user", "content": "Tell me a story about a dragon and a knight."}],
    [{"role": "user", "content": "xxxxx"}, {"role": "assistant", "content": "yyyy"}],
    [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."},
     {"role": "user", "content": "Why not?"}],
]


@pytest.fixture(scope="module")
def chatty(tiny_target):
    """tiny-random with its end-of-turn logit raised along the mean final hidden state: greedy answers of a few
    tokens that end with EOS, so conversations go on to their later turns (tiny-random's own rarely stop)."""
    model = copy.deepcopy(tiny_target.model)
    eos = tiny_target.tokenizer.eos_token_id
    prompt = prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": "Tell me a story."}])
    mean = tiny_target(torch.tensor([prompt]), logits=False).last_hidden[0].mean(0)  # (H,)
    with torch.no_grad():
        model.lm_head.weight[eos] += 4.0 * mean / mean.pow(2).sum()
    return Target(model, tokenizer=tiny_target.tokenizer, name="tiny-chatty")


@pytest.fixture(scope="module")
def server(chatty):
    standin = StandIn(chatty)
    url = standin.start()
    yield standin, url
    standin.stop()


def prompts_of(tokenizer, conversations=CONVERSATIONS, **kwargs):
    rows = []
    for i, messages in enumerate(conversations):
        first = user_turns(messages)[0]
        rows.append({"id": f"c{i}", "domain": "chat", "subdomain": "t", "messages": messages,
                     "prompt_ids": prompt_ids(tokenizer, first, **kwargs)})
    return rows


GREEDY = SamplingConfig()


def regenerate(target, folder, engine=None, sampling=GREEDY, **kwargs):
    kwargs = {"seed": 0, "progress": False, "max_new_tokens": 12, "n_per_prompt": 1, **kwargs}
    n, max_new = kwargs.pop("n_per_prompt"), kwargs.pop("max_new_tokens")
    prompts = kwargs.pop("prompts", None) or prompts_of(target.tokenizer)
    draw = Draw(sampling, n, max_new, **{k: kwargs.pop(k) for k in ("seed", "max_turns", "max_prompt_tokens",
                                                                    "chat_template_kwargs") if k in kwargs})
    return generate_rollouts(target, prompts, draw, folder, engine=engine, **kwargs)


def test_user_turns_split_a_conversation_at_its_assistant_turns():
    parts = user_turns(CONVERSATIONS[1])
    assert [[m["content"] for m in p] for p in parts] == [["be brief", "What is 2+2?"], ["times 3?"],
                                                         ["and minus one?"]]
    assert user_turns(CONVERSATIONS[3]) == [[CONVERSATIONS[3][0]]]  # a last assistant turn opens no new part


def test_server_regeneration_equals_the_local_engine_turn_by_turn_with_requests_in_flight(chatty, server, tmp_path):
    standin, url = server
    before = standin.most_in_flight
    standin.most_in_flight = 0
    local = regenerate(chatty, tmp_path / "local", LocalEngine(chatty, batch_size=2)).to_list()
    served = regenerate(chatty, tmp_path / "served", ServerEngine(url, concurrency=4)).to_list()
    assert standin.most_in_flight >= 2  # several conversations in flight at once
    standin.most_in_flight = max(before, standin.most_in_flight)
    assert [r["turns"] for r in local] == [2, 3, 1, 1, 2]  # every assistant turn (a finished last one opens none)
    for a, b in zip(local, served):  # greedy: the same tokens, turn by turn
        assert a == b
    tok = chatty.tokenizer
    second = local[1]
    assert second["messages"][:2] == CONVERSATIONS[1][:2]  # the source's system and user turns are kept
    assert second["messages"][2]["role"] == "assistant" and second["messages"][2]["content"] != "4"  # regenerated
    assert second["messages"][2]["content"] == tok.decode(second["response_ids"], skip_special_tokens=True).strip()
    assert [m["content"] for m in second["messages"][3::2]] == ["times 3?", "and minus one?"]
    _, meta = load_rollouts(tmp_path / "served")
    assert meta["engine"] == "server" and meta["server_url"] == url and meta["server_model"] == "standin"
    assert meta["format"] == 2 and meta["target_fingerprint"] == chatty.fingerprint and meta["max_turns"] is None


def test_an_unfinished_turn_ends_its_conversation(tiny_target, tmp_path):
    rows = regenerate(tiny_target, tmp_path / "cut", LocalEngine(tiny_target)).to_list()  # tiny-random rarely stops
    for row in rows:
        assert row["turns"] == 1 and not row["finished"] and len(row["response_ids"]) == 12


def test_turns_are_capped_and_a_later_prompt_past_the_cap_ends_the_conversation(chatty, tmp_path):
    engine, tok = LocalEngine(chatty, batch_size=8), chatty.tokenizer
    capped = regenerate(chatty, tmp_path / "one", engine, max_turns=1).to_list()
    assert [r["turns"] for r in capped] == [1] * len(CONVERSATIONS)
    full = regenerate(chatty, tmp_path / "all", engine).to_list()
    cap = max(len(p["prompt_ids"]) for p in prompts_of(tok))  # every first prompt fits
    short = regenerate(chatty, tmp_path / "short", engine, max_prompt_tokens=cap).to_list()
    for whole, cut in zip(full, short):  # greedy: the same answers until a turn's prompt outgrows the cap
        assistant = [i for i, m in enumerate(whole["messages"]) if m["role"] == "assistant"]
        fits = [len(prompt_ids(tok, whole["messages"][:i])) <= cap for i in assistant]
        assert cut["turns"] == (fits + [False]).index(False)
    assert sum(r["turns"] for r in short) < sum(r["turns"] for r in full)  # the cap cut some conversation short


def test_chat_template_arguments_reach_every_turn(chatty, tmp_path):
    """A template that reads a keyword argument (as Qwen3's reads enable_thinking): the later turns' prompts carry it,
    and the rollouts record it."""
    target = copy.copy(chatty)
    target.tokenizer = copy.deepcopy(chatty.tokenizer)
    target.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{{ flavour | default('') }}{% endif %}")
    kwargs = {"flavour": "[calm]"}
    prompts = prompts_of(target.tokenizer, CONVERSATIONS[:1], **kwargs)
    assert target.tokenizer.decode(prompts[0]["prompt_ids"]).endswith("assistant\n[calm]")
    rows = regenerate(target, tmp_path / "kw", LocalEngine(target), prompts=prompts, chat_template_kwargs=kwargs)
    _, meta = load_rollouts(tmp_path / "kw")
    assert meta["chat_template_kwargs"] == kwargs and rows[0]["turns"] == 2
    with pytest.raises(ValueError, match=r"chat_template_kwargs \{'flavour': '\[calm\]'\}.*\(chat_template_kwargs"):
        regenerate(target, tmp_path / "kw", LocalEngine(target), prompts=prompts)  # resumed without them: refused


def test_a_server_without_return_token_ids_answers_through_logprob_tokens(chatty, tmp_path):
    standin = StandIn(chatty, token_ids=False)
    url = standin.start()
    try:
        rows = regenerate(chatty, tmp_path / "lp", ServerEngine(url)).to_list()
    finally:
        standin.stop()
    local = regenerate(chatty, tmp_path / "local", LocalEngine(chatty)).to_list()
    assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in local]


def test_a_down_server_or_a_wrong_model_is_one_sentence(server):
    _, url = server
    with pytest.raises(ServerError, match=r"^no OpenAI-compatible server answers at --server_url http://127.0.0.1:9 "):
        ServerEngine("http://127.0.0.1:9")
    with pytest.raises(ServerError, match=r"serves \['standin'\], not --server_model 'llama'; pass one of those"):
        ServerEngine(url, model="llama")
    assert ServerEngine(url + "/v1/").model == "standin"  # with or without /v1, the only model by default


def test_the_work_ahead_and_an_estimate_are_printed_before_decoding(chatty, server, tmp_path, capsys):
    _, url = server
    regenerate(chatty, tmp_path / "p", ServerEngine(url), progress=True)
    err = capsys.readouterr().err
    assert "rollouts: 5 of 5 conversations to draw with the server engine (0 stored); 9 turns," in err
    assert "at most 108 tokens to generate; at the probe's pace" in err and "at most ~" in err


def test_the_server_probe_measures_generation_apart_from_a_prefix_cached_prefill(tiny_target, monkeypatch):
    """The estimate's two rates against a stand-in with known simulated costs and a prefix cache, which once made a
    probe that subtracted the first prefill from a cached rerun report a billion tokens/s. The stand-in pays its
    costs on the clock the engine reads (injected), so the rates come out exact on any machine."""
    from helpers.clock import FakeClock

    import lightning_spec.data.engines as engines

    clock = FakeClock()
    monkeypatch.setattr(engines, "time", clock)
    standin = StandIn(tiny_target, delay=0.0, prefill_cost=0.002, token_cost=0.01, clock=clock)
    url = standin.start()
    try:
        prompts = [[1, 2, 3 + i] * 10 for i in range(4)]  # 30 tokens each, never seen by the stand-in
        prefill, per_token = ServerEngine(url, concurrency=4).probe(prompts, SamplingConfig(), [])
    finally:
        standin.stop()
    # seconds per prompt token: 120 prompt tokens at 0.002, with the one token each request generates (4 x 0.01)
    assert prefill == pytest.approx((120 * 0.002 + 4 * 0.01) / 120)
    assert per_token == pytest.approx(0.01)  # seconds per generated token, the cached prefill not subtracted twice


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_a_killed_server_regeneration_resumes_with_nothing_lost_or_written_twice(tiny_target, tmp_path):
    """`lightning-spec rollouts --backend server` killed with SIGKILL while requests are in flight, then rerun: every
    conversation once, the same rows as an uninterrupted run."""
    standin = StandIn(tiny_target, delay=0.3)
    url = standin.start()
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": f"s{i}", "messages": CONVERSATIONS[i % 5]}) + "\n"
                              for i in range(24)))
    common = ["rollouts", "--target=tiny-random", f"--sources=[{source}]", "--prompts_per_source=null",
              "--backend=server", f"--server_url={url}", "--concurrency=4", "--temperature=0.7",
              "--max_new_tokens=10", "--progress=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        folder = tmp_path / "killed"
        proc = subprocess.Popen([sys.executable, "-m", "lightning_spec", *common, f"--out={folder}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while not list((folder / "shards").glob("0*.jsonl")) and time.time() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # with a shard written and requests in flight
        proc.wait()
        assert standin.in_flight > 0 or standin.most_in_flight > 1
        kept = sum(1 for p in (folder / "shards").glob("0*.jsonl") for _ in p.read_text().splitlines())
        assert 0 < kept < 24
        for run in (folder, tmp_path / "whole"):
            done = subprocess.run([sys.executable, "-m", "lightning_spec", *common, f"--out={run}"], env=env,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
    finally:
        standin.stop()
    resumed, whole = load_rollouts(folder)[0].to_list(), load_rollouts(tmp_path / "whole")[0].to_list()
    assert len(resumed) == 24 and len({(r["prompt_id"], r["sample"]) for r in resumed}) == 24
    assert resumed == whole  # each request's seed fixes its tokens: nothing lost, nothing drawn twice
