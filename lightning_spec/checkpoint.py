"""``load_drafter``: a drafter from a ``fit`` checkpoint (.ckpt) or an exported folder, bound to its target.

A checkpoint stores the drafter's weights, its class and init arguments, and the target it was trained for
(name, weight fingerprint, vocabulary size) — never the target's weights.

Checkpoints and exported folders are shared between people, so reading one is a trust boundary: files are read
with ``torch.load(weights_only=True)`` (tensors and plain values, no pickled code), and the only classes built
from a file's ``class_path`` strings are lightning_spec's own (``build``), never an arbitrary importable name.

``lightning-spec export`` (``export_checkpoint``) reads a checkpoint here and writes it in a serving layout
through ``export/``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_spec.assets import resolve_target_folder
from lightning_spec.drafters import class_path_now
from lightning_spec.drafters.base import Drafter, drafter_record, init_arguments
from lightning_spec.errors import UserError
from lightning_spec.export import (
    codec_for,
    export_drafter,
    is_serving_folder,
    read_serving_folder,
    vllm_speculative_config,
)
from lightning_spec.provenance import PROVENANCE_FILE, PROVENANCE_KEY, folder_record
from lightning_spec.target import TargetOptions, live_target
from lightning_spec.target_loading import load_target

if TYPE_CHECKING:
    from lightning_spec.target import Target

CKPT_KEY = "lightning_spec"
PACKAGE = "lightning_spec"


# ------------------------------------------------------------------------------------ describe <-> build
def _own_class(class_path: Any, what: str) -> type:
    """The lightning_spec class named by ``class_path``; anything else is refused (a file must not pick code)."""
    if not isinstance(class_path, str) or not class_path.startswith(f"{PACKAGE}."):
        raise UserError(
            f"{what} names {class_path!r}, which is not a lightning_spec class; only lightning_spec classes are "
            "built from a saved file (a checkpoint cannot choose code to run)."
        )
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise UserError(f"{what} names {class_path!r}, which this lightning_spec version does not have.") from None
    if not inspect.isclass(cls):
        raise UserError(f"{what} names {class_path!r}, which is not a class.")
    return cls


def build(spec: Any, what: str = "class_path") -> Any:
    """Instantiate nested ``{class_path, init_args}`` dicts (the inverse of ``describe``); lightning_spec's own
    classes only."""
    if isinstance(spec, list):
        return [build(x, what) for x in spec]
    if isinstance(spec, dict) and "class_path" in spec:
        cls = _own_class(spec["class_path"], what)
        return cls(**{k: build(v, what) for k, v in spec.get("init_args", {}).items()})
    return spec


def describe(obj: Any) -> Any:
    """A plain nested dict of an object's class and init arguments: hyperparameter logging and rebuilding."""
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, (list, tuple)):
        return [describe(x) for x in obj]
    path = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, Drafter):
        return {"class_path": path, "init_args": obj.config_dict()}
    return {"class_path": path, "init_args": {k: describe(v) for k, v in init_arguments(obj).items()}}


# ---------------------------------------------------------------------------------------------- reading
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


def recorded_target(path: str | Path, what: str = "checkpoint") -> tuple[str, TargetOptions]:
    """The target spec a checkpoint or exported folder was trained for, and the options it was loaded with."""
    path = Path(path)
    if path.is_dir() and is_serving_folder(path):
        meta = read_serving_folder(path, what)[0]
    elif path.is_dir():
        meta = _read_folder_meta(path, what)
    else:
        meta = read_checkpoint(path, what)[CKPT_KEY]
    return meta["target"], TargetOptions.of(meta.get("target_options"))


def _read_folder_meta(folder: Path, what: str) -> dict[str, Any]:
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


def drafter_classes() -> dict[str, type[Drafter]]:
    """Every lightning_spec drafter class by its dotted path: the only classes a saved file can have built."""
    import lightning_spec.drafters  # noqa: F401 (imports every family file, so each class is a subclass below)

    found, todo = {}, [Drafter]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith(f"{PACKAGE}.drafters."):
                found[f"{sub.__module__}.{sub.__qualname__}"] = sub
    return found


