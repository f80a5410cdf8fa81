"""The benchmark scripts run end to end on the packaged tiny target (their figures come from SmolLM2 runs in
benchmarks/README.md; here only that they run and print what they promise)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers.benchmarks import run_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_decode_speed_compares_chain_tree_and_plain():
    out = run_benchmark("decode_speed.py", "--target", "tiny-random", "--prompts", "2", "--max-new-tokens", "8",
                        "--repeats", "2", "--no-peers", "--plan", "{kind: tree, nodes: 6, top_k: 2}", "--threads", "1",
                        "--auto-dtypes", "float32", "bfloat16")
    assert "speculative / plain tokens/s" in out and "tree / chain" in out
    assert "greedy outputs identical on 2/2 prompts" in out  # chain and tree both
    assert "tree of 6+1 tokens (verify)" in out
    # the n-gram modes and decoding auto's pick, in one table with the mode statement and engine efficiency
    for mode in ("n-gram lookup (K=10)", "n-gram trie (6 nodes, top 2)", "tree + n-gram (2 of 6 nodes)", "auto: "):
        assert f"\n  {mode}" in out, mode
    assert "float32: greedy identity guaranteed" in out
    assert "decoding auto: " in out and ("; measured " in out or "plain against itself measured " in out)
    # auto searched both dtypes: every plan in each, judged against the faster plain decoding, which has a row
    assert "  chain, bfloat16 " in out and "  chain, float32 " in out
    baseline = "bfloat16" if "speedup over plain bfloat16" in out else "float32"
    assert f"speedup over plain {baseline}" in out and (baseline == "float32" or "\n  plain bfloat16 " in out)


def test_decode_speed_times_plain_decoding_in_the_dtype_auto_judged_against():
    """A bfloat16 target with auto searching float32 alone: the baseline auto judged against is plain float32, which
    gets a row of its own, and auto's pick decodes in float32, named so."""
    out = run_benchmark("decode_speed.py", "--target", "tiny-random", "--dtype", "bfloat16", "--prompts", "1",
                        "--max-new-tokens", "8", "--repeats", "2", "--no-peers", "--ngram", "0", "--threads", "1",
                        "--auto-dtypes", "float32")
    assert "speedup over plain float32" in out and "\n  plain float32 " in out
    assert "\n  auto: " in out and "decoding auto: " in out and "float32)" in out


def test_verify_cost_times_every_size_per_dtype():
    out = run_benchmark("verify_cost.py", "--target", "tiny-random", "--dtypes", "float32", "--repeats", "1",
                        "--prompts", "1", "--max-new-tokens", "4", "--threads", "1", "--transformers")
    for label in ("float32", "float32+hf"):  # the fast path, and transformers' forward
        rows = [line.split() for line in out.splitlines() if line.split()[:1] == [label]]
        assert [int(r[1]) for r in rows[:6]] == [1, 2, 9, 17, 33, 65]
        assert "tokens/s" in rows[-1]


def test_forward_floor_prints_each_forward_beside_its_floor():
    out = run_benchmark("forward_floor.py", "--target", "tiny-random", "--dtypes", "float32", "bfloat16", "--repeats",
                        "1", "--prompts", "1", "--max-new-tokens", "4", "--threads", "1")
    assert "read bandwidth" in out
    for label in ("float32 fast", "float32 transformers", "bfloat16 fast", "bfloat16 transformers"):
        table, plain = [line.split() for line in out.splitlines() if line.strip().startswith(label)]
        assert float(table[3]) >= 0 and float(table[4]) > 0 and table[5].endswith("x"), table  # floor, T=1, x floor
        assert "tokens/s" in plain
    assert "greedy output = float32 fast's on 1/1 prompts" in out.split("float32 transformers")[-1]


