"""Experiment overlays for the tests: a YAML holding only what differs from a base experiment, run as the command
its header names, ``lightning-spec fit -c experiments/quickstart.yaml -c experiments/<overlay>.yaml``.

What LightningCLI (jsonargparse) does with a second ``-c`` file, hence what an overlay has to say:
- mappings merge key by key, and a class block (``class_path``) of the same class merges its ``init_args``;
- a class block naming another class keeps those old ``init_args`` the new class also accepts: the quickstart
  Objective's ``normalize: weight`` survives into ``EDR`` (whose default is ``sequences``) unless stated;
- a list entry merges with the base's entry at the same index only when both lists have the same length.
``meant`` is the config an overlay's author means: its values replace the base's, and a list or a class block of
another class replaces the base's whole. The tests hold the CLI's merge equal to it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
COMMAND = "lightning-spec fit -c "


def config_files(path: Path) -> list[Path]:
    """The ``-c`` files of the ``# lightning-spec fit -c ...`` line of an overlay's header, itself last; a complete
    experiment (no such line) is ``[path]``."""
    lines = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#")]
    lines = [line for line in lines if line.startswith(COMMAND)]
    if not lines:
        return [path]
    args = shlex.split(lines[0])
    files = [ROOT / args[i + 1] for i, arg in enumerate(args) if arg == "-c"]
    assert files[-1] == path, f"{path.name}: its header command must end with `-c {path.relative_to(ROOT)}`"
    return files


def meant(base, overlay):
    """``overlay`` put onto ``base`` as its author means it: mappings (and class blocks of the same class) merge,
    anything else, a list or a class block of another class included, replaces."""
    if not (isinstance(base, dict) and isinstance(overlay, dict)):
        return overlay
    if overlay.get("class_path", base.get("class_path")) != base.get("class_path"):
        return overlay
    return {**base, **{key: meant(base[key], value) if key in base else value for key, value in overlay.items()}}


def restated(overlay, base, key: str = "") -> list[str]:
    """Keys an overlay sets to the value the base already has (an overlay says only what differs). Exempt: a
    class block's ``class_path``, a class block of another class, and lists; ``meant`` replaces those whole."""
    if isinstance(overlay, dict) and isinstance(base, dict):
        if overlay.get("class_path", base.get("class_path")) != base.get("class_path"):
            return []
        return [found for k, v in overlay.items() if k != "class_path" and k in base
                for found in restated(v, base[k], f"{key}.{k}" if key else k)]
    return [key] if overlay == base and not isinstance(overlay, list) else []


@functools.cache
def _printed(files: tuple[Path, ...]) -> str:
    import transformers

    import lightning_spec.module
    from lightning_spec.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("--print_config must not load a model")

    args = ["fit", *[arg for f in files for arg in ("-c", str(f))], "--print_config"]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(sys, "argv", ["lightning-spec"])
        patch.setattr(lightning_spec.module, "load_target", refuse)
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        try:
            main(args)
        except SystemExit as exit_:
            assert not exit_.code, f"fit {' '.join(args)} exited with {exit_.code}"
    return out.getvalue()


def printed_config(*files: Path) -> dict:
    """The config ``lightning-spec fit -c <files...> --print_config`` prints (parsed only: no model is loaded)."""
    return yaml.safe_load(_printed(tuple(files)))


def meant_config(files: list[Path]) -> dict:
    """The first of ``files`` with each later one put onto it by ``meant``."""
    config = yaml.safe_load(files[0].read_text())
    for overlay in files[1:]:
        config = meant(config, yaml.safe_load(overlay.read_text()))
    return config


def printed_of(config: dict) -> dict:
    """``printed_config`` of one file holding ``config``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "experiment.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return yaml.safe_load(_printed((path,)))