def _bind(meta: dict[str, Any], state: dict[str, torch.Tensor], target: Target | None, what: str) -> Drafter:
    cls = drafter_classes().get(meta["drafter_class"]) if isinstance(meta["drafter_class"], str) else None
    if cls is None:  # looked up, never imported: a file cannot pick code to run
        raise UserError(
            f"{what} drafter_class {meta['drafter_class']!r} is not a lightning_spec drafter class; only those are "
            "built from a saved file (a checkpoint cannot choose code to run)."
        )
    config = meta["drafter_config"]
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise UserError(f"{what} drafter_config must be a mapping of init arguments, got {type(config).__name__}.")
    try:
        drafter: Drafter = cls(**config)
    except TypeError as err:
        raise UserError(f"{what} drafter_config does not fit {cls.__name__} ({err}).") from None
    options = meta.get("target_options")  # revision, trust_remote_code, ... of the recorded target (older: none)
    if target is None:  # an equal target the user already loaded (same weights fingerprint), else the recorded one,
        # its embedding, final norm and LM head only: the drafter then decodes with any target of the same weights
        target = live_target(meta.get("target_fingerprint")) or load_target(meta["target"], options=options,
                                                                            layers=False)
    target = load_target(target, options=options) if isinstance(target, str) else load_target(target)
    if target.vocab_size != meta["target_vocab_size"]:
        raise UserError(
            f"The drafter was trained for a target with a {meta['target_vocab_size']}-token vocabulary, but this "
            f"target has {target.vocab_size}; load it with the target it was trained for ({meta['target']!r})."
        )
    drafter.bind(target)
    try:
        drafter.load_state_dict(with_target_weights(meta, state, drafter))
    except RuntimeError as err:
        first = next((ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()), str(err))
        raise UserError(
            f"{what}: the weights do not fit a {cls.__name__} of {config} on this target ({first}); load it with the "
            f"target it was trained for ({meta['target']!r})."
        ) from None
    return drafter.eval()


def with_target_weights(meta: dict[str, Any], state: dict[str, torch.Tensor], drafter: Drafter) -> dict[str, Any]:
    """``state`` plus the weights a serving folder leaves to the target (``from_target``: e.g. DFlash's mask vector,
    the target's embedding of the mask token, which ``bind`` starts it from), taken from the bound ``drafter``."""
    ours = drafter.state_dict()
    return {**{k: ours[k] for k in meta.get("from_target") or () if k in ours and k not in state}, **state}


