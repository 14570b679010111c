"""``train.profile``: a ``jax.profiler`` trace of a few steps after the compile.

The trace (XSpace ``*.xplane.pb``, which XProf / TensorBoard's profile plugin open, and JAX's
``perfetto_trace.json.gz``) goes to ``<run dir>/profile/``, or ``profile/<rank>/`` per process
of a multi-process run: each process traces its own host and devices. The compiled step's HLO
is saved beside it (``step.hlo.txt``) so that ``python -m dxrun.profile`` can tell a matmul
fusion from an elementwise one by what it computes rather than by its name.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("dxrun")

HLO_FILE = "step.hlo.txt"


def profile_dir(run_dir: Path, rank: int, processes: int) -> Path:
    """Where this process writes its trace."""
    return run_dir / "profile" / str(rank) if processes > 1 else run_dir / "profile"


def traced_steps(start: int, steps: int, done_before: int, last: int) -> range:
    """The step numbers (as logged: 1-based) to trace for ``train.profile.start/steps`` in an
    attempt that starts after step ``done_before`` (a resume's checkpoint; 0) and ends at
    ``last``. The attempt's first step compiles, so a start on or before it moves to the step
    after. Empty when off (start 0) or past the end."""
    if start <= 0:
        return range(0)
    begin = max(start, done_before + 2)
    return range(begin, min(begin + steps, last + 1))


def open_command(where: Path) -> str:
    return f"xprof --logdir={where} --port=8791"


class Tracer:
    """Starts the trace before the first traced step and stops it after the last, each time
    with the device drained, so that the trace holds exactly those steps."""

    def __init__(self, steps: range, where: Path, run_dir: Path, hlo_text: str | None):
        self.steps, self.where, self.run_dir, self.hlo_text = steps, where, run_dir, hlo_text
        self.active = False

    def before(self, step: int, pending: object) -> bool:
        """Called before running ``step``; True when it starts the trace."""
        if not self.steps or step != self.steps.start:
            return False
        import jax  # here: dxrun.profile (and the reference) read HLO_FILE without JAX

        jax.block_until_ready(pending)  # the earlier steps stay out of the trace
        self.where.mkdir(parents=True, exist_ok=True)
        if self.hlo_text:
            (self.where / HLO_FILE).write_text(self.hlo_text)
        jax.profiler.start_trace(str(self.where), create_perfetto_trace=True)
        self.active = True
        return True

    def after(self, step: int, pending: object) -> bool:
        """Called after ``step`` ran; True when it stopped the trace."""
        if not self.active or step != self.steps[-1]:
            return False
        import jax

        jax.block_until_ready(pending)
        self.stop()
        log.info("profiler trace of steps %d-%d in %s; open it with: %s (pip install xprof), "
                 "or perfetto_trace.json.gz on ui.perfetto.dev; table: python -m dxrun.profile "
                 "%s", self.steps.start, self.steps[-1], self.where, open_command(self.where),
                 self.run_dir)
        return True

    def stop(self) -> None:
        if self.active:
            import jax

            jax.profiler.stop_trace()
            self.active = False
