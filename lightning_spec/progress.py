"""One progress bar for long work outside a Lightning loop (rollouts, offline evaluation, sweeps).

Inside ``fit`` Lightning's own rich bar runs; rich allows one live display at a time, so callers that may run
under it (a callback scoring rollouts) pass ``enabled=False`` or a callable of their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class Bar:
    """``advance(n, **fields)``; ``fields`` fill the extra columns named when the bar was made."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: int = 1, **fields: Any) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, **fields)


@contextlib.contextmanager
def progress_bar(
    description: str,
    total: int | None,
    enabled: bool = True,
    columns: dict[str, Any] | None = None,
) -> Iterator[Bar]:
    """A rich bar on stderr: description, bar, done/total, the ``columns`` (name -> initial value), time left.

    ``enabled=False`` gives a bar whose ``advance`` does nothing (tests, nested under Lightning's bar)."""
    if not enabled:
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = columns or {}
    extra = [TextColumn(f"{{task.fields[{name}]}}") for name in columns]
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *extra,
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with progress:
        yield Bar(progress, progress.add_task(description, total=total, **columns))


def advancer(progress: bool | Callable[[int], None]) -> tuple[bool, Callable[[int], None] | None]:
    """``progress`` as given to a long function: True (own bar), False (silent) or a callable ``advance(n)``.

    Returns (make a bar?, the caller's callable or None)."""
    if callable(progress):
        return False, progress
    return bool(progress), None