def test_draft_cost_times_each_familys_proposal_against_the_forward():
    out = run_benchmark("draft_cost.py", "--target", "tiny-random", "--families", "eagle3", "dspark", "--dtypes",
                        "float32", "--block-size", "3", "--draft-vocab", "64", "--repeats", "1", "--threads", "1")
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.strip().startswith("float32 ")}
    assert set(rows) == {"eagle3", "dspark"}
    # EAGLE-3 grows trees and stops its chain on confidence; DSpark does neither
    assert all(rows["eagle3"][i].endswith("%") for i in (4, 6, 8)) and rows["dspark"][5:] == ["-", "-"]
    assert all(float(r[3]) > 0 and r[4].endswith("%") for r in rows.values())


def test_serve_check_runs_end_to_end_with_a_standin_engine(tmp_path, tiny_target):
    """The orchestration of `make serve-check` (export, our decoding, the offline evaluator, the table, the verdict),
    with tests/helpers/serve_standin.py in vLLM's place; the real engine runs in `make serve-check`."""
    from helpers.families import FAMILIES, trained
    from helpers.fits import fit_checkpoint

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from decode_speed import mt_bench_prompts
    from lightning_spec.drafters import DFlashDrafter, DSparkDrafter, Eagle3Drafter

    prompts = mt_bench_prompts(tiny_target, 2, seed=0)  # the prompts serve_check.py decodes
    for name, make in (("eagle3", lambda k: Eagle3Drafter(block_size=k, num_anchors=64)),
                       ("dflash", lambda k: DFlashDrafter(block_size=k, num_anchors=64, qk_norm=True, mask_token_id=1)),
                       ("dspark", lambda k: DSparkDrafter(block_size=k, num_anchors=64, markov_rank=16, qk_norm=True,
                                                          mask_token_id=1))):
        FAMILIES[f"serve_{name}"] = make
        try:  # accepted on the target's own continuations, so the MAL columns compare real acceptance
            drafter = trained(f"serve_{name}", tiny_target, prompts, k=3)
        finally:
            del FAMILIES[f"serve_{name}"]
        fit_checkpoint(drafter, tmp_path / f"{name}.ckpt", "tiny-random")
    out = run_benchmark("serve_check.py", "--serve-python", sys.executable, "--serve-script",
                        str(ROOT / "tests" / "helpers" / "serve_standin.py"), "--target", "tiny-random", "--work",
                        str(tmp_path), "--prompts", "2", "--max-new-tokens", "8", "--threads", "1", "--families",
                        "eagle3", "dflash", "dspark")
    rows = [line for line in out.splitlines() if line.startswith(("| eagle3 |", "| dflash |", "| dspark |"))]
    assert len(rows) == 3 and all("| 2/2 / 2/2 |" in row for row in rows), out
    assert "serve-check: PASSED" in out
    for row in rows:  # MAL vLLM (the stand-in's count) = ours = offline: one accounting on every side
        cells = [c.strip() for c in row.split("|")]
        assert cells[4] == cells[5] == cells[6] and float(cells[4]) > 1.2, row
        assert cells[12] == "same", row  # what the engine built is what each folder says
    # an engine that drops a field the folder says: the check fails naming it, outputs and MAL agreeing
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "STANDIN_DROP": "draft.dflash_config.mask_token_id"}
    dropped = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_check.py"), "--serve-python",
                              sys.executable, "--serve-script", str(ROOT / "tests" / "helpers" / "serve_standin.py"),
                              "--target", "tiny-random", "--work", str(tmp_path), "--prompts", "2", "--max-new-tokens",
                              "8", "--threads", "1", "--families", "dflash"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
    assert dropped.returncode == 1 and "serve-check: FAILED" in dropped.stdout, dropped.stdout[-2000:]
    assert ("serve-check: dflash: vLLM built no draft.dflash_config.mask_token_id (the folder says 1): it dropped the "
            "field.") in dropped.stdout


def test_gpu_check_runs_its_cpu_parts(tmp_path):
    """benchmarks/gpu_check.sh --cpu: the fit, the decoding table from its checkpoint, and the FSDP part's reason for
    skipping, all on the tiny target; the GPU run uses the same steps with SmolLM2 and CUDA."""
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "PY": sys.executable,
           "LS": str(Path(sys.executable).with_name("lightning-spec"))}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "gpu_check: no GPU" in out and "== 1. fit (cpu)" in out and "checkpoint " in out
    assert "speculative / plain tokens/s" in out and "float32: greedy identity guaranteed" in out
    assert "fsdp: skipped on CPU" in out


