"""The catalogue of bad input and faults a new user meets (issue 10, Part 3), each a test so it stays true.

Every failure a user can cause is one sentence naming the field or argument and the fix, never a traceback from
inside torch, datasets, jsonargparse or MLflow; files shared between people are data, never code; secrets never
leave the machine in clear; runs started together are never lost. Kept as they were: kill -9 then
``fit --ckpt_path`` continues the same MLflow run (tests/test_resume.py), and a NaN loss stops with one sentence
and a FAILED run (now tagged with that sentence).
"""

import json
import math
import os
import pickle
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from test_cli import exit_code, local_data_args  # tests/ is on sys.path (as for fit_probe)
from test_sweeps import postgres_url

from lightning_spec import SamplingConfig, generate, load_drafter, load_target, offline_rounds
from lightning_spec.checkpoint import CKPT_KEY
from lightning_spec.cli import main
from lightning_spec.data import engines as E
from lightning_spec.data import load_source
from lightning_spec.data import rollout_writer as W
from lightning_spec.data.rollout_writer import generate_rollouts
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.tracking import SaveConfigToTracker, mask_uri

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny.yaml"
T1 = SamplingConfig(temperature=1.0)
SECRET = "hunter2-Secret"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the CLI inside tmp_path (mlflow.db and runs/ land there) with a clean argv."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    return tmp_path


# ==================================================================== loading is a security boundary
class Boom:
    def __reduce__(self):
        return (Path.touch, (Path("PWNED"),))


def test_a_checkpoint_that_pickles_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:
        pickle.dump({CKPT_KEY: {}, "payload": Boom()}, f)
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_drafter(path)
    assert not (tmp_path / "PWNED").exists()


