"""``lightning-spec sweep``: check the search against its base, open (or join) the study, run a worker on it."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from jsonargparse import ArgumentError
from optuna.trial import FrozenTrial, TrialState

from lightning_spec.errors import UserError
from lightning_spec.sweeps.locks import StudyLock, study_lock
from lightning_spec.sweeps.runner import (
    Search,
    TrialPlan,
    Worker,
    error_line,
    make_pruner,
    make_sampler,
    progress,
    remember_interrupts,
    requeue,
    standing,
)
from lightning_spec.sweeps.space import (
    Param,
    check_config,
    grid_of,
    load_yaml,
    parse_space,
    plain,
    print_plan,
    probes,
    trial_config,
)
from lightning_spec.sweeps.tracker import Tracker
from lightning_spec.sweeps.workers import counts
from lightning_spec.tracking import SWEEP_EXPERIMENT, absolute_sqlite_uri, experiment_name, mask_uri, runs_link

CONFIG_ATTR = "sweep_config"  # study user attr: what a joining worker must agree with


@dataclass(frozen=True)
class StudyOptions:
    """Where the study lives and how its workers meet: the Optuna storage (an absolute URL) and study name, the
    direction, the MLflow side of the parent and child runs, the heartbeats. Every worker of a study opens the same."""

    name: str
    storage: str
    direction: str
    tracking_uri: str
    experiment_name: str
    heartbeat_interval: int | None
    grace_period: int | None


@dataclass(frozen=True)
class SearchSpace:
    """What the sweep file searches, as plain values (``plain``: jsonargparse's Namespaces back to dicts, so a
    ``class_path`` block stays a config value): the space, the fixed overrides, and the space's parameters."""

    space: dict[str, Any]
    overrides: dict[str, Any]
    params: list[Param]


@dataclass
class Sweep:
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
        experiment_name: MLflow experiment of the parent and child runs; ``{target}`` and ``{study}`` are the base's
            target and the study's name (one experiment per study).
        seed: sampler seed; a trial is drawn with seed + the number of trials already in the study (the same
            command draws the same trials again; two workers never draw alike).
        heartbeat_interval: seconds between a running trial's heartbeats; null = off (then only dead workers of
            this host are detected).
        grace_period: seconds without heartbeat after which a trial of another host counts as dead; null = 5
            heartbeat intervals.
        dry_run: check the space against base (every choice parses as a fit option), print the plan, and stop
            before touching the storage or MLflow.
    """

    base: str
    space: dict
    study_name: str
    metric: str = "val/mal"
    direction: Literal["maximize", "minimize"] = "maximize"
    n_trials: int | None = None
    timeout: float | None = None
    sampler: Literal["tpe", "grid", "random"] = "tpe"
    pruner: Literal["none", "median", "hyperband"] | optuna.pruners.BasePruner = "none"
    overrides: dict | None = None
    storage: str = "sqlite:///optuna.db"
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment_name: str = SWEEP_EXPERIMENT
    seed: int = 0
    heartbeat_interval: int | None = 60
    grace_period: int | None = None
    dry_run: bool = False

    # The fields above are the command's flags and YAML keys (``lightning-spec sweep``, ``cli.run_command``); the
    # methods below group them into the study, the search space and the trial plan.
    def run(self) -> optuna.Study | None:
        """Check the search against its base (every choice parses as a fit option), then print the plan
        (``dry_run``) or open the study and run this worker on it."""
        if int(os.environ.get("LOCAL_RANK", "0")) > 0:
            raise UserError("a sweep runs each trial on one device; start one sweep worker per GPU instead of DDP.")
        space = self.search_space()
        trials = self.trials(space)
        if not Path(self.base).is_file():
            raise UserError(f"base={self.base!r} is not a file (a path relative to the working folder, like fit -c).")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        search = checked_search(self.base, space, self.metric)
        study = self.study(search)
        if self.dry_run:
            print_plan(self.base, space.overrides, space.params, trials.grid, trials.sampler, trials.n_trials)
            return None
        return self.work(study, space, trials, search)

    def search_space(self) -> SearchSpace:
        """The space and overrides as plain values, the space parsed; the trial logger is the sweep's own."""
        space, overrides = plain(self.space), plain(self.overrides or {})
        for key in overrides:
            if key == "trainer.logger" or key.startswith("trainer.logger."):
                raise UserError("overrides.trainer.logger: the sweep logs every trial to its MLflow child run.")
        return SearchSpace(space, overrides, parse_space(space))

    def trials(self, space: SearchSpace) -> TrialPlan:
        """The trial plan; ``n_trials`` defaults to the grid's size with sampler=grid."""
        grid = grid_of(space.params) if self.sampler == "grid" else None
        n_trials = self.n_trials
        if n_trials is None:
            if grid is None and self.timeout is None:
                raise UserError("n_trials (or timeout) is needed unless sampler=grid, which runs the whole grid.")
            n_trials = math.prod(len(v) for v in grid.values()) if grid is not None else None
        return TrialPlan(self.sampler, self.pruner, self.seed, n_trials, self.timeout, grid)

    def study(self, search: Search) -> StudyOptions:
        """The study's place (a relative SQLite path made absolute: every worker must open the same file), and its
        MLflow experiment: ``{target}`` and ``{study}`` filled with the base's target and the study's name."""
        target = search.overrides.get("model.target", (search.base_config.get("model") or {}).get("target"))
        experiment = experiment_name(self.experiment_name, target, study=self.study_name)
        return StudyOptions(self.study_name, absolute_sqlite_uri(self.storage), self.direction, self.tracking_uri,
                            experiment, self.heartbeat_interval, self.grace_period)

    def identity(self, space: SearchSpace) -> dict[str, Any]:
        """What a joining worker must agree with (recorded on the study; a grid's seed orders it: every worker
        needs the same)."""
        return {"base": self.base, "metric": self.metric, "direction": self.direction, "overrides": space.overrides,
                "space": space.space, "sampler": self.sampler, "seed": self.seed}

    def work(self, options: StudyOptions, space: SearchSpace, trials: TrialPlan, search: Search) -> optuna.Study:
        """Open or join the study and its MLflow parent run, run this worker until the study has its trials (or
        the worker its timeout), then summarise the study on the parent run."""
        lock = study_lock(options.storage, options.name)
        lock.check()  # an unwritable folder or an unreachable server: one sentence now
        info = {"study_name": options.name, "storage": mask_uri(options.storage), "base": self.base,
                "metric": self.metric, "direction": self.direction, "sampler": trials.sampler,
                "pruner": _name(trials.pruner), "n_trials": trials.n_trials, "timeout": trials.timeout,
                "overrides": json.dumps(space.overrides), **{f"space/{p.name}": f"{p.key}: {p.describe()}"
                                                             for p in space.params}}
        rdb, tracker, parent = _open_study(lock, options, self.identity(space), info, Path(self.base).read_text())
        study = optuna.load_study(study_name=options.name, storage=rdb,
                                  sampler=make_sampler(trials.sampler, trials.grid, trials.seed),
                                  pruner=make_pruner(trials.pruner))
        progress(f"study {options.name!r} in {mask_uri(options.storage)}; MLflow parent run {parent} "
                 f"({mask_uri(tracker.uri)})")
        worker = Worker(study, rdb, lock, tracker, parent, search, trials, options.heartbeat_interval)
        with remember_interrupts() as interrupted:
            worker.run(interrupted)

        with lock():
            done = study.get_trials(deepcopy=False)
            finished = not any(t.state == TrialState.RUNNING for t in done) and (
                trials.n_trials is None or sum(counts(t) for t in done) >= trials.n_trials)
            tracker.summarize(parent, study, self.metric, finished)
        progress(standing(study, trials.n_trials, self.metric) + ("" if finished else " (other workers still running)"))
        progress(f"compare the trials: {runs_link(tracker.uri, tracker.experiment_id)} (experiment "
                 f"{options.experiment_name!r})")
        return study


