"""Target rollouts: batched left-padded decoding equals ``generate``, seeded per rollout, resumable after a kill,
refused under another target or sampling config, and usable as training data (target-regenerated SFT)."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import run_main

from lightning_spec import SamplingConfig, generate
from lightning_spec.data import engines as E
from lightning_spec.data import prompt_ids
from lightning_spec.data import rollout_writer as W
from lightning_spec.data import rollouts as R
from lightning_spec.data.rollout_archive import read_header, unpacked, write_archive
from lightning_spec.data.rollout_writer import Draw, generate_rollouts, rollout_seed
from lightning_spec.data.rollouts import check_compatible, is_rollouts_folder, load_rollout_set, load_rollouts
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.errors import UserError

# Openings of very different lengths, so one batch mixes short and long prompts (left padding is exercised).
TEXTS = [
    "hi",
    "What is 2+2?",
    "a much longer question about many things, with several clauses, ok?",
    "xxxxx",
    "Tell me a story about a dragon and a knight.",
    "Why?",
]
SAMPLED = SamplingConfig(temperature=1.0, top_k=50)
T1 = SamplingConfig(temperature=1.0)
DRAW_KEYS = ("seed", "max_turns", "max_prompt_tokens", "chat_template_kwargs")  # Draw's, not the run's


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [
        {
            "id": f"p{i}",
            "domain": "code" if i % 2 else "chat",
            "subdomain": f"s{i % 3}",
            "prompt_ids": prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": text}]),
        }
        for i, text in enumerate(TEXTS)
    ]


def run(target, prompts, folder, sampling=SAMPLED, n=2, max_new_tokens=24, **kwargs):
    kwargs = {"seed": 0, "batch_size": 4, "progress": False, **kwargs}
    draw = Draw(sampling, n, max_new_tokens, **{k: kwargs.pop(k) for k in DRAW_KEYS if k in kwargs})
    return generate_rollouts(target, prompts, draw, folder, **kwargs)


# ------------------------------------------------------------------------------------------ correctness


def test_greedy_batched_rollouts_equal_generate_and_flag_finished(tiny_target, prompts, tmp_path):
    """Left padding done right: every row of one mixed-length batch decodes exactly what ``generate`` does,
    including rows that stop at EOS while the others go on."""
    max_new = 32
    ds = run(tiny_target, prompts, tmp_path / "g", SamplingConfig(), n=1, max_new_tokens=max_new, batch_size=8)
    assert len({len(p["prompt_ids"]) for p in prompts}) == len(prompts)  # all lengths differ
    eos = set(tiny_target.eos_token_ids)
    for p, row in zip(prompts, ds):
        assert row["prompt_id"] == p["id"] and row["prompt_ids"] == p["prompt_ids"] and row["sample"] == 0
        assert row["domain"] == p["domain"] and row["subdomain"] == p["subdomain"]
        assert row["response_ids"] == generate(tiny_target, p["prompt_ids"], max_new).tokens
        # finished = ended with EOS; otherwise the budget was hit
        assert row["finished"] == (row["response_ids"][-1] in eos)
        assert row["finished"] or len(row["response_ids"]) == max_new
    flags = ds["finished"]
    assert any(flags) and not all(flags), "the fixture should have rows that stop at EOS and rows that do not"
    assert min(len(r) for r in ds["response_ids"]) < max_new  # a short row left the batch early


def test_a_run_ends_with_a_summary_of_what_the_folder_holds(tiny_target, prompts, tmp_path, capsys):
    """Answers, the share ended by EOS, the mean answer length and the tokens drawn: what to check after hours."""
    ds = run(tiny_target, prompts, tmp_path / "sum", SamplingConfig(), n=1, max_new_tokens=32, progress=True)
    err = capsys.readouterr().err
    n, eos = len(ds), sum(ds["finished"])
    mean = sum(map(len, ds["response_ids"])) / n
    assert f"rollouts: {n} in {tmp_path / 'sum'} ({eos} first turns ended with EOS ({eos / n:.0%}), " in err
    assert f"first answers {mean:.1f} tokens on average" in err and "tokens drawn this run at " in err


def test_finished_is_false_at_the_token_budget(tiny_target, prompts, tmp_path):
    ds = run(tiny_target, prompts[:3], tmp_path / "short", SamplingConfig(), n=1, max_new_tokens=3)
    eos = set(tiny_target.eos_token_ids)
    for row in ds:
        assert len(row["response_ids"]) <= 3
        if row["response_ids"][-1] not in eos:
            assert not row["finished"] and len(row["response_ids"]) == 3


def test_sampled_rollouts_are_reproducible_and_independent_of_the_batch(tiny_target, prompts, tmp_path):
    a = run(tiny_target, prompts, tmp_path / "a", batch_size=5).to_list()
    b = run(tiny_target, prompts, tmp_path / "b", batch_size=1).to_list()
    c = run(tiny_target, prompts, tmp_path / "c", batch_size=12).to_list()
    assert a == b == c
    assert [(r["prompt_id"], r["sample"]) for r in a] == [(p["id"], s) for p in prompts for s in range(2)]
    # each rollout is exactly `generate` with its own seed (sampling mode, left padding included)
    for row in a[:4]:
        prompt = next(p for p in prompts if p["id"] == row["prompt_id"])
        seed = rollout_seed(0, row["prompt_id"], row["sample"])
        assert row["response_ids"] == generate(tiny_target, prompt["prompt_ids"], 24, SAMPLED, seed=seed).tokens
    # the two samples of a prompt differ, and another seed draws other tokens
    assert a[0]["response_ids"] != a[1]["response_ids"]
    other = run(tiny_target, prompts, tmp_path / "d", seed=1).to_list()
    assert [r["response_ids"] for r in other] != [r["response_ids"] for r in a]


# ------------------------------------------------------------------------------------------------ resume


def test_a_killed_run_resumes_to_the_same_dataset(tiny_target, prompts, tmp_path, monkeypatch):
    reference = run(tiny_target, prompts, tmp_path / "ref", batch_size=3).to_list()

    folder = tmp_path / "killed"
    real_write = W._write_shard
    written = []

    def write_then_die(shard_dir, index, rows):
        path = real_write(shard_dir, index, rows)
        written.extend((r["prompt_id"], r["sample"]) for r in rows)
        if len(written) >= 6:  # killed after the second shard (3 rollouts each)
            (shard_dir / f"{index + 1:05d}.jsonl.tmp").write_text('{"half a li')  # and mid-way through the third
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(W, "_write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_target, prompts, folder, batch_size=3)
    monkeypatch.setattr(W, "_write_shard", real_write)
    assert len(written) == 6 and not (folder / R.META_FILE).exists()
    with pytest.raises(ValueError, match="unfinished rollouts run"):
        load_rollouts(folder)

    # the rerun draws only what is missing, with another batch size, and ends where one run would have
    drawn = []
    real_sample = E.sample_batch

    def counting(target, batch_prompts, *args, **kwargs):
        drawn.append(len(batch_prompts))
        return real_sample(target, batch_prompts, *args, **kwargs)

    monkeypatch.setattr(E, "sample_batch", counting)
    resumed = run(tiny_target, prompts, folder, batch_size=4).to_list()
    assert sum(drawn) == len(reference) - 6
    assert resumed == reference
    ds, meta = load_rollouts(folder)
    assert ds.to_list() == reference and len({(r["prompt_id"], r["sample"]) for r in reference}) == len(reference)
    assert meta["format"] == 2 and meta["n_per_prompt"] == 2 and meta["target"] == "tiny-random"
    assert meta["target_fingerprint"] == tiny_target.fingerprint and meta["seed"] == 0
    assert meta["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
    assert meta["eos_token_ids"] == tiny_target.eos_token_ids and meta["vocab_size"] == tiny_target.vocab_size
    assert not list((folder / R.SHARD_DIR).glob("*.tmp"))

    # the same command with more samples extends the finished folder: only the new samples are drawn
    drawn.clear()
    more = run(tiny_target, prompts, folder, n=3, batch_size=4).to_list()
    assert sum(drawn) == len(prompts)
    assert [r for r in more if r["sample"] < 2] == reference


def test_a_resumed_run_redraws_every_answer_whose_prompt_changed(tiny_target, prompts, tmp_path, monkeypatch):
    """Rerun into a finished folder after one prompt's ids changed under the same id (a new chat template, say): that
    prompt's samples are drawn again for its new ids, every other answer is kept as it was (issue 46)."""
    folder = tmp_path / "changed"
    first = run(tiny_target, prompts, folder, batch_size=4).to_list()
    edited = [dict(p) for p in prompts]
    edited[2]["prompt_ids"] = edited[2]["prompt_ids"][:8] + edited[2]["prompt_ids"][12:]  # same id, 4 tokens fewer
    assert edited[2]["prompt_ids"] != prompts[2]["prompt_ids"]
    drawn = []
    real_sample = E.sample_batch

    def counting(target, batch_prompts, *args, **kwargs):
        drawn.extend(map(list, batch_prompts))
        return real_sample(target, batch_prompts, *args, **kwargs)

    monkeypatch.setattr(E, "sample_batch", counting)
    again = run(tiny_target, edited, folder, batch_size=4).to_list()
    assert drawn == [edited[2]["prompt_ids"]] * 2  # its two samples, and nothing else
    assert [r for r in again if r["prompt_id"] != "p2"] == [r for r in first if r["prompt_id"] != "p2"]
    redrawn = [r for r in again if r["prompt_id"] == "p2"]
    assert [r["prompt_ids"] for r in redrawn] == [edited[2]["prompt_ids"]] * 2
    for row in redrawn:  # what a fresh run would draw for the new prompt
        seed = rollout_seed(0, "p2", row["sample"])
        assert row["response_ids"] == generate(tiny_target, edited[2]["prompt_ids"], 24, SAMPLED, seed=seed).tokens


