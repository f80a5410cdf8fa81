"""A user's JSON or JSONL file with a malformed line: the error names the file and the line, in Python (``load_source``)
and as one console line, where it was a 101-line ``datasets`` traceback."""

import json

import pytest
from helpers.cli import run_main
from helpers.data import chats, write_jsonl

from lightning_spec.data import load_source


def test_a_malformed_jsonl_line_names_the_file_and_the_line(tmp_path):
    """Was a 101-line ``datasets`` traceback ("JSON parse error ... in row 1")."""
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in chats(3)]
    lines.insert(2, '{"messages": [{"role": "user", "content": "cut off')  # line 3
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{path} line 3 is not valid JSON \(.*\); fix or remove that line"):
        load_source(str(path))

    document = tmp_path / "broken.json"  # one pretty-printed JSON list, broken on its 4th line
    document.write_text('[\n  {"messages": []},\n  {"messages": [}\n  oops\n]\n')
    with pytest.raises(ValueError, match=rf"{document} line 3 is not valid JSON"):
        load_source(str(document))

    folder = tmp_path / "folder"  # a folder of JSONL files: the file at fault is named
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", chats(2))
    (folder / "b.jsonl").write_text(json.dumps(chats(1)[0]) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"b\.jsonl line 2 is not valid JSON"):
        load_source(str(folder))


def test_a_malformed_jsonl_line_in_the_console_is_one_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps(chats(1)[0]) + "\n{oops\n")
    code, err = run_main(
        ["rollouts", "--target", "tiny-random", "--sources", f"[{bad}]", "--out", str(tmp_path / "r"),
         "--max_new_tokens", "2", "--progress", "false"],
        capsys,
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last.startswith("lightning-spec: error: ") and f"{bad} line 2 is not valid JSON" in last, last