def checked_search(base: str, space: SearchSpace, metric: str) -> Search:
    """What every trial is, checked before the first: a typo in a key or a value of the wrong type is an error
    now, not n failed trials."""
    base_config = load_yaml(base)
    for where, values in probes(space.params):
        try:
            check_config(trial_config(base_config, space.overrides, space.params, values))
        except (ArgumentError, UserError) as err:  # jsonargparse's message names the key; anything else is a bug
            raise UserError(f"{where} does not parse with {base}: {error_line(err)}") from None
    return Search(base_config, space.overrides, space.params, metric)


def _open_study(lock: StudyLock, options: StudyOptions, identity: dict[str, Any], info: dict[str, Any],
                base_text: str) -> tuple[optuna.storages.RDBStorage, Tracker, str]:
    """Create or join the study and its MLflow parent run, under the lock: the tables of fresh databases and the
    parent run are created once, by one worker. A joining worker must run the same search. Returns the storage,
    the tracker and the parent run's id."""
    tracker: Tracker | None = None
    study_name, direction, heartbeat_interval = options.name, options.direction, options.heartbeat_interval

    def stale_trial(study: optuna.Study, trial: FrozenTrial) -> None:  # failed by Optuna's heartbeat check
        requeue(study, trial, tracker, "no heartbeat")

    with lock():
        tracker = Tracker(options.tracking_uri, options.experiment_name)
        with warnings.catch_warnings():  # the heartbeat arguments are marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            rdb = optuna.storages.RDBStorage(
                options.storage, heartbeat_interval=heartbeat_interval,
                grace_period=options.grace_period or (5 * heartbeat_interval if heartbeat_interval else None),
                heartbeat_stale_trial_callback=stale_trial if heartbeat_interval else None,
            )
        study = optuna.create_study(storage=rdb, study_name=study_name, direction=direction, load_if_exists=True)
        if study.direction.name.lower() != direction:
            created = study.direction.name.lower()
            raise UserError(f"direction={direction}, but study {study_name!r} was created to {created}.")
        recorded = study.user_attrs.get(CONFIG_ATTR)
        if recorded is None:
            study.set_user_attr(CONFIG_ATTR, identity)
        else:
            for key in identity:
                if json.dumps(recorded.get(key), sort_keys=True) != json.dumps(identity[key], sort_keys=True):
                    raise UserError(
                        f"{key} differs from the one study {study_name!r} was started with; a study is one search: "
                        "use a new study_name."
                    )
        files = {"sweep.json": json.dumps({**identity, **info}, indent=1), "base.yaml": base_text}
        parent = tracker.setup(study, info, files)
    return rdb, tracker, parent


def _name(pruner: Any) -> str:
    return pruner if isinstance(pruner, str) else type(pruner).__name__

