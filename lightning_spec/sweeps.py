"""``lightning-spec sweep -c sweeps/X.yaml``: an Optuna study whose every trial is a ``fit`` run in MLflow.

A trial is ``lightning-spec fit -c runs/sweeps/<study>/trial-<n>.yaml`` run in this process through the same
``run_cli`` as ``fit``: the trial's YAML is ``base`` with the sweep's fixed ``overrides`` and the sampled
``space`` values written in at their dotted keys. Only two things are added on top: ``trainer.logger`` points at
the trial's MLflow child run, and a ``TrialReporter`` callback reports the metric to Optuna at every
validation (for the pruner) and reads the final values. There is no second training path; the child run
holds ``trial-<n>.yaml`` and ``fit_command.txt``, the command that trains the same drafter again.

Storage and workers. The study lives in an Optuna RDB (``sqlite:///optuna.db`` by default, PostgreSQL or
MySQL for workers on several machines); a second ``sweep`` with the same ``study_name`` joins the study.
``n_trials`` is the study's total: COMPLETE + PRUNED + trials that failed on their own (user attr ``error``).
Every worker claims a trial under a lock held around "count the trials; ask()" (a file lock next to a SQLite
file, ``pg_advisory_lock`` on PostgreSQL, ``GET_LOCK`` on MySQL), so two workers never both start the last
trial. A trial records its worker (host, pid, process start time) and heartbeats; a trial left RUNNING by a
dead worker (same host: the process is gone; any host: no heartbeat for ``grace_period`` seconds) is marked
FAIL with user attr ``interrupted``, does not count, and its parameters are enqueued again, so restarting a
killed sweep with the same command finishes the remaining trials without repeating finished ones.

MLflow. One parent run per study (named after it: search space, base config, best trial, comparison plots)
and one nested child run ``trial-<n>`` per trial (the fit's params, ``config.yaml`` and ``val/*`` curves, tags
``state`` = complete / pruned / failed / interrupted and ``error``; run status FINISHED / KILLED / FAILED).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import io
import itertools
import json
import math
import os
import shlex
import signal
import socket
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import optuna
from lightning.pytorch.callbacks import Callback
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from lightning_spec.evaluation.cli import absolute_sqlite_uri

PARENT_ATTR = "mlflow_parent_run_id"  # study user attr: the MLflow parent run of the study
CONFIG_ATTR = "sweep_config"  # study user attr: what a joining worker must agree with
CHOICE_TYPES = (str, int, float, bool, type(None))  # what Optuna stores as a categorical value


# ---------------------------------------------------------------------------------------------- the space
@dataclass
class Param:
    """One entry of ``space:``: a dotted config key, its Optuna name and distribution.

    ``values`` maps a categorical's Optuna value (a name) to the config value it stands for, when the choices
    are given as a mapping (``choices: {kl_decay: {class_path: ...}, ...}``); Optuna stores only the name.
    """

    key: str
    name: str
    distribution: BaseDistribution
    values: dict[str, Any] | None = None

    def config_value(self, value: Any) -> Any:
        return self.values[value] if self.values is not None else value

    def describe(self) -> str:
        d = self.distribution
        if isinstance(d, CategoricalDistribution):
            return "choices " + ", ".join(str(c) for c in d.choices)
        kind = "int" if isinstance(d, IntDistribution) else "float"
        extra = " log" if d.log else (f" step {d.step}" if d.step not in (None, 1) else "")
        return f"{kind} [{d.low}, {d.high}]{extra}"


def _number(value: Any, field: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{field} must be a number, got {value!r}.")
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{field} must be a number, got {value!r}.") from None
    return value


def short_name(key: str) -> str:
    """``model.drafter.init_args.block_size`` -> ``block_size``: the last part that is not ``init_args``."""
    parts = [p for p in key.split(".") if p != "init_args"]
    return parts[-1] if parts else key


def parse_space(space: dict[str, Any]) -> list[Param]:
    """``space:`` of a sweep YAML -> params. Each entry is ``{choices: [...] | {name: value}}`` or
    ``{low, high, log?, step?}`` (int when both bounds are ints), with an optional ``name`` (default: the
    key's last part that is not ``init_args``)."""
    if not space:
        raise ValueError("space is empty: give at least one dotted config key with choices or low/high.")
    params = []
    for key, spec in space.items():
        field = f"space.{key}"
        if not isinstance(spec, dict):
            raise ValueError(f"{field} must be a mapping with `choices` or `low`/`high`, got {spec!r}.")
        unknown = set(spec) - {"choices", "low", "high", "log", "step", "name"}
        if unknown:
            raise ValueError(f"{field} has unknown fields {sorted(unknown)}; use choices, low, high, log, step, name.")
        name = str(spec.get("name") or short_name(key))
        if "choices" in spec:
            choices = spec["choices"]
            values = None
            if isinstance(choices, dict):  # name -> config value (a class_path block, a list ...)
                values = {str(k): v for k, v in choices.items()}
                choices = list(values)
            if not isinstance(choices, list) or not choices:
                raise ValueError(f"{field}.choices must be a non-empty list or a mapping name -> value.")
            bad = [c for c in choices if not isinstance(c, CHOICE_TYPES)]
            if bad:
                raise ValueError(
                    f"{field}.choices holds {bad[0]!r}, which Optuna cannot store: give the choices as a mapping "
                    "name -> value (e.g. `choices: {kl_decay: {class_path: ...}}`); the name is the trial's param."
                )
            params.append(Param(key, name, CategoricalDistribution(choices), values))
        elif "low" in spec and "high" in spec:
            low, high = _number(spec["low"], f"{field}.low"), _number(spec["high"], f"{field}.high")
            log, step = bool(spec.get("log", False)), spec.get("step")
            if low >= high:
                raise ValueError(f"{field} needs low < high, got low={low}, high={high}.")
            if isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int)):
                params.append(Param(key, name, IntDistribution(low, high, log=log, step=step or 1)))
            else:
                step = None if step is None else float(_number(step, f"{field}.step"))
                params.append(Param(key, name, FloatDistribution(float(low), float(high), log=log, step=step)))
        else:
            raise ValueError(f"{field} needs `choices` or both `low` and `high`.")
    names = [p.name for p in params]
    for p in params:
        if names.count(p.name) > 1:
            raise ValueError(f"space.{p.key}: the param name {p.name!r} is taken twice; give each a `name:`.")
    return params


