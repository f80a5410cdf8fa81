"""A drafter rebuilt from a file and bound to a target: ``load_drafter`` (any artifact ``read.py`` reads) and
``init_weights`` (``model.init_from``: a trained drafter's weights as a fit's start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_spec.checkpoint.classes import drafter_classes
from lightning_spec.checkpoint.read import read_drafter_state
from lightning_spec.drafters.base import Drafter
from lightning_spec.errors import UserError
from lightning_spec.target import Target, live_target
from lightning_spec.target_loading import load_target


def bind_drafter(meta: dict[str, Any], state: dict[str, torch.Tensor], target: Target | None, what: str) -> Drafter:
    """A drafter built from its ``meta`` record (our classes only), given ``state`` and bound to ``target``: the one
    given, an equal one already loaded, or the recorded target's heads (``load_target(layers=False)``)."""
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


# Heads a fit may add to a trained drafter (``init_from``): init argument -> the state-dict prefix of its weights.
# AdaFlash fits its length head on top of a trained DFlash drafter (Qian et al. 2026, arXiv 2607.19223).
ADDABLE_HEADS = {"length_head": "length."}


def added_heads(drafter: Drafter, recorded: dict[str, Any]) -> tuple[str, ...]:
    """State-dict prefixes of the heads ``drafter`` has on and a file's drafter (its ``recorded`` config) had off:
    their weights are the only keys ``init_weights`` lets a file lack."""
    ours = drafter.config_dict()
    return tuple(prefix for arg, prefix in ADDABLE_HEADS.items() if ours.get(arg) and not recorded.get(arg))


def init_weights(drafter: Drafter, path: str | Path, target_fingerprints: tuple[str, ...]) -> dict[str, Any]:
    """Start a fit from a trained drafter (``model.init_from``): its weights only, not its optimizer, schedule or
    step. The file must hold the same drafter class with weights of the same shapes, trained for the same target
    weights (``Target.fingerprints``). Returns the parent record a checkpoint of this fit stores (``parent``: path,
    class, its own parent).
    A head the file's drafter had off (``ADDABLE_HEADS``) may be on in ``drafter``: it keeps its fresh weights. A family
    may start from another's file (``Drafter.warm_start_from``: DFlash2 from DFlash); the weights that file lacks
    (``warm_start_fresh``) keep their start."""
    what = "model.init_from"
    artifact = read_drafter_state(path, what)
    meta, state = artifact.record, artifact.state
    ours = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    warm = meta["drafter_class"] != ours and meta["drafter_class"] in drafter.warm_start_from  # DFlash2 from DFlash
    if meta["drafter_class"] != ours and not warm:
        raise UserError(
            f"{what} '{path}' holds a {meta['drafter_class']} but model.drafter is a {ours}; set model.drafter to the "
            "class (and sizes) the file was trained with."
        )
    if meta.get("target_fingerprint") not in (None, *target_fingerprints):
        raise UserError(
            f"{what} '{path}' was trained for target '{meta.get('target')}' (weights fingerprint "
            f"{meta.get('target_fingerprint')}), not for model.target (fingerprint {target_fingerprints[0]}); start "
            "from a drafter of this target."
        )
    added = added_heads(drafter, meta["drafter_config"])
    fresh = drafter.warm_start_fresh if warm else ()
    try:
        loaded = drafter.load_state_dict(with_target_weights(meta, state, drafter), strict=not (added or fresh))
        stray = [k for k in loaded.missing_keys if not k.startswith(added) and not any(f in k for f in fresh)]
        stray += list(loaded.unexpected_keys)
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
    artifact = read_drafter_state(path, what)
    return bind_drafter(artifact.record, artifact.state, target, what)
