"""lightning_spec.data: sources, chat templates and loss masks, the data module."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import itertools
import json
from collections import Counter

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lightning_spec import assets
from lightning_spec.data import Source, iter_json_list, load_source, prompt_ids, tokenize_conversation
from lightning_spec.data import sources as sources_module
from lightning_spec.datamodule import SpecDataModule

TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How are you?"},
    {"role": "user", "content": "Fine, and you?"},
    {"role": "assistant", "content": "Good, thanks."},
]


@pytest.fixture(scope="module")
def tiny_tok():
    return AutoTokenizer.from_pretrained(assets.tiny_folder())


@pytest.fixture(scope="module")
def smol_tok():
    return AutoTokenizer.from_pretrained(assets.smollm2_folder())


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_rows(n, domain=None, prefix="q"):
    rows = []
    for i in range(n):
        row = {
            "messages": [
                {"role": "user", "content": f"{prefix} question number {i}?"},
                {"role": "assistant", "content": f"answer {i} from {prefix}."},
            ]
        }
        if domain:
            row["domain"] = domain
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- loss masks


def check_mask(tok, messages, expected_masked_text):
    out = tokenize_conversation(tok, messages, max_length=1024)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == expected_masked_text
    # the header ends right before the first masked token; the first assistant token is in the mask
    first = mask.index(1)
    header = tok.decode(ids[:first])
    assert header.endswith("<|im_start|>assistant\n"), header
    answer = next(m["content"] for m in messages if m["role"] == "assistant")
    assert tok.decode(ids[first : first + 1]) == tok.decode(tok(answer)["input_ids"][:1])
    # each masked run ends on <|im_end|>, and the newline after it is not masked
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    runs_end = [k for k in range(len(mask)) if mask[k] and (k + 1 == len(mask) or not mask[k + 1])]
    assert [ids[k] for k in runs_end] == [eot, eot]
    return ids, mask


def test_loss_mask_tiny_tokenizer(tiny_tok):
    ids, mask = check_mask(tiny_tok, TWO_TURNS, "Hello! How are you?<|im_end|>Good, thanks.<|im_end|>")
    # byte tokenizer: one token per byte, so the count is exact
    assert sum(mask) == len("Hello! How are you?") + len("Good, thanks.") + 2
    assert tiny_tok.eos_token_id == 257


def test_loss_mask_smollm2_default_system_prompt_is_masked_out(smol_tok):
    ids, mask = check_mask(smol_tok, TWO_TURNS, "Hello! How are you?<|im_end|>Good, thanks.<|im_end|>")
    text = smol_tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    system_end = len(smol_tok(text.split("<|im_start|>user")[0], add_special_tokens=False)["input_ids"])
    assert not any(mask[:system_end])
    # an explicit system message replaces the default one and is not learned either
    msgs = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]
    check_mask(smol_tok, msgs, "Hello! How are you?<|im_end|>Good, thanks.<|im_end|>")


def test_loss_mask_truncates(tiny_tok):
    full = tokenize_conversation(tiny_tok, TWO_TURNS, max_length=10_000)
    cut = tokenize_conversation(tiny_tok, TWO_TURNS, max_length=40)
    assert cut["input_ids"] == full["input_ids"][:40]
    assert cut["loss_mask"] == full["loss_mask"][:40]


def test_long_conversation_head_matches_full_tokenization(smol_tok):
    # long texts are tokenized by their head only; the kept tokens must equal the full tokenization's
    long = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok " * 3000}]
    full_ids = smol_tok(smol_tok.apply_chat_template(long, tokenize=False), add_special_tokens=False)["input_ids"]
    for max_length in (16, 600, 3100):
        out = tokenize_conversation(smol_tok, long, max_length)
        assert out["input_ids"] == full_ids[:max_length]
    assert sum(tokenize_conversation(smol_tok, long, 3100)["loss_mask"]) > 0


def test_prompt_ids_end_with_assistant_header(tiny_tok):
    ids = prompt_ids(tiny_tok, TWO_TURNS[:1])
    assert tiny_tok.decode(ids) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------- sources


def test_sharegpt_streams_first_records():
    ds = load_source("sharegpt", limit=20)
    assert len(ds) == 20 and set(ds.column_names) == {"id", "messages", "domain", "subdomain"}
    assert set(ds["domain"]) == {"chat"}
    for messages in ds["messages"]:
        roles = [m["role"] for m in messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert roles[1 if roles[0] == "system" else 0] == "user"
        assert all(m["content"] for m in messages)
    assert ds[0]["id"] == "QWJhYvA_0" and ds[0]["messages"][0]["content"].startswith("Summarize the main ideas")
    # streaming: the first records come without reading the 125 MB file
    first = list(itertools.islice(iter_json_list(assets.sharegpt_file()), 3))
    assert [r["id"] for r in first][0] == "QWJhYvA_0"


def test_truncated_json_parses_complete_records_only(tmp_path, monkeypatch):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with the model"}]},  # dropped
        {"id": "c", "conversations": []},  # dropped
        {
            "id": "d",
            "conversations": [
                {"from": "system", "value": "sys"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "  "},  # empty message dropped
                {"from": "gpt", "value": "r"},
            ],
        },
    ]
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + ',\n  {"id": "e", "conversations": [{"fr'
    path = tmp_path / "truncated.json"
    path.write_text(text)
    assert [r["id"] for r in iter_json_list(path, chunk_chars=7)] == ["a", "b", "c", "d"]
    monkeypatch.setattr(sources_module.assets, "sharegpt_file", lambda: path)
    ds = load_source("sharegpt")
    assert ds["id"] == ["a", "d"]
    assert ds[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert [m["role"] for m in ds[1]["messages"]] == ["system", "user", "assistant"]


def test_mtbench_humaneval_mmath():
    mt = load_source("mt-bench")
    assert len(mt) == 80 and set(mt["domain"]) == {"chat"}
    assert Counter(mt["subdomain"]) == {c: 10 for c in Counter(mt["subdomain"])} and len(set(mt["subdomain"])) == 8
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in mt["messages"])
    he = load_source("humaneval")
    assert len(he) == 164 and set(he["domain"]) == {"code"}
    assert he[0]["messages"][0]["content"].startswith("Complete the following Python function:\n```python\n")
    mm = load_source("mmath")
    assert set(mm["domain"]) == {"math"}
    assert {"MATH500", "AIME2024", "AIME2025"} == set(mm["subdomain"])
    assert load_source(Source("mmath", limit=5)).num_rows == 5


def test_eval_prompts_cover_mtbench_categories(tiny_tok, tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", chat_rows(10))
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[train], eval_prompts_per_domain=8)
    prompts = dm.eval_prompts()
    by_domain = {d: [p for p in prompts if p["domain"] == d] for d in ("chat", "code", "math")}
    assert all(len(v) == 8 for v in by_domain.values()) and len(prompts) == 24
    assert len({p["subdomain"] for p in by_domain["chat"]}) == 8
    assert len({p["subdomain"] for p in by_domain["math"]}) == 3
    p = by_domain["chat"][0]
    assert tiny_tok.decode(p["prompt_ids"]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    again = SpecDataModule(tokenizer=tiny_tok, train_sources=[train], eval_prompts_per_domain=8).eval_prompts()
    assert [q["id"] for q in again] == [q["id"] for q in prompts]  # deterministic


def test_user_files(tmp_path):
    rows = chat_rows(3)
    jsonl = load_source(write_jsonl(tmp_path / "a.jsonl", rows))
    assert len(jsonl) == 3 and jsonl[0]["messages"][1]["role"] == "assistant" and jsonl[0]["domain"] == "chat"

    parquet = tmp_path / "b.parquet"
    datasets.Dataset.from_list([{**r, "domain": "code"} for r in rows]).to_parquet(str(parquet))
    ds = load_source(str(parquet), limit=2)
    assert len(ds) == 2 and set(ds["domain"]) == {"code"}

    sharegpt_style = [{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}]
    ds = load_source(Source(write_jsonl(tmp_path / "c.jsonl", sharegpt_style), domain="legal"))
    assert ds[0]["messages"] == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert ds[0]["domain"] == "legal"

    neither = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match="neither a 'messages' column .* nor a 'conversations' column"):
        load_source(neither)
    with pytest.raises(ValueError, match="sharegpt, mt-bench, humaneval, mmath"):
        load_source("./no/such/file.jsonl")


# ----------------------------------------------------------------------------------------- data module


def test_held_out_prompts_are_dropped_from_training(tiny_tok, tmp_path):
    question = load_source("mt-bench")[0]["messages"][0]["content"]
    leaked = {
        "id": "leak",
        "messages": [
            {"role": "user", "content": "  " + question.replace(" ", "   ") + "\n"},
            {"role": "assistant", "content": "a memorised answer"},
        ],
    }
    path = write_jsonl(tmp_path / "t.jsonl", [leaked, *chat_rows(20)])
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[path], eval_sources=["mt-bench"], val_fraction=0.2)
    dm.setup("fit")
    ids = [e["id"] for e in [*dm.train_dataset, *dm.val_dataset]]
    assert "leak" not in ids and len(ids) == 20
    assert not {e["id"] for e in dm.train_dataset} & {e["id"] for e in dm.val_dataset}
    assert len(dm.val_dataset) == 4
    assert [e["index"] for e in dm.val_dataset] == list(range(4))


def test_empty_and_no_assistant_data_raise(tiny_tok, tmp_path):
    only_model = [{"messages": [{"role": "assistant", "content": "no user turn"}]}] * 3
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[write_jsonl(tmp_path / "e.jsonl", only_model)])
    with pytest.raises(ValueError, match=r"data\.train_sources\[0\] \('.*e\.jsonl'\) gave no usable conversations"):
        dm.setup("fit")
    long_prompt = [
        {"messages": [{"role": "user", "content": "x" * 200 + str(i)}, {"role": "assistant", "content": "y"}]}
        for i in range(3)
    ]
    path = write_jsonl(tmp_path / "l.jsonl", long_prompt)
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[path], eval_sources=[], max_length=64)
    with pytest.raises(ValueError, match=r"data\.max_length=64"):
        dm.setup("fit")


def test_batches_and_domain_weights(tiny_tok, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(60, prefix="chat"))
    code = write_jsonl(tmp_path / "code.jsonl", chat_rows(60, domain="code", prefix="code"))
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[chat, code], eval_sources=[], batch_size=4, seed=1)
    dm.setup("fit")
    assert dm.domains == ["chat", "code"]
    batch = next(iter(dm.train_dataloader()))
    n, s = batch["input_ids"].shape
    assert n == 4 and batch["attention_mask"].shape == batch["loss_mask"].shape == (n, s)
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool and batch["domain_id"].shape == batch["index"].shape == (n,)
    lengths = batch["attention_mask"].sum(1)
    assert int(lengths.max()) == s  # padded to the batch's own longest
    pad = batch["attention_mask"] == 0
    assert (batch["input_ids"][pad] == tiny_tok.pad_token_id).all() and not batch["loss_mask"][pad].any()
    for row, idx in enumerate(batch["index"].tolist()):
        assert torch.equal(batch["input_ids"][row, : lengths[row]], dm.train_dataset[idx]["input_ids"])
    val = next(iter(dm.val_dataloader()))
    assert val["index"].tolist() == list(range(len(val["index"])))

    def code_share():
        ids = torch.cat([b["domain_id"] for b in dm.train_dataloader()])
        assert len(ids) == len(dm.train_dataset)
        return (ids == dm.domains.index("code")).float().mean().item()

    assert 0.4 < code_share() < 0.6  # plain shuffle: every example once
    dm.set_domain_weights({"chat": 1.0, "code": 9.0})
    assert code_share() > 0.75
    dm.set_domain_weights({"chat": 1.0})
    assert code_share() == 0.0
    dm.set_domain_weights(None)
    assert 0.4 < code_share() < 0.6
    with pytest.raises(ValueError, match="unknown domains"):
        dm.set_domain_weights({"poetry": 1.0})


def test_fingerprint_and_token_counts(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", chat_rows(30))

    def build(max_length):
        dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[path], eval_sources=[], max_length=max_length)
        dm.setup("fit")
        return dm

    a, b, c = build(64), build(64), build(48)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 16
    counts = a.token_counts(320)
    assert counts.shape == (320,) and int(counts.sum()) == sum(int(e["loss_mask"].sum()) for e in a.train_dataset)
    assert counts[tiny_tok.eos_token_id] == len(a.train_dataset)  # one <|im_end|> per assistant turn


def test_ddp_shards_interleave_the_one_process_order(tiny_tok, tmp_path):
    from lightning_spec.loaders import DomainSampler

    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(20, prefix="chat"))
    code = write_jsonl(tmp_path / "code.jsonl", chat_rows(21, domain="code", prefix="code"))
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[chat, code], eval_sources=[], seed=3)
    dm.setup("fit")
    n = len(dm.train_dataset)
    assert n % 3 != 0  # 3 ranks need padding
    for weights in (None, {"chat": 1.0, "code": 3.0}):
        dm.set_domain_weights(weights)
        for epoch in (0, 1):
            whole = DomainSampler(dm, seed=3)
            whole.set_epoch(epoch)
            order = list(whole)
            assert len(order) == n
            if weights is None:
                assert sorted(order) == list(range(n))
            for world in (2, 3):
                shards = []
                for rank in range(world):
                    sampler = DomainSampler(dm, seed=3, num_replicas=world, rank=rank)
                    sampler.set_epoch(epoch)
                    shards.append(list(sampler))
                    assert len(shards[-1]) == len(sampler) == -(-n // world)
                padded = (order * 2)[: len(shards[0]) * world]  # wrapped around to equal shards
                assert [x for group in zip(*shards) for x in group] == padded, (weights, epoch, world)
    dm.set_domain_weights(None)
    later = DomainSampler(dm, seed=3)
    later.set_epoch(1)
    assert list(later) != list(DomainSampler(dm, seed=3))  # every epoch its own order
    with pytest.raises(ValueError):  # torch's own check: a rank outside the world
        DomainSampler(dm, seed=3, num_replicas=2, rank=2)


def test_train_loader_resumes_mid_epoch(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", chat_rows(30))
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[path], eval_sources=[], batch_size=4, seed=2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.state_dict() == {"epoch": 0, "batches": 0, "domain_weights": None}
    loader.sampler.set_epoch(1)
    full = [b["index"].tolist() for b in loader]
    assert len(full) == len(loader) >= 4
    loader.sampler.set_epoch(1)
    it = iter(loader)
    seen = [next(it)["index"].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert seen == full[:3] and state == {"epoch": 1, "batches": 3, "domain_weights": None}

    resumed = dm.train_dataloader()  # a fresh process: same data, the checkpoint's state
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)
    rest = [b["index"].tolist() for b in resumed]
    assert rest == full[3:]  # the epoch continues where it stopped, nothing repeated or lost
    assert resumed.state_dict() == {"epoch": 1, "batches": len(full), "domain_weights": None}
    resumed.sampler.set_epoch(2)
    assert len(list(resumed)) == len(full)  # the next epoch is whole

    ended = dm.train_dataloader()  # a checkpoint written at the end of epoch 1: epoch 2 is not cut short
    ended.load_state_dict({"epoch": 1, "batches": len(full)})
    ended.sampler.set_epoch(2)
    assert len(list(ended)) == len(full)


def test_train_loader_resumes_the_order_drawn_before_the_weights_changed(tiny_tok, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16, prefix="chat"))
    code = write_jsonl(tmp_path / "code.jsonl", chat_rows(16, domain="code", prefix="code"))
    dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[chat, code], eval_sources=[], batch_size=4, seed=2)
    dm.setup("fit")
    dm.set_domain_weights({"chat": 1.0, "code": 3.0})
    loader = dm.train_dataloader()
    full = [b["index"].tolist() for b in loader]  # epoch 0
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 2, "domain_weights": {"chat": 1.0, "code": 3.0}}
    dm.set_domain_weights({"chat": 1.0})  # a mid-epoch validation re-weighted; the checkpoint holds these
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in resumed] == full[2:]  # the interrupted order, not one with chat only
    resumed.sampler.set_epoch(1)
    assert {dm.train_dataset[i]["domain"] for b in resumed for i in b["index"].tolist()} == {"chat"}  # then the new


# ------------------------------------------------------------------------------------- the tokenised set


def test_a_second_data_module_loads_the_tokenised_set_instead_of_tokenising(tiny_tok, tmp_path, monkeypatch):
    """Tokenising runs once per sources + tokenizer + max_length (datasets.map, saved as Arrow); the next run loads
    it, identical example for example, and a changed file is tokenised again."""
    import lightning_spec.datamodule as datamodule_module

    path = tmp_path / "t.jsonl"
    write_jsonl(path, chat_rows(12))

    def build():
        dm = SpecDataModule(tokenizer=tiny_tok, train_sources=[str(path)], eval_sources=[], max_length=64)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    first = build()
    calls = []
    real = datamodule_module.tokenize_conversation
    monkeypatch.setattr(datamodule_module, "tokenize_conversation", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = build()
    assert calls == []  # loaded, not tokenised
    assert second.fingerprint == first.fingerprint
    for a, b in zip([*first.train_dataset, *first.val_dataset], [*second.train_dataset, *second.val_dataset]):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["id"] == b["id"] and a["index"] == b["index"] and a["domain_id"] == b["domain_id"]
    write_jsonl(path, chat_rows(13))  # another file: another set
    third = build()
    assert len(calls) == 13 and third.fingerprint != first.fingerprint


def test_tokenising_in_several_processes_gives_the_same_set(tiny_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", chat_rows(20))
    one, two = (SpecDataModule(tokenizer=tiny_tok, train_sources=[path], eval_sources=[], max_length=64, num_proc=n,
                               seed=3) for n in (1, 2))
    two._cache_key = lambda: "another-key"  # noqa: B023 (not the first one's cached set)
    one.setup("fit")
    two.setup("fit")
    assert [e["input_ids"].tolist() for e in one.train_dataset] == [e["input_ids"].tolist() for e in two.train_dataset]
    assert one.fingerprint == two.fingerprint


def test_chat_template_arguments_reach_training_conversations_and_eval_prompts(tiny_tok, tmp_path):
    import copy

    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{{ mood | default('') }}{% endif %}"
                         "{{ '' if add_generation_prompt else mood | default('') }}")
    path = write_jsonl(tmp_path / "t.jsonl", chat_rows(6))
    dm = SpecDataModule(tokenizer=tok, train_sources=[path], eval_sources=["mt-bench"], max_length=96,
                        eval_prompts_per_domain=1, target_options={"chat_template_kwargs": {"mood": "[calm]"}})
    dm.setup("fit")
    assert tok.decode(dm.eval_prompts()[0]["prompt_ids"]).endswith("assistant\n[calm]")
    assert tok.decode(dm.train_dataset[0]["input_ids"]).endswith("[calm]")
    plain = SpecDataModule(tokenizer=tok, train_sources=[path], eval_sources=["mt-bench"], max_length=96)
    plain.setup("fit")
    assert plain.fingerprint != dm.fingerprint  # another template rendering: another set


def test_a_streamed_source_reads_only_what_the_limit_asks_for(tmp_path):
    rows = chat_rows(50)
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    streamed = load_source(Source(path, streaming=True, limit=3))
    assert [r["messages"] for r in streamed.to_list()] == [r["messages"] for r in rows[:3]]
    assert isinstance(sources_module._load_ordinary(Source(path, streaming=True)), datasets.IterableDataset)


def test_a_tokenised_set_another_process_saved_first_is_the_one_kept(tmp_path, monkeypatch):
    """Two processes building the same tokenised set (two sweep workers starting together): the one whose rename
    comes second keeps the first one's folder and removes its own copy, instead of failing on the rename. The other
    process's folder appears while this one builds, and any look at it just before the rename misses it (the race
    a check-then-rename loses)."""
    from pathlib import Path

    from lightning_spec.data.tokenized import FEATURES, META_FILE, tokenized_set

    rows = datasets.Dataset.from_dict({"id": ["a"], "domain": ["chat"], "key": ["a"], "input_ids": [[1, 2, 3]],
                                      "loss_mask": [[False, True, True]]}).cast(FEATURES)
    folder = tmp_path / "set"
    built = []

    def read():  # the other process builds and saves the set while this one is still reading
        if not built:
            built.append(tokenized_set("k", lambda: [(rows, None)], folder=folder))
        return [(rows, None)]

    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self, **kw: False if self == folder else exists(self, **kw))
    table, meta = tokenized_set("k", read, folder=folder)
    assert meta == built[0][1] and table["input_ids"] == [[1, 2, 3]] and (folder / META_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["set"]  # this build's own copy was removed
