"""`lightning-spec fit` in a subprocess for tests/integration/test_ddp.py and tests/integration/test_resume.py (and
several fits in the same processes: ``fit_jobs_together``), the callbacks those subprocesses and sweeps load by class
path (``helpers.fits.Probe``: ``fit`` puts tests/ on their PYTHONPATH), ``fit_checkpoint``, the smallest file a fit
writes, and ``quiet_trainer``, an in-process Trainer that prints and saves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import lightning_spec.callbacks.spec_validation as spec_validation
from lightning_spec.callbacks import SpecDecodeValidation

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "experiments" / "tiny.yaml"


def fit_checkpoint(drafter, path: Path, target_spec: str) -> Path:
    """``path``: what a ``fit`` checkpoint holds of ``drafter`` (its record and its weights under ``drafter.``)."""
    from lightning_spec.checkpoint import CKPT_KEY
    from lightning_spec.drafters.base import drafter_record

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"drafter.{k}": v for k, v in drafter.state_dict().items()}
    torch.save({"state_dict": state, CKPT_KEY: drafter_record(drafter, target_spec)}, path)
    return path


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU Trainer that logs, checkpoints, prints and validates nothing unless ``kwargs`` say so."""
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def fit(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``lightning-spec fit -c experiments/tiny.yaml *args`` run in ``cwd`` (its mlflow.db and runs/ land there),
    offline, one thread per process, with tests/ importable (``helpers.fits.Probe``)."""
    return fits_together([(cwd, args)], timeout)[0]


def fits_together(jobs: list[tuple[Path, tuple[str, ...] | list[str]]], timeout: int = 300
                  ) -> list[subprocess.CompletedProcess]:
    """Several ``fit`` runs (cwd, args) started at once and awaited: a 1-process reference next to a 2-rank DDP run
    keeps both cores busy instead of one (each process computes on one thread, so results do not change)."""
    procs = [_start_fit(cwd, *args) for cwd, args in jobs]
    done = []
    for cmd, proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def _start_fit(cwd: Path, *args: str) -> tuple[list[str], subprocess.Popen]:
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_spec", "fit", "-c", str(TINY), "--trainer.enable_progress_bar=false",
           *args]
    return cmd, subprocess.Popen(cmd, cwd=cwd, env=_fit_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)


def _fit_env() -> dict[str, str]:
    """Offline, one thread per process, tests/ importable (``helpers.fits.Probe``)."""
    path = os.pathsep.join(p for p in [str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def fit_jobs_together(launches: list[tuple[list[tuple[Path, list[str]]], int]], folder: Path, timeout: int = 600
                      ) -> list[list[subprocess.CompletedProcess]]:
    """Launches (jobs, ranks) started at once and awaited: each starts ``ranks`` processes once
    (``helpers/fit_jobs.py``) that run every job (cwd, args) of ``fit -c experiments/tiny.yaml *args`` in turn; with
    ``ranks=2`` they are the two gloo ranks of each job's DDP fit (each job must say ``--trainer.strategy=ddp
    --trainer.devices=2``). Returns each launch's processes, rank 0 first; ``folder`` holds the job lists."""
    folder.mkdir(parents=True, exist_ok=True)
    started = []
    for i, (jobs, ranks) in enumerate(launches):
        listing = folder / f"jobs{i}.json"
        listing.write_text(json.dumps([{"cwd": str(cwd), "args": list(args)} for cwd, args in jobs]))
        port = free_port()
        procs = []
        for rank in range(ranks):
            env = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(ranks),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if ranks > 1 else {}
            cmd = [sys.executable, "-m", "helpers.fit_jobs", str(listing)]
            out, err = folder / f"launch{i}-rank{rank}.out", folder / f"launch{i}-rank{rank}.err"
            with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: nobody reads while they run
                procs.append((cmd, out, err, subprocess.Popen(cmd, cwd=folder, env={**_fit_env(), **env}, stdout=o,
                                                              stderr=e)))
        started.append(procs)
    every = [p for procs in started for *_, p in procs]
    deadline = time.monotonic() + timeout
    # a rank that fails leaves the other waiting in a collective: end every process as soon as one fails
    while any(p.poll() is None for p in every):
        if any(p.returncode not in (None, 0) for p in every) or time.monotonic() > deadline:
            for p in every:
                p.kill()
            break
        time.sleep(0.2)
    for p in every:
        p.wait()
    return [[subprocess.CompletedProcess(cmd, p.returncode, out.read_text(), err.read_text())
             for cmd, out, err, p in procs] for procs in started]


