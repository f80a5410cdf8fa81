"""Who runs a trial, whether it is still alive, and what counts toward ``n_trials``.

A trial records its worker (host, pid, process start time, a token) and, with ``heartbeat_interval``, beats in
the RDB. A trial left RUNNING by a dead worker (same host: its process is gone; any host: no heartbeat for
``grace_period`` seconds, Optuna's own check) is failed with user attr ``interrupted``; it does not count, and
the runner enqueues its parameters again.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState


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


def counts(trial: FrozenTrial) -> bool:
    """Does the trial count toward ``n_trials``? Yes when it finished on its own: COMPLETE, PRUNED, or FAIL
    with the trial's own error; not when its worker was killed or interrupted (it is run again)."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs and not trial.user_attrs.get("interrupted")


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` of ``study`` (what the storage API takes)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def fail_interrupted(storage: optuna.storages.BaseStorage, trial: int, why: str) -> bool:
    """Fail the RUNNING trial with id ``trial`` as interrupted (it will not count). False when it finished
    meanwhile, or another worker failed it first."""
    try:
        storage.set_trial_user_attr(trial, "interrupted", why)
        return storage.set_trial_state_values(trial, TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False


def reap(
    study: optuna.Study, storage: optuna.storages.BaseStorage, me: dict[str, Any]
) -> list[tuple[FrozenTrial, str]]:
    """Trials left RUNNING by a dead worker of this host, failed as interrupted: ``[(trial, why)]`` for the
    runner to enqueue again. Called under the study lock, where a RUNNING trial without a worker can only be one
    whose worker died between ``ask()`` and recording itself (both happen under the lock)."""
    reaped = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is not None and not worker_is_dead(worker, me):
            continue
        why = "its worker died before it started" if worker is None else (
            f"worker {worker.get('host')}:{worker.get('pid')} is gone")
        if fail_interrupted(storage, trial_id(storage, study, t.number), why):
            reaped.append((t, why))
    return reaped


class Heartbeat:
    """Records the trial's heartbeat in the RDB every ``interval`` seconds, so workers on other hosts can tell
    a dead worker's trial (Optuna's heartbeat; ``study.optimize`` runs this thread itself, ask/tell does not)."""

    def __init__(self, storage: Any, trial: int, interval: int | None) -> None:
        self._stop = threading.Event()
        self._thread = None
        if interval:
            storage.record_heartbeat(trial)
            self._thread = threading.Thread(target=self._beat, args=(storage, trial, interval), daemon=True)
            self._thread.start()

    def _beat(self, storage: Any, trial: int, interval: int) -> None:
        while not self._stop.wait(interval):
            with contextlib.suppress(Exception):  # a missed beat is not worth killing the trial
                storage.record_heartbeat(trial)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
