"""README.md and docs/*.md stay true: every code block runs, every link resolves, the README stays a front door.

Every fence names its language: ``python``, ``bash``, ``yaml``, or ``text`` (printed output, not run).

- ``python`` blocks run as written, the packaged SmolLM2 name replaced by ``tiny-random``, and must print.
- ``yaml`` blocks parse; an experiment or overlay (top-level keys among ``trainer``, ``model``, ``data`` ...) must
  resolve on the quickstart (``fit -c experiments/quickstart.yaml -c <block> --print_config``, no model loaded), and
  a sweep file (``base`` and ``space``) must pass ``lightning-spec sweep --dry_run true``.
- ``bash`` blocks run line by line (a ``\\`` continues a line, ``#`` starts a comment), each command through the
  rewrites listed in ``REWRITES`` that make it tiny and fast, then in-process: ``lightning-spec ...`` through
  ``lightning_spec.cli.main``, ``.venv/bin/python benchmarks/<script>.py`` through ``runpy``. A command with no way
  to run fast fails the test: it belongs in a block whose first line is ``# needs: <kind> ...``, a kind of
  ``NEEDS``; such a block is reported as skipped with its reason.

Blocks run in page order (README.md, then docs/*.md by name) in one workspace folder, as a reader would run them:
a block may use what an earlier block of its page made. Where xdist gave the earlier blocks to another worker, they
run first in this worker's workspace. The workspace starts with what the pages assume a reader has: a finished
quickstart ``fit`` (on the tiny target), the checkpoints the evaluation examples compare (``runs/<name>/last.ckpt``)
and a conversations file in the documented schema (``my_chats.jsonl``). Pages whose name starts with ``_`` are
drafts for another page; their blocks are not run.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import sys
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if not p.name.startswith("_"))]
LINKED_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LANGUAGES = {"python", "bash", "yaml", "text"}
README_MAX_LINES = 300
SMOLLM2, TINY = "smollm2-135m-instruct", "tiny-random"
TINY_OVERLAY = ROOT / "tests" / "fixtures" / "docs_tiny.yaml"
TINY_ON_POLICY = ROOT / "tests" / "fixtures" / "docs_tiny_on_policy.yaml"
ON_POLICY_REGIMES = {"experiments/regimes/sft_then_opd.yaml"}  # the on-policy regimes the pages run
PLACEHOLDER_CKPT = "runs/<experiment id>/<run id>/checkpoints/last.ckpt"
EVAL_CHECKPOINTS = {"a": 1, "b": 2, "ce": 3, "edr_s0": 4, "edr_s1": 5}  # runs/<name>/last.ckpt, and their seeds

# `# needs: <kind> ...` as a block's first line: the block is not run, and the test says why.
NEEDS = {
    "gpu": "needs a GPU",
    "server": "starts a server (vLLM, MLflow's UI) or needs one running",
    "minutes": "takes minutes (a make target or a full-size run)",
}


# --------------------------------------------------------------------------------------------- the blocks
@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}:{self.language}"

    @property
    def needs(self) -> tuple[str, str] | None:
        """(kind, the marker line) of a ``# needs: <kind> ...`` first line, else None."""
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        match = re.match(r"#\s*needs:\s*(\w+)", first)
        return (match.group(1), first) if match else None


def fenced_blocks(page: Path) -> list[Block]:
    blocks, opening, lines = [], None, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            if opening is None:
                opening, lines = (number, line[3:].strip()), []
            else:
                blocks.append(Block(page, opening[0], opening[1], "\n".join(lines) + "\n"))
                opening = None
        elif opening is not None:
            lines.append(line)
    assert opening is None, f"{page.name}: the fence opened on line {opening[0]} is never closed"
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page) if block.language != "text"]


def test_every_fence_names_its_language():
    for page in LINKED_PAGES:
        for block in fenced_blocks(page):
            assert block.language in LANGUAGES, f"{block.name}: say which of {sorted(LANGUAGES)} the block is"


def test_the_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move depth to a page under docs/"


def test_every_page_starts_by_saying_what_a_reader_does_there():
    for page in PAGES[1:]:
        paragraphs = page.read_text().split("\n\n")
        assert paragraphs[0].startswith("# ") and not paragraphs[1].startswith(("#", "```", "|", "-")), page.name


