"""Sweeps: every sweep YAML parses, a tiny study lands in Optuna and MLflow (parent + one child per trial),
failed and pruned trials are recorded and the study goes on, a killed sweep resumes without repeating
finished trials, and two workers on one PostgreSQL study run exactly n_trials between them."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
import yaml
from filelock import FileLock
from helpers.cli import exit_code
from helpers.tracking import fresh_database, sweep_runs

from lightning_spec.sweeps import (
    TrialReporter,
    counts,
    load_yaml,
    parse_space,
    this_worker,
    trial_config,
    worker_is_dead,
)

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
TINY_SWEEP = ROOT / "sweeps" / "tiny.yaml"
TINY = ROOT / "experiments" / "tiny.yaml"

# A trial of a few seconds: 2 optimizer steps, one validation (greedy decoding of 3 prompts, 8 tokens).
FAST = {
    "trainer.max_steps": 2,
    "trainer.val_check_interval": 2,
    "trainer.enable_progress_bar": False,
    "trainer.callbacks": [{
        "class_path": "lightning_spec.callbacks.SpecDecodeValidation",
        "init_args": {"prompts_per_domain": 1, "max_new_tokens": 8, "sampling": [{"temperature": 0.0}],
                      "measure_speedup": False, "before_training": False, "print_summary": False},
    }],
}
KL = {
    "class_path": "lightning_spec.objectives.Objective",
    "init_args": {"loss": {"class_path": "lightning_spec.objectives.KL"}},
}


def sweep_yaml(tmp: Path, name: str = "sweep.yaml", **changes) -> Path:
    """sweeps/tiny.yaml on the tiny experiment by absolute path, with the fast overrides and ``changes``."""
    config = yaml.safe_load(TINY_SWEEP.read_text())
    config.update(base=str(TINY), overrides=dict(FAST))
    config.update(changes)
    path = tmp / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------ every YAML parses


def test_sweep_yamls_exist():
    assert {"tiny", "objectives_vs_block"} <= {p.stem for p in SWEEPS}


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_every_sweep_yaml_parses(path, monkeypatch, capsys):
    """--dry_run parses every choice of every space entry as a fit config of its base, loads no model and
    writes nothing (no study, no MLflow run)."""
    import transformers

    import lightning_spec.module

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not load a model")

    monkeypatch.chdir(ROOT)  # bases are relative to the working folder, as with fit -c
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    monkeypatch.setattr(lightning_spec.module, "load_target", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    before = sorted(p.name for p in ROOT.iterdir())
    assert exit_code(["sweep", "-c", str(path), "--dry_run", "true"]) == 0
    out = capsys.readouterr().out
    source = yaml.safe_load(path.read_text())
    assert "trials, sampler" in out and all(key in out for key in source["space"])
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_a_space_key_that_does_not_parse_is_one_sentence_before_any_trial(tmp_path, monkeypatch, capsys):
    """A typo in a space key is the user's: one sentence naming the entry, before a study exists."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    monkeypatch.delenv("LIGHTNING_SPEC_TRACEBACK", raising=False)
    sweep = yaml.safe_load((ROOT / "sweeps" / "tiny.yaml").read_text())
    sweep["space"] = {"model.drafter.init_args.block_sise": {"choices": [2, 4]}}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(sweep))
    assert exit_code(["sweep", "-c", str(path), "--dry_run", "true"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightning-spec: error: ") and "block_sise" in last and "does not parse with" in last, last


def test_objectives_vs_block_reuses_the_objective_yamls():
    """Its choices are model.objective of experiments/objectives/<name>.yaml, on the quickstart, K in {4, 8, 16}."""
    sweep = yaml.safe_load((ROOT / "sweeps" / "objectives_vs_block.yaml").read_text())
    assert sweep["base"] == "experiments/quickstart.yaml" and sweep["sampler"] == "grid"
    choices = sweep["space"]["model.objective"]["choices"]
    assert list(choices) == ["ce_uniform", "ce_decay", "kl_decay", "lk_lambda", "auf", "e2e", "edr"]
    for name, block in choices.items():
        assert block == yaml.safe_load((ROOT / "experiments" / "objectives" / f"{name}.yaml").read_text())["model"][
            "objective"], name
    assert sweep["space"]["model.drafter.init_args.block_size"] == {"choices": [4, 8, 16]}


# ----------------------------------------------------------------------------------------------- pieces


def test_space_entries():
    params = parse_space({
        "model.objective": {"choices": {"kl": KL, "ce": {"class_path": "lightning_spec.objectives.Objective"}}},
        "model.drafter.init_args.block_size": {"choices": [4, 8]},
        "model.lr": {"low": "1e-4", "high": 1.0e-2, "log": True},
        "model.drafter.init_args.num_layers": {"low": 1, "high": 3},
        "model.objective.init_args.position_weight.init_args.gamma": {"low": 1.0, "high": 8.0, "name": "gamma"},
    })
    by_name = {p.name: p for p in params}
    assert list(by_name) == ["objective", "block_size", "lr", "num_layers", "gamma"]
    assert by_name["objective"].distribution.choices == ("kl", "ce")  # Optuna stores the names
    assert by_name["objective"].config_value("kl") == KL
    assert isinstance(by_name["lr"].distribution, optuna.distributions.FloatDistribution)
    assert by_name["lr"].distribution.low == 1e-4 and by_name["lr"].distribution.log
    assert isinstance(by_name["num_layers"].distribution, optuna.distributions.IntDistribution)

    with pytest.raises(ValueError, match=r"space\.model\.objective\.choices holds .*mapping name -> value"):
        parse_space({"model.objective": {"choices": [KL]}})
    with pytest.raises(ValueError, match=r"'lr' is taken twice; give each a `name:`"):
        parse_space({"model.lr": {"low": 0.1, "high": 1.0}, "data.lr": {"low": 0.1, "high": 1.0}})
    with pytest.raises(ValueError, match=r"space\.model\.lr needs `choices` or both `low` and `high`"):
        parse_space({"model.lr": {"low": 0.1}})


def test_trial_config_writes_values_as_editing_the_yaml_would():
    base = load_yaml(TINY)
    params = parse_space({
        "model.objective": {"choices": {"e2e": {"class_path": "lightning_spec.objectives.E2E"}, "kl": KL}},
        "model.objective.init_args.loss.init_args.sampling.init_args.temperature": {"choices": [0.5], "name": "t"},
    })
    config = trial_config(base, {"trainer.max_steps": 9, "model.feature_cache": "off"}, params,
                          {"objective": "kl", "t": 0.5})
    # the whole block replaced first (nothing of the base's ExpDecay left), then the key inside it
    assert config["model"]["objective"] == {
        "class_path": "lightning_spec.objectives.Objective",
        "init_args": {"loss": {"class_path": "lightning_spec.objectives.KL",
                               "init_args": {"sampling": {"init_args": {"temperature": 0.5}}}}},
    }
    assert config["trainer"]["max_steps"] == 9 and config["model"]["feature_cache"] == "off"
    assert config["model"]["drafter"] == base["model"]["drafter"] and base["trainer"]["max_steps"] == 6
    config = trial_config(base, {}, params, {"objective": "e2e"})
    assert config["model"]["objective"] == {"class_path": "lightning_spec.objectives.E2E"}  # no inherited init_args


def test_trial_reporter_reports_fresh_values_at_the_global_step_and_prunes():
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=1.5))
    trial = study.ask()
    reporter = TrialReporter(trial, "val/mal")
    trainer = SimpleNamespace(callback_metrics={"val/mal": torch.tensor(1.0)}, global_step=0, sanity_checking=False,
                              state=SimpleNamespace(fn="fit"))
    reporter.on_validation_start(trainer, None)  # the value logged before training (on_fit_start)
    trainer.global_step = 3
    reporter.on_validation_end(trainer, None)  # this validation did not write val/mal: nothing reported
    assert study.trials[0].intermediate_values == {}
    reporter.on_validation_start(trainer, None)
    trainer.callback_metrics["val/mal"] = torch.tensor(2.0)
    reporter.on_validation_end(trainer, None)
    assert study.trials[0].intermediate_values == {3: 2.0}
    reporter.on_validation_start(trainer, None)
    trainer.global_step = 6
    trainer.callback_metrics["val/mal"] = torch.tensor(1.2)
    with pytest.raises(optuna.TrialPruned, match="pruned at step 6"):
        reporter.on_validation_end(trainer, None)
    assert study.trials[0].intermediate_values == {3: 2.0, 6: pytest.approx(1.2)}
    with pytest.raises(ValueError, match="metric 'val/mal' was not logged by the trial"):
        reporter.value()


