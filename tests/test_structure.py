"""Options as objects (issue 34, item 5): no function of the package runs longer than ``MAX_LINES`` lines or takes
more than ``MAX_PARAMS`` parameters, and no dataclass holds more than ``MAX_PARAMS`` fields (its ``__init__`` takes
them all), except what ``EXEMPT`` lists with why: mostly a typed ``__init__`` or a command dataclass that is the
YAML schema, one flag or key per parameter. A new wide function takes grouped option objects instead.

The scan reads the package's source with ``ast`` (as ``test_declared.py`` does): a function's lines run from its
``def`` to its last line, docstring included; its parameters are every positional, keyword-only and ``*``/``**``
parameter but ``self`` and ``cls``.

Typed seams (issue 47, item 3): no parameter or field named ``target``, ``drafter`` or ``tree`` is annotated ``Any``.

Layers (issue 47): the package's rooms (a top-level module, or a first-level folder as one room) import each other
without a cycle, every import counted (``TYPE_CHECKING`` and function-level ones too), so they stack in floors and
no import climbs from a lower floor to a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_spec"
MAX_LINES, MAX_PARAMS = 80, 10

# (file, qualified name) -> why it may be wider than MAX_PARAMS
EXEMPT: dict[tuple[str, str], str] = {
    # typed __init__ signatures that are the YAML schema (LightningCLI reads them: `model:`, `data:`, ...)
    ("lightning_spec/module.py", "DraftModule.__init__"): "schema: an experiment's `model:`",
    ("lightning_spec/datamodule.py", "SpecDataModule.__init__"): "schema: an experiment's `data:`",
    ("lightning_spec/drafters/block.py", "ParallelBlockDrafter.__init__"): "schema: `model.drafter`",
    ("lightning_spec/drafters/dspark.py", "DSparkDrafter.__init__"): "schema: `model.drafter`",
    ("lightning_spec/drafters/domino.py", "DominoDrafter.__init__"): "schema: `model.drafter`",
    ("lightning_spec/drafters/d2sd.py", "D2SDDrafter.__init__"): "schema: `model.drafter`",
    ("lightning_spec/drafters/peagle.py", "PEagleDrafter.__init__"): "schema: `model.drafter`",
    ("lightning_spec/drafters/dflash2.py", "DFlash2Drafter.__init__"): "schema: `model.drafter`",
    # the command dataclasses: their fields are the command's flags and YAML keys (cli.run_command)
    ("lightning_spec/evaluation/cli.py", "Evaluate"): "schema: `lightning-spec evaluate`",
    ("lightning_spec/data/rollout_writer.py", "Rollouts"): "schema: `lightning-spec rollouts`",
    ("lightning_spec/sweeps/command.py", "Sweep"): "schema: `lightning-spec sweep`",
    # not a schema
    ("lightning_spec/decoding/plans.py", "Adapt"): "the adapting plan: how it decodes and the adapter's knobs, "
                                                   "every field defaulted and named by callers",
    ("lightning_spec/decoding/engine.py", "Generation"): "a result record the engine fills, not an argument list",
    ("lightning_spec/decoding/timed.py", "DecodeReport"): "a result record the runner fills",
    ("lightning_spec/adaptation.py", "Decision"): "a result record: one window's decision, logged",
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    names = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
    return any((isinstance(n, ast.Name) and n.id == "dataclass") or (isinstance(n, ast.Attribute)
               and n.attr == "dataclass") for n in names)


def _fields(node: ast.ClassDef) -> int:
    """A dataclass's fields: its annotated class attributes, ``ClassVar`` ones aside."""
    return sum(isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
               and "ClassVar" not in ast.unparse(s.annotation) for s in node.body)


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return n - (1 if first and first[0].arg in ("self", "cls") else 0)