def test_refuses_to_resume_under_other_settings(tiny_target, prompts, tmp_path):
    folder = tmp_path / "r"
    run(tiny_target, prompts[:2], folder, n=1, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"sampling differ\) — choose another --out"):
        run(tiny_target, prompts[:2], folder, SamplingConfig(temperature=0.7), n=1, max_new_tokens=4)
    with pytest.raises(ValueError, match="seed, max_new_tokens differ"):
        run(tiny_target, prompts[:2], folder, n=1, max_new_tokens=5, seed=3)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a rollouts folder"):
        run(tiny_target, prompts[:2], tmp_path / "busy", n=1, max_new_tokens=4)


def test_rollouts_of_another_target_or_sampling_are_refused(tiny_target, prompts, tmp_path, make_random_llama):
    folder = tmp_path / "r"
    run(tiny_target, prompts[:2], folder, n=1, max_new_tokens=4)
    _, meta = load_rollouts(folder)
    check_compatible(meta, tiny_target, SAMPLED)  # the same: fine
    with pytest.raises(ValueError, match=r"drawn from target 'tiny-random' .* regenerate them with `lightning-spec"):
        check_compatible(meta, make_random_llama(), SAMPLED)
    with pytest.raises(ValueError, match=r"temperature=1.0, top_p=1.0, top_k=50; this run uses temperature=1.0, "):
        check_compatible(meta, tiny_target, SamplingConfig(temperature=1.0), folder=str(folder))
    # all greedy configs are one distribution
    greedy = {**meta, "sampling": {"temperature": 0.0, "top_p": 0.9, "top_k": 5}}
    check_compatible(greedy, tiny_target, SamplingConfig())


