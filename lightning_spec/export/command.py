"""``lightning-spec export``: a fit checkpoint written in a serving layout (the command over ``export_drafter``)."""

from __future__ import annotations

from pathlib import Path

from lightning_spec.assets import resolve_target_folder
from lightning_spec.checkpoint import load_drafter, read_drafter_state
from lightning_spec.export import codec_for, export_drafter


def export(ckpt: str, out: str, format: str = "speculators", target_path: str | None = None) -> Path:  # noqa: A002
    """Write a trained drafter in a layout a serving engine loads (vLLM: speculators; SGLang: sglang).

    Args:
        ckpt: a .ckpt written by `lightning-spec fit` (or an exported / save_drafter folder).
        out: the folder to write: config.json, model.safetensors, lightning_spec.json (+ mask_embedding.pt).
        format: speculators (EAGLE-3, DFlash, DSpark, which vLLM serves, and MTP) or sglang (EAGLE-3, DFlash).
        target_path: the verifier path written into the config (default: the target's local folder).
    """
    record, _ = read_drafter_state(ckpt, "export --ckpt")
    drafter = load_drafter(ckpt)
    parent = {"path": str(ckpt), "drafter_class": record["drafter_class"], "parent": record.get("parent")}
    folder = export_drafter(drafter, out, format, record["target"], target_path, parent)
    k = drafter.block_size
    codec = codec_for(drafter, format)
    print(f"export: wrote {type(drafter).__name__} (K={k}) as {format} to {folder}")
    if format == "speculators" and codec.vllm:
        verifier = target_path or resolve_target_folder(record["target"])
        print(f'serve: vllm.LLM(model="{verifier}", speculative_config={{"method": "{codec.vllm}", "model": '
              f'"{folder}", "num_speculative_tokens": {k}}})')
    if format == "speculators" and codec.serving_note:
        print(f"note: {codec.serving_note}")
    return folder