def measure(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, lines, parameters or fields) of every function and dataclass in ``source``."""
    rows: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                rows.append((name, child.end_lineno - child.lineno + 1, _params(child)))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                if _is_dataclass(child):
                    rows.append((prefix + child.name, 0, _fields(child)))
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return rows


def over_budget(source: str) -> list[tuple[str, int, int]]:
    return [(name, lines, params) for name, lines, params in measure(source)
            if lines > MAX_LINES or params > MAX_PARAMS]


def package_offenders() -> dict[tuple[str, str], tuple[int, int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for name, lines, params in over_budget(path.read_text(encoding="utf-8")):
            found[(rel, name)] = (lines, params)
    return found


def test_no_function_is_longer_or_wider_than_the_budget():
    offenders = {k: v for k, v in package_offenders().items() if k not in EXEMPT}
    shown = "\n".join(f"  {file}: {name} ({lines} lines, {params} parameters)"
                      for (file, name), (lines, params) in offenders.items())
    assert not offenders, (f"over {MAX_LINES} lines or {MAX_PARAMS} parameters (split it, or group its options in "
                           f"an object):\n{shown}")


def test_every_exempt_entry_is_still_over_the_budget():
    """An entry that fits the budget again (or is gone) leaves the list, so the list says what is wide today."""
    offenders = package_offenders()
    stale = [key for key in EXEMPT if key not in offenders]
    assert not stale, f"no longer over the budget, remove from EXEMPT: {stale}"
    assert all(lines <= MAX_LINES for key, (lines, _) in offenders.items() if key in EXEMPT), (
        "an exempt signature may be wide, never long")


def test_the_scan_finds_a_wide_or_long_function_and_a_wide_dataclass():
    wide = "def f(" + ", ".join(f"a{i}" for i in range(12)) + "):\n    pass\n"
    method = "class C:\n    def m(self, " + ", ".join(f"a{i}" for i in range(10)) + "):\n        pass\n"
    long = "def g():\n" + "    x = 1\n" * MAX_LINES
    fields = "@dataclass(frozen=True)\nclass D:\n" + "".join(f"    a{i}: int = 0\n" for i in range(11))
    source = wide + method + long + fields
    assert over_budget(source) == [("f", 2, 12), ("g", MAX_LINES + 1, 0), ("D", 0, 11)]
    assert ("C.m", 2, 10) in measure(source)  # self is not counted: 10 fits


def untyped_seams(source: str) -> list[str]:
    """Parameters named ``target``, ``drafter`` or ``tree`` annotated ``Any`` in ``source``: the seams where a
    ``Target``, a ``Proposer`` (or a ``Drafter``) and a ``TreeConfig`` pass between rooms."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.arg in ("target", "drafter", "tree") and isinstance(arg.annotation, ast.Name) \
                        and arg.annotation.id == "Any":
                    found.append(f"{node.name}({arg.arg}: Any) line {node.lineno}")
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id in ("target", "drafter", "tree") and isinstance(node.annotation, ast.Name) \
                and node.annotation.id == "Any":
            found.append(f"{node.target.id}: Any line {node.lineno}")
    return found


def test_targets_drafters_and_trees_are_typed_where_they_pass():
    """``target: Any``, ``drafter: Any`` and ``tree: Any`` are gone from the package's signatures and fields: a
    reader sees what crosses each seam (``Target``, ``Proposer``, ``TreeConfig``), the checker what may."""
    found = {str(p.relative_to(PACKAGE.parent)): untyped_seams(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert not {path: seams for path, seams in found.items() if seams}
    assert untyped_seams("def f(target: Any, tree: TreeConfig): ...\nclass C:\n    drafter: Any\n") == [
        "f(target: Any) line 1", "drafter: Any line 3"]


# ------------------------------------------------------------------------------------------------ layers
def room_of(module: str) -> str | None:
    """``lightning_spec.decoding.auto.choice`` -> ``decoding``: the room a dotted module belongs to (None: outside)."""
    parts = module.split(".")
    if parts[0] != "lightning_spec":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def room_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """room -> the other rooms it imports, from every ``import`` / ``from ... import`` anywhere in its files."""
    edges: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        relative = path.relative_to(root.parent).with_suffix("")
        module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        here = room_of(module)
        if here in (None, "__init__", "__main__"):  # the package's face and entry point re-export every layer
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module == "lightning_spec":  # from lightning_spec import x
                names = [f"lightning_spec.{a.name}" for a in node.names]
            for name in names:
                there = room_of(name)
                if there not in (None, here, "__init__"):
                    edges.setdefault(here, set()).add(there)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of rooms (first room repeated at the end), or None when the imports stack in floors."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(room: str) -> list[str] | None:
        state[room] = 1
        path.append(room)
        for nxt in sorted(edges.get(room, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[room] = 2
        path.pop()
        return None

    for room in sorted(edges):
        if room not in state and (found := visit(room)):
            return found
    return None


def test_the_rooms_stack_in_floors_without_an_import_back_up():
    """No cycle among the package's rooms: an import from a lower room to a higher one (``decoding`` importing
    ``objectives``, ``metrics`` importing ``drafters``) would close one, and the test names it."""
    cycle = find_cycle(room_imports())
    assert cycle is None, f"the imports {' -> '.join(cycle)} climb back up: move the type or the code down a floor"


def test_the_layer_check_sees_a_climb(tmp_path):
    """The check itself: a type-only import from a low room back up to the room that imports it is a cycle."""
    package = tmp_path / "lightning_spec"
    (package / "drafters").mkdir(parents=True)
    (package / "metrics.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from lightning_spec.drafters.base import DraftOutput\n")
    (package / "drafters" / "base.py").write_text("from lightning_spec.metrics import RatioOfSums\n")
    assert find_cycle(room_imports(package)) == ["drafters", "metrics", "drafters"]
    (package / "metrics.py").write_text("import torch\n")
    assert find_cycle(room_imports(package)) is None


def test_the_module_keeps_the_step_the_reduction_and_the_hooks():
    """``module.py`` (issue 47, item 4): at most 300 lines, and no callback imported; loading, the feature store, the
    artifacts, the clock and what MLflow compares runs by live in their own rooms."""
    source = (PACKAGE / "module.py").read_text()
    assert len(source.splitlines()) <= 300
    assert "callbacks" not in room_imports().get("module", set())
