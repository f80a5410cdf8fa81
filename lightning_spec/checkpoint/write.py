"""Writing a drafter artifact: ``save_drafter`` (our folder), ``export_drafter`` (a serving layout, ``formats/``),
``write_model_folder`` (what a fit hands on: the MLflow logged model, with its card) and ``export_checkpoint``
(``lightning-spec export``). Every folder carries ``provenance.json``: the fit's record and the weights' SHA-256.
The export policy lives here once: the speculators layout where the family's codec can express it, else our own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_spec.assets import resolve_target_folder
from lightning_spec.checkpoint.formats import codec_for, vllm_speculative_config
from lightning_spec.checkpoint.formats.common import SIDECAR, Codec
from lightning_spec.checkpoint.load import bind_drafter
from lightning_spec.checkpoint.read import read_drafter_state
from lightning_spec.drafters.base import Drafter, drafter_record
from lightning_spec.errors import UserError
from lightning_spec.provenance import PROVENANCE_FILE, folder_record
from lightning_spec.target import Target


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
class Exported:
    """What ``export_drafter`` wrote: the folder, the codec that wrote it, the verifier its config names (the model a
    serving engine runs next to the drafter) and the ``speculative_config`` vLLM serves it with (None: the format
    is not speculators, or no vLLM method runs the family from it)."""

    folder: Path
    codec: Codec
    verifier: str
    serving: dict[str, Any] | None


def export_drafter(
    drafter: Drafter, out: str | Path, fmt: str = "speculators", target_spec: str | None = None,
    target_path: str | None = None, parent: dict[str, Any] | None = None, fit: dict[str, Any] | None = None,
) -> Exported:
    """Write ``drafter`` to the folder ``out`` in format ``fmt`` (``formats.FORMATS``); returns what it wrote.

    ``target_spec``: the target name recorded for ``load_drafter`` (default the bound target's); ``target_path``:
    the verifier path written into the serving config (default the target's local folder), the model vLLM or
    SGLang serves next to the drafter; ``fit``: the record of the fit that trained it (a checkpoint's ``provenance``),
    kept in the folder's ``provenance.json`` with the weights' SHA-256."""
    codec = codec_for(drafter, fmt)
    codec.check(drafter)
    if not bool(drafter.vocab.ready):
        raise UserError(
            "The drafter's reduced draft vocabulary was never chosen (vocab.ready is False): export a drafter "
            "after `fit` has set it from the data."
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = drafter.target
    verifier = target_path or target.folder or resolve_target_folder(target_spec or target.name)  # folder: resolved
    config, tensors, extra = codec.write(drafter, verifier)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    from safetensors.torch import save_file

    # cloned: a tied target's full-vocabulary head and its embedding are one tensor, which safetensors refuses twice
    save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, str(out / "model.safetensors"))
    record = folder_record(out / "model.safetensors", target.fingerprint, fit)
    (out / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for name, obj in extra.items():  # e.g. DFlash's mask_embedding.pt, DSpark's dspark_calibration.json
        if name.endswith(".json"):
            (out / name).write_text(json.dumps(obj, indent=2) + "\n")
        else:
            torch.save(obj, out / name)
    record = drafter_record(drafter, target_spec or target.name)
    record.update(format=fmt, parent=parent)
    (out / SIDECAR).write_text(json.dumps(record, indent=2) + "\n")
    serving = vllm_speculative_config(drafter, out, codec) if fmt == "speculators" else None
    return Exported(out, codec, verifier, serving)


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
    artifact = read_drafter_state(ckpt, "checkpoint")  # read once: the record, the weights, the fit's record
    drafter = bind_drafter(artifact.record, artifact.state, target, "checkpoint")
    fit, family, k = artifact.fit, drafter.family or type(drafter).__name__, drafter.block_size
    try:
        exported = export_drafter(drafter, folder, "speculators", target_spec, parent={"path": str(ckpt)}, fit=fit)
        serving = exported.serving
        layout = "speculators (vLLM)"
        use = (f"`load_drafter(folder)`, or serve it: `vllm.LLM(model=<target>, speculative_config="
               f"{json.dumps({**serving, 'model': '<this folder>'})})`" if serving else
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


def export_checkpoint(ckpt: str, out: str, format: str = "speculators",  # noqa: A002
                      target_path: str | None = None) -> Path:
    """``lightning-spec export``: write a trained drafter in a layout a serving engine loads (vLLM: speculators;
    SGLang: sglang), through ``export_drafter``.

    Args:
        ckpt: a .ckpt written by `lightning-spec fit` (or an exported / save_drafter folder).
        out: the folder to write: config.json, model.safetensors, lightning_spec.json (+ mask_embedding.pt).
        format: speculators (EAGLE-3, P-EAGLE, DFlash, DSpark, which vLLM serves, and MTP) or sglang (EAGLE-3,
            DFlash).
        target_path: the verifier path written into the config (default: the target's local folder).
    """
    artifact = read_drafter_state(ckpt, "export --ckpt")  # read once: the record, the weights, the fit's record
    record = artifact.record
    drafter = bind_drafter(record, artifact.state, None, "export --ckpt")
    parent = {"path": str(ckpt), "drafter_class": record["drafter_class"], "parent": record.get("parent")}
    exported = export_drafter(drafter, out, format, record["target"], target_path, parent, artifact.fit)
    print(f"export: wrote {type(drafter).__name__} (K={drafter.block_size}) as {format} to {exported.folder}")
    if exported.serving is not None:
        print(f'serve: vllm.LLM(model="{exported.verifier}", speculative_config={json.dumps(exported.serving)})')
    if format == "speculators" and exported.codec.serving_note:
        print(f"note: {exported.codec.serving_note}")
    return exported.folder
