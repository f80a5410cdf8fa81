"""What a saved file may build: ``build`` instantiates nested ``{class_path, init_args}`` dicts (a checkpoint's
hyperparameters), ``describe`` writes them, ``drafter_classes`` lists the drafter classes a record may name. Files are
shared between people, so this is a trust boundary: only lightning_spec's own classes are built, never an arbitrary
importable name."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from lightning_spec.drafters.base import Drafter, init_arguments
from lightning_spec.errors import UserError

PACKAGE = "lightning_spec"


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
