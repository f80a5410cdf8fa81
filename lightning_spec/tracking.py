"""MLflow in one place: the tracking store, the run a ``fit`` logs to, and what is shown or saved about it.

Every run lives in an MLflow tracking store (``sqlite:///mlflow.db`` of the working folder by default, a database
or a tracking server for teams). This module is the only one that talks to MLflow for ``fit`` and ``evaluate``;
the sweep's study tracker (``sweeps/tracker.py``) opens its store here too.

- ``store_lock`` / ``open_store``: a client whose store is created once. MLflow creates the tables of a fresh
  SQLite file on first use, so two processes started together on a fresh ``mlflow.db`` both create them and the
  second crashes (``table latest_metrics already exists``); a file lock beside the database serialises that
  first use (and the creation of an experiment).
- ``mask_uri``: ``user:password@`` becomes ``user:***@`` wherever a URI is printed, logged or saved (the resolved
  config is an artifact of every run, and a PostgreSQL tracking URI carries its password).
- ``prepare_loggers``: before the CLI builds the trainer's MLFlowLogger, through its constructor arguments: the
  store, the run a checkpoint was written by (``fit --ckpt_path`` continues it), and the run's name.
- ``SaveConfigToTracker``: the resolved YAML as the run's ``config.yaml``, and the ``error`` tag of a failed fit.
- ``checkpoint_record`` (into every checkpoint), ``run_summary`` (printed when ``fit`` ends), ``log_runs``
  (``evaluate --mlflow``).
- ``log_drafter``: when ``fit`` ends, the trained drafter as the run's logged model (MLflow's Models column): the
  folder ``checkpoint.write_model_folder`` writes (the layout vLLM serves where the family exports, else the
  drafter's own, with a ``README.md`` card and the fit's provenance); this module only logs it.
- ``ensure_experiment``, ``log_comparison``, ``runs_link``: one experiment per target, opened on its runs table with
  the columns that compare drafters (docs/sweeps.md, "Comparing drafters in MLflow").
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import Logger, MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_spec.errors import UserError

if TYPE_CHECKING:
    from lightning_spec.datamodule import SpecDataModule
    from lightning_spec.drafters.base import Drafter
    from lightning_spec.target import Target

MLFLOW_RUN_KEY = "mlflow_run_id"  # checkpoint key: the MLflow run that wrote it (continued by `fit --ckpt_path`)
# One experiment per target: ``{target}`` in an experiment name is the run's target (``experiment_name``). A name
# without it (a user's own) is taken as written.
DEFAULT_EXPERIMENT = "lightning_spec: {target}"
EVALUATE_EXPERIMENT = "lightning_spec: {target}, evaluate"  # `evaluate --mlflow`: one run per arm
SWEEP_EXPERIMENT = "lightning_spec: {target}, sweep {study}"  # its parent run and trials ("/" nests in the UI)
DEFAULT_LOGGER = {  # trainer.logger of every fit unless the YAML says otherwise
    "class_path": "lightning.pytorch.loggers.MLFlowLogger",
    "init_args": {"experiment_name": DEFAULT_EXPERIMENT, "tracking_uri": "sqlite:///mlflow.db", "log_model": False},
}
# MLflow's UI opens an experiment on its runs table (not its GenAI traces overview) for this experiment kind ...
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# ... and, from ``?viewStateShareKey=drafters``, with the columns that compare drafters (a view MLflow keeps in
# the experiment tag ``mlflow.sharedViewState.drafters``). MLflow 3.17 follows its GenAI / Model training switch
# over the experiment kind, so the link also says ``workflowType=machine_learning`` (``runs_link``).
VIEW_KEY = "drafters"
COMPARISON_COLUMNS = [  # MLflow column ids: what a drafter researcher sorts by (``comparison_of``)
    "params.`family`", "params.`objective`", "params.`K`", "params.`draft_vocab`", "params.`target`",
    "params.`train_examples`", "metrics.`steps`", "metrics.`val/mal`", "metrics.`val/temp1/mal`",
    "metrics.`val/offline_mal`", "metrics.`val/speedup`", "metrics.`val/auto/speedup`", "tags.`decoding_auto`",
    "attributes.`Dataset`", "attributes.`Models`",
]

# scheme://user:password@host: the password is whatever runs up to the last "@" before the host's "/".
_CREDENTIALS = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s/]+(?=@)")


def mask_uri(text: str) -> str:
    """Every ``scheme://user:password@host`` in ``text`` as ``scheme://user:***@host`` (SQLAlchemy's mask)."""
    return _CREDENTIALS.sub(r"\g<head>***", text)


