"""The search space of a sweep and the config of one trial.

``space:`` maps dotted config keys to Optuna distributions (``Param``); a trial's config is the base YAML with
the fixed ``overrides`` and the sampled values written in at their keys (``trial_config``), checked against
``fit``'s parser before any trial runs (``probes`` + ``check_config``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from lightning_spec.errors import UserError
from lightning_spec.files import atomic_write_text

CHOICE_TYPES = (str, int, float, bool, type(None))  # what Optuna stores as a categorical value


@dataclass
class Param:
    """One entry of ``space:``: a dotted config key, its Optuna name and distribution.

    ``values`` maps a categorical's Optuna value (a name) to the config value it stands for, when the choices
    are given as a mapping (``choices: {kl_decay: {class_path: ...}, ...}``); Optuna stores only the name.
    """

    key: str
    name: str
    distribution: BaseDistribution
    values: dict[str, Any] | None = None

    def config_value(self, value: Any) -> Any:
        return self.values[value] if self.values is not None else value

    def describe(self) -> str:
        d = self.distribution
        if isinstance(d, CategoricalDistribution):
            return "choices " + ", ".join(str(c) for c in d.choices)
        kind = "int" if isinstance(d, IntDistribution) else "float"
        extra = " log" if d.log else (f" step {d.step}" if d.step not in (None, 1) else "")
        return f"{kind} [{d.low}, {d.high}]{extra}"


def _number(value: Any, field: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UserError(f"{field} must be a number, got {value!r}.")
    if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise UserError(f"{field} must be a number, got {value!r}.") from None
    return value


def short_name(key: str) -> str:
    """``model.drafter.init_args.block_size`` -> ``block_size``: the last part that is not ``init_args``."""
    parts = [p for p in key.split(".") if p != "init_args"]
    return parts[-1] if parts else key


def parse_space(space: dict[str, Any]) -> list[Param]:
    """``space:`` of a sweep YAML -> params. Each entry is ``{choices: [...] | {name: value}}`` or
    ``{low, high, log?, step?}`` (int when both bounds are ints), with an optional ``name`` (default: the
    key's last part that is not ``init_args``)."""
    if not space:
        raise UserError("space is empty: give at least one dotted config key with choices or low/high.")
    params = []
    for key, spec in space.items():
        field = f"space.{key}"
        if not isinstance(spec, dict):
            raise UserError(f"{field} must be a mapping with `choices` or `low`/`high`, got {spec!r}.")
        unknown = set(spec) - {"choices", "low", "high", "log", "step", "name"}
        if unknown:
            raise UserError(f"{field} has unknown fields {sorted(unknown)}; use choices, low, high, log, step, name.")
        name = str(spec.get("name") or short_name(key))
        if "choices" in spec:
            choices = spec["choices"]
            values = None
            if isinstance(choices, dict):  # name -> config value (a class_path block, a list ...)
                values = {str(k): v for k, v in choices.items()}
                choices = list(values)
            if not isinstance(choices, list) or not choices:
                raise UserError(f"{field}.choices must be a non-empty list or a mapping name -> value.")
            bad = [c for c in choices if not isinstance(c, CHOICE_TYPES)]
            if bad:
                raise UserError(
                    f"{field}.choices holds {bad[0]!r}, which Optuna cannot store: give the choices as a mapping "
                    "name -> value (e.g. `choices: {kl_decay: {class_path: ...}}`); the name is the trial's param."
                )
            params.append(Param(key, name, CategoricalDistribution(choices), values))
        elif "low" in spec and "high" in spec:
            low, high = _number(spec["low"], f"{field}.low"), _number(spec["high"], f"{field}.high")
            log, step = bool(spec.get("log", False)), spec.get("step")
            if low >= high:
                raise UserError(f"{field} needs low < high, got low={low}, high={high}.")
            if isinstance(low, int) and isinstance(high, int) and (step is None or isinstance(step, int)):
                params.append(Param(key, name, IntDistribution(low, high, log=log, step=step or 1)))
            else:
                step = None if step is None else float(_number(step, f"{field}.step"))
                params.append(Param(key, name, FloatDistribution(float(low), float(high), log=log, step=step)))
        else:
            raise UserError(f"{field} needs `choices` or both `low` and `high`.")
    names = [p.name for p in params]
    for p in params:
        if names.count(p.name) > 1:
            raise UserError(f"space.{p.key}: the param name {p.name!r} is taken twice; give each a `name:`.")
    return params


def grid_of(params: list[Param]) -> dict[str, list[Any]]:
    """The search space of the grid sampler: every param must be categorical."""
    for p in params:
        if not isinstance(p.distribution, CategoricalDistribution):
            raise UserError(f"sampler=grid needs `choices` for every space entry; space.{p.key} is a range.")
    return {p.name: list(p.distribution.choices) for p in params}


def probes(params: list[Param]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Values to parse before the first trial: every choice of every categorical once, the others at their
    first choice or lower bound."""
    first = {p.name: p.distribution.choices[0] if isinstance(p.distribution, CategoricalDistribution)
             else p.distribution.low for p in params}
    yield "space", first
    for p in params:
        if isinstance(p.distribution, CategoricalDistribution):
            for choice in p.distribution.choices[1:]:
                yield f"space.{p.key} = {choice!r}", {**first, p.name: choice}


# ------------------------------------------------------------------------------------------ trial config
def plain(value: Any) -> Any:
    """jsonargparse Namespaces (what a parsed ``dict`` option holds) back to dicts, all the way down."""
    from jsonargparse import Namespace

    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML as ``fit -c`` reads it (jsonargparse's loader: ``3e-3`` is a float)."""
    from jsonargparse import get_loader

    config = get_loader("yaml")(Path(path).read_text())
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a YAML mapping.")
    return config


def trial_config(
    base: dict[str, Any], overrides: dict[str, Any], params: list[Param], values: dict[str, Any]
) -> dict[str, Any]:
    """``base`` with the fixed ``overrides`` and the sampled values written in, as editing the YAML would: a
    value replaces what the key held, a whole ``class_path`` block included. (``fit``'s command-line
    ``--model.objective={...}`` would instead keep the old block's init_args that the new class also takes, so
    E2E would inherit ``normalize`` from the base's Objective.) Keys apply shallow to deep: a whole block
    before a key inside it, the fixed overrides before the space's at the same depth."""
    pairs = [(k, v) for k, v in overrides.items()]
    pairs += [(p.key, p.config_value(values[p.name])) for p in params if p.name in values]
    pairs.sort(key=lambda kv: kv[0].count("."))
    config = copy.deepcopy(base)
    for key, value in pairs:
        node = config
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = copy.deepcopy(value)
    return config


def write_yaml(config: dict[str, Any], path: Path) -> Path:
    import yaml

    return atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))


