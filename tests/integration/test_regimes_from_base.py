"""benchmarks/regimes_from_base.py: the training-regime Reproductions rows continued from a trained drafter, each
against its SFT twin (same base, steps, learning rate), scored offline and paired over prompts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.benchmarks import run_benchmark

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import regimes_from_base as regimes  # noqa: E402 (benchmarks/ is on sys.path from the line above)


def test_every_regime_gets_its_sft_twin_after_the_bases():
    arms = regimes.plan(None)
    names = [a.name for a in arms]
    assert names[:3] == ["base-dflash", "base-eagle3", "base-eagle3-t1"]  # where every row starts, scored first
    by_name = {a.name: a for a in arms}
    for name in ("draft-opd", "grpo", "adaflash"):
        twin = by_name[f"sft-{name}"]
        assert names.index(twin.name) < names.index(name) and by_name[name].control == twin.name
        assert twin.regime is None and twin.steps == by_name[name].steps and twin.base == by_name[name].base
    # the twin trains at its regime's learning rate and warm-up, read from the regime's YAML
    assert by_name["sft-draft-opd"].patch == {"model": {"lr": 3.0e-4, "warmup_ratio": 0.0}}
    assert by_name["sft-grpo"].patch == {"model": {"lr": 1.0e-4}}
    # EDR's arms compare with the base's own objective on the same epoch; the response-only Draft-OPD with its twin
    assert by_name["edr"].control == by_name["edr-e2e"].control == "edr-base" and "sft-edr" not in by_name
    assert by_name["draft-opd-response"].control == "sft-draft-opd"
    alone = [a.name for a in regimes.plan(["draft-opd-response"])]
    assert alone == ["base-eagle3", "sft-draft-opd", "draft-opd-response"]
    with pytest.raises(SystemExit, match="unknown --arms"):
        regimes.plan(["opd"])


def test_an_arm_runs_its_regime_as_written_minus_decode_validation_and_time_cap(tmp_path):
    by_name = {a.name: a for a in regimes.plan(None)}
    opd = yaml.safe_load(regimes.overlay(by_name["adaflash"], tmp_path, tiny=False).read_text())
    assert "max_time" not in opd["trainer"]
    assert [c["class_path"].rsplit(".", 1)[1] for c in opd["trainer"]["callbacks"]] == ["OnPolicyRollouts"]
    assert opd["trainer"]["callbacks"][0]["init_args"]["buffer_size"] == 16  # the arm's patch
    assert opd["model"]["drafter"]["init_args"]["length_head"] is True  # the rest as the regime wrote it
    e2e = yaml.safe_load(regimes.overlay(by_name["edr-e2e"], tmp_path, tiny=False).read_text())
    assert e2e["model"]["objective"] == {"class_path": "lightning_spec.objectives.E2E",  # EDR's own options dropped
                                         "init_args": {"sampling": {"temperature": 1.0}, "normalize": "sequences"}}
    base = yaml.safe_load(regimes.overlay(by_name["edr-base"], tmp_path, tiny=False).read_text())
    assert "objective" not in base["model"] and base["model"]["lr"] == 1.0e-4  # the base recipe's objective trains


def test_the_spread_across_domains_and_its_paired_interval(tmp_path):
    """spread_delta on two arms whose per-domain MAL is known: the point spreads are the domains' population std."""
    domains = ["chat"] * 4 + ["code"] * 4 + ["math"] * 4
    rows = {"prompt_id": [f"p{i}" for i in range(12)], "domain": domains, "tokens": [10] * 12}
    results = {}
    for name, per_domain in (("a", (5.0, 5.0, 5.0)), ("b", (5.0, 4.0, 2.5))):  # MAL 2, 2, 2 and 2, 2.5, 4
        path = tmp_path / f"{name}.json"
        rounds = [per_domain[i // 4] for i in range(12)]
        path.write_text(json.dumps({"rows": rows, "arms": {"arm": {"rounds": rounds}}}))
        results[name] = {"name": name, "eval": {"evaluation": str(path)}}
    a, b, ci = regimes.spread_delta(results["a"], results["b"])
    assert a == pytest.approx(0.0) and b == pytest.approx(np.std([2.0, 2.5, 4.0]))
    assert ci[0] == pytest.approx(ci[1]) == pytest.approx(-b)  # every prompt of a domain alike: no sampling spread


def test_regimes_continue_a_drafter_against_sft_and_resume(tmp_path):
    """The whole benchmark on the tiny target for Draft-OPD and EDR: the base scored at both temperatures, each
    arm's fit starting from it, the table's paired deltas; a rerun fits nothing."""
    env = {"LIGHTNING_SPEC_CACHE": str(tmp_path / "cache")}
    base = subprocess.run([sys.executable, "-m", "lightning_spec", "fit", *regimes.BASE_RECIPES["eagle3"],
                           *regimes.TINY, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                           "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'base'}",
                           f"--trainer.logger.init_args.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, capture_output=True, text=True,
                          timeout=300)
    assert base.returncode == 0, base.stderr[-3000:]
    ckpt = next((tmp_path / "base").rglob("last.ckpt"))
    out = tmp_path / "regimes"
    args = ("--target", "tiny-random", "--steps", "2", "--arms", "draft-opd", "edr", "--base-eagle3", str(ckpt),
            "--out", str(out))
    text = run_benchmark("regimes_from_base.py", *args, env=env)
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
             for line in text.splitlines() if line.startswith("| ")}
    assert {"base-eagle3", "base-eagle3-t1", "sft-draft-opd", "draft-opd", "edr-base", "edr"} <= set(table)
    assert table["draft-opd"][6] == "sft-draft-opd" and table["edr"][6] == "edr-base"
    for name in ("draft-opd", "edr"):
        assert table[name][7].startswith(("+", "-")) and "[" in table[name][7]  # Δ with its paired interval
    assert table["edr"][3] == "1" and table["draft-opd"][3] == "0"  # EDR's arms are scored on T = 1 rollouts
    for name, objective in (("draft-opd", "DraftOPD"), ("sft-draft-opd", "Objective"), ("edr", "EDR")):
        record = json.loads((out / "arms" / f"{name}.json").read_text())
        hparams = torch.load(record["checkpoint"], map_location="cpu", weights_only=False)["hyper_parameters"]
        assert hparams["init_from"] == str(ckpt) and hparams["objective"]["class_path"].endswith(f".{objective}"), name
        assert record["steps_reached"] == 2
        if name == "sft-draft-opd":
            assert hparams["lr"] == 3.0e-4 and hparams["warmup_ratio"] == 0.0  # the regime's, not the base's
    again = run_benchmark("regimes_from_base.py", *args, env=env)
    assert "[regimes] fit-" not in again and "| draft-opd |" in again
