"""Reading a drafter artifact as data: a ``fit`` checkpoint (``torch.load(weights_only=True)``: tensors and plain
values, no pickled code), a ``save_drafter`` folder (``drafter.json`` + ``drafter.pt``) or a serving folder
(``formats/``: ours, the speculators library's, SGLang's). Every reader gives the same pair, ``(record, drafter state
dict)``; the record names the drafter class, its init arguments and the target it was trained for."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spec.checkpoint.formats import is_serving_folder, read_serving_folder
from lightning_spec.drafters import class_path_now
from lightning_spec.errors import UserError
from lightning_spec.provenance import PROVENANCE_FILE, PROVENANCE_KEY
from lightning_spec.target import TargetOptions

CKPT_KEY = "lightning_spec"  # a checkpoint's entry with the drafter's record (``drafters.base.drafter_record``)


def read_checkpoint(path: str | Path, what: str = "checkpoint") -> dict[str, Any]:
    """A ``fit`` checkpoint's contents, read without unpickling code (``weights_only=True``).

    ``what`` names the option the path came from (``--ckpt``, ``drafters``) in the one-sentence errors."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} '{path}' does not exist; pass the path of a .ckpt written by `lightning-spec fit`.")
    if path.stat().st_size == 0:
        raise UserError(f"{what} '{path}' is an empty file (an interrupted copy?); pass a complete .ckpt.")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{what} '{path}' cannot be read safely: it is not a torch file of tensors and plain values (it is "
            "corrupt, or holds pickled Python objects, which are never loaded because that could run code)."
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise UserError(f"{what} '{path}' is not a readable torch checkpoint ({str(err).splitlines()[0]}).") from None
    if not isinstance(ckpt, dict) or CKPT_KEY not in ckpt:
        raise UserError(
            f"{what} '{path}' is not a lightning_spec checkpoint (no '{CKPT_KEY}' entry); pass a fit checkpoint."
        )
    return ckpt


def read_own_folder(folder: Path, what: str) -> dict[str, Any]:
    """The record (``drafter.json``) of a folder ``save_drafter`` wrote."""
    meta_file = folder / "drafter.json"
    if not meta_file.is_file():
        raise UserError(
            f"{what} '{folder}' is a folder without drafter.json or a serving config.json; pass a .ckpt, a "
            "save_drafter folder or an exported one."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{what} '{meta_file}' is not valid JSON ({err.msg} at line {err.lineno}).") from None
    missing = {"drafter_class", "drafter_config", "target", "target_vocab_size"} - set(meta)
    if missing:
        raise UserError(f"{what} '{meta_file}' lacks {sorted(missing)}; it was not written by save_drafter.")
    return meta


@dataclass(frozen=True)
class Artifact:
    """A drafter artifact read once: its ``record`` (class, init arguments, target), the drafter's ``state`` dict, and
    ``fit``, the record of the fit that trained it (``provenance.py``; None where none was recorded)."""

    record: dict[str, Any]
    state: dict[str, torch.Tensor]
    fit: dict[str, Any] | None


def read_drafter_state(path: str | Path, what: str) -> Artifact:
    """The ``Artifact`` of a ``.ckpt`` or an exported folder, its file read once and without running code. A class
    path an older version recorded is given as this version names it (``drafters.RENAMED``)."""
    path = Path(path)
    if path.is_dir() and is_serving_folder(path):  # an exported serving layout (ours, speculators', SGLang's)
        (meta, state), fit = read_serving_folder(path, what), _folder_fit(path)
    elif path.is_dir():
        meta, fit = read_own_folder(path, what), _folder_fit(path)
        try:
            state = torch.load(path / "drafter.pt", map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
            raise UserError(f"{what} '{path / 'drafter.pt'}' is not a readable weights file ({err}).") from None
    else:
        ckpt = read_checkpoint(path, what)
        meta, fit = ckpt[CKPT_KEY], ckpt.get(PROVENANCE_KEY)
        state = {k[len("drafter.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    if isinstance(meta.get("drafter_class"), str):
        meta = {**meta, "drafter_class": class_path_now(meta["drafter_class"])}
    return Artifact(meta, state, fit)


def recorded_target(path: str | Path, what: str = "checkpoint") -> tuple[str, TargetOptions]:
    """The target spec a checkpoint or exported folder was trained for, and the options it was loaded with."""
    path = Path(path)
    if path.is_dir() and is_serving_folder(path):
        meta = read_serving_folder(path, what)[0]
    elif path.is_dir():
        meta = read_own_folder(path, what)
    else:
        meta = read_checkpoint(path, what)[CKPT_KEY]
    return meta["target"], TargetOptions.of(meta.get("target_options"))


def recorded_fit(path: str | Path) -> dict[str, Any] | None:
    """The record of the fit that trained the drafter in ``path`` (``provenance.py``): a checkpoint's own, a
    folder's ``provenance.json``'s ``fit``; None where none was recorded (a checkpoint written before it was)."""
    path = Path(path)
    return _folder_fit(path) if path.is_dir() else read_checkpoint(path, "checkpoint").get(PROVENANCE_KEY)


def _folder_fit(folder: Path) -> dict[str, Any] | None:
    """The ``fit`` of a folder's ``provenance.json`` (None without one: a folder another tool wrote)."""
    file = folder / PROVENANCE_FILE
    return json.loads(file.read_text()).get("fit") if file.is_file() else None
