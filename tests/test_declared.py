"""Declared, not probed (the design's rule; issue 25, part 1): no module of the package probes
another project object for attributes (``getattr``/``hasattr``/``vars``/``inspect.signature``) or sets attributes
on one (``dm.on_policy = True``, ``trainer.datamodule.x = ...``); it reads what that object declares.

The scan reads the package's source with ``ast`` (so strings and comments never match) and fails on every
occurrence that ``ALLOWED`` does not list. Each entry is (file, a substring of the line, why): probing a third-party
object (an HF config or model, a tokenizer, torch, Lightning's trainer) or reading one's own attributes is fine, and
so is serialisation (recording init arguments, importing a class by its saved path).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_spec"

PROBES = {"getattr", "hasattr", "setattr", "delattr", "vars"}
# the names our code gives to project objects: setting an attribute on one of them (or through one of them:
# ``self.trainer.datamodule.x = ``) sets it on another object
OTHERS = {"dm", "datamodule", "trainer", "pl_module", "module", "callback", "cb", "objective", "drafter", "target",
          "sampler", "loader", "model", "reference"}

ALLOWED: list[tuple[str, str, str]] = [
    # third-party objects: HF configs, models, tokenizers, torch, Lightning, jsonargparse, exceptions
    ("lightning_spec/target.py", 'getattr(model.config, "_name_or_path"', "HF config"),
    ("lightning_spec/target.py", 'hasattr(self.model, "get_decoder")', "HF model"),
    ("lightning_spec/target.py", 'getattr(self.model, "generation_config"', "HF model"),
    ("lightning_spec/target.py", 'getattr(src, "eos_token_id"', "HF generation config / model config"),
    ("lightning_spec/target_loading.py", 'hasattr(torch.cpu, "get_capabilities")', "torch version"),
    ("lightning_spec/target.py", "getattr(torch, dtype)", "torch dtype by name"),
    ("lightning_spec/target_loading.py", "getattr(torch, dtype)", "torch dtype by name"),
    ("lightning_spec/target_loading.py", 'getattr(model.config, "_attn_implementation"', "HF config"),
    ("lightning_spec/target_loading.py", 'hasattr(model, "get_decoder")', "HF model"),
    ("lightning_spec/target_loading.py", 'getattr(decoder, "norm", None)', "HF decoder"),
    ("lightning_spec/target_loading.py", "setattr(module, pname, loaded[name])", "HF model's torch modules"),
    ("lightning_spec/target.py", "inspect.signature(self.base.forward)", "HF decoder's forward"),
    ("lightning_spec/assets.py", "hasattr(config, attr)", "HF config"),
    ("lightning_spec/assets.py", "delattr(config, attr)", "HF config"),
    ("lightning_spec/callbacks/base.py", "trainer.callback_metrics[key] = ", "Lightning's trainer: its metrics dict"),
    ("lightning_spec/datamodule.py", 'getattr(self.tokenizer, "name_or_path"', "a user's tokenizer"),
    ("lightning_spec/datamodule.py", 'getattr(self.trainer, "distributed_sampler_kwargs"', "Lightning trainer"),
    ("lightning_spec/data/chat.py", "getattr(tokenizer, ", "HF tokenizer"),
    ("lightning_spec/data/tokenized.py", 'getattr(tokenizer, "chat_template"', "HF tokenizer"),
    ("lightning_spec/data/rollout_writer.py", 'getattr(tokenizer, "name_or_path"', "HF tokenizer"),
    ("lightning_spec/data/engines.py", 'getattr(err, "reason"', "urllib's exception"),
    ("lightning_spec/sweeps/locks.py", 'getattr(err, "orig"', "SQLAlchemy's exception"),
    ("lightning_spec/decoding/engine.py", 'hasattr(input_ids, "keys")', "a tokenizer's BatchEncoding"),
    ("lightning_spec/data/rollouts.py", 'hasattr(rollouts, "__iter__")', "a user's argument: any iterable"),
    ("lightning_spec/data/sources.py", 'hasattr(source, "name")', "jsonargparse Namespace"),
    ("lightning_spec/data/sources.py", "vars(source)", "jsonargparse Namespace"),
    ("lightning_spec/tracking.py", 'hasattr(entry, "get")', "a parsed YAML entry (dict or Namespace)"),
    ("lightning_spec/cli.py", "vars(parser.instantiate_classes(cfg))", "jsonargparse Namespace"),
    ("lightning_spec/evaluation/report.py", 'getattr(out, "isatty"', "an output stream"),
    ("lightning_spec/adaptation.py", 'hasattr(input_ids, "keys")', "a tokenizer's BatchEncoding"),
    ("lightning_spec/checkpoint/formats/common.py", "getattr(cfg, ", "HF config"),
    ("lightning_spec/checkpoint/formats/common.py", 'getattr(target.config, "architectures"', "HF config"),
    ("lightning_spec/drafters/layers.py", "getattr(cfg, ", "HF config"),
    ("lightning_spec/drafters/layers.py", 'getattr(target.base, "norm"', "HF decoder"),
    ("lightning_spec/drafters/layers.py", 'getattr(final_norm, "weight"', "HF decoder's norm"),
    # serialisation: import a class or function by its saved path, record or rebuild an object's init arguments
    ("lightning_spec/cli.py", "getattr(importlib.import_module(module), attr)", "serialisation: a command by path"),
    ("lightning_spec/checkpoint/classes.py", "getattr(importlib.import_module(module), name)", "serialisation"),
    ("lightning_spec/tracking.py", "getattr(importlib.import_module(module), name)", "serialisation"),
    ("lightning_spec/drafters/base.py", "hasattr(obj, name)", "serialisation: init_arguments"),
    ("lightning_spec/drafters/base.py", "getattr(obj, name)", "serialisation: init_arguments"),
    ("lightning_spec/drafters/base.py", "inspect.signature(type(obj).__init__)", "serialisation: init_arguments"),
    ("lightning_spec/data/rollout_writer.py", "vars(source)", "serialisation: a Source recorded in rollouts.json"),
    ("lightning_spec/target.py", "getattr(default, k)", "serialisation: TargetOptions.to_dict, its own dataclass"),
    # its own attributes, by name
    ("lightning_spec/features/store.py", "getattr(self, name)", "self: the spec's fields, by name"),
    ("lightning_spec/features/store.py", "getattr(found, name) != getattr(wanted, name)", "two StoreSpecs' fields"),
    ("lightning_spec/features/store.py", "getattr(torch, self.dtype)", "torch dtype by name"),
    ("lightning_spec/decoding/trees.py", "getattr(self, name)", "self: the config's fields, by name"),
]



def _chain(node: ast.expr) -> list[str]:
    """The names along an attribute chain: ``self.trainer.datamodule`` -> [self, trainer, datamodule]."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def stored(node: ast.AST) -> list[ast.expr]:
    """The attributes and subscripts ``node`` stores into (plain, augmented, annotated, tuple targets: a, x.y = ...)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [t for target in targets for t in ast.walk(target)
            if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, ast.Store)]


def findings(source: str) -> list[tuple[int, str]]:
    """(line, what) of every probe and every attribute set on another object in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in PROBES:
                found.append((node.lineno, f"{func.id}()"))
            elif _chain(func) == ["inspect", "signature"]:
                found.append((node.lineno, "inspect.signature()"))
        for t in stored(node):
            owner = _chain(t.value)
            if isinstance(t, ast.Attribute):
                if owner and owner != ["self"] and OTHERS & set(owner):
                    found.append((t.lineno, f"sets {'.'.join(owner)}.{t.attr}"))
            elif len(owner) > 1 and OTHERS & set(owner[:-1]) and owner[:-1] != ["self"]:
                # dm.train_dataset[:] = ...: another object's contents, in place
                found.append((t.lineno, f"sets {'.'.join(owner)}[...]"))
    return sorted(set(found))