def test_an_exported_folder_cannot_name_a_callable(saved_drafter, tmp_path, monkeypatch):
    """``"drafter_class": "os.system"`` in drafter.json ran a shell command in load_drafter."""
    monkeypatch.chdir(tmp_path)
    _, _, folder = saved_drafter
    meta = json.loads((folder / "drafter.json").read_text())
    meta["drafter_class"] = "os.system"
    meta["drafter_config"] = {"command": "touch PWNED"}
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    meta["drafter_class"] = "lightning_spec.objectives.KL"  # ours, but not a drafter
    meta["drafter_config"] = {}
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    assert not (tmp_path / "PWNED").exists()
    # a name is looked up among the drafter classes, never imported: a module of ours the file names stays unloaded
    sys.modules.pop("lightning_spec.sweeps.plots", None)
    meta["drafter_class"] = "lightning_spec.sweeps.plots.Anything"
    (folder / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a lightning_spec drafter class"):
        load_drafter(folder)
    assert "lightning_spec.sweeps.plots" not in sys.modules


# ============================================================ secrets, concurrent runs, MLflow and sweeps
@pytest.fixture
def postgres() -> str:
    return postgres_url()  # skips without a server, fails where CI needs one


def runs(tracking_uri: str, experiment: str = "lightning_spec") -> tuple:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    return client, (client.search_runs([exp.experiment_id]) if exp is not None else [])


def tracked_here(folder: Path) -> str:
    """``--trainer.logger`` into ``folder/mlflow.db`` by absolute path: MLflow caches one store per URI string for
    the life of the process, so a second in-process fit with ``sqlite:///mlflow.db`` would log to the first's."""
    return f"--trainer.logger.init_args.tracking_uri=sqlite:///{folder / 'mlflow.db'}"


def last_error_line(err: str) -> str:
    return err.strip().splitlines()[-1]


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
    callback.on_exception(trainer, None, ValueError(f"storage postgresql://me:{SECRET}@db/x cannot be reached."))
    client, (run,) = runs(uri)
    saved = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert saved.read_text() == "tracking_uri: postgresql://me:***@db/mlflow\n"
    assert run.data.tags["error"] == "storage postgresql://me:***@db/x cannot be reached."


def artifact_texts(client, run_id: str, folder: Path) -> str:
    """Every text artifact of the run, concatenated."""
    out = Path(client.download_artifacts(run_id, "", str(folder / run_id)))
    return "".join(p.read_text() for p in out.rglob("*") if p.suffix in (".yaml", ".json", ".txt"))


def test_credentials_never_leave_a_sweep_or_its_fit_in_clear(tmp_path, postgres):
    """A sweep (one trial = one fit) whose Optuna storage and MLflow tracking URI carry a password (the CI
    server trusts local connections, so any password works): the password is in no printed line, no param or
    tag, and no artifact (sweep.json, base/trial YAMLs, the fit's config.yaml); the printed `mlflow ui`
    command shows it masked."""
    import sqlalchemy as sa

    name = f"secrets_{uuid.uuid4().hex[:8]}"
    server = sa.engine.make_url(postgres)
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE mlflow_{name}"))
    storage = server.set(password=SECRET).render_as_string(hide_password=False)
    tracking = server.set(database=f"mlflow_{name}", password=SECRET).render_as_string(hide_password=False)
    try:
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

        client, found = runs(tracking)
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
    finally:
        admin.dispose()
        with sa.create_engine(server, isolation_level="AUTOCOMMIT").connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS mlflow_{name} WITH (FORCE)"))


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


# ------------------------------------------------------------------------------------------- one sentence
def test_fit_ckpt_path_to_a_missing_or_empty_file_is_one_sentence(in_tmp, capsys):
    (in_tmp / "empty.ckpt").write_bytes(b"")  # an interrupted copy
    for path, sentence in [
        ("runs/nothing/last.ckpt", "--ckpt_path 'runs/nothing/last.ckpt' does not exist; pass the path of a .ckpt "
         "written by `lightning-spec fit` (e.g. runs/<experiment id>/<run id>/checkpoints/last.ckpt)."),
        ("empty.ckpt", "--ckpt_path 'empty.ckpt' is an empty file"),
    ]:
        assert exit_code(["fit", "-c", str(TINY), "--ckpt_path", path]) == 2
        err = capsys.readouterr().err
        assert last_error_line(err).startswith("lightning-spec: error: " + sentence), err[-2000:]
        assert "Traceback" not in err
    assert not (in_tmp / "mlflow.db").exists()  # refused before any run was started


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


def test_a_diverging_fit_is_a_failed_run_tagged_with_the_sentence(in_tmp, capsys):
    assert exit_code(["fit", "-c", str(TINY), "--model.lr=1e30", "--model.warmup_ratio=0", tracked_here(in_tmp)]) == 2
    line = last_error_line(capsys.readouterr().err)
    assert line.startswith("lightning-spec: error: train/loss is not finite (nan) at step 1: ")
    _, (run,) = runs(f"sqlite:///{in_tmp / 'mlflow.db'}")
    assert run.info.status == "FAILED" and "lightning-spec: error: " + run.data.tags["error"] == line


# ========================================================================================== data input
def chats(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of the console entry point, run in this process."""
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------ a malformed JSONL line


def test_a_malformed_jsonl_line_names_the_file_and_the_line(tmp_path):
    """Was a 101-line ``datasets`` traceback ("JSON parse error ... in row 1")."""
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in chats(3)]
    lines.insert(2, '{"messages": [{"role": "user", "content": "cut off')  # line 3
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path} line 3 is not valid JSON \(.*\); fix or remove that line"):
        load_source(str(path))

    document = tmp_path / "broken.json"  # one pretty-printed JSON list, broken on its 4th line
    document.write_text('[\n  {"messages": []},\n  {"messages": [}\n  oops\n]\n')
    with pytest.raises(ValueError, match=rf"{document} line 3 is not valid JSON"):
        load_source(str(document))

    folder = tmp_path / "folder"  # a folder of JSONL files: the file at fault is named
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", chats(2))
    (folder / "b.jsonl").write_text(json.dumps(chats(1)[0]) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"b\.jsonl line 2 is not valid JSON"):
        load_source(str(folder))


def test_a_malformed_jsonl_line_in_the_console_is_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps(chats(1)[0]) + "\n{oops\n")
    code, err = run_main(
        ["rollouts", "--target", "tiny-random", "--sources", f"[{bad}]", "--out", str(tmp_path / "r"),
         "--max_new_tokens", "2", "--progress", "false"],
        capsys,
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last.startswith("lightning-spec: error: ") and f"{bad} line 2 is not valid JSON" in last, last


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
        generate_rollouts(tiny_target, [[1, 2, 3]], T1, 1, 4, out, progress=False)
    with pytest.raises(ValueError, match="is a file; name a folder"):
        generate_rollouts(tiny_target, [[1, 2, 3]], T1, 1, 4, blocker, progress=False)


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
        ("hello", r"takes loaded rollouts, not the path 'hello'; pass load_rollout_set\('hello'\)"),
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


# ------------------------------------------------------------------------- val_check_interval beyond an epoch


def test_val_check_interval_beyond_the_epoch_names_the_field_and_the_batch_count(tiny_target, tmp_path):
    """Was Lightning's ValueError from inside its fit loop (a traceback in the console)."""
    from lightning_spec.drafters import DFlashDrafter
    from lightning_spec.module import DraftModule

    train = write_jsonl(tmp_path / "train.jsonl", chats(20))
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    dm = SpecDataModule(target="tiny-random", train_sources=[train], eval_sources=[evals], train_limit=None,
                        max_length=48, batch_size=4, val_fraction=0.2)
    module = DraftModule(DFlashDrafter(block_size=2, num_layers=1, num_anchors=4), target="tiny-random",
                         feature_cache="off")
    trainer = L.Trainer(accelerator="cpu", max_steps=2, val_check_interval=50, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"trainer\.val_check_interval=50 is more than the 4 training batches of an "
                                         r"epoch .*lower it to at most 4, or set trainer\.check_val_every_n_epoch"):
        trainer.fit(module, datamodule=dm)
    # counted across epochs (check_val_every_n_epoch=None), the same interval is Lightning's to run
    dm.trainer = L.Trainer(val_check_interval=50, check_val_every_n_epoch=None, logger=False)
    assert len(dm.train_dataloader()) == 4


def test_val_check_interval_beyond_the_epoch_in_the_console_is_one_line(in_tmp, capsys):
    train = write_jsonl(in_tmp / "train.jsonl", chats(8))
    evals = write_jsonl(in_tmp / "eval.jsonl", [{"messages": [{"role": "user", "content": "Say something."}]}])
    code, err = run_main(
        ["fit", "-c", str(TINY), "--data.train_sources", json.dumps([train]), "--data.eval_sources",
         json.dumps([evals]), "--data.val_fraction", "0.25", "--trainer.logger", "false",
         "--trainer.val_check_interval", "40", "--trainer.num_sanity_val_steps", "0"],
        capsys,
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last.startswith("lightning-spec: error: trainer.val_check_interval=40 is more than the 2 training"), last


# ========================================================================================== public API
@pytest.mark.parametrize(
    "ids, match",
    [
        ([1, 2, 400], "token id 400, outside the target's vocabulary 0..319"),  # tiny-random: vocab 320
        ([1, -3, 2], "token id -3"),
        ([1.5, 2.0], "must be token ids"),
        ([], "non-empty"),
        ("hello", "must be token ids"),
    ],
)
def test_generate_refuses_bad_token_ids(tiny_target, ids, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_target, ids, 4)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_generate_refuses_a_bad_token_budget(tiny_target, bad):
    """``max_new_tokens=-1`` silently returned nothing."""
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        generate(tiny_target, [1, 2, 3], bad)


def test_generate_takes_sampling_as_a_dict(tiny_target):
    as_dict = generate(tiny_target, [1, 2, 3], 5, sampling={"temperature": 1.0, "top_k": 4}, seed=3)
    as_config = generate(tiny_target, [1, 2, 3], 5, sampling=SamplingConfig(temperature=1.0, top_k=4), seed=3)
    assert as_dict.tokens == as_config.tokens
    with pytest.raises(ValueError, match="unknown keys"):
        generate(tiny_target, [1, 2, 3], 5, sampling={"temp": 1.0})
    with pytest.raises(TypeError, match="SamplingConfig or a dict"):
        generate(tiny_target, [1, 2, 3], 5, sampling=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": -1.0}, "temperature must be a finite number"),
        ({"top_p": math.nan}, "top_p must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": -1}, "top_k must be an int"),
    ],
)
def test_sampling_config_refuses_values_torch_would_choke_on(kwargs, match):
    """``SamplingConfig(temperature=nan)`` was accepted and failed later inside torch."""
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_an_unknown_target_name_lists_the_packaged_names():
    """``load_target("no-such-name")`` reported a network error."""
    with pytest.raises(ValueError, match=r"not a packaged name \(smollm2-135m-instruct, tiny-random\)"):
        load_target("no-such-name")
    with pytest.raises(ValueError, match="not a packaged name"):
        load_target("no-such-org/no-such-model")  # HF_HUB_OFFLINE=1 in the tests: no download is tried


def test_load_drafter_of_a_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter(tmp_path / "nope.ckpt")
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty file"):
        load_drafter(empty)
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="cannot be read safely"):
        load_drafter(junk)
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, other)
    with pytest.raises(ValueError, match="not a lightning_spec checkpoint"):
        load_drafter(other)
    with pytest.raises(ValueError, match="without drafter.json"):
        load_drafter(tmp_path)