def grid_of(params: list[Param]) -> dict[str, list[Any]]:
    """The search space of the grid sampler: every param must be categorical."""
    for p in params:
        if not isinstance(p.distribution, CategoricalDistribution):
            raise ValueError(f"sampler=grid needs `choices` for every space entry; space.{p.key} is a range.")
    return {p.name: list(p.distribution.choices) for p in params}


def plain(value: Any) -> Any:
    """jsonargparse Namespaces (what a parsed ``dict`` option holds) back to dicts, all the way down."""
    from jsonargparse import Namespace

    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML as ``fit -c`` reads it (jsonargparse's loader: ``3e-3`` is a float)."""
    from jsonargparse import get_loader

    config = get_loader("yaml")(Path(path).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a YAML mapping.")
    return config


def trial_config(
    base: dict[str, Any], overrides: dict[str, Any], params: list[Param], values: dict[str, Any]
) -> dict[str, Any]:
    """``base`` with the fixed ``overrides`` and the sampled values written in, as editing the YAML would: a
    value replaces what the key held, a whole ``class_path`` block included. (``fit``'s command-line
    ``--model.objective={...}`` would instead keep the old block's init_args that the new class also takes, so
    E2E would inherit ``normalize`` from the base's Objective.) Keys apply shallow to deep: a whole block
    before a key inside it, the fixed overrides before the space's at the same depth."""
    pairs = [(k, v) for k, v in overrides.items()]
    pairs += [(p.key, p.config_value(values[p.name])) for p in params if p.name in values]
    pairs.sort(key=lambda kv: kv[0].count("."))
    config = copy.deepcopy(base)
    for key, value in pairs:
        node = config
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = copy.deepcopy(value)
    return config


def write_yaml(config: dict[str, Any], path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def check_config(config: dict[str, Any]) -> None:
    """Parse a trial's config as ``fit -c trial.yaml --print_config`` would (no model is loaded): a typo in a
    key or a value of the wrong type is an error before any trial runs."""
    from lightning_spec.cli import run_cli

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        try:
            run_cli(["fit", "-c", str(write_yaml(config, Path(tmp) / "trial.yaml")), "--print_config"],
                    exit_on_error=False)
        except SystemExit as exit_:  # --print_config exits 0 after printing
            if exit_.code not in (0, None):
                raise


# ------------------------------------------------------------------------------------------------ locking
class StudyLock:
    """A lock every worker of one study shares: a file lock next to a SQLite file, a session advisory lock on
    PostgreSQL (``pg_advisory_lock``), ``GET_LOCK`` on MySQL. Database locks go with the connection, so a
    killed worker never leaves one behind."""

    def __init__(self, url: str, study_name: str) -> None:
        from sqlalchemy.engine import make_url

        self.url = url
        parsed = make_url(url)
        self.backend = parsed.get_backend_name()
        digest = hashlib.sha256(f"lightning_spec.sweep:{study_name}".encode()).digest()
        self.key = int.from_bytes(digest[:8], "big", signed=True)  # pg advisory keys are bigint
        self.name = "lightning_spec:" + digest.hex()[:40]  # MySQL lock names: at most 64 characters
        if self.backend == "sqlite":
            database = parsed.database
            if not database or database == ":memory:":
                raise ValueError("storage: an in-memory SQLite study is not shared; use sqlite:///optuna.db.")
            from filelock import FileLock

            self._file = FileLock(str(Path(database).resolve()) + ".lock")
        elif self.backend in ("postgresql", "mysql", "mariadb"):
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            self._engine = create_engine(url, poolclass=NullPool)
        else:
            raise ValueError(
                f"storage {parsed.render_as_string(hide_password=True)!r}: sweeps need an Optuna RDB URL "
                "(sqlite:///optuna.db, postgresql://..., mysql://...)."
            )

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.backend == "sqlite":
            with self._file:
                yield
            return
        from sqlalchemy import text

        with self._engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            if self.backend == "postgresql":
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            else:
                conn.execute(text("SELECT GET_LOCK(:n, -1)"), {"n": self.name})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": self.name})


# ------------------------------------------------------------------------------------------------ workers
def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux /proc), to tell a reused pid from the worker that had it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return None if fields[0] == "Z" else fields[19]  # state Z: a zombie is dead; field 22 of stat: starttime


def this_worker() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _process_start(pid), "token": uuid.uuid4().hex}


def worker_is_dead(worker: dict[str, Any], me: dict[str, Any]) -> bool:
    """True for a worker of this host whose process is gone (or was replaced); other hosts: unknown (False)."""
    if not isinstance(worker, dict) or worker.get("host") != me["host"]:
        return False
    if worker.get("token") == me["token"]:
        return False
    pid = int(worker.get("pid", -1))
    if pid == me["pid"]:
        return True  # our own pid, recorded by another process: the one that had it before us is gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _process_start(pid)
    if Path("/proc").is_dir():
        return start is None or (worker.get("start") is not None and start != worker["start"])
    return False


class Heartbeat:
    """Records the trial's heartbeat in the RDB every ``interval`` seconds, so workers on other hosts can tell
    a dead worker's trial (Optuna's heartbeat; ``study.optimize`` runs this thread itself, ask/tell does not)."""

    def __init__(self, storage: Any, trial_id: int, interval: int | None) -> None:
        self._stop = threading.Event()
        self._thread = None
        if interval:
            storage.record_heartbeat(trial_id)
            self._thread = threading.Thread(target=self._beat, args=(storage, trial_id, interval), daemon=True)
            self._thread.start()

    def _beat(self, storage: Any, trial_id: int, interval: int) -> None:
        while not self._stop.wait(interval):
            with contextlib.suppress(Exception):  # a missed beat is not worth killing the trial
                storage.record_heartbeat(trial_id)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def counts(trial: FrozenTrial) -> bool:
    """Does the trial count toward ``n_trials``? Yes when it finished on its own: COMPLETE, PRUNED, or FAIL
    with the trial's own error; not when its worker was killed or interrupted (it is run again)."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs and not trial.user_attrs.get("interrupted")


def error_line(err: BaseException) -> str:
    """``Type: message`` on one line, at most 500 characters (jsonargparse's messages span several lines)."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"{type(err).__name__}: {text}".strip()[:500]


# ---------------------------------------------------------------------------------------- trial callback
def objective_label(objective: Any) -> str:
    name = type(objective).__name__
    if name == "Objective" and hasattr(objective, "loss") and hasattr(objective, "position_weight"):
        return f"{type(objective.loss).__name__}+{type(objective.position_weight).__name__}"
    return name


class TrialReporter(Callback):
    """Feeds Optuna from inside the trial's ``fit``: the metric at every validation (step = global step) for
    the pruner, and the final ``val/*`` values, block size and objective when fit ends.

    Not ``optuna_integration.PyTorchLightningPruningCallback``: it reports at ``step=current_epoch``, and our
    validations run every ``val_check_interval`` steps inside one epoch, so Optuna would drop every report after
    an epoch's first (``trial.report`` ignores a step already reported) and prune on stale values. A value is
    reported only when this validation wrote it (the tensor in ``callback_metrics`` changed): the decode
    validation also logs before training, and a metric set by a callback that skipped this validation is old.
    """

    def __init__(self, trial: optuna.Trial, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.final: dict[str, float] = {}
        self.block_size: int | None = None
        self.objective: str | None = None
        self.checkpoint: str | None = None
        self._before: Any = None
        self._reported: set[int] = set()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:
            raise ValueError(
                "a sweep runs each trial in its own process on one device (trainer.devices: 1); for several "
                "GPUs start one sweep worker per GPU (CUDA_VISIBLE_DEVICES) on the same study."
            )
        block = getattr(getattr(pl_module, "drafter", None), "block_size", None)
        self.block_size = int(block) if block is not None else None
        objective = getattr(pl_module, "objective", None)
        self.objective = objective_label(objective) if objective is not None else None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = trainer.callback_metrics.get(self.metric)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.metric)
        step = trainer.global_step
        if value is None or value is self._before or step in self._reported:
            return
        self._reported.add(step)
        self.trial.report(float(value), step)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at step {step}: {self.metric}={float(value):.4g}")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.final = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and v.numel() == 1
        }
        callback = trainer.checkpoint_callback
        self.checkpoint = getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None)

    def value(self) -> float:
        """The trial's objective: the metric's last value (the drafter the trial ends with)."""
        if self.metric not in self.final:
            logged = ", ".join(sorted(k for k in self.final if k.count("/") == 1)) or "nothing"
            raise ValueError(
                f"metric {self.metric!r} was not logged by the trial (it logged {logged}); add the callback that "
                "logs it (SpecDecodeValidation: val/mal, val/tokens_per_s; OfflineEvaluation: val/offline_mal)."
            )
        value = self.final[self.metric]
        if not math.isfinite(value):
            raise FloatingPointError(f"metric {self.metric!r} ended at {value}.")
        return value