def absolute_sqlite_uri(uri: str) -> str:
    """``sqlite:///mlflow.db`` -> ``sqlite:////abs/cwd/mlflow.db``. MLflow caches one store per URI string for the
    life of the process, so a relative URI would keep writing to the folder of its first use."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory SQLite)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    return Path(database) if database and database != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str, field: str = "tracking_uri") -> Iterator[None]:
    """Held while a process first opens the store ``uri`` and creates an experiment in it. MlflowClient creates
    the store, and the store the tables of a fresh SQLite file; the first run of an experiment creates the
    experiment: one process at a time, so the next finds both made. A file lock beside a SQLite file (every
    process of ours that opens one comes through here); nothing for a server, which creates its tables once.
    ``field`` names the option in the one-sentence error for a SQLite file in a folder that cannot be written."""
    database = sqlite_file(uri)
    if database is None:
        yield
        return
    from filelock import FileLock

    from lightning_spec.files import writable_dir

    writable_dir(database.resolve().parent, field)
    with FileLock(str(database.resolve()) + ".lock"):
        yield


def open_store(uri: str, field: str = "tracking_uri") -> Any:
    """An ``MlflowClient`` on ``uri`` whose store exists."""
    from mlflow.tracking import MlflowClient

    with store_lock(uri, field):
        return MlflowClient(tracking_uri=uri)


def experiment_name(template: str, target: str | None, study: str | None = None) -> str:
    """The experiment a run of ``target`` logs to: ``template`` with ``{target}`` filled (a local folder by its
    name) and, for a sweep, ``{study}``; a template that names neither is taken as written."""
    label = Path(target).name if target and os.path.isdir(target) else (target or "unknown target")
    name = template.replace("{target}", label)
    return name.replace("{study}", study) if study is not None else name


def comparison_view() -> str:
    """The runs table MLflow shows from ``?viewStateShareKey=drafters``: the comparison columns in their order (the
    run's dataset narrow), best MAL first."""
    order = ["attributes.`Run Name`", *COMPARISON_COLUMNS]
    return json.dumps({"selectedColumns": COMPARISON_COLUMNS, "columnOrder": order,
                       "columnWidths": {"attributes.`Dataset`": 180}, "orderByKey": "metrics.`val/mal`",
                       "orderByAsc": False})


def ensure_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created if missing (by whichever process gets there first), tagged as model
    development (its runs open first) with the comparison view; an existing experiment keeps a kind set by hand."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        experiment = client.get_experiment_by_name(name)  # ours, or the one another process created meanwhile
    experiment_id, tags = experiment.experiment_id, experiment.tags
    if EXPERIMENT_KIND[0] not in tags:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    view = comparison_view()
    if tags.get(f"mlflow.sharedViewState.{VIEW_KEY}") != view:
        client.set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{VIEW_KEY}", view)
    return experiment_id


# ------------------------------------------------------------------------------------------------ fit runs
def _is_mlflow_logger(entry: Any) -> bool:
    """Is a parsed ``trainer.logger`` entry (``{class_path, init_args}``) an MLFlowLogger or a subclass?"""
    class_path = entry.get("class_path") if hasattr(entry, "get") else None
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, MLFlowLogger)


