"""A sweep's storage as a user names it: a password in its URI never leaves the machine in clear (not printed, not
logged, not in an artifact), and a storage that cannot be written or reached is one sentence naming it (masked).
The PostgreSQL test runs where .ci/run started a server (tests/sweeps/conftest.py)."""

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from helpers.cli import exit_code, last_error_line
from helpers.tracking import fresh_database, sweep_runs

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "experiments" / "tiny.yaml"
SECRET = "hunter2-Secret"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def artifact_texts(client, run_id: str, folder: Path) -> str:
    """Every text artifact of the run, concatenated."""
    out = Path(client.download_artifacts(run_id, "", str(folder / run_id)))
    return "".join(p.read_text() for p in out.rglob("*") if p.suffix in (".yaml", ".json", ".txt"))


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_credentials_never_leave_a_sweep_or_its_fit_in_clear(tmp_path, postgres):
    """A sweep (one trial = one fit) whose Optuna storage and MLflow tracking URI carry a password (the CI
    server trusts local connections, so any password works): the password is in no printed line, no param or
    tag, and no artifact (sweep.json, base/trial YAMLs, the fit's config.yaml); the printed `mlflow ui`
    command shows it masked."""
    import sqlalchemy as sa

    name = f"secrets_{uuid.uuid4().hex[:8]}"
    server = sa.engine.make_url(postgres)
    with fresh_database(postgres, f"mlflow_{name}"):
        storage = server.set(password=SECRET).render_as_string(hide_password=False)
        tracking = server.set(database=f"mlflow_{name}", password=SECRET).render_as_string(hide_password=False)
        sweep = yaml.safe_load((ROOT / "sweeps" / "tiny.yaml").read_text())
        sweep.update(base=str(TINY), study_name=name, storage=storage, tracking_uri=tracking, sampler="grid",
                     space={"model.drafter.init_args.block_size": {"choices": [2]}},
                     overrides={"trainer.max_steps": 2, "trainer.val_check_interval": 2,
                                "trainer.enable_progress_bar": False})
        (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
        done = subprocess.run([sys.executable, "-m", "lightning_spec", "sweep", "-c", "sweep.yaml"], cwd=tmp_path,
                              env=ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert SECRET not in done.stdout + done.stderr
        masked = server.set(database=f"mlflow_{name}").render_as_string(hide_password=False).replace(
            "postgres@", "postgres:***@")
        assert f"see it: mlflow ui --backend-store-uri {masked}" in done.stdout  # the trial's fit summary

        client, found = sweep_runs(tracking, name)
        assert len(found) == 2  # the study's parent run and its trial
        for run in found:
            assert SECRET not in json.dumps([run.data.params, run.data.tags])
            assert SECRET not in artifact_texts(client, run.info.run_id, tmp_path / "artifacts")
        (parent,) = [r for r in found if r.info.run_name == name]
        assert parent.data.params["storage"] == storage.replace(SECRET, "***")
        (trial,) = [r for r in found if r is not parent]
        fit_config = yaml.safe_load(Path(client.download_artifacts(trial.info.run_id, "config.yaml",
                                                                   str(tmp_path))).read_text())
        assert fit_config["trainer"]["logger"]["init_args"]["tracking_uri"] == masked


# ------------------------------------------------------------------------------------------- one sentence
def sweep_config(folder: Path, storage: str) -> Path:
    config = yaml.safe_load((ROOT / "sweeps" / "tiny.yaml").read_text())
    config.update(base=str(TINY), storage=storage, space={"model.drafter.init_args.block_size": {"choices": [2]}})
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_sweep_storage_in_an_unwritable_place_is_one_sentence(in_tmp, capsys):
    (in_tmp / "a_file").write_text("not a folder")
    storage = f"sqlite:///{in_tmp / 'a_file' / 'optuna.db'}"
    assert exit_code(["sweep", "-c", str(sweep_config(in_tmp, storage))]) == 2
    err = capsys.readouterr().err
    line = last_error_line(err)
    assert line.startswith(f"lightning-spec: error: storage '{in_tmp / 'a_file'}' cannot be written"), line
    assert line.endswith("pick a folder you can write to.") and "Traceback" not in err
    assert not (in_tmp / "mlflow.db").exists()


def test_unreachable_postgres_storage_is_one_sentence(in_tmp, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = f"postgresql+psycopg2://me:{SECRET}@127.0.0.1:{port}/studies"
    assert exit_code(["sweep", "-c", str(sweep_config(in_tmp, storage))]) == 2
    err = capsys.readouterr().err
    line = last_error_line(err)
    assert line.startswith(f"lightning-spec: error: storage 'postgresql+psycopg2://me:***@127.0.0.1:{port}/studies' "
                           "cannot be reached ("), line
    assert line.endswith("start the database server or correct the host, port, database, user or password in "
                         "storage.")
    assert "Traceback" not in err and SECRET not in err


DATASET_SCRIPT = """
import sys, time
from pathlib import Path
from lightning.pytorch.loggers import MLFlowLogger
from lightning_spec.tracking import log_comparison
uri, folder, n, name = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
logger = MLFlowLogger(experiment_name="together", tracking_uri=uri, run_name=name)
logger.experiment.log_param(logger.run_id, "who", name)  # the run exists before the barrier
(folder / f"ready-{name}").touch()  # then every process logs the same data set at the same moment
deadline = time.monotonic() + 120
while len(list(folder.glob("ready-*"))) < n and time.monotonic() < deadline:
    time.sleep(0.001)
data = {"name": "sharegpt", "digest": "0123456789abcdef", "source": "sharegpt", "rows": 48}
log_comparison([logger], {"family": "dflash"}, data)
logger.finalize("success")
"""


@pytest.mark.integration  # a subprocess: the process boundary is what it tests
def test_workers_logging_the_same_data_at_once_all_record_it(tmp_path, postgres):
    """Two fits of one experiment (a sweep's two workers) log the same training data set in the same instant: both
    runs record it as their input. MLflow looks the data set up and then inserts it, so without the retry in
    ``log_comparison`` the later insert fails on PostgreSQL's unique key (what failed a CI sweep's trial)."""
    from mlflow import MlflowClient

    with fresh_database(postgres, f"datasets_{uuid.uuid4().hex[:8]}") as url:
        uri = url.render_as_string(hide_password=False)
        MlflowClient(uri).create_experiment("together")  # the tables and the experiment, as the sweep's parent makes
        (tmp_path / "barrier").mkdir()
        procs = [subprocess.Popen([sys.executable, "-c", DATASET_SCRIPT, uri, str(tmp_path / "barrier"), "2",
                                   f"run-{i}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        client = MlflowClient(uri)
        found = client.search_runs([client.get_experiment_by_name("together").experiment_id])
        assert len(found) == 2
        for run in found:
            assert [(d.dataset.name, d.dataset.digest) for d in run.inputs.dataset_inputs] == [
                ("sharegpt", "0123456789abcdef")]