def test_the_pages_have_blocks_of_every_kind():
    assert {block.language for block in BLOCKS} == {"python", "bash", "yaml"}
    assert any(block.needs is None for block in BLOCKS if block.language == "bash")


# ---------------------------------------------------------------------------------------------- the links
WORD = {"Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd"}  # what GitHub keeps of a heading besides " -_"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text as rendered, lowercased, without punctuation, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c) in WORD)
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        match = None if fenced else re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # nor inline code
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: the link {link!r} points to no file"
        if anchor:
            assert target.suffix == ".md", f"{page.name}: {link!r} has an anchor into a file that is no page"
            assert anchor in anchors(target), f"{page.name}: {link!r}: {target.name} has no heading #{anchor}"


def test_the_link_checker_knows_githubs_anchors():
    assert slug("Rollouts → evaluate → compare") == "rollouts--evaluate--compare"
    assert slug("Rollouts: the target's own answers") == "rollouts-the-targets-own-answers"
    assert slug("`fit` and [the store](x.md)") == "fit-and-the-store"


# ------------------------------------------------------------------------------------------ the workspace
@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_target):
    """The folder every block runs in: the repository's experiments/, sweeps/ and benchmarks/ as the commands name
    them, a cache of its own (feature stores land there, not in the user's), and what the pages assume exists."""
    from helpers.fits import fit_checkpoint

    from lightning_spec.cli import main
    from lightning_spec.drafters import DFlashDrafter

    folder = tmp_path_factory.mktemp("docs")
    for name in ("experiments", "sweeps", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LIGHTNING_SPEC_CACHE", str(folder / "cache"))
        patch.chdir(folder)
        patch.setattr(sys, "argv", ["lightning-spec"])
        main(["fit", "-c", "experiments/quickstart.yaml", "-c", str(TINY_OVERLAY)])  # the README's finished quickstart
        for name, seed in EVAL_CHECKPOINTS.items():
            torch.manual_seed(seed)
            drafter = DFlashDrafter(block_size=3)
            drafter.bind(tiny_target)
            fit_checkpoint(drafter, folder / "runs" / name / "last.ckpt", TINY)
        with open(folder / "my_chats.jsonl", "w") as f:  # the schema README.md states
            for i in range(12):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: how do I reset it?"},
                                                 {"role": "assistant", "content": f"Hold the button for {i} s."}],
                                    "domain": "support" if i % 2 else "chat"}) + "\n")
        assert list(folder.glob("runs/*/*/checkpoints/last.ckpt")), "fit did not write runs/<exp>/<run>/checkpoints/"
        yield folder


def newest_checkpoint(folder: Path) -> str:
    paths = list(folder.glob("runs/*/*/checkpoints/last.ckpt"))
    return str(max(paths, key=lambda p: p.stat().st_mtime).relative_to(folder))


# ------------------------------------------------------------------------------------------- the rewrites
def _set(argv: list[str], option: str, value: str) -> list[str]:
    """``option value`` in place of the option's value (``--x v`` or ``--x=v``), appended when absent."""
    out, skip, found = [], False, False
    for arg in argv:
        if skip:
            out.append(value)
            skip = False
        elif arg == option:
            out.append(arg)
            skip = found = True
        elif arg.startswith(option + "="):
            out.append(f"{option}={value}")
            found = True
        else:
            out.append(arg)
    return out if found else [*out, option, value]


def _tiny_fit(argv: list[str], folder: Path) -> list[str]:
    if argv[:2] not in (["lightning-spec", "fit"], ["lightning-spec", "features"]) or "--print_config" in argv:
        return argv
    last = max((i + 1 for i, arg in enumerate(argv) if arg == "-c"), default=1)  # the last -c file, else the command
    files = {argv[i + 1] for i, arg in enumerate(argv) if arg == "-c"}
    extra = ["-c", str(TINY_OVERLAY)] + (["-c", str(TINY_ON_POLICY)] if files & ON_POLICY_REGIMES else [])
    return [*argv[: last + 1], *extra, *argv[last + 1 :]]


def _tiny_rollouts(argv: list[str], folder: Path) -> list[str]:
    if argv[:2] != ["lightning-spec", "rollouts"]:
        return argv
    argv = _set(_set(argv, "--prompts_per_source", "3"), "--max_new_tokens", "8")
    return argv if "--target" in argv else [*argv, "--target", TINY]