@contextlib.contextmanager
def quiet_cli_args() -> Iterator[None]:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds options: the sweep's own command line
    is not the trial's, and the trial's args are the whole of it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended to run from within")
        yield


def check_config(config: dict[str, Any]) -> None:
    """Parse a trial's config as ``fit -c trial.yaml --print_config`` would (no model is loaded): a typo in a
    key or a value of the wrong type is an error before any trial runs."""
    from lightning_spec.cli import run_cli

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), quiet_cli_args():
        try:
            run_cli(["fit", "-c", str(write_yaml(config, Path(tmp) / "trial.yaml")), "--print_config"],
                    exit_on_error=False)
        except SystemExit as exit_:  # --print_config exits 0 after printing
            if exit_.code not in (0, None):
                raise


def print_plan(
    base: str, overrides: dict[str, Any], params: list[Param], grid: dict[str, list[Any]] | None, sampler: str,
    n_trials: int | None,
) -> None:
    print(f"{n_trials if n_trials is not None else 'until timeout:'} trials, sampler {sampler}; each trial is "
          f"`lightning-spec fit -c trial.yaml`, trial.yaml = {base} with")
    for key, value in overrides.items():
        print(f"  {key}: {json.dumps(value)}")
    for p in params:
        print(f"  {p.key}: <{p.name}: {p.describe()}>")
    if grid is not None:
        names = list(grid)
        for i, combo in enumerate(itertools.product(*grid.values())):
            print(f"  grid point {i}: " + ", ".join(f"{n}={v}" for n, v in zip(names, combo)))