def test_what_counts_and_which_workers_are_dead():
    state = optuna.trial.TrialState
    make = lambda s, **attrs: optuna.trial.create_trial(state=s, user_attrs=attrs, value=1.0 if s == state.COMPLETE
                                                        else None)
    assert counts(make(state.COMPLETE)) and counts(make(state.PRUNED))
    assert counts(make(state.FAIL, error="ValueError: bad block"))
    assert not counts(make(state.FAIL, error="x", interrupted="KeyboardInterrupt"))
    assert not counts(make(state.FAIL))  # failed by Optuna's heartbeat check: its worker died

    me = this_worker()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = {**me, "pid": int(done.stdout), "token": "other"}
    assert worker_is_dead(gone, me)
    assert not worker_is_dead(me, me)
    assert not worker_is_dead({**gone, "host": "elsewhere"}, me)  # another host: the heartbeat decides
    assert worker_is_dead({**me, "token": "other"}, me)  # our pid, recorded by a process that had it before
    assert not worker_is_dead({**me, "pid": os.getppid(), "token": "other", "start": None}, me)


# ------------------------------------------------------------------------------------- a tiny study


def test_tiny_sweep_lands_in_optuna_and_mlflow(tmp_path, monkeypatch):
    """3 grid trials, one of which raises (block size 200 > data.max_length): 3 child runs under one parent, the
    failure recorded in both with its error, the best trial tagged, the plots on the parent; the same command
    again runs nothing. A second study prunes its trial at the first validation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    space = {"model.objective": {"choices": {"kl": KL}},
             "model.drafter.init_args.block_size": {"choices": [2, 200, 4]}}
    config = sweep_yaml(tmp_path, study_name="three", sampler="grid", pruner="median", space=space)
    assert exit_code(["sweep", "-c", str(config)]) == 0
    assert exit_code(["sweep", "-c", str(config)]) == 0  # finished: nothing more to run

    study = optuna.load_study(study_name="three", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.number for t in trials] == [0, 1, 2]
    by_block = {t.params["block_size"]: t for t in trials}
    assert sorted(by_block) == [2, 4, 200]
    failed = by_block[200]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert "block_size=200" in failed.user_attrs["error"] and failed.user_attrs["error"].startswith("UserError")
    for k in (2, 4):
        assert by_block[k].state == optuna.trial.TrialState.COMPLETE and by_block[k].value >= 1.0
        assert by_block[k].user_attrs["block_size"] == k and by_block[k].user_attrs["objective"] == "kl"
        assert "val/mal/chat" in by_block[k].user_attrs["metrics"]
        assert by_block[k].intermediate_values  # reported at the validation of step 2

    client, runs = sweep_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "three")
    (parent,) = [r for r in runs if r.info.run_name == "three"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 4 and len(children) == 3
    assert parent.info.status == "FINISHED" and parent.data.params["metric"] == "val/mal"
    child = {int(r.data.tags["optuna.trial_number"]): r for r in children}
    assert {r.info.run_name for r in children} == {"trial-0", "trial-1", "trial-2"}
    bad = child[failed.number]
    assert bad.info.status == "FAILED" and bad.data.tags["state"] == "failed"
    assert bad.data.tags["error"] == failed.user_attrs["error"]
    assert "error.txt" in [a.path for a in client.list_artifacts(bad.info.run_id)]
    good = child[by_block[4].number]
    assert good.info.status == "FINISHED" and good.data.tags["state"] == "complete"
    assert good.data.params["sweep/block_size"] == "4" and good.data.params["sweep/objective"] == "kl"
    assert {"val/mal", "val/mal/chat", "train/loss"} <= set(good.data.metrics)
    trial_yaml = f"trial-{by_block[4].number}.yaml"  # the YAML `fit -c` reruns the trial with
    assert {"config.yaml", "fit_command.txt", trial_yaml} <= {a.path for a in client.list_artifacts(good.info.run_id)}
    tagged = [r for r in children if r.data.tags.get("best_trial") == "true"]
    assert [int(r.data.tags["optuna.trial_number"]) for r in tagged] == [study.best_trial.number]
    assert parent.data.tags["best_trial"] == str(study.best_trial.number)
    (best,) = tagged  # the best trial's drafter is marked on the parent: what the sweep says to load or serve
    assert parent.data.tags["best_drafter"] == best.data.tags["drafter_model"]  # its logged model's models:/ URI
    model_id = best.data.tags["drafter_model"].removeprefix("models:/")
    assert "drafter.pt" in {a.path for a in client.list_logged_model_artifacts(model_id)}
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == {"plots/metric_vs_block_size.png", "plots/per_domain.png", "plots/optimization_history.png"}
    assert {"base.yaml", "sweep.json", "trials.json"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}

    pruned = sweep_yaml(tmp_path, "pruned.yaml", study_name="pruned", sampler="grid",
                        space={"model.drafter.init_args.block_size": {"choices": [2]}},
                        pruner={"class_path": "optuna.pruners.ThresholdPruner", "init_args": {"lower": 5.0}})
    assert exit_code(["sweep", "-c", str(pruned)]) == 0
    (trial,) = optuna.load_study(study_name="pruned", storage=f"sqlite:///{tmp_path / 'optuna.db'}").trials
    assert trial.state == optuna.trial.TrialState.PRUNED and "pruned at step 2" in trial.user_attrs["error"]
    run = client.get_run(trial.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["state"] == "pruned"


# ---------------------------------------------------------------------------------- processes


def sweep_command(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "lightning-spec"  # the installed console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_spec"]
    return [*command, "sweep", *args]


# tests/ importable in the sweep's process: its trials load helpers.fits.PauseWhenArmed by class path
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")] if p)}


def wait_for(condition, proc: subprocess.Popen, what: str, log: Path, seconds: float = 240.0) -> None:
    """Poll ``condition()`` (a state of the study or a file, never a guess of how long something takes) until it
    holds; fail if the process ends first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached (exit code {proc.poll()})\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def stop_during_a_trial(command: list[str], cwd: Path, storage: str, sig: int, log: Path, folder: Path) -> int:
    """Start the sweep; once a trial of the study has completed, arm ``PauseWhenArmed`` (in ``folder``); when a
    trial has paused mid-fit, send ``sig`` and return that trial's number (the one RUNNING trial)."""
    database = cwd / "optuna.db"

    def study_trials() -> list:
        if not database.exists():
            return []
        with FileLock(f"{database}.lock"):  # the sweep's own lock: never read tables it is creating
            try:
                return optuna.load_study(study_name="resume", storage=storage).trials
            except KeyError:  # the study is not created yet
                return []

    armed, paused = folder / "armed", folder / "paused"
    with open(log, "w") as out:
        # SIG_DFL: a suite started in the background of a script (`./.ci/run &`) inherits SIGINT ignored, and the
        # sweep (rightly) keeps an ignored SIGINT ignored; the child must see Ctrl-C as a terminal would send it
        proc = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_for(lambda: any(t.state.name == "COMPLETE" for t in study_trials()), proc, "a complete trial", log)
            armed.touch()
            wait_for(paused.exists, proc, "a trial paused mid-fit", log)
            (victim,) = [t.number for t in study_trials() if t.state.name == "RUNNING"]
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            armed.unlink(missing_ok=True)  # the next sweep's trials run through
            paused.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode != 0, log.read_text()[-3000:]
    return victim


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_an_interrupted_or_killed_sweep_resumes_without_repeating_finished_trials(tmp_path):
    """Ctrl-C the sweep during a trial: it stops, the trial is failed as interrupted. Then kill -9 it during a
    trial: the trial stays RUNNING. The same command again: both trials are failed as interrupted (not counted)
    and their params run again, finished trials are not repeated, and the study ends with exactly 4."""
    space = {"model.drafter.init_args.block_size": {"choices": [2, 3, 4, 5]}}
    pause = {"class_path": "helpers.fits.PauseWhenArmed", "init_args": {"folder": str(tmp_path)}}
    overrides = {**FAST, "trainer.callbacks": [*FAST["trainer.callbacks"], pause]}
    config = sweep_yaml(tmp_path, study_name="resume", sampler="grid", space=space, overrides=overrides)
    command = sweep_command("-c", str(config))
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    trials = lambda: {t.number: t for t in optuna.load_study(study_name="resume", storage=storage).trials}

    stopped = stop_during_a_trial(command, tmp_path, storage, signal.SIGINT, tmp_path / "first.log", tmp_path)
    assert "stopped by" in trials()[stopped].user_attrs["interrupted"] and trials()[stopped].state.name == "FAIL"
    killed = stop_during_a_trial(command, tmp_path, storage, signal.SIGKILL, tmp_path / "second.log", tmp_path)
    before = trials()
    assert before[killed].state.name == "RUNNING"  # nobody told the study
    done_before = {n: t.params for n, t in before.items() if t.state.name == "COMPLETE"}

    again = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    after = trials()
    complete = [t for t in after.values() if t.state.name == "COMPLETE"]
    assert len(complete) == 4 and sorted(t.params["block_size"] for t in complete) == [2, 3, 4, 5]
    assert all(after[n].state.name == "COMPLETE" and after[n].params == p for n, p in done_before.items())
    assert "is gone" in after[killed].user_attrs["interrupted"] and after[killed].state.name == "FAIL"
    for victim in (stopped, killed):  # (the second run may have picked up the first victim's params again)
        assert not counts(after[victim])
        (rerun,) = [t for t in complete if t.params == after[victim].params]
        assert rerun.user_attrs["requeued_from"] in (stopped, killed)
    assert len(after) == 6

    client, runs = sweep_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "resume")
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FINISHED"
    states = sorted(r.data.tags["state"] for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    assert states == ["complete"] * 4 + ["interrupted"] * 2
    assert {client.get_run(after[v].user_attrs["mlflow_run_id"]).info.status for v in (stopped, killed)} == {"KILLED"}


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_two_workers_share_a_postgres_study(tmp_path, postgres):
    """Two `sweep` processes on one study: exactly n_trials=4 trials between them, no number twice, each trial
    exactly one MLflow child run (MLflow in its own fresh PostgreSQL database)."""
    name = f"workers_{uuid.uuid4().hex[:8]}"
    with fresh_database(postgres, f"mlflow_{name}") as url:
        tracking = url.render_as_string(hide_password=False)
        space = {"model.lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True}}
        config = sweep_yaml(tmp_path, study_name=name, sampler="random", n_trials=4, space=space,
                            storage=postgres, tracking_uri=tracking)
        command = sweep_command("-c", str(config))
        procs = [subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        outs = [p.communicate(timeout=400) for p in procs]
        for proc, (_, err) in zip(procs, outs):
            assert proc.returncode == 0, err[-3000:]

        trials = optuna.load_study(study_name=name, storage=postgres).trials
        assert sorted(t.number for t in trials) == [0, 1, 2, 3]
        assert all(t.state.name == "COMPLETE" for t in trials), [
            (t.number, t.state.name, t.user_attrs.get("error"), t.user_attrs.get("interrupted")) for t in trials]
        workers = {t.user_attrs["worker"]["pid"] for t in trials}
        print(f"trials per worker: {[sum(t.user_attrs['worker']['pid'] == w for t in trials) for w in workers]}")

        _, runs = sweep_runs(tracking, name)
        (parent,) = [r for r in runs if r.info.run_name == name]
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == [0, 1, 2, 3]
        assert {r.info.run_id for r in children} == {t.user_attrs["mlflow_run_id"] for t in trials}
        assert parent.info.status == "FINISHED" and len(runs) == 5
        assert json.loads(parent.data.tags["best_params"]) == optuna.load_study(
            study_name=name, storage=postgres).best_params
