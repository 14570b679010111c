"""The step timer with a hand-driven clock: no JAX, no run."""

from __future__ import annotations

import pytest

from dxrun.tracking.goodput import SaveTotals, StepTimer, save_note
from tests.conftest import FakeClock

NO_SAVES = SaveTotals(0.0, 0)


def test_the_compiling_step_is_in_no_window_and_not_in_the_loop():
    clock = FakeClock()
    timer = StepTimer(start=10, steps=14, clock=clock)  # a resumed attempt: steps 11-14
    clock.tick(30.0)  # step 11 compiles
    timer.stepped(11, NO_SAVES)
    for done in (12, 13):
        with timer.data_wait():
            clock.tick(0.5)
        clock.tick(1.5)
        timer.stepped(done, NO_SAVES)  # only the compiling step starts the window
    assert timer.measure(13) == (pytest.approx(4.0), 2, pytest.approx(1.0), False)
    timer.reset(13, NO_SAVES)  # the log point of step 13
    clock.tick(5.0)  # its evaluation: in no window
    timer.reset(13, NO_SAVES)
    clock.tick(2.0)  # step 14
    assert timer.measure(14) == (pytest.approx(2.0), 1, 0.0, False)
    timer.end_loop()
    # The loop after the compiling step: steps 12-14 and the evaluation, 11 s.
    assert timer.loop_tokens_per_s(tokens_per_step=110, steps=14) == pytest.approx(30.0)


def test_a_batch_that_never_came_is_no_wait():
    clock = FakeClock()
    timer = StepTimer(start=0, steps=2, clock=clock)
    timer.stepped(1, NO_SAVES)
    with pytest.raises(StopIteration), timer.data_wait():
        clock.tick(3.0)
        raise StopIteration
    assert timer.measure(1).waited == 0.0


def test_traced_steps_are_paused_out_and_flagged():
    clock = FakeClock()
    timer = StepTimer(start=0, steps=6, clock=clock)
    timer.stepped(1, NO_SAVES)
    clock.tick(1.0)  # step 2
    timer.pause(2)  # steps 3-4 traced
    clock.tick(20.0)
    timer.resume(4)
    clock.tick(1.0)  # step 5
    assert timer.measure(5) == (pytest.approx(2.0), 2, 0.0, True)


def test_no_step_after_the_compiling_one_gives_no_loop_rate():
    timer = StepTimer(start=0, steps=1, clock=FakeClock())
    timer.stepped(1, NO_SAVES)
    timer.end_loop()
    assert timer.loop_tokens_per_s(64, 1) is None


def test_the_note_names_saves_that_held_the_window():
    timer = StepTimer(start=0, steps=10, clock=FakeClock())
    timer.stepped(1, SaveTotals(0.2, 1))  # the first window starts after one small save
    held = SaveTotals(2.2, 2)  # a 2 s save in the window
    assert timer.note(held, has_rate=True) == save_note(2.0)
    assert timer.note(held, has_rate=False) == ""  # no tokens/s on the line to explain
    assert timer.note(SaveTotals(0.5, 2), has_rate=True) == ""  # 0.3 s: not noticeable
    timer.reset(4, NO_SAVES)
    assert timer.note(SaveTotals(3.0, 1), has_rate=True) == save_note(3.0)