def _tracking_uri(init_args: Any) -> str:
    """The URI an MLFlowLogger with these arguments logs to (its own default: $MLFLOW_TRACKING_URI, else files)."""
    return init_args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or (
        "file:" + str(init_args.get("save_dir") or "./mlruns"))


def checkpoint_run_id(path: str) -> str | None:
    """The MLflow run that wrote the checkpoint ``path`` (``--ckpt_path``), read without loading its tensors."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip checkpoint, or an empty, broken or code-carrying file: one sentence for those
        from lightning_spec.checkpoint import read_checkpoint

        ckpt = read_checkpoint(path, "--ckpt_path")
    return ckpt.get(MLFLOW_RUN_KEY) if isinstance(ckpt, dict) else None


def prepare_loggers(
    logger_config: Any, resume_run: str | None, run_name: str | None, target: str | None = None
) -> None:
    """Fill the MLFlowLogger entries of a parsed ``trainer.logger`` before the CLI builds them.

    The store, and the experiment of a new run, are created now (under ``store_lock``). ``resume_run`` (the run
    a ``--ckpt_path`` checkpoint was written by) becomes the logger's ``run_id`` when the store holds it, so a
    resumed training is one run with its metrics before and after; ``run_name`` (the experiment file's name)
    names a new run: MLflow's own random names repeat here, because they come from Python's RNG, which
    ``seed_everything`` has just reset; ``{target}`` in the experiment name becomes ``target`` (one experiment per
    target, ``experiment_name``). What the user set is kept. Runs on every rank, so all ranks build the same
    loggers."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    entries = logger_config if isinstance(logger_config, list) else [logger_config]
    for entry in entries:
        if not _is_mlflow_logger(entry):
            continue
        init = entry.get("init_args")
        if init is None:
            continue
        uri = absolute_sqlite_uri(_tracking_uri(init))
        if init.get("tracking_uri"):  # MLflow caches a store per URI string: a relative one follows the first cwd
            init["tracking_uri"] = uri
        with store_lock(uri, "trainer.logger.init_args.tracking_uri"):
            client = MlflowClient(tracking_uri=uri)
            if resume_run is not None and init.get("run_id") is None:
                try:
                    client.get_run(resume_run)
                    init["run_id"] = resume_run
                except MlflowException:
                    rank_zero_warn(f"--ckpt_path was written by MLflow run {resume_run}, which is not in the "
                                   f"tracking store {mask_uri(uri)}; logging the resumed training to a new run.")
            if init.get("experiment_name"):
                init["experiment_name"] = experiment_name(init["experiment_name"], target)
            if init.get("run_id") is None:  # the logger will create a run, in this experiment
                name = init.get("experiment_name") or "lightning_logs"
                ensure_experiment(client, name, init.get("artifact_location"))
                if run_name and init.get("run_name") is None:
                    init["run_name"] = run_name


def mlflow_loggers(loggers: Iterable[Logger]) -> list[MLFlowLogger]:
    return [lg for lg in loggers if isinstance(lg, MLFlowLogger)]


def started_run(logger: MLFlowLogger) -> str | None:
    """The run the logger has started or was given, without starting one (``logger.run_id`` would create a run,
    and Lightning offers no public "has it started?"; this is the only private access to the logger)."""
    return logger._run_id


def checkpoint_record(loggers: Iterable[Logger]) -> dict[str, str]:
    """What a checkpoint carries about its run: ``{MLFLOW_RUN_KEY: run id}`` (empty without an MLflow logger)."""
    runs = [logger.run_id for logger in mlflow_loggers(loggers)]
    return {MLFLOW_RUN_KEY: runs[0]} if runs else {}


def error_text(err: BaseException) -> str:
    """The ``error`` tag of a failed run: a user error's one sentence, else ``Type: message``; one line."""
    text = " ".join(str(err).split())
    if not isinstance(err, UserError):  # a bug: its type says which
        text = f"{type(err).__name__}: {text}".strip()
    return mask_uri(text)[:5000]  # MLflow's limit on a tag value


class SaveConfigToTracker(SaveConfigCallback):
    """Store the resolved YAML with the run, as the MLflow artifact ``config.yaml`` (MLflow has no log folder),
    credentials in URIs masked; and when the fit fails after its run started, tag the run with the ``error``."""

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        text = mask_uri(self.parser.dump(self.config, skip_none=False))
        for logger in mlflow_loggers(trainer.loggers):
            logger.experiment.log_text(logger.run_id, text, "config.yaml")

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this before it marks the run FAILED; a KeyboardInterrupt is not an error of the run
        if not trainer.is_global_zero or not isinstance(exception, Exception):
            return
        for logger in mlflow_loggers(trainer.loggers):
            run_id = started_run(logger)
            if run_id is not None:
                # the store itself may be what failed: then the run stays FAILED, untagged
                with contextlib.suppress(Exception):
                    logger.experiment.set_tag(run_id, "error", error_text(exception))


def runs_link(uri: str, experiment_id: str) -> str:
    """The page that compares the experiment's drafters: its runs table with the comparison columns. On a tracking
    server its URL; on a local store the page ``mlflow ui`` serves (its default port, 5000)."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    query = f"workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    return mask_uri(f"{base}/#/experiments/{experiment_id}/runs?{query}")


def ui_hint(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """How to look at runs of the store ``uri``: the ``mlflow ui`` command, or the server's page."""
    if uri.startswith(("http://", "https://")):
        page = f"/#/experiments/{experiment_id}/runs/{run_id}" if experiment_id and run_id else ""
        return mask_uri(uri.rstrip("/") + page)
    database = sqlite_file(uri)
    if database is not None and database.is_relative_to(Path.cwd().resolve()):  # as typed from this folder
        uri = "sqlite:///" + str(database.relative_to(Path.cwd().resolve()))
    return "mlflow ui --backend-store-uri " + mask_uri(uri)


def run_summary(loggers: Iterable[Logger]) -> list[str]:
    """Lines printed when ``fit`` ends (rank 0): each MLflow run's id and experiment, and how to see it."""
    lines = []
    for logger in mlflow_loggers(loggers):
        client, run_id, experiment_id = logger.experiment, logger.run_id, logger.experiment_id
        name = client.get_experiment(experiment_id).name
        lines.append(f"MLflow run: {run_id} (experiment {name!r}, id {experiment_id})")
        lines.append(f"see it: {ui_hint(client.tracking_uri, experiment_id, run_id)}")
        lines.append(f"compare the experiment's drafters: {runs_link(client.tracking_uri, experiment_id)}")
    return lines


# ------------------------------------------------------------------------------------------- evaluate runs
def log_runs(tracking_uri: str, experiment_name: str, runs: list[dict[str, Any]]) -> list[str]:
    """One finished run per entry ``{name, tags, params, metrics}`` in ``experiment_name``; returns the run ids."""
    from mlflow.entities import Metric, Param, RunTag

    client = open_store(absolute_sqlite_uri(tracking_uri))
    exp_id = ensure_experiment(client, experiment_name)
    now = int(time.time() * 1000)
    run_ids = []
    for run in runs:
        run_id = client.create_run(exp_id, run_name=run["name"]).info.run_id
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in run["metrics"].items()],
            params=[Param(k, mask_uri(str(v))) for k, v in run["params"].items()],
            tags=[RunTag(k, str(v)) for k, v in run["tags"].items()],
        )
        client.set_terminated(run_id)
        run_ids.append(run_id)
    return run_ids


