"""Side-by-side timing: the variants of a figure run interleaved (A, B, A, B, ...) in one
process, so that load from other jobs falls on all of them alike.

Each step is timed to ``block_until_ready`` (wall clock), with the process's CPU seconds (user
and system, all threads) and its minor page faults over the same step: under load the wall
clock stretches, CPU seconds much less, and the faults show memory being mapped anew. A
variant's figure is the median over repetitions of each repetition's median step.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timing:
    wall_s: list[float] = field(default_factory=list)  # one median per repetition
    user_s: list[float] = field(default_factory=list)
    system_s: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def cpu_s(self) -> float:
        """CPU seconds per step (user + system, all threads): stretches less under load."""
        return statistics.median(self.user_s) + statistics.median(self.system_s)

    def summary(self) -> dict[str, Any]:
        """Raw figures for the report: milliseconds per step and faults per step."""
        ms = lambda xs: round(1e3 * statistics.median(xs), 2)  # noqa: E731
        return {"wall_ms": ms(self.wall_s), "wall_ms_per_rep": [round(1e3 * x, 1)
                                                                 for x in self.wall_s],
                "user_ms": ms(self.user_s), "system_ms": ms(self.system_s),
                "minor_faults": round(statistics.median(self.faults))}


def _usage() -> tuple[float, float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, float(r.ru_minflt)


def time_step(run: Callable[[], Any]) -> tuple[float, float, float, float]:
    """(wall, user, system seconds, minor faults) of one blocking call."""
    u0, s0, f0 = _usage()
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    u1, s1, f1 = _usage()
    return wall, u1 - u0, s1 - s0, f1 - f0


def interleaved(variants: dict[Any, Callable[[], Any]], steps: int, reps: int,
                before: Callable[[Any], None] | None = None) -> dict[Any, Timing]:
    """Time ``steps`` blocking calls of each variant per repetition, the variants taking turns.
    Each variant runs once untimed first (compile, settle); ``before(name)`` runs before each
    variant's turn (e.g. to switch a process setting) and is not timed."""
    for name, run in variants.items():
        if before:
            before(name)
        run()
    out = {name: Timing() for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            if before:
                before(name)
            run()  # the first step after a switch pays for it; not timed
            rows = [time_step(run) for _ in range(steps)]
            for series, col in zip((out[name].wall_s, out[name].user_s, out[name].system_s,
                                    out[name].faults), zip(*rows, strict=True), strict=True):
                series.append(statistics.median(col))
    return out