def test_learning_curve_trains_each_knob_from_one_store_resumes_and_reports(tmp_path):
    """Two points of benchmarks/learning_curve.py on the tiny target: each trained with its knob, scored with CIs per
    domain, its costs and losses recorded; a rerun trains nothing; the table and the plot come from the points."""
    out = tmp_path / "curve"
    args = ("--target", "tiny-random", "--out", str(out), "--eval-prompts", "2", "--eval-tokens", "8",
            "--lines", "base", "vocabfull", "--max-steps", "2")
    text = run_benchmark("learning_curve.py", *args)
    points = {p.stem: json.loads(p.read_text()) for p in (out / "points").glob("*.json")}
    assert set(points) == {"dflash-rows24-len64-v64-d1-k4-s2", "dflash-rows24-len64-vfull-d1-k4-s2"}
    for name, p in points.items():
        e = p["eval"]
        assert e["mal_ci"][0] <= e["mal"] <= e["mal_ci"][1] and e["mal"] >= 1.0
        assert set(e["by_domain"]) == {"chat", "code", "math"} and 0 <= e["ar1"] <= 1
        assert p["train_cpu_s"] > 0 and p["store"]["cpu_s"] > 0 and p["store"]["examples"] > 0
        assert math.isfinite(p["train_loss"]) and math.isfinite(p["val_loss"])
        record = torch.load(p["checkpoint"], map_location="cpu", weights_only=False)["lightning_spec"]
        config = record["drafter_config"]
        assert config["draft_vocab_size"] == (64 if "-v64-" in name else None), config  # the knob reached the fit
        assert config["block_size"] == 4
    # the vocabulary does not change the target's features: both points read one store
    assert sorted(d.name for d in (out / "stores").iterdir() if d.is_dir()) == ["dflash-d1-rows24-len64"]
    assert "| base | 2 |" in text and "HumanEval" in text
    row = next(line for line in text.splitlines() if line.startswith("| vocabfull | 2 |")).split(" | ")
    assert row[4].startswith(("+", "-")) and "[" in row[4]  # its Δ against base at 2 steps, paired over rollouts
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = run_benchmark("learning_curve.py", *args)  # every point is on disk: nothing is trained again
    assert "[curve] fit-" not in again and "[curve] store-" not in again and "| vocabfull | 2 |" in again
    one = run_benchmark("learning_curve.py", *args[:-4], "--lines", "base", "--steps", "4")  # one budget alone
    assert "[curve] fit-dflash-rows24-len64-v64-d1-k4-s4" in one and "| base | 4 |" in one and "-s2" not in one