def free_port() -> int:
    """A port of 127.0.0.1 no process listens on now (the ranks of a launch meet there)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def callback(class_path: str, **init_args) -> str:
    """A ``--trainer.callbacks+=`` argument that appends one callback to the YAML's."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def mlflow_runs(cwd: Path) -> tuple[object, list]:
    """(client, runs) of the ``lightning_spec`` experiment in ``cwd/mlflow.db``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name("lightning_spec: tiny-random").experiment_id])


def metric_history(cwd: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key`` in the single MLflow run in ``cwd``, by step."""
    client, (run,) = mlflow_runs(cwd)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


class Probe(Callback):
    """Writes, per rank, what the run did to ``<out>/rank<r>.json`` (the example indices of every training batch,
    the ids of the prompts this rank decoded at every validation, and ``SpecDecodeValidation.history``: the
    metrics this rank ended up with) and the drafter before and after training to ``<out>/rank<r>.pt``."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.batches: list[dict] = []
        self.decoded: list[list[str]] = []
        self._decode = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        decode = spec_validation.decode_prompts

        def recording(target, drafter, prompts, *args, **kwargs):
            self.decoded.append([p["id"] for p in prompts])
            return decode(target, drafter, prompts, *args, **kwargs)

        self._decode = decode
        spec_validation.decode_prompts = recording  # undone in teardown

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {k: v.detach().cpu().clone() for k, v in pl_module.drafter.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append({"step": trainer.global_step, "index": batch["index"].tolist()})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        history = [h for c in trainer.callbacks if isinstance(c, SpecDecodeValidation) for h in c.history]
        record = {"world_size": trainer.world_size, "batches": self.batches, "decoded": self.decoded,
                  "history": history}
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
        final = {k: v.detach().cpu() for k, v in pl_module.drafter.state_dict().items()}
        torch.save({"initial": self.initial, "final": final}, self.out / f"rank{rank}.pt")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._decode is not None:
            spec_validation.decode_prompts, self._decode = self._decode, None


class BufferProbe(Callback):
    """Writes, per rank, the on-policy replay buffer at the end of the fit and the examples and rollout steps of
    every training batch to ``<out>/buffer<r>.json`` (tests/integration/test_on_policy_ddp.py)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.batches: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append({"step": trainer.global_step, "index": batch["index"].tolist(),
                             "drawn_step": batch["drawn_step"].tolist()})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_spec.callbacks import OnPolicyRollouts

        (rollouts,) = [c for c in trainer.callbacks if isinstance(c, OnPolicyRollouts)]
        buffer = [{"index": e["index"], "input_ids": e["input_ids"].tolist(), "rounds": e["round_starts"].tolist()}
                  for e in rollouts.buffer]
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"world_size": trainer.world_size, "buffer": buffer, "batches": self.batches,
                  "history": rollouts.history}
        (self.out / f"buffer{trainer.global_rank}.json").write_text(json.dumps(record))


class KillAt(Callback):
    """SIGKILLs the process when training step ``step + 1`` is about to start: steps 1..step are done, with their
    checkpoints and logged metrics, and nothing is flushed or finalised (a machine that dies)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PauseWhenArmed(Callback):
    """In a trial's fit: at training step ``step``, if the file ``<folder>/armed`` exists, write
    ``<folder>/paused`` and wait while ``armed`` exists (at most ``limit`` s). A test that sees ``paused`` knows
    a trial is in the middle of its fit, and stays there until the test's signal arrives."""

    def __init__(self, folder: str, step: int = 1, limit: float = 120.0) -> None:
        self.folder, self.step, self.limit = Path(folder), step, limit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        armed = self.folder / "armed"
        if trainer.global_step != self.step or not armed.exists():
            return
        (self.folder / "paused").write_text(str(os.getpid()))
        deadline = time.monotonic() + self.limit
        while armed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
