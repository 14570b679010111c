"""What goodput's spans and an idle train.profile cost per step (tracing off): the loop's added
work is a few clock reads and two integer compares, timed here in isolation.

    python benchmarks/profile_off_cost.py
"""

from __future__ import annotations

import time
import timeit
from pathlib import Path

from dxrun.tracking import Tracer
from dxrun.tracking.goodput import Goodput, StepWindow


def main(n: int = 100_000) -> None:
    g, w = Goodput(time.time()), StepWindow()
    tracer = Tracer(range(0), Path("profile"), Path("."), None)  # train.profile.start=0

    def one_step() -> None:  # what train() adds around a step that is not traced
        with g.span("productive"):
            tracer.before(5, None)
        with g.span("data"):
            w.wait(0.0)
        with g.span("productive"):
            tracer.after(5, None)

    per_step = min(timeit.repeat(one_step, number=n, repeat=3)) / n
    print(f"tracing off, goodput on: {per_step * 1e6:.2f} us per step")


if __name__ == "__main__":
    main()