# ------------------------------------------------------------------------------------------------- MLflow
class Tracker:
    """The study's MLflow side: a parent run, one nested child run per trial, the summary on the parent."""

    def __init__(self, tracking_uri: str, experiment_name: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = absolute_sqlite_uri(tracking_uri)
        self.experiment_name = experiment_name
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment_id: str | None = None

    def setup(self, study: optuna.Study, info: dict[str, Any], files: dict[str, str]) -> str:
        """The parent run of the study: found through the study, created by its first worker (call under the
        study lock: two workers must not both create it; also the first use of a fresh tracking database)."""
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is None:
            self.experiment_id = self.client.create_experiment(self.experiment_name)
        else:
            self.experiment_id = experiment.experiment_id
        parent = study.user_attrs.get(PARENT_ATTR)
        if parent is not None:
            try:
                self.experiment_id = self.client.get_run(parent).info.experiment_id  # the children go beside it
            except Exception:
                raise ValueError(
                    f"study {study.study_name!r} logs to MLflow parent run {parent}, which tracking_uri={self.uri!r} "
                    "does not hold; give every worker the tracking_uri of the first one."
                ) from None
            self.client.update_run(parent, status="RUNNING")
            return parent
        run = self.client.create_run(self.experiment_id, run_name=study.study_name, tags={
            "lightning_spec.command": "sweep", "optuna.study_name": study.study_name,
        })
        parent = run.info.run_id
        self.client.log_batch(parent, params=[Param(k, str(v)[:6000]) for k, v in info.items()])
        for name, text in files.items():
            self.client.log_text(parent, text, name)
        study.set_user_attr(PARENT_ATTR, parent)
        return parent

    def start_trial(self, parent: str, study_name: str, number: int, params: dict[str, Any]) -> str:
        from mlflow.entities import Param

        run = self.client.create_run(self.experiment_id, run_name=f"trial-{number}", tags={
            "mlflow.parentRunId": parent, "lightning_spec.command": "sweep-trial",
            "optuna.study_name": study_name, "optuna.trial_number": str(number), "state": "running",
        })
        # prefixed: the fit logs its own hyperparameters (lr, ...) into this run, and MLflow params never change
        self.client.log_batch(run.info.run_id, params=[Param(f"sweep/{k}", str(v)) for k, v in params.items()])
        return run.info.run_id

    def logger(self, run_id: str) -> dict[str, Any]:
        """``trainer.logger`` of a trial: the CLI's MLflow logger, writing into the trial's child run."""
        return {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"experiment_name": self.experiment_name, "tracking_uri": self.uri, "run_id": run_id,
                          "log_model": False},
        }

    def end_trial(self, run_id: str, state: str, error: str | None = None) -> None:
        status = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED", "interrupted": "KILLED"}[state]
        self.client.set_tag(run_id, "state", state)
        if error:
            self.client.set_tag(run_id, "error", error)
        self.client.set_terminated(run_id, status)

    def summarize(self, parent: str, study: optuna.Study, metric: str, finished: bool) -> None:
        """Tag the best child, log the best value and params on the parent, and the comparison plots."""
        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        if complete:
            best = study.best_trial
            for t in trials:
                run_id = t.user_attrs.get("mlflow_run_id")
                if run_id is None:
                    continue
                if t.number == best.number:
                    self.client.set_tag(run_id, "best_trial", "true")
                else:
                    with contextlib.suppress(Exception):  # not every child ever had the tag
                        self.client.delete_tag(run_id, "best_trial")
            self.client.set_tag(parent, "best_trial", str(best.number))
            self.client.set_tag(parent, "best_params", json.dumps(best.params)[:5000])
            if best.user_attrs.get("mlflow_run_id"):
                self.client.set_tag(parent, "best_run_id", best.user_attrs["mlflow_run_id"])
            if best.user_attrs.get("checkpoint"):
                self.client.set_tag(parent, "best_checkpoint", best.user_attrs["checkpoint"])
            done = sum(counts(t) for t in trials)
            self.client.log_metric(parent, f"best/{metric}", float(best.value), step=done)
        with tempfile.TemporaryDirectory() as tmp:
            table = Path(tmp) / "trials.json"
            table.write_text(json.dumps([trial_record(t) for t in trials], indent=1))
            self.client.log_artifact(parent, str(table))
            for path in comparison_plots(trials, metric, study.direction, Path(tmp)):
                self.client.log_artifact(parent, str(path), "plots")
        if finished:
            self.client.set_terminated(parent, "FINISHED")