def occurrences() -> list[tuple[str, int, str, str]]:
    """(file, line number, line, what) for every finding in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        out += [(rel, n, lines[n - 1].strip(), what) for n, what in findings(text)]
    return out


def allowed_by(rel: str, line: str) -> tuple[str, str, str] | None:
    return next((e for e in ALLOWED if e[0] == rel and e[1] in line), None)


def test_no_module_probes_or_sets_attributes_of_another_project_object():
    bad = [f"{rel}:{n}: {line}  [{what}]" for rel, n, line, what in occurrences() if allowed_by(rel, line) is None]
    assert not bad, (
        "probes of (or attributes set on) another object, not in tests/test_declared.py's ALLOWED:\n  "
        + "\n  ".join(bad)
        + "\ndeclare it (an attribute in the other class's __init__, a method, a class-level declaration) or add it "
        "to ALLOWED with a reason (third-party object, serialisation, self)."
    )


def test_every_allowed_entry_still_matches_a_line():
    """An entry whose line went away is removed with it."""
    used = {allowed_by(rel, line) for rel, _, line, _ in occurrences()}
    stale = [e for e in ALLOWED if e not in used]
    assert not stale, f"ALLOWED entries that match no line any more (remove them): {stale}"
    assert all(reason for _, _, reason in ALLOWED)


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ('x = getattr(dm, "on_policy", False)\n', "getattr()"),
        ('if hasattr(objective, "needs_rollouts"): pass\n', "hasattr()"),
        ("dm.on_policy = True\n", "sets dm.on_policy"),
        ("self.trainer.datamodule.on_policy = True\n", "sets self.trainer.datamodule.on_policy"),
        ("trainer.datamodule.train_dataset[:] = buffer\n", "sets trainer.datamodule.train_dataset[...]"),
        ("self.buffer[0] = example\nbatch['x'] = 1\n", None),
        ("self.x = 1\nself.x += 1\n", None),
        ('msg = f"data.max_length={n}"  # dm.max_length = 3\n', None),  # strings and comments never match
    ],
)
def test_the_scan_finds_what_it_should(source, what):
    got = [w for _, w in findings(source)]
    assert got == ([what] if what else [])


def test_no_drafter_family_file_imports_another_family():
    """A family's file imports the contract (``base.py``), what families share (``layers.py``; the bodies ``block.py``
    and ``eagle.py``) and its own helpers (``<family>_*.py``), never another family's file: a change to one family
    cannot move another."""
    from lightning_spec.drafters import FAMILIES

    drafters = PACKAGE / "drafters"
    files = {cls.__module__.rsplit(".", 1)[1]: family for family, cls in FAMILIES.items()}
    assert set(files) == set(FAMILIES), "each family lives in a file named after it"
    for name in files:
        imported = set()
        for node in ast.walk(ast.parse((drafters / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_spec.drafters."):
                imported.add(node.module.rsplit(".", 1)[1])
        others = {m for m in imported if m in files and m != name}
        assert not others, f"drafters/{name}.py imports the family file(s) {sorted(others)}"
        assert imported <= {"base", "layers", "block", "eagle"} | {m for m in imported if m.startswith(name + "_")}, \
            imported


# ------------------------------------------------ a DraftOutput is written by its drafter only, a StepContext by nobody
OWNED = {"draft": "DraftOutput", "ctx": "StepContext"}  # the names our code gives them -> their class


def owned_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) of every write to a ``DraftOutput`` or a ``StepContext`` in ``source``: an assignment (plain,
    augmented, annotated, in place through a subscript) whose target is an attribute of a variable named ``draft`` or
    ``ctx``, or of a parameter annotated with either class. The drafter builds the first, the module the second;
    nobody writes to them afterwards."""
    tree = ast.parse(source)
    names = set(OWNED) | {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and a.annotation is not None
                          and any(cls in ast.unparse(a.annotation) for cls in OWNED.values())}
    found = []
    for node in ast.walk(tree):
        for t in stored(node):
            chain = _chain(t.value if isinstance(t, ast.Subscript) else t)
            if len(chain) > 1 and chain[0] in names:
                found.append((t.lineno, f"writes {'.'.join(chain)}"))
    return sorted(set(found))


