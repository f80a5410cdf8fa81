"""The folder layouts serving engines load: one codec per family and format that writes a drafter in it
(``checkpoint.write.export_drafter`` calls ``codec.write``) and reads such a folder back, ours or another tool's.

    codec_for(drafter, "speculators")   # the codec that writes this family in this format (or one sentence why none)
    read_serving_folder(folder)         # -> (record, state dict) of our drafter class

Formats (``FORMATS``): ``speculators`` (vLLM's speculators format: EAGLE-3, DFlash and DSpark, which vLLM serves
directly, and MTP) and ``sglang`` (SGLang's EAGLE-3 layout with ``midlayer.*`` names and ``hot_token_id``, and the
DFlash release layout with ``dflash_config``). Each format module holds one codec per family it can express, keyed
by our drafter class; a family without a codec is refused in one sentence naming the formats that have one, never
written half-right. Every folder also gets ``lightning_spec.json`` (our class, init arguments, target and its weights
fingerprint, lineage) so ``load_drafter`` rebuilds the drafter exactly; a folder another tool wrote (the
speculators library, a release) has none, and its config.json is mapped instead.

Reading a folder never runs code from it: tensors come from safetensors (or ``torch.load(weights_only=True)`` for
``mask_embedding.pt``), the class is chosen from our own codecs by the folder's declared algorithm, and a
``config.py`` / ``auto_map`` that speculators folders carry is ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spec.checkpoint.formats import sglang, speculators
from lightning_spec.checkpoint.formats.common import SIDECAR, Codec, read_json
from lightning_spec.drafters import FAMILIES, family_class
from lightning_spec.drafters.base import Drafter
from lightning_spec.errors import UserError

FORMATS: dict[str, Any] = {"speculators": speculators, "sglang": sglang}


def codec_for(drafter: Drafter, fmt: str) -> Codec:
    """The codec writing ``drafter``'s family (``drafters.FAMILIES``) in ``fmt``; a family the format cannot
    express, or a class that is not exactly a registered family, is refused."""
    if fmt not in FORMATS:
        raise UserError(f"export --format '{fmt}' is not one of {sorted(FORMATS)}.")
    family = drafter.family if family_class(drafter) is not None else None
    codec = FORMATS[fmt].CODECS.get(family)
    if codec is None:
        able = sorted(f for f, m in FORMATS.items() if family in m.CODECS)
        where = f"formats that can: {', '.join(able)}" if able else "this package has no codec for it in any format yet"
        known = sorted({FAMILIES[name].__name__ for m in FORMATS.values() for name in m.CODECS})
        raise UserError(
            f"A {type(drafter).__name__} cannot be written in the {fmt} format ({where}; the exportable families are "
            f"{', '.join(known)})."
        )
    return codec


def vllm_speculative_config(drafter: Drafter, folder: str | Path, codec: Codec | None = None) -> dict[str, Any] | None:
    """The ``speculative_config`` vLLM serves ``drafter``'s speculators export in ``folder`` with (None: no vLLM
    method runs the family from the format); ``codec``: the speculators codec that wrote it, when known."""
    codec = codec or codec_for(drafter, "speculators")
    if not codec.vllm:
        return None
    return {"method": codec.vllm, "model": str(folder), "num_speculative_tokens": drafter.block_size,
            **codec.vllm_options}


def served_fields(folder: str | Path) -> dict[str, Any]:
    """What vLLM must build from a speculators ``folder``: its codec's ``served`` of the folder's config.json, dotted
    paths into vLLM's speculative config (``method``, ``num_speculative_tokens``, ``parallel_drafting``) and, under
    ``draft.``, into the draft model's config -> values. Empty for a family vLLM has no method for (MTP)."""
    config = read_json(Path(folder) / "config.json", "served folder")
    codec = speculators.codec_of_config(config)
    return codec.served(config) if codec is not None and codec.vllm else {}


def served_mismatches(expected: dict[str, Any], built: dict[str, Any]) -> list[str]:
    """One sentence per field that vLLM built otherwise than the folder says, or not at all: ``expected`` from
    ``served_fields``, ``built`` what the engine holds ({method, num_speculative_tokens, parallel_drafting, draft: the
    draft model's config as a dict}, ``benchmarks/serve_vllm.py``). A server that drops or rewrites a field serves
    another drafter than the one trained (vLLM once dropped EAGLE-3.1's norms without an error)."""
    out = []
    for path, want in expected.items():
        node: Any = built
        for key in path.split("."):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
            if node is _MISSING:
                break
        if node is _MISSING:
            out.append(f"vLLM built no {path} (the folder says {want!r}): it dropped the field.")
        elif node != want:
            out.append(f"vLLM built {path} = {node!r} where the folder says {want!r}: it rewrote the field.")
    return out


_MISSING = object()


def is_serving_folder(folder: Path) -> bool:
    """True when ``folder`` holds a serving layout (a config.json this package can map), not save_drafter's."""
    return (folder / "config.json").is_file() and not (folder / "drafter.json").is_file()


def read_serving_folder(folder: str | Path, what: str = "path") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(record, our drafter's state dict) of a serving folder, ours or another tool's; no code from it runs."""
    folder = Path(folder)
    config = read_json(folder / "config.json", what)
    codec = None
    for module in FORMATS.values():
        codec = module.codec_of_config(config)
        if codec is not None:
            break
    if codec is None:
        raise UserError(
            f"{what} '{folder}' holds a config.json of no layout this package reads (speculators EAGLE-3 / DFlash / "
            "DSpark / MTP, SGLang EAGLE-3 / DFlash); pass a .ckpt, a save_drafter folder or an exported one."
        )
    tensors = _read_safetensors(folder, what)
    sidecar = read_json(folder / SIDECAR, what) if (folder / SIDECAR).is_file() else None
    return codec.read(config, tensors, folder, sidecar, what)


def _read_safetensors(folder: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{what} '{folder}' has a config.json but no .safetensors weights.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{what} '{f}' is not a readable safetensors file ({err}).") from None
    return tensors


__all__ = ["FORMATS", "codec_for", "is_serving_folder", "read_serving_folder", "vllm_speculative_config"]
