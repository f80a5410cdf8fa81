"""The learning-rate schedule: linear warm-up, then cosine to ``min_lr_ratio``, ending when training ends.

Training ends at ``trainer.max_steps`` or at ``trainer.max_time``, whichever comes first. A cosine schedule on
steps alone never anneals on a machine where ``max_time`` binds: it stops half-way down the curve, at a high
learning rate, and the drafter it leaves is worse than the same run would be with fewer, fully annealed steps.
So ``TrainingClock`` watches the pace: after each step it projects the time the remaining steps need; if they do
not fit in the time left, the rest of the curve is stretched over the time left (progress runs on elapsed time
from there), and the last step before ``max_time`` is at the floor. When the steps fit, nothing changes: the
schedule is the plain step schedule, so a run that was not time-bound trains exactly as before.

The projection separates drafter work from target forwards: with the feature cache, the first epoch pays one
target forward per example and later epochs none, so projecting the first epoch's step time onto the whole run
would switch to the time schedule on machines that would have finished in time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Timer


def time_budget(callbacks: list[Any]) -> Callable[[], tuple[float, float]] | None:
    """(elapsed, left) seconds of ``trainer.max_time``'s training budget, read from Lightning's ``Timer`` among
    ``callbacks``; None without one."""
    timer = next((c for c in callbacks if isinstance(c, Timer)), None)
    if timer is None or timer.time_remaining() is None:
        return None
    return lambda: (timer.time_elapsed(), timer.time_remaining())


def warmup_cosine(step: int, total: int, warmup: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` of ``total``: linear warm-up over ``warmup`` steps, then cosine from
    1 to ``min_lr_ratio``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return _cosine((step - warmup) / max(1, total - warmup), min_lr_ratio)


def _cosine(progress: float, min_lr_ratio: float) -> float:
    progress = min(1.0, max(0.0, progress))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainingClock:
    """Where a run with a step budget and an optional time budget stands, and its LR multiplier there.

    Args:
        max_steps: the step budget (``trainer.max_steps``).
        warmup: warm-up steps (the cosine starts after them).
        time_left: a callable returning (seconds elapsed, seconds left) of the training time budget, or None when
            the run has no ``max_time``.
        window: steps whose median costs feed the projection.
    """

    MIN_SAMPLES = 5  # steps measured before the projection may switch the schedule to time

    def __init__(
        self,
        max_steps: int,
        warmup: int,
        time_left: Callable[[], tuple[float, float]] | None = None,
        window: int = 20,
    ) -> None:
        self.max_steps, self.warmup, self.time_left = max(1, max_steps), warmup, time_left
        self.drafter_seconds: deque[float] = deque(maxlen=window)  # per step, target forwards excluded
        self.target_seconds: deque[float] = deque(maxlen=window)  # per example that needed a target forward
        self.step_seconds: deque[float] = deque(maxlen=window)  # whole steps, for when the next one will end
        self.switch: tuple[float, float] | None = None  # (progress, elapsed seconds) when time took over
        self._last_tick: float | None = None  # perf_counter at the previous optimizer step

    @classmethod
    def for_fit(cls, total: int, warmup_ratio: float, callbacks: list[Any],
                state: dict[str, Any] | None) -> TrainingClock:
        """The clock of a fit of ``total`` optimizer steps, on time too when a ``Timer`` callback bounds it
        (``time_budget``), restored from a checkpoint's ``state`` (a resumed run keeps a switch to time)."""
        clock = cls(total, int(warmup_ratio * total), time_budget(callbacks))
        if state:
            clock.load_state_dict(state)
        return clock

    def run_progress(self, step: int) -> float:
        """Share 0..1 of the run done after ``step`` optimizer steps: by steps, or by time once the remaining steps
        stopped fitting in the time left (then it reaches 1 exactly at ``max_time``)."""
        by_steps = step / self.max_steps
        if self.switch is None or self.time_left is None:
            return by_steps
        u0, t0 = self.switch
        elapsed, left = self.time_left()
        # the LR set now is used by the next step: place it where that step ends, so the step that crosses the
        # deadline (Lightning stops after it) runs at the floor
        ends = elapsed + (statistics.median(self.step_seconds) if self.step_seconds else 0.0)
        by_time = u0 + (1 - u0) * (ends - t0) / max(elapsed + left - t0, 1e-9)
        return min(1.0, max(by_steps, by_time))

    def multiplier(self, step: int, min_lr_ratio: float) -> float:
        """The LR multiplier at ``step``. On steps it is ``warmup_cosine`` exactly; on time, the same curve over
        the share of the run done (the warm-up is the same share of the run as ``warmup`` is of ``max_steps``)."""
        if self.switch is None:
            return warmup_cosine(step, self.max_steps, self.warmup, min_lr_ratio)
        u, w = self.run_progress(step), self.warmup / self.max_steps
        if u < w:
            return max(u / w, (step + 1) / (self.warmup + 1))
        return _cosine((u - w) / max(1 - w, 1e-9), min_lr_ratio)

    def tick(self, step: int, target_seconds: float, target_examples: int, uncached_examples: int) -> None:
        """Optimizer step ``step`` is about to run: the wall time since the previous one is that step's (``record``)."""
        now = time.perf_counter()
        last, self._last_tick = self._last_tick, now
        if last is not None:
            self.record(step, now - last, target_seconds, target_examples, uncached_examples)

    def record(self, step: int, step_seconds: float, target_seconds: float, target_examples: int,
               uncached_examples: int) -> None:
        """After optimizer step ``step`` (0-based count of steps done): how long it took, how much of it was target
        forwards and for how many examples, and how many training examples still need one (0 without a cache:
        then every step's target forwards are part of its drafter time)."""
        if self.time_left is None:
            return
        self.step_seconds.append(step_seconds)
        if self.switch is not None:
            return
        self.drafter_seconds.append(max(step_seconds - target_seconds, 0.0))
        if target_examples:
            self.target_seconds.append(target_seconds / target_examples)
        if len(self.drafter_seconds) < self.MIN_SAMPLES:
            return
        per_example = statistics.median(self.target_seconds) if self.target_seconds else 0.0
        needed = (self.max_steps - step) * statistics.median(self.drafter_seconds) + uncached_examples * per_example
        elapsed, left = self.time_left()
        if needed > left:
            self.switch = (step / self.max_steps, elapsed)

    def state_dict(self) -> dict[str, Any]:
        return {"switch": self.switch, "step_seconds": list(self.step_seconds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        switch = state.get("switch")
        self.switch = tuple(switch) if switch is not None else None
        self.step_seconds.extend(state.get("step_seconds", []))


def lr_schedule(optimizer: Any, clock: TrainingClock, min_lr_ratio: float) -> dict[str, Any]:
    """Lightning's ``lr_scheduler`` entry: linear warm-up, then cosine to ``min_lr_ratio``, on ``clock`` (steps, or
    time once ``max_time`` binds), stepped after every optimizer step."""
    import torch

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: clock.multiplier(step, min_lr_ratio))
    return {"scheduler": scheduler, "interval": "step"}