def test_no_module_but_the_drafters_writes_to_a_draft_output():
    """issue 34: each value of a step has one owner. The drafter builds its ``DraftOutput`` (``drafters/``, which
    never sees a ``StepContext``); the module's additions (the target's side, the reference drafter's logits, the
    objective's extras, progress, seeds) are a ``StepContext`` it builds whole."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel.startswith("lightning_spec/drafters/"):
            continue
        lines = path.read_text().splitlines()
        bad += [f"{rel}:{n}: {lines[n - 1].strip()}  [{what}]" for n, what in owned_writes(path.read_text())]
    assert not bad, "writes to a DraftOutput outside its drafter, or to a StepContext (build a new one):\n  " + \
        "\n  ".join(bad)


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("draft.extra = x\n", "writes draft.extra"),
        ("draft.seeds, y = s, 1\n", "writes draft.seeds"),
        ("draft.aux['rank'] = z\n", "writes draft.aux"),
        ("def f(out: DraftOutput):\n    out.progress += 0.1\n", "writes out.progress"),
        ("ctx.progress = 0.5\n", "writes ctx.progress"),
        ("def f(c: StepContext | None):\n    c.extra['edr'] = e\n", "writes c.extra"),
        ("ctx = StepContext(extra=x)\nout.extra = x\ndraft = d\nself.draft = d\n", None),
        ('msg = "draft.extra = x"  # draft.extra = x\n', None),  # strings and comments never match
    ],
)
def test_the_ownership_scan_finds_what_it_should(source, what):
    got = [w for _, w in owned_writes(source)]
    assert got == ([what] if what else [])
