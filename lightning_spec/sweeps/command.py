"""``lightning-spec sweep``: check the search against its base, open (or join) the study, run a worker on it."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import optuna
from jsonargparse import ArgumentError
from optuna.trial import FrozenTrial, TrialState

from lightning_spec.errors import UserError
from lightning_spec.sweeps.locks import StudyLock, study_lock
from lightning_spec.sweeps.runner import (
    Search,
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
from lightning_spec.tracking import absolute_sqlite_uri, mask_uri

CONFIG_ATTR = "sweep_config"  # study user attr: what a joining worker must agree with


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
        raise UserError("a sweep runs each trial on one device; start one sweep worker per GPU instead of DDP.")
    # plain `dict` types: jsonargparse would build `class_path` blocks typed Any; they stay config values here
    space, overrides = plain(space), plain(overrides or {})
    for key in overrides:
        if key == "trainer.logger" or key.startswith("trainer.logger."):
            raise UserError("overrides.trainer.logger: the sweep logs every trial to its MLflow child run.")
    params = parse_space(space)
    grid = grid_of(params) if sampler == "grid" else None
    if n_trials is None:
        if grid is None and timeout is None:
            raise UserError("n_trials (or timeout) is needed unless sampler=grid, which runs the whole grid.")
        n_trials = math.prod(len(v) for v in grid.values()) if grid is not None else None
    if not Path(base).is_file():
        raise UserError(f"base={base!r} is not a file (a path relative to the working folder, like fit -c).")
    storage = absolute_sqlite_uri(storage)
    identity = {"base": base, "metric": metric, "direction": direction, "overrides": overrides, "space": space,
                "sampler": sampler, "seed": seed}  # (a grid's seed orders it: every worker needs the same)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base_config = load_yaml(base)
    # a typo in a key or a value of the wrong type: an error now, not n failed trials
    for where, values in probes(params):
        try:
            check_config(trial_config(base_config, overrides, params, values))
        except (ArgumentError, UserError) as err:  # jsonargparse's message names the key; anything else is a bug
            raise UserError(f"{where} does not parse with {base}: {error_line(err)}") from None
    if dry_run:
        print_plan(base, overrides, params, grid, sampler, n_trials)
        return None

    lock = study_lock(storage, study_name)
    lock.check()  # an unwritable folder or an unreachable server: one sentence now
    info = {"study_name": study_name, "storage": mask_uri(storage), "base": base, "metric": metric,
            "direction": direction, "sampler": sampler, "pruner": _name(pruner), "n_trials": n_trials,
            "timeout": timeout, "overrides": json.dumps(overrides),
            **{f"space/{p.name}": f"{p.key}: {p.describe()}" for p in params}}
    rdb, tracker, parent = _open_study(
        lock, storage, study_name, direction, identity, info, tracking_uri, experiment_name, heartbeat_interval,
        grace_period, Path(base).read_text(),
    )
    study = optuna.load_study(study_name=study_name, storage=rdb, sampler=make_sampler(sampler, grid, seed),
                              pruner=make_pruner(pruner))

    progress(f"study {study_name!r} in {mask_uri(storage)}; MLflow parent run {parent} ({mask_uri(tracker.uri)})")
    worker = Worker(study, rdb, lock, tracker, parent, Search(base_config, overrides, params, metric), sampler, grid,
                    seed, n_trials, timeout, heartbeat_interval)
    with remember_interrupts() as interrupted:
        worker.run(interrupted)

    with lock():
        trials = study.get_trials(deepcopy=False)
        finished = not any(t.state == TrialState.RUNNING for t in trials) and (
            n_trials is None or sum(counts(t) for t in trials) >= n_trials)
        tracker.summarize(parent, study, metric, finished)
    progress(standing(study, n_trials, metric) + ("" if finished else " (other workers still running)"))
    return study


def _open_study(
    lock: StudyLock, storage: str, study_name: str, direction: str, identity: dict[str, Any], info: dict[str, Any],
    tracking_uri: str, experiment_name: str, heartbeat_interval: int | None, grace_period: int | None,
    base_text: str,
) -> tuple[optuna.storages.RDBStorage, Tracker, str]:
    """Create or join the study and its MLflow parent run, under the lock: the tables of fresh databases and the
    parent run are created once, by one worker. A joining worker must run the same search. Returns the storage,
    the tracker and the parent run's id."""
    tracker: Tracker | None = None

    def stale_trial(study: optuna.Study, trial: FrozenTrial) -> None:  # failed by Optuna's heartbeat check
        requeue(study, trial, tracker, "no heartbeat")

    with lock():
        tracker = Tracker(tracking_uri, experiment_name)
        with warnings.catch_warnings():  # the heartbeat arguments are marked experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            rdb = optuna.storages.RDBStorage(
                storage, heartbeat_interval=heartbeat_interval,
                grace_period=grace_period or (5 * heartbeat_interval if heartbeat_interval else None),
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

