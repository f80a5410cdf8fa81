"""The console entry point run in this process, and its data pointed at local files."""

import json
from pathlib import Path

from helpers.data import write_jsonl
from lightning_spec.cli import main


def exit_code(args: list[str]) -> int:
    """The exit status of ``lightning-spec *args`` run in this process (0 when it returns)."""
    try:
        main(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def local_data_args(tmp: Path, train_rows: list[dict]) -> list[str]:
    """Point the tiny experiment at local files (no packaged data read), and log nowhere."""
    train = write_jsonl(tmp / "train.jsonl", train_rows)
    evals = write_jsonl(tmp / "eval.jsonl", [{"messages": [{"role": "user", "content": "Say something."}]}])
    return [
        "--data.train_sources", json.dumps([train]), "--data.eval_sources", json.dumps([evals]),
        "--trainer.logger", "false",
    ]


def run_main(args: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of the console entry point, run in this process."""
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def last_error_line(err: str) -> str:
    """The last line of a stderr: where the console prints its one-sentence error."""
    return err.strip().splitlines()[-1]