def read_drafter_state(path: str | Path, what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(record, drafter state dict) of a ``.ckpt`` or an exported folder, read without running code. A class path
    an older version recorded is given as this version names it (``drafters.RENAMED``)."""
    meta, state = _read_drafter_state(Path(path), what)
    if isinstance(meta.get("drafter_class"), str):
        meta = {**meta, "drafter_class": class_path_now(meta["drafter_class"])}
    return meta, state


def _read_drafter_state(path: Path, what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if path.is_dir() and is_serving_folder(path):  # an exported serving layout (ours, speculators', SGLang's)
        return read_serving_folder(path, what)
    if path.is_dir():
        meta = _read_folder_meta(path, what)
        try:
            state = torch.load(path / "drafter.pt", map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
            raise UserError(f"{what} '{path / 'drafter.pt'}' is not a readable weights file ({err}).") from None
        return meta, state
    ckpt = read_checkpoint(path, what)
    state = {k[len("drafter.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    return ckpt[CKPT_KEY], state


# Heads a fit may add to a trained drafter (``init_from``): init argument -> the state-dict prefix of its weights.
# AdaFlash fits its length head on top of a trained DFlash drafter (Qian et al. 2026, arXiv 2607.19223).
ADDABLE_HEADS = {"length_head": "length."}


def added_heads(drafter: Drafter, recorded: dict[str, Any]) -> tuple[str, ...]:
    """State-dict prefixes of the heads ``drafter`` has on and a file's drafter (its ``recorded`` config) had off:
    their weights are the only keys ``init_weights`` lets a file lack."""
    ours = drafter.config_dict()
    return tuple(prefix for arg, prefix in ADDABLE_HEADS.items() if ours.get(arg) and not recorded.get(arg))


def init_weights(drafter: Drafter, path: str | Path, target_fingerprint: str) -> dict[str, Any]:
    """Start a fit from a trained drafter (``model.init_from``): its weights only, not its optimizer, schedule or
    step. The file must hold the same drafter class with weights of the same shapes, trained for the same target
    weights. Returns the parent record a checkpoint of this fit stores (``parent``: path, class, its own parent).
    A head the file's drafter had off (``ADDABLE_HEADS``) may be on in ``drafter``: it keeps its fresh weights."""
    what = "model.init_from"
    meta, state = read_drafter_state(path, what)
    ours = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    if meta["drafter_class"] != ours:
        raise UserError(
            f"{what} '{path}' holds a {meta['drafter_class']} but model.drafter is a {ours}; set model.drafter to the "
            "class (and sizes) the file was trained with."
        )
    if meta.get("target_fingerprint") not in (None, target_fingerprint):
        raise UserError(
            f"{what} '{path}' was trained for target '{meta.get('target')}' (weights fingerprint "
            f"{meta.get('target_fingerprint')}), not for model.target (fingerprint {target_fingerprint}); start from "
            "a drafter of this target."
        )
    added = added_heads(drafter, meta["drafter_config"])
    try:
        loaded = drafter.load_state_dict(with_target_weights(meta, state, drafter), strict=not added)
        stray = [k for k in loaded.missing_keys if not k.startswith(added)] + list(loaded.unexpected_keys)
        if stray:
            raise RuntimeError(f"Error(s) in loading state_dict:\n\tMissing or unexpected key(s): {stray}.")
    except RuntimeError as err:
        first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
        raise UserError(
            f"{what} '{path}' does not fit model.drafter ({first}); give model.drafter the init_args it was trained "
            f"with: {meta['drafter_config']}."
        ) from None
    return {"path": str(path), "drafter_class": meta["drafter_class"], "parent": meta.get("parent")}


def load_drafter(path: str | Path, target: Target | str | None = None) -> Drafter:
    """Rebuild a drafter from ``path`` (a ``.ckpt`` from ``fit`` or a folder from ``save_drafter``).

    ``target`` (a ``Target``, name, folder or model) defaults to a target already loaded in this process with the
    weights the drafter was trained for (same fingerprint), so ``load_target(name)`` then ``load_drafter(path)``
    holds one copy of the target; when none is loaded, only the recorded target's embedding, final norm and LM head
    are read (``load_target(..., layers=False)``: its layers never enter memory), which is all a drafter holds of
    it. ``generate(target, ..., drafter=drafter)`` then binds it to the user's target of the same weights."""
    what = "load_drafter path"
    meta, state = read_drafter_state(path, what)
    return _bind(meta, state, target, what)


def save_drafter(drafter: Drafter, folder: str | Path, target_spec: str | None = None,
                 fit: dict[str, Any] | None = None) -> Path:
    """Export a drafter as a folder: ``drafter.json`` (class, config, target) + ``drafter.pt`` (weights) +
    ``provenance.json`` (``fit``, the record of the fit that trained it, and the weights' SHA-256)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = drafter_record(drafter, target_spec or drafter.target.name)
    (folder / "drafter.json").write_text(json.dumps(meta, indent=2))
    torch.save(drafter.state_dict(), folder / "drafter.pt")
    record = folder_record(folder / "drafter.pt", drafter.target.fingerprint, fit)
    (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return folder


@dataclass(frozen=True)
class ModelFolder:
    """A drafter's folder as ``write_model_folder`` wrote it: where, the layout it chose, the logged model's name and
    the parameters it is listed by."""

    folder: Path
    layout: str
    name: str
    params: dict[str, str]


def write_model_folder(ckpt: str | Path, folder: Path, target: Target, target_spec: str) -> ModelFolder:
    """The drafter of a finished fit's checkpoint ``ckpt`` as one folder to hand on (the MLflow logged model): the
    speculators layout where the family exports (vLLM serves it), else our own (``save_drafter``) with the reason,
    a ``README.md`` card saying which and how to load or serve it, and the fit's provenance. The drafter is read
    from the file, not a module: whole even if FSDP sharded it."""
    drafter = load_drafter(ckpt, target=target)
    fit, family, k = recorded_fit(ckpt), drafter.family or type(drafter).__name__, drafter.block_size
    try:
        export_drafter(drafter, folder, "speculators", target_spec, parent={"path": str(ckpt)}, fit=fit)
        layout = "speculators (vLLM)"
        serving = vllm_speculative_config(drafter, "<this folder>")
        use = (f"`load_drafter(folder)`, or serve it: `vllm.LLM(model=<target>, speculative_config="
               f"{json.dumps(serving)})`" if serving else
               "`load_drafter(folder)`; no serving engine runs this family from the format yet")
    except UserError as err:  # the format cannot express this drafter: its own layout, and why
        save_drafter(drafter, folder, target_spec, fit=fit)
        layout = "lightning_spec (drafter.json + drafter.pt)"
        use = f"`load_drafter(folder)`; not exported for serving: {err}"
    (folder / "README.md").write_text(
        f"# {type(drafter).__name__} drafter (K = {k}) for {target_spec}\n\n"
        f"- checkpoint: `{ckpt}`\n- layout: {layout}\n- use: {use}\n"
        f"- target weights fingerprint: {drafter.target.fingerprint}\n"
        f"- provenance: `{PROVENANCE_FILE}`: the fit's command and resolved config, the package versions and commit "
        f"it ran with, and the weights' SHA-256 (rebuild: `lightning-spec fit --config <its config>`)\n")
    params = {"family": family, "K": str(k), "layout": layout, "target": target_spec}
    return ModelFolder(folder, layout, f"{family}-K{k}", params)


def recorded_fit(path: str | Path) -> dict[str, Any] | None:
    """The record of the fit that trained the drafter in ``path`` (``provenance.py``): a checkpoint's own, a
    folder's ``provenance.json``'s ``fit``; None where none was recorded (a checkpoint written before it was)."""
    path = Path(path)
    if path.is_dir():
        file = path / PROVENANCE_FILE
        return json.loads(file.read_text()).get("fit") if file.is_file() else None
    return read_checkpoint(path, "checkpoint").get(PROVENANCE_KEY)


def export_checkpoint(ckpt: str, out: str, format: str = "speculators",  # noqa: A002
                      target_path: str | None = None) -> Path:
    """``lightning-spec export``: write a trained drafter in a layout a serving engine loads (vLLM: speculators;
    SGLang: sglang), through ``export.export_drafter``.

    Args:
        ckpt: a .ckpt written by `lightning-spec fit` (or an exported / save_drafter folder).
        out: the folder to write: config.json, model.safetensors, lightning_spec.json (+ mask_embedding.pt).
        format: speculators (EAGLE-3, P-EAGLE, DFlash, DSpark, which vLLM serves, and MTP) or sglang (EAGLE-3,
            DFlash).
        target_path: the verifier path written into the config (default: the target's local folder).
    """
    record, state = read_drafter_state(ckpt, "export --ckpt")  # read once: the record and the weights
    drafter = _bind(record, state, None, "export --ckpt")
    parent = {"path": str(ckpt), "drafter_class": record["drafter_class"], "parent": record.get("parent")}
    folder = export_drafter(drafter, out, format, record["target"], target_path, parent, recorded_fit(ckpt))
    k = drafter.block_size
    codec = codec_for(drafter, format)
    print(f"export: wrote {type(drafter).__name__} (K={k}) as {format} to {folder}")
    serving = vllm_speculative_config(drafter, folder) if format == "speculators" else None
    if serving is not None:
        verifier = target_path or resolve_target_folder(record["target"])
        print(f'serve: vllm.LLM(model="{verifier}", speculative_config={json.dumps(serving)})')
    if format == "speculators" and codec.serving_note:
        print(f"note: {codec.serving_note}")
    return folder
