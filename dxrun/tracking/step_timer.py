"""The step timer: the log window's step time and data wait, and the loop's own time.

Step time is measured from device-ready to device-ready over the window between two log
points (the host waits on the device only there). An attempt's first step compiles: the windows
and the loop's time start after it. Evaluation is not in a window (a log point starts the next
one after it), a checkpoint save is (a save holds the loop, and the line says so: ``note``),
and traced steps are left out (``pause``/``resume``: ``goodput.StepWindow``). No JAX here: the
clock is a parameter, so tests drive it by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from dxrun.tracking.goodput import StepWindow

NOTICEABLE_BLOCK_S = 0.5  # a save that holds the loop less is never warned or noted about


def save_note(held_s: float) -> str:
    """Why a window's tokens/s dropped: checkpoint saves held the loop ``held_s`` of it."""
    return f"(tok/s includes {held_s:.1f} s of checkpoint saving)"


class SaveTotals(NamedTuple):
    """The checkpoint saves of this attempt so far (``SaveCost.totals``)."""

    block_s: float  # seconds the saves held the loop
    saves: int


class Measured(NamedTuple):
    """A log window up to a step, traced steps left out."""

    seconds: float
    steps: int
    waited: float  # of ``seconds``, waiting for data
    profiled: bool  # traced steps were in the window (left out of perf/*)


class _Wait:
    """``with timer.data_wait():`` adds the block's seconds to the window's data wait (a plain
    class: it runs every step)."""

    __slots__ = ("t0", "timer")

    def __init__(self, timer: StepTimer):
        self.timer = timer

    def __enter__(self) -> None:
        self.t0 = self.timer.clock()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:  # a batch that never came is no wait of a step
            self.timer.window.wait(self.timer.clock() - self.t0)


class StepTimer:
    """The timing of an attempt that runs steps ``start+1 .. steps``."""

    def __init__(self, start: int, steps: int, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.start = clock, start
        self.window = StepWindow(clock)
        self.saves0 = SaveTotals(0.0, 0)  # the saves before this window
        self.loop_t, self.loop_step = 0.0, steps  # from the compiling step's end
        self.loop_s: float | None = None

    def data_wait(self) -> _Wait:
        return _Wait(self)

    def pause(self, step: int) -> None:
        """Tracing starts after step ``step``."""
        self.window.pause(step)

    def resume(self, step: int) -> None:
        """Tracing stopped after step ``step``."""
        self.window.resume(step)

    def stepped(self, done: int, saves: SaveTotals) -> None:
        """Step ``done`` ran; after the compiling one the first window and the loop start."""
        if done == self.start + 1:
            self.reset(done, saves)
            self.loop_t, self.loop_step = self.window.t, done

    def reset(self, done: int, saves: SaveTotals) -> None:
        """A new window after the log point of step ``done`` (its evaluation not in it)."""
        self.window.reset(done)
        self.saves0 = saves

    def measure(self, done: int) -> Measured:
        seconds, steps, waited = self.window.measure(done)
        return Measured(seconds, steps, waited, self.window.profiled)

    def note(self, saves: SaveTotals, has_rate: bool) -> str:
        """Why this window's tokens/s dropped, when saves held it noticeably; else ''."""
        held = saves.block_s - self.saves0.block_s
        return save_note(held) if has_rate and held >= NOTICEABLE_BLOCK_S else ""

    def end_loop(self) -> None:
        """The last step was logged: it is done."""
        self.loop_s = self.clock() - self.loop_t

    def loop_tokens_per_s(self, tokens_per_step: int, steps: int) -> float | None:
        """Tokens/s of the whole loop after the compiling step: data, the step, logging,
        evaluation, saves and the progress bar (None: no step after it)."""
        if steps <= self.loop_step or self.loop_s is None:
            return None
        return tokens_per_step * (steps - self.loop_step) / self.loop_s