def _tiny_online(argv: list[str], folder: Path) -> list[str]:
    if argv[:2] != ["lightning-spec", "evaluate"] or "online" not in argv:
        return argv
    return _set(_set(argv, "--prompts_per_source", "1"), "--max_new_tokens", "8")


def _one_trial(argv: list[str], folder: Path) -> list[str]:
    if argv[:2] != ["lightning-spec", "sweep"] or "--dry_run" in argv:
        return argv
    return [*argv, "--n_trials", "1"]


def _tiny_decode_speed(argv: list[str], folder: Path) -> list[str]:
    if argv[1:2] != ["benchmarks/decode_speed.py"]:
        return argv
    return [*argv, "--target", TINY, "--prompts", "1", "--max-new-tokens", "8", "--repeats", "2", "--cache-len", "16",
            "--no-peers", "--no-auto"]


def _replace(old: str, new: str | Callable[[Path], str]) -> Callable[[list[str], Path], list[str]]:
    def rewrite(argv: list[str], folder: Path) -> list[str]:
        if not any(old in arg for arg in argv):
            return argv
        value = new(folder) if callable(new) else new
        return [arg.replace(old, value) for arg in argv]

    return rewrite


def _tiny_folder(folder: Path) -> str:
    from lightning_spec.assets import tiny_folder

    return str(tiny_folder())