# ---------------------------------------------------------------------------------------- training data


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def sft_folder(tiny_target, prompts, tmp_path):
    folder = tmp_path / "sft"
    run(tiny_target, prompts, folder, SamplingConfig(), n=1, max_new_tokens=32)
    # one rollout prompt is also an eval prompt: it must not train
    eval_file = write_jsonl(
        tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": TEXTS[1]}], "domain": "math"}]
    )
    return folder, eval_file


def trained_on(source, eval_file) -> tuple[SpecDataModule, list[dict]]:
    """The data module of a fit on ``source`` (100 tokens per example, a fifth held out) and all its examples."""
    dm = SpecDataModule(target="tiny-random", train_sources=[str(source)], eval_sources=[eval_file], train_limit=None,
                        max_length=100, val_fraction=0.2, eval_prompts_per_domain=1)
    dm.setup("fit")
    return dm, [*dm.train_dataset, *dm.val_dataset]


def test_datamodule_trains_on_rollouts_with_the_response_masked_in(sft_folder, prompts):
    folder, eval_file = sft_folder
    ds, _ = load_rollouts(folder)
    dm, examples = trained_on(folder, eval_file)
    by_id = {f"{r['prompt_id']}#{r['sample']}": r for r in ds}
    assert sorted(e["id"] for e in examples) == sorted(k for k in by_id if not k.startswith("p1#"))  # held out
    assert len(by_id["p2#0"]["prompt_ids"]) + len(by_id["p2#0"]["response_ids"]) > 100  # one is truncated
    for e in examples:
        row = by_id[e["id"]]
        ids = (row["prompt_ids"] + row["response_ids"])[:100]
        mask = ([0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"]))[:100]
        assert e["input_ids"].tolist() == ids and e["loss_mask"].tolist() == [bool(m) for m in mask]
        assert e["domain"] == row["domain"]
        if row["finished"] and len(row["prompt_ids"]) + len(row["response_ids"]) <= 100:
            assert e["input_ids"][-1] in dm.tokenizer.convert_tokens_to_ids(["<|im_end|>"]) and e["loss_mask"][-1]
    assert set(dm.domains) == {"chat", "code", "math"}
    assert dm.rollout_meta[0]["folder"] == str(folder) and dm.rollout_meta[0]["target"] == "tiny-random"


def test_datamodule_refuses_rollouts_of_another_target(sft_folder):
    folder, eval_file = sft_folder
    dm = SpecDataModule(target="another-target", train_sources=[str(folder)], eval_sources=[eval_file])
    with pytest.raises(ValueError, match=r"data.train_sources\[0\] .* drawn from target 'tiny-random'.*data.target"):
        dm.rollout_meta  # noqa: B018
    with pytest.raises(ValueError, match="is a rollouts folder"):
        SpecDataModule(target="tiny-random", train_sources=["x.jsonl"], eval_sources=[str(folder)]).eval_prompts()


def test_fit_on_rollouts_checks_the_target_weights(sft_folder, tmp_path):
    import lightning as L

    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule

    folder, eval_file = sft_folder

    def fit(source):
        torch.manual_seed(0)
        dm = SpecDataModule(
            target="tiny-random",
            train_sources=[str(source)],
            eval_sources=[eval_file],
            train_limit=None,
            max_length=64,
            batch_size=2,
            val_fraction=0.2,
        )
        module = DraftModule(
            DFlashDrafter(block_size=3, num_layers=1, num_anchors=4), target="tiny-random", feature_cache="off"
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, datamodule=dm)
        return trainer

    assert fit(folder).global_step == 1
    forged = tmp_path / "forged"
    shutil.copytree(folder, forged)
    meta = json.loads((forged / R.META_FILE).read_text())
    (forged / R.META_FILE).write_text(json.dumps({**meta, "target_fingerprint": "0123456789abcdef"}))
    with pytest.raises(ValueError, match="fingerprint 0123456789abcdef, but model.target has fingerprint"):
        fit(forged)


def test_cli_writes_a_rollouts_folder(tmp_path, monkeypatch, capsys):
    from lightning_spec.cli import main

    source = write_jsonl(
        tmp_path / "q.jsonl",
        [{"messages": [{"role": "user", "content": t}], "domain": "chat"} for t in TEXTS[:3]],
    )
    out = tmp_path / "cli"
    args = [
        "rollouts",
        "--target",
        "tiny-random",
        "--sources",
        f"[{source}]",
        "--prompts_per_source",
        "2",
        "--n_per_prompt",
        "2",
        "--max_new_tokens",
        "8",
        "--target_options",
        "{chat_template_kwargs: {flavour: calm}}",  # model.target_options' form: they reach every prompt's template
        "--out",
        str(out),
        "--batch_size",
        "3",
        "--temperature",
        "0.8",
        "--progress",
        "false",
    ]
    main(args)
    ds, meta = load_rollouts(out)
    assert len(ds) == 4 and meta["sources"] == [source] and meta["sampling"]["temperature"] == 0.8
    assert meta["chat_template_kwargs"] == {"flavour": "calm"}
    with pytest.raises(SystemExit) as exit_:
        main([*args[:-4], "--temperature", "0.5", "--progress", "false"])
    assert exit_.value.code == 2 and "choose another --out" in capsys.readouterr().err


def test_more_prompts_per_source_keep_the_smaller_selection_as_their_prefix(tiny_target, tmp_path):
    """400 then 600 prompts of a large source (pools of 4000 and 6000 rows, a length cap in between): the 600 start
    with the 400, so a regeneration extended from 400 to 600 draws only new prompts. (A shuffle of the whole pool
    kept 20 of 400.)"""
    from lightning_spec.data.prompts import select_prompts

    rows = [{"id": str(i), "messages": [{"role": "user", "content": "word " * (1 + i % 29)}], "domain": "chat"}
            for i in range(6500)]
    source = write_jsonl(tmp_path / "many.jsonl", rows)

    def ids(n: int) -> list[str]:
        return [p["id"] for p in select_prompts(tiny_target.tokenizer, [source], n, seed=0, max_prompt_tokens=100)]

    small, large = ids(400), ids(600)
    assert large[:400] == small and len(set(large)) == 600
    assert small != sorted(small, key=int)  # still shuffled


def test_select_prompts_skips_prompts_longer_than_max_prompt_tokens(tiny_target, tmp_path):
    from lightning_spec.data.prompts import select_prompts

    texts = ["hi", "a much longer question " * 8, "ok?", "another long one, " * 10]
    source = write_jsonl(
        tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": t}], "domain": "chat"} for t in texts]
    )
    everything = select_prompts(tiny_target.tokenizer, [source], None, seed=0)
    lengths = sorted(len(p["prompt_ids"]) for p in everything)
    limit = lengths[1]  # the two short prompts fit, the two long ones do not
    assert lengths[2] > limit
    kept = select_prompts(tiny_target.tokenizer, [source], None, seed=0, max_prompt_tokens=limit)
    assert len(kept) == 2 and all(len(p["prompt_ids"]) <= limit for p in kept)
    assert [p["prompt_ids"] for p in kept] == [p["prompt_ids"] for p in everything if len(p["prompt_ids"]) <= limit]
    with pytest.raises(ValueError, match="max_prompt_tokens=3 tokens; raise it"):
        select_prompts(tiny_target.tokenizer, [source], None, seed=0, max_prompt_tokens=3)


# --------------------------------------------------------------------------------- rollouts --out unwritable
def test_rollouts_out_that_cannot_be_written_is_refused_before_any_decoding(tiny_target, tmp_path, monkeypatch,
                                                                            capsys):
    """Was found only when the first shard was written, after the target was loaded and a batch decoded."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "rollouts"  # its parent is a file: nothing can be created there (even as root)

    def refuse(*args, **kwargs):
        raise AssertionError("--out must be checked before the target is loaded or anything decoded")

    monkeypatch.setattr(W, "load_target", refuse)
    monkeypatch.setattr(E, "sample_batch", refuse)
    code, err = run_main(["rollouts", "--target", "tiny-random", "--out", str(out), "--progress", "false"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"--out '{out}' cannot be written" in last and "pick a folder you can write to" in last, last

    with pytest.raises(ValueError, match=r"--out '.*' cannot be written"):  # the Python API checks it too
        generate_rollouts(tiny_target, [[1, 2, 3]], Draw(T1, 1, 4), out, progress=False)
    with pytest.raises(ValueError, match="is a file; name a folder"):
        generate_rollouts(tiny_target, [[1, 2, 3]], Draw(T1, 1, 4), blocker, progress=False)


def test_a_batch_of_one_is_generate_on_the_fast_path(tiny_target, prompts, monkeypatch):
    """One conversation at a time (``--batch_size 1``, what a served comparison one request at a time runs) needs no
    padding: it decodes with ``generate`` on the target's static-cache path, never the left-padded batch."""
    from lightning_spec.decoding.batched import sample_batch
    from lightning_spec.target import Target

    def padded(*args, **kwargs):
        raise AssertionError("a batch of one ran the left-padded path")

    prompt = prompts[0]["prompt_ids"]
    want = generate(tiny_target, prompt, 12, SAMPLED, seed=3).tokens
    monkeypatch.setattr(Target, "forward_left_padded", padded)
    (tokens, finished), = sample_batch(tiny_target, [prompt], [3], SAMPLED, 12)
    assert tokens == want and finished == (tokens[-1] in set(tiny_target.eos_token_ids))


# ------------------------------------------------------------------------------- a folder packed into one file
# A rollouts folder packed into one .rollouts.jsonl.gz file (kept in the repository for the testbed's regenerated
# answers) reads exactly as the folder: the same rows, the same record, the same training examples.


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SPEC_CACHE", str(tmp_path / "cache"))


def test_an_archive_reads_as_its_folder_row_for_row(sft_folder, tmp_path, own_cache):
    folder, _ = sft_folder
    path = write_archive(folder, tmp_path / "kept.rollouts.jsonl.gz", provenance={"server": {"dtype": "bfloat16"}})
    assert is_rollouts_folder(path) and not is_rollouts_folder(tmp_path / "missing.rollouts.jsonl.gz")
    (ds, meta), (packed, packed_meta) = load_rollouts(folder), load_rollouts(path)
    assert packed.to_list() == ds.to_list() and packed.features == ds.features and packed_meta == meta
    header = read_header(path)
    assert header["rows"] == len(ds) and header["provenance"] == {"server": {"dtype": "bfloat16"}}
    assert header["rollouts"]["target_fingerprint"] == meta["target_fingerprint"]
    assert load_rollout_set(path).response_ids == load_rollout_set(folder).response_ids
    again = write_archive(folder, tmp_path / "again.rollouts.jsonl.gz", provenance={"server": {"dtype": "bfloat16"}})
    assert again.read_bytes() == path.read_bytes()  # deterministic: a repacked folder shows no diff
    assert unpacked(path) == unpacked(again)  # unpacked once, by content


def test_a_fit_trains_on_an_archive_as_on_its_folder(sft_folder, tmp_path, own_cache):
    folder, eval_file = sft_folder
    path = write_archive(folder, tmp_path / "kept.rollouts.jsonl.gz")
    rows = {}
    for source in (folder, path):
        dm, examples = trained_on(source, eval_file)
        rows[source] = sorted((e["id"], e["input_ids"].tolist(), e["loss_mask"].tolist()) for e in examples)
        assert dm.rollout_meta[0]["folder"] == str(source)
    assert rows[path] == rows[folder] and len(rows[folder]) > 0


def test_a_bad_name_or_a_truncated_archive_is_one_sentence(sft_folder, tmp_path, own_cache):
    folder, _ = sft_folder
    with pytest.raises(UserError, match=r"ends with \.rollouts\.jsonl\.gz"):
        write_archive(folder, tmp_path / "kept.jsonl.gz")
    path = write_archive(folder, tmp_path / "kept.rollouts.jsonl.gz")
    with gzip.open(path, "rt") as f:
        lines = f.readlines()
    with gzip.open(tmp_path / "cut.rollouts.jsonl.gz", "wt") as f:
        f.writelines(lines[:-1])
    with pytest.raises(UserError, match="truncated"):
        load_rollouts(tmp_path / "cut.rollouts.jsonl.gz")
    with gzip.open(tmp_path / "old.rollouts.jsonl.gz", "wt") as f:
        f.write(json.dumps({"archive": 99}) + "\n")
    with pytest.raises(UserError, match="not a rollouts archive of format 1"):
        load_rollouts(tmp_path / "old.rollouts.jsonl.gz")


def test_the_rollouts_command_packs_what_it_drew(tiny_target, tmp_path, own_cache):
    from lightning_spec.data.rollout_writer import Rollouts

    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"say {i}"}]} for i in range(3)]
    )
    command = Rollouts(
        out=str(tmp_path / "r"),
        target="tiny-random",
        sources=[prompts],
        temperature=0,
        max_new_tokens=4,
        progress=False,
        archive=str(tmp_path / "r.rollouts.jsonl.gz"),
    )
    drawn = command.run()
    assert load_rollouts(tmp_path / "r.rollouts.jsonl.gz")[0].to_list() == drawn.to_list()
    with pytest.raises(UserError, match="--archive x.gz must end with .rollouts.jsonl.gz"):
        Rollouts(out=str(tmp_path / "s"), archive="x.gz").check()