def trial_record(t: FrozenTrial) -> dict[str, Any]:
    attrs = t.user_attrs
    return {
        "number": t.number, "state": attrs.get("state", t.state.name.lower()), "value": t.value,
        "params": t.params, "objective": attrs.get("objective"), "block_size": attrs.get("block_size"),
        "error": attrs.get("error"), "interrupted": attrs.get("interrupted"), "run_id": attrs.get("mlflow_run_id"),
        "metrics": attrs.get("metrics"),
    }


# -------------------------------------------------------------------------------------------------- plots
def _domain_keys(metrics: dict[str, float], metric: str) -> dict[str, str]:
    """Per-domain keys of the metric (``val/mal/<domain>``), else of ``val/mal``."""
    for prefix in (metric, "val/mal"):
        n = len(prefix) + 1
        keys = {k[n:]: k for k in metrics if k.startswith(prefix + "/") and "/" not in k[n:]}
        if keys:
            return keys
    return {}


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def comparison_plots(trials: list[FrozenTrial], metric: str, direction: Any, out: Path) -> list[Path]:
    """PNG files: the metric vs block size per objective, per-domain values of each objective's best trial,
    and the optimisation history. Only trials that completed are compared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    maximize = direction == optuna.study.StudyDirection.MAXIMIZE
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    paths = []
    if done:
        objectives = sorted({str(t.user_attrs.get("objective")) for t in done})
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in objectives:
            mine = [t for t in done if str(t.user_attrs.get("objective")) == name and t.user_attrs.get("block_size")]
            if not mine:
                continue
            ks = sorted({t.user_attrs["block_size"] for t in mine})
            pick = max if maximize else min
            best = [pick(t.value for t in mine if t.user_attrs["block_size"] == k) for k in ks]
            line = ax.plot(ks, best, marker="o", label=name)[0]
            ax.scatter([t.user_attrs["block_size"] for t in mine], [t.value for t in mine], s=12, alpha=0.4,
                       color=line.get_color())
        sizes = sorted({t.user_attrs["block_size"] for t in done if t.user_attrs.get("block_size")})
        if sizes and sizes[0] > 0:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(k) for k in sizes])
            ax.minorticks_off()
        ax.set_xlabel("block size K")
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs block size (line: best trial per K)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "metric_vs_block_size.png"))

        best_per_objective = {}
        for t in done:
            name = str(t.user_attrs.get("objective"))
            other = best_per_objective.get(name)
            if other is None or (t.value > other.value if maximize else t.value < other.value):
                best_per_objective[name] = t
        keys = _domain_keys(next(iter(best_per_objective.values())).user_attrs.get("metrics") or {}, metric)
        if keys:
            domains = sorted(keys)
            fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(best_per_objective) + 2), 4.2))
            width = 0.8 / len(domains)
            names = sorted(best_per_objective)
            shown = []
            for j, domain in enumerate(domains):
                ys = [(best_per_objective[n].user_attrs.get("metrics") or {}).get(keys[domain], math.nan)
                      for n in names]
                ax.bar([i + j * width for i in range(len(names))], ys, width, label=domain)
                shown += [y for y in ys if math.isfinite(y)]
            if shown:  # MAL lives above 1: zoom on the values, not on the bars' zero
                lo, hi = min(shown), max(shown)
                pad = 0.15 * (hi - lo) or 0.05 * max(abs(hi), 1e-3)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(next(iter(keys.values())).rsplit("/", 1)[0] + "/<domain>")
            ax.set_title("per domain, best trial of each objective")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            paths.append(_save(plt, fig, out / "per_domain.png"))

    finished = sorted((t for t in trials if t.state.is_finished()), key=lambda t: t.number)
    if finished:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        styles = {TrialState.COMPLETE: ("o", "complete"), TrialState.PRUNED: ("x", "pruned")}
        for state, (marker, label) in styles.items():
            mine = [t for t in finished if t.state == state and t.value is not None]
            if mine:
                ax.scatter([t.number for t in mine], [t.value for t in mine], marker=marker, label=label)
        xs, ys, best = [], [], None
        for t in finished:
            if t.state == TrialState.COMPLETE and t.value is not None:
                best = t.value if best is None else (max(best, t.value) if maximize else min(best, t.value))
            if best is not None:
                xs.append(t.number)
                ys.append(best)
        if xs:
            ax.step(xs, ys, where="post", color="black", label="best so far")
        failed = [t.number for t in finished if t.state == TrialState.FAIL]
        for n in failed:
            ax.axvline(n, color="red", alpha=0.2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("trial")
        ax.set_ylabel(metric)
        ax.set_title("optimisation history" + (" (red: failed)" if failed else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(plt, fig, out / "optimization_history.png"))
    return paths


# ------------------------------------------------------------------------------------------------ command
def _progress(text: str) -> None:
    # One line per event, not a live bar: Lightning's rich progress bar is live during a trial, and rich allows
    # one live display at a time.
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold cyan]\\[sweep][/] {text}")


def sweep(
    base: str,
    space: dict,
    study_name: str,
    metric: str = "val/mal",
    direction: Literal["maximize", "minimize"] = "maximize",
    n_trials: int | None = None,
    timeout: float | None = None,
    sampler: Literal["tpe", "grid", "random"] = "tpe",
    pruner: Literal["none", "median", "hyperband"] | optuna.pruners.BasePruner = "none",
    overrides: dict | None = None,
    storage: str = "sqlite:///optuna.db",
    tracking_uri: str = "sqlite:///mlflow.db",
    experiment_name: str = "lightning_spec",
    seed: int = 0,
    heartbeat_interval: int | None = 60,
    grace_period: int | None = None,
    dry_run: bool = False,
) -> optuna.Study | None:
    """Run an Optuna study whose every trial is ``lightning-spec fit`` of ``base`` with sampled overrides.

    A second sweep with the same study_name and storage joins the study; the same command after a kill
    finishes what is left. Every trial is a nested MLflow run under the study's parent run.

    Args:
        base: the experiment YAML every trial starts from (as ``fit -c base``).
        space: dotted config key -> ``{choices: [...]}``, ``{choices: {name: value}}`` (a value may be a whole
            class_path block; the name is the trial's param) or ``{low, high, log, step}``; optional ``name``.
        study_name: the Optuna study (and the MLflow parent run's name); workers join by this name.
        metric: what the trial is judged by, its last logged value: val/mal, val/mal/<domain>,
            val/offline_mal, val/tokens_per_s, val/loss ...
        direction: maximize (MAL, tokens/s) or minimize (a loss).
        n_trials: the study's total of finished trials (complete, pruned or failed); null = the grid size
            with sampler=grid, else run until timeout.
        timeout: this worker starts no new trial after this many seconds.
        sampler: tpe (default), grid (every combination of the choices) or random.
        pruner: none, median, hyperband, or any optuna.pruners class_path; fed at every validation.
        overrides: dotted config key -> value written into every trial's config (e.g. a shorter
            trainer.max_steps); a value replaces what the key held, as editing the YAML would.
        storage: the Optuna RDB URL: sqlite:///optuna.db, or postgresql://user:pw@host/db for many workers.
        tracking_uri: MLflow tracking URI of the parent and child runs.
        experiment_name: MLflow experiment of the parent and child runs.
        seed: sampler seed; a trial is drawn with seed + the number of trials already in the study (the same
            command draws the same trials again; two workers never draw alike).
        heartbeat_interval: seconds between a running trial's heartbeats; null = off (then only dead workers of
            this host are detected).
        grace_period: seconds without heartbeat after which a trial of another host counts as dead; null = 5
            heartbeat intervals.
        dry_run: check the space against base (every choice parses as a fit option), print the plan, and stop
            before touching the storage or MLflow.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        raise ValueError("a sweep runs each trial on one device; start one sweep worker per GPU instead of DDP.")
    # plain `dict` types: jsonargparse would build `class_path` blocks typed Any; they stay config values here
    space, overrides = plain(space), plain(overrides or {})
    for key in overrides:
        if key == "trainer.logger" or key.startswith("trainer.logger."):
            raise ValueError("overrides.trainer.logger: the sweep logs every trial to its MLflow child run.")
    params = parse_space(space)
    distributions = {p.name: p.distribution for p in params}
    grid = grid_of(params) if sampler == "grid" else None
    if n_trials is None:
        if grid is None and timeout is None:
            raise ValueError("n_trials (or timeout) is needed unless sampler=grid, which runs the whole grid.")
        n_trials = math.prod(len(v) for v in grid.values()) if grid is not None else None
    if not Path(base).is_file():
        raise ValueError(f"base={base!r} is not a file (a path relative to the working folder, like fit -c).")
    storage = absolute_sqlite_uri(storage)
    identity = {"base": base, "metric": metric, "direction": direction, "overrides": overrides, "space": space,
                "sampler": sampler, "seed": seed}  # (a grid's seed orders it: every worker needs the same)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*Heartbeat of storage is supposed to be used with Study.optimize.*")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended to run from within")
    base_config = load_yaml(base)
    # a typo in a key or a value of the wrong type: an error now, not n failed trials
    for where, values in probes(params):
        try:
            check_config(trial_config(base_config, overrides, params, values))
        except Exception as err:  # jsonargparse's message names the key
            raise ValueError(f"{where} does not parse with {base}: {error_line(err)}") from None
    if dry_run:
        print_plan(base, overrides, params, grid, sampler, n_trials)
        return None

    lock = StudyLock(storage, study_name)
    me = this_worker()

    def stale_trial(study: optuna.Study, trial: FrozenTrial) -> None:  # failed by Optuna's heartbeat check
        _requeue(study, trial, tracker, "no heartbeat")

    with lock():  # the tables of fresh databases and the parent run are created once, by one worker
        tracker = Tracker(tracking_uri, experiment_name)
        rdb = optuna.storages.RDBStorage(
            storage, heartbeat_interval=heartbeat_interval,
            grace_period=grace_period or (5 * heartbeat_interval if heartbeat_interval else None),
            heartbeat_stale_trial_callback=stale_trial if heartbeat_interval else None,
        )
        study = optuna.create_study(storage=rdb, study_name=study_name, direction=direction, load_if_exists=True)
        if study.direction.name.lower() != direction:
            created = study.direction.name.lower()
            raise ValueError(f"direction={direction}, but study {study_name!r} was created to {created}.")
        recorded = study.user_attrs.get(CONFIG_ATTR)
        if recorded is None:
            study.set_user_attr(CONFIG_ATTR, identity)
        else:
            for key in identity:
                if json.dumps(recorded.get(key), sort_keys=True) != json.dumps(identity[key], sort_keys=True):
                    raise ValueError(
                        f"{key} differs from the one study {study_name!r} was started with; a study is one search: "
                        "use a new study_name."
                    )
        info = {"study_name": study_name, "storage": _hide_password(storage), "base": base, "metric": metric,
                "direction": direction, "sampler": sampler, "pruner": _name(pruner), "n_trials": n_trials,
                "timeout": timeout, "overrides": json.dumps(overrides),
                **{f"space/{p.name}": f"{p.key}: {p.describe()}" for p in params}}
        files = {"sweep.json": json.dumps({**identity, **info}, indent=1), "base.yaml": Path(base).read_text()}
        parent = tracker.setup(study, info, files)
    study = optuna.load_study(study_name=study_name, storage=rdb, sampler=_sampler(sampler, grid, seed),
                              pruner=_pruner(pruner))

    started = time.monotonic()
    _progress(f"study {study_name!r} in {_hide_password(storage)}; MLflow parent run {parent} ({tracker.uri})")
    with _remember_interrupts() as interrupted:
        _work(study, lock, me, tracker, rdb, parent, base_config, overrides, params, distributions, metric,
              sampler, grid, seed, n_trials, timeout, started, heartbeat_interval, interrupted)

    with lock():
        trials = study.get_trials(deepcopy=False)
        finished = not any(t.state == TrialState.RUNNING for t in trials) and (
            n_trials is None or sum(counts(t) for t in trials) >= n_trials)
        tracker.summarize(parent, study, metric, finished)
    _progress(_standing(study, n_trials, metric) + ("" if finished else " (other workers still running)"))
    return study