def test_testbed_recipe_trains_scores_times_and_resumes(tmp_path):
    """benchmarks/testbed.py on the tiny target: the evaluation rollouts, the store in the cache folder (by its key),
    the fit, exact offline MAL as a chain and as trees, the speed table with the goals' ratios; a rerun trains
    nothing and reads the store it left."""
    out, cache = tmp_path / "testbed", tmp_path / "cache"
    args = ("--target", "tiny-random", "--out", str(out), "--rows", "24", "--max-length", "64", "--steps", "2",
            "--eval-prompts", "2", "--eval-tokens", "8", "--speed-prompts", "1", "--speed-tokens", "8",
            "--speed-tree", "{kind: tree, nodes: 4, top_k: 2}", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    env = {"LIGHTNING_SPEC_CACHE": str(cache)}
    text = run_benchmark("testbed.py", *args, env=env)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recipe"] == {"family": "eagle3", "rows": 24, "max_length": 64, "steps": 2, "regenerate": 0}
    record = torch.load(out / "drafter.ckpt", map_location="cpu", weights_only=False)["lightning_spec"]
    assert record["drafter_class"].endswith("Eagle3Drafter") and record["drafter_config"]["block_size"] == 4
    stores = [d for d in (cache / "features").iterdir() if d.is_dir()]
    assert len(stores) == 1  # the store went to the cache folder, named by its key
    assert set(summary["offline"]) == {"chain", "tree8", "tree16", "tree32"}
    for arm in summary["offline"].values():
        assert arm["mal_ci"][0] <= arm["mal"] <= arm["mal_ci"][1] and arm["mal"] >= 1.0
    assert summary["train_cpu_hours"] > 0 and summary["cpu_seconds"]["features-drafter"] > 0
    assert math.isfinite(summary["fit"]["train_loss"]) and math.isfinite(summary["fit"]["val_loss"])
    speed = summary["speed_float32"]
    assert speed["plain_tokens_per_s"] > 0 and speed["best_tree"]["mode"].startswith("tree")
    assert speed["tree_with_ngram_vs_ngram"] > 0
    modes = json.loads((out / "speed-float32.json").read_text())["modes"]
    assert all(m["same"] == m["prompts"] for m in modes)  # greedy: every mode decodes plain decoding's tokens
    for goal in ("exact chain MAL, MT-Bench", "CPU-hours, store", "tree with n-gram nodes / n-grams alone"):
        assert goal in text  # the figures set against issue 33's goals
    again = run_benchmark("testbed.py", *args, "--no-speed", env=env)
    assert "[testbed] fit-drafter" not in again
    assert "features: 0 of" in (out / "logs" / "features-drafter.log").read_text()  # the store was complete
    rerun = json.loads((out / "summary.json").read_text())
    assert rerun["cpu_seconds"]["features-drafter"] == summary["cpu_seconds"]["features-drafter"]  # what it cost
    assert rerun["offline"] == summary["offline"]  # the evaluation was not redone for the same checkpoint


def test_testbed_trains_on_a_kept_regeneration_and_compares_it_with_sharegpts_answers(tmp_path):
    """``--regenerate N --compare-sharegpt --mixed`` on the tiny target, from a kept archive (no vLLM): the target's
    answers, ShareGPT's answers to the same prompts (cut to the same budget) and both, each fitted, compared on the
    held-out greedy rollouts of three domains, paired; an archive of other settings is one sentence."""
    kept, out = tmp_path / "tiny.rollouts.jsonl.gz", tmp_path / "testbed"
    subprocess.run([sys.executable, "-m", "lightning_spec", "rollouts", "--target=tiny-random", "--sources=[sharegpt]",
                    "--prompts_per_source=6", "--max_prompt_tokens=256", "--max_turns=1", "--temperature=0",
                    "--max_new_tokens=8", f"--out={tmp_path / 'regen'}", f"--archive={kept}", "--progress=false"],
                   check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    args = ("--target", "tiny-random", "--out", str(out), "--max-length", "256", "--steps", "2", "--eval-prompts", "2",
            "--eval-tokens", "8", "--no-speed", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--kept", str(kept), "--max-new-tokens", "8")
    env = {"LIGHTNING_SPEC_CACHE": str(tmp_path / "cache")}
    text = run_benchmark("testbed.py", *args, "--regenerate", "6", "--compare-sharegpt", "--mixed", env=env)
    assert "[testbed] sharegpt-regen" not in text  # the kept archive was read, nothing drawn
    answers = [json.loads(line) for line in (out / "sharegpt-answers.jsonl").read_text().splitlines()]
    assert 0 < len(answers) <= 6 and all(a["messages"][-1]["role"] == "assistant" for a in answers)
    result = json.loads((out / "summary.json").read_text())["regeneration_vs_sharegpt"]
    assert set(result["arms"]) == {"sharegpt", "regenerated", "mixed"} and result["rollouts"] == 6  # 3 domains x 2
    assert set(result["comparison"]["by_domain"]) == {"chat", "code", "math"}
    assert result["comparison"]["baseline"] == "sharegpt" and all(len(a["accept_rate"]) == 2
                                                                 for a in result["arms"].values())
    assert "| regenerated |" in text and "| mixed |" in text
    failed = subprocess.run([sys.executable, "benchmarks/testbed.py", *args, "--regenerate", "5"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, **env})
    assert failed.returncode != 0 and "holds prompts 6, not the 5 this run asks for" in failed.stderr
