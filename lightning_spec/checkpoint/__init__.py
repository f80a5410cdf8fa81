"""Every drafter artifact, read and written in one place.

A fit leaves its drafter as three artifacts: the Lightning checkpoint (``.ckpt``: the drafter's weights, its class
and init arguments, the target it was trained for, never the target's weights), an exported folder (our own
``save_drafter`` layout, or a serving layout vLLM or SGLang loads) and the MLflow logged model (one of those
folders with a card). Files are shared between people, so reading one is a trust boundary: ``torch.load`` with
``weights_only=True`` (no pickled code), and only lightning_spec's own classes are ever built from a file.

    classes.py   what a file may build: ``build`` / ``describe`` of ``class_path`` dicts, ``drafter_classes``
    formats/     the serving layouts (speculators, SGLang): one codec per family and format, writing and reading
    read.py      any artifact as ``(record, state dict)``; a checkpoint's recorded target and fit
    load.py      ``load_drafter`` (a drafter bound to its target), ``init_weights`` (``model.init_from``)
    fit.py       what a ``fit`` checkpoint holds beside Lightning's state (``DraftModule``'s save and load hooks)
    write.py     ``save_drafter``, ``export_drafter``, ``write_model_folder`` (the logged model), ``export_checkpoint``
                 (``lightning-spec export``); every folder carries ``provenance.json``

The layers go one way: ``write`` uses ``load`` and ``read``; ``fit`` and ``load`` use ``read``; ``read`` uses
``formats``. None of them imports a module above this package (``tracking.py`` only logs the folder
``write_model_folder`` made).
"""

from lightning_spec.checkpoint.classes import build, describe, drafter_classes
from lightning_spec.checkpoint.formats import (
    FORMATS,
    codec_for,
    served_fields,
    served_mismatches,
    vllm_speculative_config,
)
from lightning_spec.checkpoint.load import init_weights, load_drafter
from lightning_spec.checkpoint.read import (
    CKPT_KEY,
    Artifact,
    read_checkpoint,
    read_drafter_state,
    recorded_fit,
    recorded_target,
)
from lightning_spec.checkpoint.write import (
    Exported,
    ModelFolder,
    export_checkpoint,
    export_drafter,
    save_drafter,
    write_model_folder,
)

__all__ = ["CKPT_KEY", "FORMATS", "Artifact", "Exported", "ModelFolder", "build", "codec_for", "describe",
           "drafter_classes", "export_checkpoint", "export_drafter", "init_weights", "load_drafter", "read_checkpoint",
           "read_drafter_state", "recorded_fit", "recorded_target", "save_drafter", "served_fields",
           "served_mismatches", "vllm_speculative_config", "write_model_folder"]