@contextlib.contextmanager
def _remember_interrupts() -> Iterator[threading.Event]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: Python drops an exception raised inside
    a ``__del__`` (garbage collection during a trial), and then the sweep still stops after that trial."""
    seen = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None):  # ignored on purpose (a background job of a script, nohup)
        yield seen
        return

    def on_interrupt(signum: int, frame: Any) -> None:
        seen.set()
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _work(
    study: optuna.Study, lock: StudyLock, me: dict[str, Any], tracker: Tracker, rdb: Any, parent: str,
    base_config: dict[str, Any], overrides: dict[str, Any], params: list[Param],
    distributions: dict[str, BaseDistribution], metric: str, sampler: str, grid: dict[str, list[Any]] | None,
    seed: int, n_trials: int | None, timeout: float | None, started: float, heartbeat_interval: int | None,
    interrupted: threading.Event,
) -> None:
    """Claim a trial under the lock, run it, until the study has its n_trials or this worker its timeout."""
    while True:
        if interrupted.is_set():
            _progress("interrupted: no new trial (the same command resumes the study)")
            raise KeyboardInterrupt
        if timeout is not None and time.monotonic() - started > timeout:
            _progress(f"timeout ({timeout:g} s): no new trial")
            break
        with lock():
            _reap(study, me, tracker)
            with contextlib.suppress(Exception):
                optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            done = sum(counts(t) for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if n_trials is not None and done + running >= n_trials:
                trial = None
            else:
                if sampler != "grid":  # (the grid's seed shuffles the grid: it must stay the same for the study)
                    # seeded by the trial's place in the study: one worker is reproducible, two never draw alike
                    study.sampler = _sampler(sampler, grid, seed + len(trials))
                trial = study.ask(distributions)
                trial.set_user_attr("worker", me)
        if trial is None:
            break
        _run_trial(study, trial, rdb, tracker, parent, base_config, overrides, params, metric, heartbeat_interval,
                   n_trials)


def print_plan(
    base: str, overrides: dict[str, Any], params: list[Param], grid: dict[str, list[Any]] | None, sampler: str,
    n_trials: int | None,
) -> None:
    print(f"{n_trials if n_trials is not None else 'until timeout:'} trials, sampler {sampler}; each trial is "
          f"`lightning-spec fit -c trial.yaml`, trial.yaml = {base} with")
    for key, value in overrides.items():
        print(f"  {key}: {json.dumps(value)}")
    for p in params:
        print(f"  {p.key}: <{p.name}: {p.describe()}>")
    if grid is not None:
        names = list(grid)
        for i, combo in enumerate(itertools.product(*grid.values())):
            print(f"  grid point {i}: " + ", ".join(f"{n}={v}" for n, v in zip(names, combo)))


def probes(params: list[Param]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Values to parse before the first trial: every choice of every categorical once, the others at their
    first choice or lower bound."""
    first = {p.name: p.distribution.choices[0] if isinstance(p.distribution, CategoricalDistribution)
             else p.distribution.low for p in params}
    yield "space", first
    for p in params:
        if isinstance(p.distribution, CategoricalDistribution):
            for choice in p.distribution.choices[1:]:
                yield f"space.{p.key} = {choice!r}", {**first, p.name: choice}


