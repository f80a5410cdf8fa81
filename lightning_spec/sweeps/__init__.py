"""``lightning-spec sweep -c sweeps/X.yaml``: an Optuna study whose every trial is a ``fit`` run in MLflow.

A trial is ``lightning-spec fit -c runs/sweeps/<study>/trial-<n>.yaml`` run in the sweep's process through the
same ``run_cli`` as ``fit``: the trial's YAML is ``base`` with the sweep's fixed ``overrides`` and the sampled
``space`` values written in at their dotted keys; the child run holds ``trial-<n>.yaml`` and
``fit_command.txt``, the command that trains the same drafter again.

Storage and workers. The study lives in an Optuna RDB (``sqlite:///optuna.db`` by default, PostgreSQL or MySQL
for workers on several machines); a second ``sweep`` with the same ``study_name`` joins the study. ``n_trials``
is the study's total: COMPLETE + PRUNED + trials that failed on their own (user attr ``error``). Every worker
claims a trial under the study's lock, so two workers never both start the last trial; a trial left RUNNING by
a dead worker is failed as ``interrupted``, does not count, and its parameters are enqueued again, so restarting
a killed sweep with the same command finishes the remaining trials without repeating finished ones.

MLflow. One parent run per study (named after it: search space, base config, best trial, comparison plots)
and one nested child run ``trial-<n>`` per trial (the fit's params, ``config.yaml`` and ``val/*`` curves).

The package, top to bottom:

    space.py     the search space (Param, parse_space, grid_of, probes) and a trial's config (trial_config)
    locks.py     the study lock, one class per storage backend (SQLite file lock, PostgreSQL advisory lock, MySQL)
    workers.py   who runs a trial, whether it is alive (heartbeats, reaping), what counts toward n_trials
    reporter.py  TrialReporter: the callback that feeds Optuna from inside a trial's fit
    tracker.py   the study's MLflow parent and child runs
    plots.py     the comparison plots on the parent run
    runner.py    Worker: claim a trial, run its fit, record it
    command.py   Sweep: the command's options, the checks before the first trial, the study opened or joined
"""

from lightning_spec.sweeps.command import Sweep
from lightning_spec.sweeps.reporter import TrialReporter, objective_label
from lightning_spec.sweeps.space import Param, load_yaml, parse_space, trial_config
from lightning_spec.sweeps.workers import counts, this_worker, worker_is_dead

__all__ = [
    "Param",
    "Sweep",
    "TrialReporter",
    "counts",
    "load_yaml",
    "objective_label",
    "parse_space",
    "this_worker",
    "trial_config",
    "worker_is_dead",
]
