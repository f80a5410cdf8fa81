"""A sweep worker: claim a trial under the study lock, run it as a ``fit``, record it; until the study is done.

A trial is ``lightning-spec fit -c runs/sweeps/<study>/trial-<n>.yaml`` run in this process through the same
``run_cli`` as ``fit``. Only two things are added on top: ``trainer.logger`` points at the trial's MLflow child
run, and a ``TrialReporter`` callback reports the metric to Optuna at every validation (for the pruner) and
reads the final values. There is no second training path.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shlex
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from lightning_spec.sweeps.locks import StudyLock
from lightning_spec.sweeps.reporter import TrialReporter
from lightning_spec.sweeps.space import Param, quiet_cli_args, trial_config, write_yaml
from lightning_spec.sweeps.tracker import Tracker
from lightning_spec.sweeps.workers import Heartbeat, counts, fail_interrupted, reap, this_worker, trial_id
from lightning_spec.tracking import mask_uri


def progress(text: str) -> None:
    # One line per event, not a live bar: Lightning's rich progress bar is live during a trial, and rich allows
    # one live display at a time.
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold cyan]\\[sweep][/] {text}")


def error_line(err: BaseException) -> str:
    """``Type: message`` on one line, at most 500 characters (jsonargparse's messages span several lines)."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return mask_uri(f"{type(err).__name__}: {text}".strip())[:500]


def standing(study: optuna.Study, n_trials: int | None, metric: str) -> str:
    trials = study.get_trials(deepcopy=False)
    done = sum(counts(t) for t in trials)
    text = f"{done}/{n_trials if n_trials is not None else '?'} trials finished"
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        shown = ", ".join(f"{k}={v}" for k, v in best.params.items())
        text += f"; best {metric}={best.value:.4f} (trial {best.number}: {shown})"
    return text


# ----------------------------------------------------------------------------------------- sampler, pruner
class _Grid(optuna.samplers.GridSampler):
    """GridSampler without its ``study.stop()`` when the grid is used up: that only works inside
    ``study.optimize`` (ask/tell raises); the sweep stops on its own count of trials."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


def make_sampler(name: str, grid: dict[str, list[Any]] | None, seed: int) -> optuna.samplers.BaseSampler:
    if name == "grid":
        return _Grid(grid, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(pruner: Any) -> optuna.pruners.BasePruner:
    if not isinstance(pruner, str):
        return pruner
    return {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
            "hyperband": optuna.pruners.HyperbandPruner}[pruner]()


def requeue(study: optuna.Study, trial: FrozenTrial, tracker: Tracker, why: str) -> None:
    """A trial whose worker died or was interrupted: run its params again (it does not count)."""
    study.enqueue_trial(trial.params, user_attrs={"requeued_from": trial.number})
    run_id = trial.user_attrs.get("mlflow_run_id")
    if run_id:
        with contextlib.suppress(Exception):
            tracker.end_trial(run_id, "interrupted", why)
    progress(f"trial {trial.number} was interrupted ({why}): its params run again")


@contextlib.contextmanager
def remember_interrupts() -> Iterator[threading.Event]:
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


# ----------------------------------------------------------------------------------------------- the worker
@dataclass
class Search:
    """What every trial is: ``fit`` of ``base_config`` with the fixed ``overrides`` and the sampled ``params``
    written in, judged by the last value of ``metric``."""

    base_config: dict[str, Any]
    overrides: dict[str, Any]
    params: list[Param]
    metric: str


@dataclass(frozen=True)
class TrialPlan:
    """How trials are drawn and how many: the sampler (its grid with ``grid``) and its seed, the pruner, the
    study's total of finished trials and this worker's timeout."""

    sampler: str
    pruner: str | optuna.pruners.BasePruner
    seed: int
    n_trials: int | None
    timeout: float | None
    grid: dict[str, list[Any]] | None


@dataclass
class Worker:
    """One sweep process on one study: the study and its storage and lock, the MLflow side, what a trial is,
    how trials are drawn and this worker's budget (``plan``: the study's ``n_trials``, its own ``timeout``)."""

    study: optuna.Study
    storage: optuna.storages.RDBStorage
    lock: StudyLock
    tracker: Tracker
    parent: str  # the study's MLflow parent run
    search: Search
    plan: TrialPlan
    heartbeat_interval: int | None
    me: dict[str, Any] = field(default_factory=this_worker)

    def run(self, interrupted: threading.Event) -> None:
        """Claim a trial under the lock, run it, until the study has its n_trials or this worker its timeout."""
        started = time.monotonic()
        while True:
            if interrupted.is_set():
                progress("interrupted: no new trial (the same command resumes the study)")
                raise KeyboardInterrupt
            timeout = self.plan.timeout
            if timeout is not None and time.monotonic() - started > timeout:
                progress(f"timeout ({timeout:g} s): no new trial")
                return
            trial = self.claim()
            if trial is None:
                return
            self.run_trial(trial)

    def claim(self) -> optuna.Trial | None:
        """The next trial for this worker (None: the study has its trials), after failing the trials of dead
        workers; all under the study lock."""
        with self.lock():
            for trial, why in reap(self.study, self.storage, self.me):
                requeue(self.study, trial, self.tracker, why)
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(self.study)  # other hosts' trials without a heartbeat
            trials = self.study.get_trials(deepcopy=False)
            done = sum(counts(t) for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            if self.plan.n_trials is not None and done + running >= self.plan.n_trials:
                return None
            plan = self.plan
            if plan.sampler != "grid":  # (the grid's seed shuffles the grid: it must stay the same for the study)
                # seeded by the trial's place in the study: one worker is reproducible, two never draw alike
                self.study.sampler = make_sampler(plan.sampler, plan.grid, plan.seed + len(trials))
            with warnings.catch_warnings():  # our Heartbeat thread does what study.optimize would
                warnings.filterwarnings("ignore", message=r".*Heartbeat of storage is supposed to be used with")
                trial = self.study.ask({p.name: p.distribution for p in self.search.params})
            trial.set_user_attr("worker", self.me)
        return trial

    def run_trial(self, trial: optuna.Trial) -> None:
        """The trial's ``fit`` in its MLflow child run; its result told to Optuna and tagged in MLflow. Ctrl-C
        fails it as interrupted (its params run again) and stops the sweep."""
        study, tracker, metric = self.study, self.tracker, self.search.metric
        trial_key = trial_id(self.storage, study, trial.number)
        heartbeat = Heartbeat(self.storage, trial_key, self.heartbeat_interval)
        try:
            run_id = tracker.start_trial(self.parent, study.study_name, trial.number, trial.params)
            trial.set_user_attr("mlflow_run_id", run_id)
            state, value, error = self._fit(trial, run_id)
            try:
                trial.set_user_attr("state", state)
                if error:
                    trial.set_user_attr("error", error)
                if state == "complete":
                    study.tell(trial, value)
                else:
                    study.tell(trial, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
            except Exception:
                if self.storage.get_trial(trial_key).state == TrialState.RUNNING:
                    raise
                # failed meanwhile by another worker that saw no heartbeat: it was enqueued again there
                state, value, error = "interrupted", None, "failed by another worker: no heartbeat in the grace period"
            tracker.end_trial(run_id, state, error)
        except BaseException as err:  # KeyboardInterrupt (Lightning turns it into SystemExit): stop the sweep
            if isinstance(err, Exception):
                raise
            why = f"stopped by {type(err).__name__} in its worker"
            with contextlib.suppress(Exception):
                if fail_interrupted(self.storage, trial_key, why):
                    requeue(study, self.storage.get_trial(trial_key), tracker, why)
            with contextlib.suppress(Exception):
                tracker.stop(self.parent)
            raise
        finally:
            heartbeat.stop()
            gc.collect()
            with contextlib.suppress(Exception):
                import torch

                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        result = f"{metric}={value:.4f}" if value is not None else (error or "")
        progress(f"trial {trial.number} {state}: {result} | {standing(study, self.plan.n_trials, metric)}")

    def _fit(self, trial: optuna.Trial, run_id: str) -> tuple[str, float | None, str | None]:
        """Write the trial's YAML, run ``fit`` on it: (state, value, error). A trial that raises fails on its own
        (NaN loss, out of memory, a bad sampled config) and the study goes on."""
        from lightning_spec.cli import run_cli

        search, tracker, study = self.search, self.tracker, self.study
        if any(p.name == "objective" and p.key == "model.objective" for p in search.params):
            trial.set_user_attr("objective", trial.params["objective"])
        config = trial_config(search.base_config, search.overrides, search.params, trial.params)
        path = write_yaml(config, Path("runs") / "sweeps" / study.study_name / f"trial-{trial.number}.yaml")
        tracker.log_text(run_id, path.read_text(), path.name)
        # the logger only on the command line: `fit -c trial-<n>.yaml` alone reproduces the trial as a new run
        args = ["fit", "-c", str(path), f"--trainer.logger={json.dumps(tracker.logger(run_id))}"]
        tracker.log_text(run_id, shlex.join(["lightning-spec", *args[:3]]) + "\n", "fit_command.txt")
        shown = ", ".join(f"{k}={v}" for k, v in trial.params.items())
        progress(f"trial {trial.number} ({shown}) -> MLflow run {run_id}")
        reporter = TrialReporter(trial, search.metric)
        state, value, error = "failed", None, None
        try:
            with quiet_cli_args():
                run_cli(args, callbacks=[reporter], exit_on_error=False)
            value = reporter.value()
            state = "complete"
        except optuna.TrialPruned as err:
            state, error = "pruned", str(err)
        except Exception as err:
            error = error_line(err)
            with contextlib.suppress(Exception):
                tracker.log_text(run_id, traceback.format_exc(), "error.txt")
        if reporter.block_size is not None:
            trial.set_user_attr("block_size", reporter.block_size)
        if "objective" not in trial.user_attrs and reporter.objective is not None:
            trial.set_user_attr("objective", reporter.objective)
        if reporter.final:
            trial.set_user_attr("metrics", reporter.final)
        if reporter.checkpoint:
            trial.set_user_attr("checkpoint", str(Path(reporter.checkpoint).resolve()))
        return state, value, error
