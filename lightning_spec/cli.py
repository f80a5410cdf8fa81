"""``lightning-spec fit|validate|test -c experiments/X.yaml`` (also installed as ``lightning``).

Other subcommands (``rollouts``, ``evaluate``, …) are registered in ``EXTRA_COMMANDS`` below; ``features`` (the
feature store of a fit, written ahead of it) takes ``fit``'s own options (``run_features``; the work is
``features/command.py``).

A thin LightningCLI: the YAML schema is the typed ``__init__`` of ``DraftModule``, ``SpecDataModule`` and the
parts they take. Defaults a user meets: MLflow tracking in ``sqlite:///mlflow.db`` of the working folder, the
rich progress bar, and a checkpoint (drafter only) with ``last.ckpt``, rewritten at every validation and epoch end;
``fit --ckpt_path .../last.ckpt`` resumes mid-epoch into the same MLflow run (``tracking.prepare_loggers``), and
``fit`` ends by printing where the checkpoint is and how to see the run (``SpecCLI.after_fit``).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_spec import provenance
from lightning_spec.datamodule import SpecDataModule
from lightning_spec.errors import UserError
from lightning_spec.module import DraftModule
from lightning_spec.tracking import (
    DEFAULT_LOGGER,
    SaveConfigToTracker,
    checkpoint_run_id,
    log_drafter,
    mask_uri,
    prepare_loggers,
    run_summary,
)

TRAINER_DEFAULTS = {
    # checkpoints go to runs/<mlflow experiment id>/<mlflow run id>/checkpoints (MLflow has no log folder)
    "default_root_dir": "runs",
    "logger": DEFAULT_LOGGER,  # MLflow in sqlite:///mlflow.db of the working folder
}


class SpecCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # the tokenizer of the data is the target's: one place to say which target
        parser.link_arguments("model.target", "data.target")
        parser.link_arguments("model.target_options", "data.target_options")

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # Checked here too, before Lightning sets up the data (which would fail first with a less useful message).
        if isinstance(self.datamodule, SpecDataModule):  # a user's data module: DraftModule.setup has no check
            self.datamodule.check_block_size(self.model.drafter.block_size)

    def parse_arguments(self, parser, args) -> None:
        """Parse, then check ``--ckpt_path`` before Lightning reads the file (for its hyperparameters) and before
        any model is loaded: a missing, empty or broken checkpoint is one sentence. ``fit --ckpt_path x.ckpt``
        continues the MLflow run that wrote it (its id is stored in the checkpoint)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        self._resume_run = None
        if path is None or _lightning_shortcut(str(path)):
            return
        if not os.path.isfile(path):
            raise UserError(f"--ckpt_path '{path}' does not exist; pass the path of a .ckpt written by "
                            "`lightning-spec fit` (e.g. runs/<experiment id>/<run id>/checkpoints/last.ckpt).")
        run = checkpoint_run_id(path)
        self._resume_run = run if subcommand == "fit" else None

    def before_instantiate_classes(self) -> None:
        """Set up the MLflow loggers before they are built (``tracking.prepare_loggers``): the store, the run a
        resumed fit continues, a new run's name (the experiment file's), the experiment of its target."""
        section = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        files = [str(f) for f in (section.get("config") or []) if f is not None]
        trainer = section.get("trainer")
        if trainer is not None:
            target = (section.get("model") or {}).get("target")  # names the experiment: one per target
            prepare_loggers(trainer.get("logger"), self._resume_run, Path(files[-1]).stem if files else None, target)

    def before_fit(self) -> None:
        """Every checkpoint of this fit keeps its command and resolved config (with the seed it drew): what rebuilds
        the drafter (``provenance.py``)."""
        if isinstance(self.model, DraftModule):
            config = self.config.get(str(self.subcommand), self.config)
            text = mask_uri(self._parser(self.subcommand).dump(config, skip_none=False))
            self.model.record_fit(provenance.run_record(text))

    def after_fit(self) -> None:
        """The last lines of ``fit`` (rank 0, after every callback's output): where the checkpoint is and how to
        see the run in MLflow."""
        if not self.trainer.is_global_zero:
            return
        paths = [c.last_model_path or c.best_model_path for c in self.trainer.checkpoint_callbacks]
        lines = [f"checkpoint: {p}" for p in paths if p]
        if paths and paths[0]:  # the drafter itself in the run, not only its curves: what to load or serve
            try:
                lines += log_drafter(self.trainer.loggers, paths[0], self.model.target, self.model.target_spec)
            except Exception as err:  # the fit is done and its checkpoint written: say so, do not fail it here
                lines.append(f"drafter: not logged to MLflow ({type(err).__name__}: {err}); the checkpoint holds it")
        print("\n".join(lines + run_summary(self.trainer.loggers)), flush=True)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Trainer:
        # A YAML `trainer.callbacks:` list replaces defaults wholesale; add ours unless the user chose their own.
        given = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(StepProgressBar())
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(c, ModelCheckpoint) for c in given
        ):
            callbacks.append(ModelCheckpoint(save_last=True))
        return super()._instantiate_trainer(config, callbacks)


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar showing the optimizer step out of ``max_steps`` instead of "Epoch 2/-2": training here
    is bounded by ``max_steps`` or ``max_time`` (``max_epochs`` is -1), so the epoch count has no end to show."""

    def _get_train_description(self, current_epoch: int) -> str:  # Lightning's hook for the bar's label
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"Epoch {current_epoch}"

    def get_metrics(self, trainer: Trainer, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        steps = trainer.max_steps
        return {"step": f"{trainer.global_step}/{steps}" if steps > 0 else trainer.global_step, **metrics}


def _lightning_shortcut(path: str) -> bool:
    """``--ckpt_path`` values that are not local files: Lightning's ``last``/``best``/``hpc``/``registry`` and
    remote URLs (``s3://...``)."""
    return path in ("last", "best", "hpc") or path.startswith("registry") or "://" in path


# Subcommands that are not Lightning trainer runs: name -> "module:attr", imported only when used. A command class
# (a dataclass) holds the options: its typed fields and its docstring's ``Args`` are the flags, YAML keys and
# --help, and its ``run()`` runs the command; a function's typed signature and docstring are (``export``).
EXTRA_COMMANDS: dict[str, str] = {
    "rollouts": "lightning_spec.data.rollout_writer:Rollouts",
    "evaluate": "lightning_spec.evaluation.cli:Evaluate",
    "sweep": "lightning_spec.sweeps:Sweep",
    "export": "lightning_spec.checkpoint:export_checkpoint",
}


def run_command(name: str, argv: list[str]) -> Any:
    """Parse ``argv`` against the registered command's fields or function's signature (plus ``--config f.yaml``),
    then run it: ``Command(**options).run()`` or ``function(**options)``. Returns what that returns."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    module, _, attr = EXTRA_COMMANDS[name].partition(":")
    func = getattr(importlib.import_module(module), attr)
    command = isinstance(func, type)  # a command class; else a function
    parser = ArgumentParser(
        prog=f"lightning-spec {name}", description=(func.__doc__ or "").split("\n\n")[0], exit_on_error=False
    )
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="a YAML file with these options")
    if command:
        parser.add_class_arguments(func, as_group=False)
    else:
        parser.add_function_arguments(func, as_group=False)
    cfg = parser.parse_args(argv)
    cfg.pop("config", None)
    options = {k: v for k, v in vars(parser.instantiate_classes(cfg)).items() if k != "config"}
    return func(**options).run() if command else func(**options)


def run_features(argv: list[str]) -> None:
    """``lightning-spec features``: parse ``fit``'s options (``-c`` files, ``--model.*``, ``--data.*``) plus
    ``--out``/``--batch_size``, then write the store."""
    from lightning_spec.features.command import write_store

    class FeaturesCLI(SpecCLI):
        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.add_argument("--out", type=str | None, default=None,
                                help="the store's folder (default: the one fit uses: model.feature_store, else the "
                                     "cache's)")
            parser.add_argument("--batch_size", type=int, default=16, help="examples per target forward")
            parser.add_argument("--progress", type=bool, default=True, help="show the progress bar")

        def before_instantiate_classes(self) -> None:  # no MLflow run: nothing here trains
            self.config["trainer"]["logger"] = False

    cli = FeaturesCLI(DraftModule, SpecDataModule, run=False, args=argv,
                      parser_kwargs={"exit_on_error": False, "prog": "lightning-spec features"})
    cli.datamodule.setup("fit")
    write_store(cli.model, cli.datamodule, cli.config["out"], cli.config["batch_size"], cli.config["progress"],
                echo=lambda text: print(text, file=sys.stderr, flush=True))


class _NoAdvertisements(logging.Filter):
    """Drops Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines (``logger_connector.py``,
    ``callback_connector.py``): advertisements for its cloud services, printed into every fit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip:")


_QUIET = _NoAdvertisements()


def quiet_dependencies() -> None:
    """Keep out of a run's output what our dependencies print there that neither we nor the user can act on: Lightning's
    advertisements, and the deprecation warning its ``utilities/_pytree.py`` raises against torch >= 2.10's pytree
    API at every fit (Lightning's to fix: it tests ``isinstance(spec, LeafSpec)``)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_QUIET)  # the same filter once
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def main(args: list[str] | None = None) -> None:
    from jsonargparse import ArgumentError

    quiet_dependencies()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    argv = list(sys.argv[1:] if args is None else args)
    provenance.COMMAND[:] = ["lightning-spec", *argv]  # what every artifact of this run records as its command
    command = argv[0] if argv and not argv[0].startswith("-") else "fit"
    try:
        if argv and argv[0] == "features":  # fit's own options (the same YAML), so parsed by a LightningCLI
            run_features(argv[1:])
        elif argv and argv[0] in EXTRA_COMMANDS:
            run_command(argv[0], argv[1:])
        else:
            run_cli(args, exit_on_error=False)
    except ArgumentError as err:  # a bad option or YAML value: jsonargparse's nested report, boiled down
        if os.environ.get("LIGHTNING_SPEC_TRACEBACK"):
            raise
        print(f"lightning-spec: error: {parser_error_sentence(str(err), command)}", file=sys.stderr)
        raise SystemExit(2) from None
    except UserError as err:
        # Errors by kind (errors.py): what a user can cause is a UserError whose message is one sentence naming the
        # option, field, file or data to change; print that, not a stack trace. Anything else, a plain ValueError
        # of our own included, is a bug and propagates with its traceback.
        if os.environ.get("LIGHTNING_SPEC_TRACEBACK"):
            raise
        print(f"lightning-spec: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


_PARSER_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Expected a <class 'NoneType'>|"
    r"Given value|Problem with given class_path|Parser key|tip:|usage:)"
)


def parser_error_sentence(message: str, command: str = "fit") -> str:
    """jsonargparse's report of a bad option — for a class inside a Union (``model.objective.loss``) dozens of lines
    of alternatives, with the cause at the bottom — as one sentence: the full key, the innermost cause, the value."""
    message = re.sub(r"^\s*error:\s*", "", message.strip())
    key = ".".join(re.findall(r'Parser key "([^"]+)"', message))
    cause, depth = "", -1
    for line in message.splitlines():  # the most indented line that is not Union bookkeeping is the cause
        text = line.strip().lstrip("- ").strip()
        if text and not _PARSER_NOISE.match(text) and len(line) - len(line.lstrip()) > depth:
            cause, depth = text, len(line) - len(line.lstrip())
    given = [g.strip() for g in re.findall(r"Given value: (.+)", message) if "NestedArg" not in g]
    value = f" (given {given[-1]})" if given and given[-1] not in cause else ""
    return f"{key + ': ' if key else ''}{cause.rstrip('.')}{value}; see `lightning-spec {command} --help`."


def run_cli(args: list[str] | None = None, callbacks: list[Any] | None = None, exit_on_error: bool = True) -> None:
    """Run the CLI; user errors propagate as ``UserError`` (``main`` turns them into one printed sentence).

    ``callbacks``: instances added to the trainer after the YAML's (the sweep's trial reporter); the run is
    otherwise exactly ``fit``. ``exit_on_error=False`` raises a bad option as ``jsonargparse.ArgumentError``
    instead of printing the usage and exiting (a sweep records it as a failed trial and goes on).
    """
    quiet = {"exit_on_error": False}
    parser_kwargs = {} if exit_on_error else {**quiet, **{c: quiet for c in ("fit", "validate", "test", "predict")}}
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
