"""``lightning-spec fit|validate|test -c experiments/X.yaml`` (also installed as ``lightning``).

Other subcommands (``rollouts``, ``evaluate``, …) are registered in ``EXTRA_COMMANDS`` below.

A thin LightningCLI: the YAML schema is the typed ``__init__`` of ``DraftModule``, ``SpecDataModule`` and the
parts they take. Defaults a user meets: MLflow tracking in ``sqlite:///mlflow.db`` of the working folder, the
rich progress bar, and a checkpoint (drafter only) with ``last.ckpt``, rewritten at every validation and epoch end;
``fit --ckpt_path .../last.ckpt`` resumes mid-epoch into the same MLflow run (``SpecCLI.before_fit``).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_spec.data.datamodule import SpecDataModule
from lightning_spec.module import MLFLOW_RUN_KEY, DraftModule

TRAINER_DEFAULTS = {
    # checkpoints go to runs/<mlflow experiment id>/<mlflow run id>/checkpoints (MLflow has no log folder)
    "default_root_dir": "runs",
    "logger": {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"experiment_name": "lightning_spec", "tracking_uri": "sqlite:///mlflow.db", "log_model": False},
    },
}


class SaveConfigToTracker(SaveConfigCallback):
    """Store the resolved YAML with the run: an MLflow artifact ``config.yaml`` (MLflow has no log folder)."""

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_text(logger.run_id, text, "config.yaml")


class SpecCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # the tokenizer of the data is the target's: one place to say which target
        parser.link_arguments("model.target", "data.target")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # Checked here, before Lightning sets up the data (which would fail first with a less useful message).
        block = getattr(self.model.drafter, "block_size", None)
        max_length = getattr(self.datamodule, "max_length", None)
        if block is not None and max_length is not None and block + 2 > max_length:
            raise ValueError(
                f"model.drafter.block_size={block} needs data.max_length >= block_size + 2 (got {max_length}); "
                "raise data.max_length or lower model.drafter.block_size."
            )

    def before_fit(self) -> None:
        """``fit --ckpt_path x.ckpt`` continues the MLflow run that wrote the checkpoint (its id is stored in the
        checkpoint), so an interrupted and resumed training is one run with its metrics before and after."""
        path = self.config_init[self.subcommand].get("ckpt_path")
        loggers = [lg for lg in self.trainer.loggers if isinstance(lg, MLFlowLogger) and lg._run_id is None]
        if not path or not os.path.isfile(path) or not loggers:  # also Lightning's "last"/"hpc" shortcuts
            return
        run_id = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get(MLFLOW_RUN_KEY)
        if run_id is None:
            return
        from mlflow.exceptions import MlflowException

        for logger in loggers:
            if self.trainer.is_global_zero:
                try:
                    logger._mlflow_client.get_run(run_id)
                except MlflowException:
                    rank_zero_warn(f"{path} was written by MLflow run {run_id}, which is not in the tracking store "
                                   f"{logger._tracking_uri}; logging the resumed training to a new run.")
                    continue
            logger._run_id = run_id  # MLFlowLogger continues a run id set before its first use (no public setter)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Trainer:
        # A YAML `trainer.callbacks:` list replaces defaults wholesale; add ours unless the user chose their own.
        given = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(RichProgressBar())
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(c, ModelCheckpoint) for c in given
        ):
            callbacks.append(ModelCheckpoint(save_last=True))
        trainer = super()._instantiate_trainer(config, callbacks)
        self._name_runs(trainer)
        return trainer

    def _name_runs(self, trainer: Trainer) -> None:
        """An MLflow run without a ``run_name`` is named after its experiment file (``quickstart``): MLflow's own
        random names repeat here, because they come from Python's RNG, which ``seed_everything`` has just reset."""
        section = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        files = [str(f) for f in (section.get("config") or []) if f is not None]
        if not files:
            return
        name = Path(files[-1]).stem
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger) and logger._run_name is None and logger._run_id is None:
                logger._run_name = name  # read when the run is created (no public setter)


# Subcommands that are not Lightning trainer runs: name -> "module:function", imported only when used. The
# function's typed signature and docstring are its options and --help, parsed here like LightningCLI does.
EXTRA_COMMANDS: dict[str, str] = {
    "rollouts": "lightning_spec.data.rollouts:rollouts",
    "evaluate": "lightning_spec.evaluation.cli:evaluate",
    "sweep": "lightning_spec.sweeps:sweep",
}


def run_command(name: str, argv: list[str]) -> None:
    """Parse ``argv`` against the registered function's signature (plus ``--config f.yaml``) and call it."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    module, _, attr = EXTRA_COMMANDS[name].partition(":")
    func = getattr(importlib.import_module(module), attr)
    parser = ArgumentParser(prog=f"lightning-spec {name}", description=(func.__doc__ or "").split("\n\n")[0])
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="a YAML file with these options")
    parser.add_function_arguments(func, as_group=False)
    cfg = parser.parse_args(argv)
    cfg.pop("config", None)
    func(**{k: v for k, v in vars(parser.instantiate_classes(cfg)).items() if k != "config"})


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    argv = list(sys.argv[1:] if args is None else args)
    try:
        if argv and argv[0] in EXTRA_COMMANDS:
            run_command(argv[0], argv[1:])
        else:
            run_cli(args)
    except (ValueError, FloatingPointError) as err:
        # Errors a user can cause are ValueErrors raised by our own code with one sentence naming the field (and
        # the module's FloatingPointError for a diverged loss): print that sentence, not a stack trace. Anything
        # raised deeper (torch, transformers) keeps its trace.
        if not _raised_here(err) or os.environ.get("LIGHTNING_SPEC_TRACEBACK"):
            raise
        print(f"lightning-spec: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _raised_here(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}lightning_spec{os.sep}" in tb.tb_frame.f_code.co_filename


def run_cli(args: list[str] | None = None, callbacks: list[Any] | None = None, exit_on_error: bool = True) -> None:
    """Run the CLI; user errors propagate as ValueError (``main`` turns them into one printed sentence).

    ``callbacks``: instances added to the trainer after the YAML's (the sweep's trial reporter); the run is
    otherwise exactly ``fit``. ``exit_on_error=False`` raises a bad option as ``jsonargparse.ArgumentError``
    instead of printing the usage and exiting (a sweep records it as a failed trial and goes on).
    """
    parser_kwargs = {} if exit_on_error else {"exit_on_error": False, "fit": {"exit_on_error": False}}
    SpecCLI(
        DraftModule,
        SpecDataModule,
        trainer_defaults={**TRAINER_DEFAULTS, "callbacks": list(callbacks)} if callbacks else TRAINER_DEFAULTS,
        save_config_callback=SaveConfigToTracker,
        save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
        args=args,
        parser_kwargs=parser_kwargs,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