def _name(pruner: Any) -> str:
    return pruner if isinstance(pruner, str) else type(pruner).__name__


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    with contextlib.suppress(Exception):
        return make_url(url).render_as_string(hide_password=True)
    return url


class _Grid(optuna.samplers.GridSampler):
    """GridSampler without its ``study.stop()`` when the grid is used up: that only works inside
    ``study.optimize`` (ask/tell raises); the sweep stops on its own count of trials."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


def _sampler(name: str, grid: dict[str, list[Any]] | None, seed: int) -> optuna.samplers.BaseSampler:
    if name == "grid":
        return _Grid(grid, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(pruner: Any) -> optuna.pruners.BasePruner:
    if not isinstance(pruner, str):
        return pruner
    return {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
            "hyperband": optuna.pruners.HyperbandPruner}[pruner]()


def _requeue(study: optuna.Study, trial: FrozenTrial, tracker: Tracker, why: str) -> None:
    """A trial whose worker died or was interrupted: run its params again (it does not count)."""
    study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
    run_id = trial.user_attrs.get("mlflow_run_id")
    if run_id:
        with contextlib.suppress(Exception):
            tracker.end_trial(run_id, "interrupted", why)
    _progress(f"trial {trial.number} was interrupted ({why}): its params run again")


def _reap(study: optuna.Study, me: dict[str, Any], tracker: Tracker) -> None:
    """Trials left RUNNING by a dead worker of this host: FAIL + ``interrupted``, params enqueued again. Called
    under the study lock, where a RUNNING trial without a worker can only be one whose worker died between
    ``ask()`` and recording itself (both happen under the lock)."""
    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is not None and not worker_is_dead(worker, me):
            continue
        why = "its worker died before it started" if worker is None else (
            f"worker {worker.get('host')}:{worker.get('pid')} is gone")
        try:
            storage.set_trial_user_attr(t._trial_id, "interrupted", why)
            if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another worker got there first
        _requeue(study, t, tracker, why)


def _standing(study: optuna.Study, n_trials: int | None, metric: str) -> str:
    trials = study.get_trials(deepcopy=False)
    done = sum(counts(t) for t in trials)
    text = f"{done}/{n_trials if n_trials is not None else '?'} trials finished"
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        shown = ", ".join(f"{k}={v}" for k, v in best.params.items())
        text += f"; best {metric}={best.value:.4f} (trial {best.number}: {shown})"
    return text


def _run_trial(
    study: optuna.Study, trial: optuna.Trial, rdb: Any, tracker: Tracker, parent: str,
    base_config: dict[str, Any], overrides: dict[str, Any], params: list[Param], metric: str,
    heartbeat_interval: int | None, n_trials: int | None,
) -> None:
    from lightning_spec.cli import run_cli

    heartbeat = Heartbeat(rdb, trial._trial_id, heartbeat_interval)
    run_id = None
    try:
        run_id = tracker.start_trial(parent, study.study_name, trial.number, trial.params)
        trial.set_user_attr("mlflow_run_id", run_id)
        if any(p.name == "objective" and p.key == "model.objective" for p in params):
            trial.set_user_attr("objective", trial.params["objective"])
        config = trial_config(base_config, overrides, params, trial.params)
        path = write_yaml(config, Path("runs") / "sweeps" / study.study_name / f"trial-{trial.number}.yaml")
        tracker.client.log_artifact(run_id, str(path))
        # the logger only on the command line: `fit -c trial-<n>.yaml` alone reproduces the trial as a new run
        args = ["fit", "-c", str(path), f"--trainer.logger={json.dumps(tracker.logger(run_id))}"]
        tracker.client.log_text(run_id, shlex.join(["lightning-spec", *args[:3]]) + "\n", "fit_command.txt")
        shown = ", ".join(f"{k}={v}" for k, v in trial.params.items())
        _progress(f"trial {trial.number} ({shown}) -> MLflow run {run_id}")
        reporter = TrialReporter(trial, metric)
        state, value, error = "failed", None, None
        try:
            run_cli(args, callbacks=[reporter], exit_on_error=False)
            value = reporter.value()
            state = "complete"
        except optuna.TrialPruned as err:
            state, error = "pruned", str(err)
        except Exception as err:  # NaN loss, out of memory, a bad sampled config: this trial fails, the study goes on
            error = error_line(err)
            with contextlib.suppress(Exception):
                tracker.client.log_text(run_id, traceback.format_exc(), "error.txt")
        if reporter.block_size is not None:
            trial.set_user_attr("block_size", reporter.block_size)
        if "objective" not in trial.user_attrs and reporter.objective is not None:
            trial.set_user_attr("objective", reporter.objective)
        if reporter.final:
            trial.set_user_attr("metrics", reporter.final)
        if reporter.checkpoint:
            trial.set_user_attr("checkpoint", str(Path(reporter.checkpoint).resolve()))
        try:
            trial.set_user_attr("state", state)
            if error:
                trial.set_user_attr("error", error)
            if state == "complete":
                study.tell(trial, value)
            else:
                study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
        except Exception:
            if study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                raise
            # failed meanwhile by another worker that saw no heartbeat: it was enqueued again there
            state, value, error = "interrupted", None, "failed by another worker: no heartbeat in the grace period"
        tracker.end_trial(run_id, state, error)
    except BaseException as err:  # KeyboardInterrupt (Lightning turns it into SystemExit): stop the sweep
        if isinstance(err, Exception):
            raise
        why = f"stopped by {type(err).__name__} in its worker"
        with contextlib.suppress(Exception):
            study._storage.set_trial_user_attr(trial._trial_id, "interrupted", why)
            if study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                _requeue(study, study._storage.get_trial(trial._trial_id), tracker, why)
        with contextlib.suppress(Exception):
            tracker.client.set_terminated(parent, "KILLED")
        raise
    finally:
        heartbeat.stop()
        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result = f"{metric}={value:.4f}" if value is not None else (error or "")
    _progress(f"trial {trial.number} {state}: {result} | {_standing(study, n_trials, metric)}")
