"""The learning-rate schedule ends when training ends: at max_steps, or annealed by max_time when that binds."""

import math
import sys

import pytest

from lightning_spec.schedule import TrainingClock, warmup_cosine


class FakeTime:
    """A training budget of ``budget`` seconds whose clock the test moves by hand."""

    def __init__(self, budget: float) -> None:
        self.budget, self.now = budget, 0.0

    def __call__(self) -> tuple[float, float]:
        return self.now, self.budget - self.now


def old_schedule(step: int, total: int, warmup: int, floor: float) -> float:
    """The step-only schedule of earlier releases, written out: the clock must reproduce it when time is ample."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def run(clock: TrainingClock, time: FakeTime | None, steps: int, step_seconds, target=lambda s: (0.0, 0, 0)):
    """Drive the clock like the module does: after optimizer step s (1-based), record its cost."""
    lrs = []
    for s in range(1, steps + 1):
        seconds = step_seconds(s)
        if time is not None:
            time.now += seconds
            if time.now >= time.budget:  # Lightning's Timer stops training here
                lrs.append(clock.multiplier(s, 0.1))
                break
        target_seconds, examples, uncached = target(s)
        clock.record(s, seconds, target_seconds, examples, uncached)
        lrs.append(clock.multiplier(s, 0.1))
    return lrs


def test_without_a_time_budget_the_schedule_is_the_step_schedule():
    clock = TrainingClock(max_steps=100, warmup=3, time_left=None)
    lrs = run(clock, None, 100, lambda s: 1.0)
    assert lrs == pytest.approx([old_schedule(s, 100, 3, 0.1) for s in range(1, 101)], abs=1e-12)
    assert [warmup_cosine(s, 100, 3, 0.1) for s in range(101)] == [old_schedule(s, 100, 3, 0.1) for s in range(101)]


def test_a_budget_that_binds_during_warm_up_still_warms_up_and_anneals():
    """max_steps far beyond what the time allows: the warm-up (a share of max_steps) would never end on steps."""
    time = FakeTime(30.0)
    clock = TrainingClock(max_steps=100_000, warmup=4000, time_left=time)
    lrs = run(clock, time, 100_000, lambda s: 1.0)
    assert len(lrs) == 30
    assert max(lrs) == pytest.approx(1.0, abs=0.05)  # warmed up to the full rate...
    assert lrs[-1] == pytest.approx(0.1, abs=1e-9)  # ...and annealed to the floor by the deadline


def test_a_budget_that_fits_changes_nothing():
    """1 s steps, 100 steps, 150 s budget: the steps fit, the schedule is the step schedule to the last step."""
    time = FakeTime(150.0)
    clock = TrainingClock(max_steps=100, warmup=3, time_left=time)
    lrs = run(clock, time, 100, lambda s: 1.0)
    assert clock.switch is None
    assert lrs == pytest.approx([old_schedule(s, 100, 3, 0.1) for s in range(1, 101)], abs=1e-12)


def test_a_budget_that_binds_anneals_by_the_deadline():
    """1 s steps, 100 steps, 40 s budget: the step schedule would stop at 40% (lr ~0.68); the clock switches to
    time and the last step before the deadline is at the floor."""
    time = FakeTime(40.0)
    clock = TrainingClock(max_steps=100, warmup=3, time_left=time)
    lrs = run(clock, time, 100, lambda s: 1.0)
    assert clock.switch is not None
    assert len(lrs) == 40
    assert lrs[-1] == pytest.approx(0.1, abs=1e-9)
    assert old_schedule(40, 100, 3, 0.1) > 0.6  # what the old schedule left
    assert all(a >= b - 1e-12 for a, b in zip(lrs[4:], lrs[5:]))  # still decreasing after warm-up


def test_the_first_epochs_target_forwards_do_not_switch_a_run_that_fits():
    """Feature cache: the first 20 steps each pay 2 s of target forwards for 8 new examples, later steps 0.5 s
    of drafter work only. 100 steps need 20 x 2.5 + 80 x 0.5 = 90 s < 100 s. Projecting the first steps' 2.5 s
    onto the run would need 250 s and switch; the cache-aware projection must not."""
    time = FakeTime(100.0)
    clock = TrainingClock(max_steps=100, warmup=3, time_left=time)

    def target(s):  # (target seconds, examples computed, examples still uncached after step s)
        return (2.0, 8, max(160 - 8 * s, 0)) if s <= 20 else (0.0, 0, 0)

    lrs = run(clock, time, 100, lambda s: 2.5 if s <= 20 else 0.5, target)
    assert clock.switch is None
    assert lrs == pytest.approx([old_schedule(s, 100, 3, 0.1) for s in range(1, 101)], abs=1e-12)


def test_the_switch_survives_a_resume():
    time = FakeTime(40.0)
    clock = TrainingClock(max_steps=100, warmup=3, time_left=time)
    run(clock, time, 10, lambda s: 1.0)
    assert clock.switch is not None
    resumed = TrainingClock(max_steps=100, warmup=3, time_left=time)
    resumed.load_state_dict(clock.state_dict())
    assert resumed.multiplier(10, 0.1) == clock.multiplier(10, 0.1)


def test_a_time_bound_fit_ends_annealed(tmp_path, monkeypatch):
    """A real fit whose max_time binds long before max_steps: the last learning rate is the floor. The clocks are
    injected (Lightning's Timer and the training clock's step timer read one hand-moved clock that every batch moves
    by 1 s), so the 20 s budget buys exactly 20 steps on any machine."""
    import lightning as L
    import lightning.pytorch.callbacks.timer as timer
    from helpers.clock import FakeClock

    import lightning_spec.schedule as schedule
    from lightning_spec.cli import run_cli

    clock = FakeClock()
    monkeypatch.setattr(timer, "time", clock)
    monkeypatch.setattr(schedule, "time", clock)
    seen = {}

    class LastLR(L.Callback):
        def on_train_batch_start(self, trainer, *args, **kwargs):
            clock.advance(1.0)  # one second of "training" per batch

        def on_train_batch_end(self, trainer, *args, **kwargs):
            seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
            seen["steps"] = trainer.global_step

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-spec"])
    run_cli(
        ["fit", "-c", str(__import__("pathlib").Path(__file__).parents[1] / "experiments" / "tiny.yaml"),
         "--trainer.max_steps=100000", "--trainer.max_time=00:00:00:20", "--trainer.val_check_interval=null",
         "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]",
         "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--model.min_lr_ratio=0.1"],
        callbacks=[LastLR()],
    )
    assert seen["steps"] == 20  # the budget, not the machine, decided the steps
    assert seen["lr"] == pytest.approx(1e-3 * 0.1, rel=0.15)  # the tiny experiment's lr, at the floor
