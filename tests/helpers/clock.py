"""A clock the test moves by hand, injected where the code reads time, so no assertion depends on how fast the
machine is.

``FakeClock`` stands in for the ``time`` module inside the module under test (``monkeypatch.setattr(module, "time",
clock)``): ``perf_counter``, ``monotonic`` and ``time`` read the same hand-moved value, and ``sleep`` moves it
instead of waiting. ``advance`` moves it from a test's own hooks (a callback, a patched method).
"""

from __future__ import annotations


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now
