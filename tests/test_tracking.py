"""Tracking (``tracking.py``): secrets never leave the machine in clear (a URI's password masked in the saved
config and the error tag), runs started together on a fresh MLflow store are never lost, and a run that fails says
why (FAILED, tagged with the sentence the console printed). Kept as they were: kill -9 then ``fit --ckpt_path``
continues the same MLflow run (tests/integration/test_resume.py), and a NaN loss stops with one sentence.
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cli import exit_code, last_error_line, local_data_args
from helpers.tracking import runs

from lightning_spec.errors import UserError
from lightning_spec.tracking import SaveConfigToTracker, mask_uri

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny.yaml"
SECRET = "hunter2-Secret"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def tracked_here(folder: Path) -> str:
    """``--trainer.logger`` into ``folder/mlflow.db`` by absolute path: MLflow caches one store per URI string for
    the life of the process, so a second in-process fit with ``sqlite:///mlflow.db`` would log to the first's."""
    return f"--trainer.logger.init_args.tracking_uri=sqlite:///{folder / 'mlflow.db'}"


# --------------------------------------------------------------------------------------------------- secrets
def test_mask_uri_hides_the_password_and_nothing_else():
    assert mask_uri(f"postgresql+psycopg2://user:{SECRET}@db.example:5432/mlflow") == (
        "postgresql+psycopg2://user:***@db.example:5432/mlflow")
    assert mask_uri(f"storage 'mysql://u:p@ss:w{SECRET}@host/db' and http://h:p{SECRET}@x/y") == (
        "storage 'mysql://u:***@host/db' and http://h:***@x/y")  # "@" and ":" inside a password, two URIs
    for clear in ["sqlite:///mlflow.db", "sqlite:////abs/optuna.db", "http://127.0.0.1:5000/#/experiments/1",
                  "postgresql://user@host/db", "user: value@host"]:
        assert mask_uri(clear) == clear


def test_saved_config_and_error_tag_mask_credentials(tmp_path):
    """The config.yaml artifact and the error tag of a run: a URI's password is masked (no server needed: the
    config text holds a PostgreSQL URI, the run lives in SQLite)."""
    from lightning.pytorch.loggers import MLFlowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="lightning_spec", tracking_uri=uri)
    parser = SimpleNamespace(dump=lambda config, skip_none: f"tracking_uri: postgresql://me:{SECRET}@db/mlflow\n")
    callback = SaveConfigToTracker(parser, config=None, save_to_log_dir=False)
    trainer = SimpleNamespace(loggers=[logger], is_global_zero=True)
    callback.save_config(trainer, None, "fit")
    callback.on_exception(trainer, None, UserError(f"storage postgresql://me:{SECRET}@db/x cannot be reached."))
    client, (run,) = runs(uri, "lightning_spec")
    saved = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert saved.read_text() == "tracking_uri: postgresql://me:***@db/mlflow\n"
    assert run.data.tags["error"] == "storage postgresql://me:***@db/x cannot be reached."


