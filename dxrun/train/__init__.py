"""The trainer's package, what the rest may use: ``train`` (a run into its dir; ``open_run`` to
add hooks of one's own first), ``prepare`` and ``start_state`` (the startup), the ``Trainer``
and its ``Hook``, ``evaluate`` (held-out loss) and the numbers of a logged row.

- ``start.py``: before anything is written or allocated (the decision, the resume, the memory
  preflight), then where training begins.
- ``trainer.py``: the loop, a schedule of hooks; ``train`` and ``open_run``.
- ``hooks.py``: each part of a run at its cadence (metrics, evaluation, checkpoints, trace,
  early stop, goodput, the summary), registered as a user's hook is.
- ``rows.py``: the numbers of a logged row, pure functions.
"""

from dxrun.train.hooks import Hook, StepInfo, evaluate
from dxrun.train.rows import (
    RunFacts,
    StepCost,
    first_row,
    log_row,
    peak_bytes_since,
    peak_over_devices,
    perf_row,
    perplexity,
)
from dxrun.train.start import Start, prepare, start_state
from dxrun.train.trainer import Trainer, open_run, train

__all__ = ["Hook", "RunFacts", "Start", "StepCost", "StepInfo", "Trainer", "evaluate",
           "first_row", "log_row", "open_run", "peak_bytes_since", "peak_over_devices",
           "perf_row", "perplexity", "prepare", "start_state", "train"]