# ============================================================================================ config errors
@pytest.mark.parametrize(
    "option, says",
    [
        # 85 lines of nested Union alternatives before, the cause at the bottom
        ("--model.objective.init_args.loss=lightning_spec.objectives.NoSuchLoss",
         "model.objective.loss: module 'lightning_spec.objectives' has no attribute 'NoSuchLoss'"),
        ("--model.lr=-1", "model.lr is -1.0; it must be a learning rate > 0"),  # torch's "Invalid learning rate" before
        ("--model.lr=abc", "model.lr: Expected a <class 'float'>"),
        ("--model.no_such_option=3", "unrecognized arguments: --model.no_such_option=3"),
    ],
)
def test_a_bad_config_value_is_one_line(in_tmp, capsys, option, says):
    code = exit_code(["fit", "-c", str(TINY), option, "--trainer.logger=false", "--trainer.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("lightning-spec: error: ") and says in err[-1]
    assert not any("Traceback" in line or line.startswith("usage:") for line in err)


@pytest.mark.parametrize("content", [None, b"", b"garbage"])
def test_offline_evaluate_of_a_missing_or_broken_checkpoint_is_one_line(in_tmp, capsys, tiny_target, content):
    """``evaluate`` with a missing or empty checkpoint ended in FileNotFoundError / EOFError."""
    generate_rollouts(tiny_target, [[5, 6, 7]], T1, n_per_prompt=1, max_new_tokens=4, out_dir=in_tmp / "rollouts",
                      progress=False)
    ckpt = in_tmp / "drafter.ckpt"
    if content is not None:
        ckpt.write_bytes(content)
    code = exit_code(["evaluate", "--drafters", f"[{ckpt}]", "--rollouts", str(in_tmp / "rollouts")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("lightning-spec: error: ") and str(ckpt) in err[-1]
    assert not any("Traceback" in line for line in err)