# ------------------------------------------------------------------------------------------- what runs compare
def comparison_of(drafter: Drafter, objective: str, target: str, target_fingerprint: str,
                  data: SpecDataModule | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What a fit's run is compared by in MLflow (``COMPARISON_COLUMNS``): the drafter's family, the ``objective``'s
    label, K and the draft vocabulary, the target and its weights' fingerprint, the size of the training ``data``;
    and that data as the run's dataset input (None without a ``SpecDataModule``)."""
    vocab = drafter.draft_vocab_size
    params = {"family": drafter.family or type(drafter).__name__, "objective": objective, "K": drafter.block_size,
              "draft_vocab": vocab if vocab is not None else "full", "target": target,
              "target_fingerprint": target_fingerprint}
    if data is None:
        return params, None
    return {**params, "train_examples": len(data.train_dataset)}, data.dataset_input()


def log_comparison(loggers: Iterable[Logger], params: dict[str, Any], data: dict[str, Any] | None) -> None:
    """Record, on each MLflow run of a fit, what drafters are compared by (``COMPARISON_COLUMNS``): ``params``
    under their stable names, and the training ``data`` as the run's dataset input (MLflow's Dataset column:
    ``name``, ``digest``, ``source``, ``rows``). Rank 0; a resumed run already holds them (same values)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    for logger in mlflow_loggers(loggers):
        logger.log_hyperparams(params)
        if data is None:
            continue
        dataset = Dataset(name=data["name"], digest=data["digest"], source_type="local",
                          source=json.dumps({"uri": data["source"]}), profile=json.dumps({"num_rows": data["rows"]}))
        inputs = [DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "training")])]
        try:
            logger.experiment.log_inputs(logger.run_id, datasets=inputs)
        except MlflowException:
            # Fits of one experiment logging the same data at once (sweep workers): MLflow looks the dataset's row
            # up, then inserts it, so the later insert of (experiment, name, digest) fails on the unique key. The
            # row is committed by then: logging again links this run to it.
            logger.experiment.log_inputs(logger.run_id, datasets=inputs)


def tag_runs(loggers: Iterable[Logger], key: str, value: str) -> None:
    """Set the tag ``key`` on each MLflow run of a fit (e.g. ``decoding_auto``, decoding auto's pick). Rank 0."""
    for logger in mlflow_loggers(loggers):
        logger.experiment.set_tag(logger.run_id, key, value)


# --------------------------------------------------------------------------------------- the drafter as a model
DRAFTER_TAG = "drafter_model"  # run tag: the models:/ URI of the run's logged drafter (what to download and serve)


def log_drafter(loggers: Iterable[Logger], ckpt: str, target: Target, target_spec: str) -> list[str]:
    """Log the drafter of ``ckpt`` (a finished fit's last checkpoint) to each MLflow run as its logged model, a
    folder with a card (one copy: the run itself holds no second one); returns the lines ``fit`` prints about it.
    Rank 0 only (the caller's)."""
    from lightning_spec.checkpoint.write import write_model_folder

    runs = [logger for logger in mlflow_loggers(loggers) if started_run(logger)]
    if not runs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_folder(ckpt, Path(tmp) / "drafter", target, target_spec)
        uris = [_log_model(logger, model.folder, model.name, model.params) for logger in runs]
    return [f"drafter: MLflow logged model '{model.name}' of the run ({uris[0]}), {model.layout}"]


def _log_model(logger: MLFlowLogger, folder: Path, name: str, params: dict[str, str]) -> str:
    """``folder`` as a logged model of the logger's run (its output at the last step); returns its models:/ URI."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    client, run_id = logger.experiment, logger.run_id
    model = client.create_logged_model(logger.experiment_id, name=name, source_run_id=run_id, params=params,
                                       model_type="drafter")
    client.log_model_artifacts(model.model_id, str(folder))
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    step = max((m.step for m in client.get_metric_history(run_id, "steps")), default=0)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    uri = f"models:/{model.model_id}"
    client.set_tag(run_id, "drafter_layout", params["layout"])
    client.set_tag(run_id, DRAFTER_TAG, uri)
    return uri