def test_an_archive_records_the_fingerprint_every_machine_computes(sft_folder, tiny_target, tmp_path, own_cache):
    """A folder drawn before the fingerprint left the folder path out records the path-dependent one; packed with its
    target, the archive records the one another machine computes; packed with other weights, it is refused."""
    folder, _ = sft_folder
    meta = json.loads((folder / "rollouts.json").read_text())
    (folder / "rollouts.json").write_text(json.dumps({**meta, "target_fingerprint": tiny_target.fingerprints[1]}))
    path = write_archive(folder, tmp_path / "kept.rollouts.jsonl.gz", target=tiny_target)
    assert read_header(path)["rollouts"]["target_fingerprint"] == tiny_target.fingerprint
    from conftest import random_llama

    with pytest.raises(UserError, match="pack it with the target it was drawn from"):
        write_archive(folder, tmp_path / "other.rollouts.jsonl.gz", target=random_llama())


KEPT = Path(__file__).resolve().parents[2] / "regenerated"


@pytest.mark.parametrize("path", sorted(KEPT.glob("*.rollouts.jsonl.gz")), ids=lambda p: p.name)
def test_every_kept_regeneration_is_whole_small_and_says_how_it_was_drawn(path):
    header = read_header(path)
    assert path.stat().st_size <= 20e6  # the repository's allowance for kept data
    meta, drawn = header["rollouts"], header["provenance"]
    assert meta["target"] == "smollm2-135m-instruct" and meta["sampling"]["temperature"] == 0
    assert {"name", "version", "dtype"} <= set(drawn["engine"]) and drawn["cpu"]
    with gzip.open(path, "rt") as f:
        assert sum(1 for _ in f) == header["rows"] + 1  # not truncated


@pytest.mark.slow  # loads SmolLM2
def test_the_kept_regeneration_matches_the_packaged_target_on_this_machine():
    """The archive recorded SmolLM2's fingerprint where it was drawn; a fit here (another cache path on CI) must
    compute the same one, or every testbed run on the kept answers is refused."""
    from lightning_spec import load_target

    target = load_target("smollm2-135m-instruct")
    kept = sorted(KEPT.glob("*.rollouts.jsonl.gz"))
    assert kept, "regenerated/ holds no kept regeneration: the testbed's --regenerate 5638 would draw it again"
    for path in kept:
        assert read_header(path)["rollouts"]["target_fingerprint"] == target.fingerprint, path.name
