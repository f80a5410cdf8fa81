"""The study's MLflow side: one parent run per study, one nested child run per trial, the summary on the parent.

The parent run is named after the study and holds the search space (params), ``sweep.json``, ``base.yaml``,
the best trial (tags, ``best/<metric>``), ``trials.json`` and the comparison plots. Each child run
``trial-<n>`` is the trial's ``fit`` run: tags ``state`` = complete / pruned / failed / interrupted and
``error``, status FINISHED / KILLED / FAILED.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from lightning_spec.errors import UserError
from lightning_spec.sweeps.plots import comparison_plots
from lightning_spec.sweeps.workers import counts
from lightning_spec.tracking import DRAFTER_TAG, absolute_sqlite_uri, ensure_experiment, mask_uri, open_store

PARENT_ATTR = "mlflow_parent_run_id"  # study user attr: the MLflow parent run of the study
STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED", "interrupted": "KILLED"}


class Tracker:
    """The study's parent run and its children in the MLflow store ``tracking_uri``."""

    def __init__(self, tracking_uri: str, experiment_name: str) -> None:
        self.uri = absolute_sqlite_uri(tracking_uri)
        self.experiment_name = experiment_name
        self.client = open_store(self.uri, "tracking_uri")
        self.experiment_id: str | None = None

    def setup(self, study: optuna.Study, info: dict[str, Any], files: dict[str, str]) -> str:
        """The parent run of the study: found through the study, created by its first worker (call under the
        study lock: two workers must not both create it)."""
        from mlflow.entities import Param

        self.experiment_id = ensure_experiment(self.client, self.experiment_name)  # tagged: it opens on its runs
        parent = study.user_attrs.get(PARENT_ATTR)
        if parent is not None:
            try:
                self.experiment_id = self.client.get_run(parent).info.experiment_id  # the children go beside it
            except Exception:
                raise UserError(
                    f"study {study.study_name!r} logs to MLflow parent run {parent}, which tracking_uri="
                    f"{mask_uri(self.uri)!r} does not hold; give every worker the tracking_uri of the first one."
                ) from None
            self.client.update_run(parent, status="RUNNING")
            return parent
        run = self.client.create_run(self.experiment_id, run_name=study.study_name, tags={
            "lightning_spec.command": "sweep", "optuna.study_name": study.study_name,
        })
        parent = run.info.run_id
        self.client.log_batch(parent, params=[Param(k, mask_uri(str(v))[:6000]) for k, v in info.items()])
        for name, text in files.items():
            self.client.log_text(parent, mask_uri(text), name)
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

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """A text artifact of the run, credentials in URIs masked."""
        self.client.log_text(run_id, mask_uri(text), name)

    def logger(self, run_id: str) -> dict[str, Any]:
        """``trainer.logger`` of a trial: the CLI's MLflow logger, writing into the trial's child run."""
        return {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"experiment_name": self.experiment_name, "tracking_uri": self.uri, "run_id": run_id,
                          "log_model": False},
        }

    def end_trial(self, run_id: str, state: str, error: str | None = None) -> None:
        self.client.set_tag(run_id, "state", state)
        if error:
            self.client.set_tag(run_id, "error", mask_uri(error))
        self.client.set_terminated(run_id, STATUS[state])

    def stop(self, parent: str) -> None:
        """The sweep was stopped (Ctrl-C): the parent run is KILLED until a worker resumes the study."""
        self.client.set_terminated(parent, "KILLED")

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
                best_run = best.user_attrs["mlflow_run_id"]
                self.client.set_tag(parent, "best_run_id", best_run)
                drafter = self.client.get_run(best_run).data.tags.get(DRAFTER_TAG)  # its logged model (log_drafter)
                if drafter is not None:
                    self.client.set_tag(parent, "best_drafter", drafter)
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
    """One row of ``trials.json``."""
    attrs = t.user_attrs
    return {
        "number": t.number, "state": attrs.get("state", t.state.name.lower()), "value": t.value,
        "params": t.params, "objective": attrs.get("objective"), "block_size": attrs.get("block_size"),
        "error": attrs.get("error"), "interrupted": attrs.get("interrupted"), "run_id": attrs.get("mlflow_run_id"),
        "metrics": attrs.get("metrics"),
    }