# (what a reader runs -> what the test runs, how). Applied in this order to every command of an unmarked bash block.
REWRITES = [
    (f"{SMOLLM2} -> {TINY}", _replace(SMOLLM2, TINY)),
    (f"{PLACEHOLDER_CKPT} -> the workspace's newest fit checkpoint", _replace(PLACEHOLDER_CKPT, newest_checkpoint)),
    ("./my-model (the reader's own model folder) -> the packaged tiny target's folder",
     _replace("./my-model", _tiny_folder)),
    ("/fast/disk/store -> fast-disk/store in the workspace", _replace("/fast/disk/store", "fast-disk/store")),
    ("fit, features: -c tests/fixtures/docs_tiny.yaml after the last -c file (and docs_tiny_on_policy.yaml after an "
     "on-policy regime); not with --print_config, which loads no model", _tiny_fit),
    ("rollouts: --prompts_per_source 3, --max_new_tokens 8, --target tiny-random unless one is given", _tiny_rollouts),
    ("evaluate --mode online: --prompts_per_source 1, --max_new_tokens 8", _tiny_online),
    ("sweep (not a dry run): --n_trials 1", _one_trial),
    ("benchmarks/decode_speed.py: the tiny target, 1 prompt of 8 tokens, 2 timing repeats, no peers, no auto",
     _tiny_decode_speed),
]


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block, split as the shell would; a ``<placeholder>`` with spaces is one word."""
    joined = re.sub(r"\\\n", " ", code)
    argvs = []
    for line in joined.splitlines():
        protected = re.sub(r"<[^<>\n]*>", lambda m: m.group(0).replace(" ", "\0"), line)
        if argv := [word.replace("\0", " ") for word in shlex.split(protected, comments=True)]:
            argvs.append(argv)
    return argvs


def run_command(argv: list[str], folder: Path) -> None:
    from lightning_spec.cli import main

    applied = []
    for what, rewrite in REWRITES:
        rewritten = rewrite(argv, folder)
        if rewritten != argv:
            applied.append(what)
        argv = rewritten
    shown = shlex.join(argv) + "".join(f"\n  (rewrite: {what})" for what in applied)
    if argv[0] == "lightning-spec":
        run = lambda: main(argv[1:])
    elif argv[:2] == [".venv/bin/python", "benchmarks/decode_speed.py"]:
        run = lambda: runpy.run_path(str(folder / argv[1]), run_name="__main__")
    else:
        pytest.fail(f"no rewrite runs `{shown}` fast: add one to REWRITES in tests/integration/test_docs.py, or move "
                    f"the line to a block whose first line is `# needs: <{'|'.join(NEEDS)}> ...`")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv if argv[0] == "lightning-spec" else argv[1:])
        try:
            run()
        except SystemExit as exit_:
            assert not exit_.code, f"`{shown}` exited with {exit_.code}"
        except Exception as err:
            raise AssertionError(f"`{shown}` raised {type(err).__name__}: {err}") from err
        finally:
            torch.set_num_threads(1)  # a benchmark may set its own


def test_bash_blocks_split_as_the_shell_does_and_unrunnable_lines_fail(tmp_path):
    code = "lightning-spec fit -c a.yaml \\\n  --model.init_from runs/<run id>/last.ckpt  # stage 2\nmake long\n"
    assert commands(code) == [["lightning-spec", "fit", "-c", "a.yaml", "--model.init_from", "runs/<run id>/last.ckpt"],
                              ["make", "long"]]
    with pytest.raises(pytest.fail.Exception, match="no rewrite runs `make long` fast"):
        run_command(["make", "long"], tmp_path)
    assert _tiny_fit(["lightning-spec", "fit", "-c", "q.yaml", "--x", "1"], tmp_path)[4:6] == ["-c", str(TINY_OVERLAY)]


# ---------------------------------------------------------------------------------------------- the yaml
EXPERIMENT_KEYS = {"seed_everything", "trainer", "model", "data", "ckpt_path"}


def printed_on_the_quickstart(path: Path) -> str:
    """``fit -c experiments/quickstart.yaml -c path --print_config``; refuses to load a model, as test_cli does."""
    import transformers

    import lightning_spec.module
    from lightning_spec.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("--print_config must not load a model")

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(lightning_spec.module, "load_target", refuse)
        patch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
        try:
            main(["fit", "-c", "experiments/quickstart.yaml", "-c", str(path), "--print_config"])
        except SystemExit as exit_:
            assert not exit_.code, f"{path.name} does not resolve on the quickstart (exit {exit_.code})"
    return out.getvalue()


def check_yaml(block: Block, folder: Path) -> None:
    config = yaml.safe_load(block.code)
    assert isinstance(config, dict), f"{block.name}: a YAML block holds a mapping"
    path = folder / f"block-{block.page.stem}-{block.line}.yaml"
    path.write_text(block.code)
    if {"base", "space"} <= set(config):
        from lightning_spec.cli import main

        try:
            main(["sweep", "-c", str(path), "--dry_run", "true"])
        except SystemExit as exit_:
            assert not exit_.code, f"{block.name}: `sweep --dry_run true` exited with {exit_.code}"
    elif set(config) <= EXPERIMENT_KEYS:
        printed = yaml.safe_load(printed_on_the_quickstart(path))
        for section, values in config.items():
            if section in ("trainer", "data") and isinstance(values, dict):
                for key, value in values.items():
                    if not isinstance(value, (dict, list)):
                        assert printed[section][key] == value, f"{block.name}: {section}.{key} did not arrive"
    else:
        pytest.fail(f"{block.name}: neither an experiment (keys among {sorted(EXPERIMENT_KEYS)}) nor a sweep "
                    "(base, space); say in tests/integration/test_docs.py how to check it")


# ------------------------------------------------------------------------------------------------- the run
RAN: dict[Path, set[str]] = {}  # per workspace (one per xdist worker): the blocks that ran in it


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs(block, request, monkeypatch, capsys):
    if block.needs is not None:
        kind, line = block.needs
        assert kind in NEEDS, f"{block.name}: `{line}` names no kind of {sorted(NEEDS)}"
        pytest.skip(f"{block.name} {NEEDS[kind]}: {line}")
    workspace = request.getfixturevalue("workspace")
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    ran = RAN.setdefault(workspace, set())
    # xdist may give another worker the earlier blocks of this page: what they made is made here first
    for earlier in BLOCKS[: BLOCKS.index(block)]:
        if earlier.page == block.page and earlier.needs is None and earlier.name not in ran:
            run_block(earlier, workspace, capsys)
            ran.add(earlier.name)
    run_block(block, workspace, capsys)
    ran.add(block.name)


def run_block(block: Block, workspace: Path, capsys) -> None:
    """One block, in ``workspace``: Python executed, YAML checked, bash run command by command."""
    if block.language == "python":
        code = block.code.replace(SMOLLM2, TINY)
        exec(compile(code, block.name, "exec"), {"__name__": "__docs__"})
        assert capsys.readouterr().out.strip(), f"{block.name}: a Python block prints what it shows"
    elif block.language == "yaml":
        check_yaml(block, workspace)
    else:
        argvs = commands(block.code)
        assert argvs, f"{block.name}: a bash block with no command"
        for argv in argvs:
            run_command(argv, workspace)