# ------------------------------------------------------------------------------------ runs started together
STORE_SCRIPT = """
import sys, time
from pathlib import Path
from lightning_spec.tracking import open_store, ensure_experiment
uri, folder, n, name = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
(folder / f"ready-{name}").touch()  # imports done; then every process opens the fresh store at the same moment
deadline = time.monotonic() + 120
while len(list(folder.glob("ready-*"))) < n and time.monotonic() < deadline:
    time.sleep(0.001)
client = open_store(uri)
run = client.create_run(ensure_experiment(client, "together"), run_name=name)
client.log_metric(run.info.run_id, "x", 1.0)
client.set_terminated(run.info.run_id)
"""


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_processes_opening_a_fresh_mlflow_db_together_all_get_their_run(tmp_path):
    """Four processes open a fresh SQLite store in the same instant and each logs a run: every one succeeds and
    every run is there (without the store lock the tables are created twice: `table ... already exists`)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "barrier").mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", STORE_SCRIPT, uri, str(tmp_path / "barrier"), "4", f"run-{i}"],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    _, found = runs(uri, "together")
    assert sorted(r.info.run_name for r in found) == [f"run-{i}" for i in range(4)]
    assert {r.info.status for r in found} == {"FINISHED"}


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_two_fits_started_together_on_a_fresh_mlflow_db_both_finish(tmp_path):
    """`lightning-spec fit` twice at once in one folder with no mlflow.db yet: two FINISHED runs."""
    command = [sys.executable, "-m", "lightning_spec", "fit", "-c", str(TINY), "--trainer.enable_progress_bar=false",
               "--trainer.max_steps=2", "--trainer.val_check_interval=2"]
    procs = [subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    _, found = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert len(found) == 2 and {r.info.status for r in found} == {"FINISHED"}


# ------------------------------------------------------------------------------------- failed runs say why
def test_a_config_error_after_the_run_started_is_its_error_tag(in_tmp, capsys):
    """The data module refuses the data in setup, after the logger started the run: the run is FAILED and its
    `error` tag is the sentence the console printed."""
    long_prompt = [{"messages": [{"role": "user", "content": f"{i} " + "x" * 200},
                                 {"role": "assistant", "content": "ok"}]} for i in range(4)]
    args = local_data_args(in_tmp, long_prompt)[:-2]  # (without its --trainer.logger false)
    assert exit_code(["fit", "-c", str(TINY), *args, "--data.max_length", "64", tracked_here(in_tmp)]) == 2
    line = last_error_line(capsys.readouterr().err)
    assert "no training conversation has an assistant token within data.max_length=64" in line
    _, (run,) = runs(f"sqlite:///{in_tmp / 'mlflow.db'}")
    assert run.info.status == "FAILED"
    assert "lightning-spec: error: " + run.data.tags["error"] == line


def test_the_error_tag_is_a_user_errors_sentence_and_a_bugs_type():
    from lightning_spec.errors import DivergedLoss
    from lightning_spec.tracking import error_text

    assert error_text(UserError("data.max_length=8 is short;\n  raise it.")) == "data.max_length=8 is short; raise it."
    assert error_text(DivergedLoss("train/loss is not finite (nan)")) == "train/loss is not finite (nan)"
    assert error_text(ValueError("boom")) == "ValueError: boom"  # a plain ValueError is a bug: its type is kept


def test_a_diverging_fit_is_a_failed_run_tagged_with_the_sentence(in_tmp, capsys):
    assert exit_code(["fit", "-c", str(TINY), "--model.lr=1e30", "--model.warmup_ratio=0", tracked_here(in_tmp)]) == 2
    line = last_error_line(capsys.readouterr().err)
    assert line.startswith("lightning-spec: error: train/loss is not finite (nan) at step 1: ")
    _, (run,) = runs(f"sqlite:///{in_tmp / 'mlflow.db'}")
    assert run.info.status == "FAILED" and "lightning-spec: error: " + run.data.tags["error"] == line


# ------------------------------------------------------------------------------ the view users compare drafters in
def test_one_experiment_per_target_unless_the_user_names_one(tmp_path):
    from lightning_spec.tracking import DEFAULT_EXPERIMENT, SWEEP_EXPERIMENT, experiment_name

    assert experiment_name(DEFAULT_EXPERIMENT, "smollm2-135m-instruct") == "lightning_spec: smollm2-135m-instruct"
    assert experiment_name(DEFAULT_EXPERIMENT, str(tmp_path)) == f"lightning_spec: {tmp_path.name}"  # a local folder
    assert experiment_name(SWEEP_EXPERIMENT, "tiny-random", study="s1") == "lightning_spec: tiny-random, sweep s1"
    assert experiment_name("my experiment", "tiny-random") == "my experiment"  # the user's name wins


def test_an_experiment_opens_on_its_runs_with_the_comparison_view(tmp_path):
    import json

    from lightning_spec.tracking import COMPARISON_COLUMNS, EXPERIMENT_KIND, ensure_experiment, open_store, runs_link

    client = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    first = ensure_experiment(client, "lightning_spec: tiny-random")
    assert ensure_experiment(client, "lightning_spec: tiny-random") == first  # found, not made twice
    tags = client.get_experiment(first).tags
    assert tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    view = json.loads(tags["mlflow.sharedViewState.drafters"])
    assert view["selectedColumns"] == COMPARISON_COLUMNS and view["orderByAsc"] is False
    mine = client.create_experiment("mine", tags={EXPERIMENT_KIND[0]: "finetuning"})
    ensure_experiment(client, "mine")
    assert client.get_experiment(mine).tags[EXPERIMENT_KIND[0]] == "finetuning"  # a kind set by hand is kept
    assert runs_link("sqlite:///mlflow.db", first) == (f"http://127.0.0.1:5000/#/experiments/{first}/runs"
                                                       "?workflowType=machine_learning&viewStateShareKey=drafters")
    assert runs_link("https://u:secret@mlflow.example.com/", "7").startswith("https://u:***@mlflow.example.com/#/")


def test_an_objective_is_labelled_by_its_parts_that_are_not_the_default():
    from lightning_spec.objectives import CE, E2E, KL, AnchorUniform, ExpDecay, Mixture, Objective, Uniform

    assert Objective(KL(), ExpDecay(2.0)).label == "KL + ExpDecay"
    assert Objective(CE(), Uniform(), AnchorUniform()).label == "CE"
    assert E2E().label == "E2E"
    assert Mixture([Objective(CE()), E2E()], [0.1, 0.9]).label == "0.1·CE + 0.9·E2E"
