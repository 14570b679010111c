"""What a run measures and reports, what the rest may use: where the wall time went, the log
window's step time and the profiler's trace of a few steps (``goodput``, used as a module: the
run's clock); the one metrics path to ``metrics.jsonl``, W&B and the other backends
(``MetricsLogger``), the progress on the terminal, a monitored metric (keep-best, early stop) and
the end's ``summary.json``; and the W&B workspace's panels (``dashboard.yaml``, which ``python -m
dxrun.dashboard`` creates). A logged row's numbers are the trainer's (``dxrun.train``).

- ``goodput.py``: the run's clock by part, the step timer, the trace window.
- ``logger.py``: every row to metrics.jsonl and the backends; a resume's rows rewound.
- ``backends.py``: TensorBoard, CSV, MLflow and W&B behind one interface.
- ``wandb_file.py``: an offline W&B run read back from its file.
- ``console.py``: the progress bar or log lines.
- ``monitor.py``: a monitored metric (checkpoint.keep_best, train.early_stop).
- ``summary.py``: summary.json at the run's end.
"""

from dxrun.tracking import goodput
from dxrun.tracking.backends import open_wandb
from dxrun.tracking.console import Progress
from dxrun.tracking.goodput import (
    HLO_FILE,
    NOTICEABLE_BLOCK_S,
    Measured,
    SaveTotals,
    StepTimer,
    Tracer,
    job_started_at,
    mark,
    profile_dir,
    traced_steps,
)
from dxrun.tracking.logger import MetricsLogger, Rewound, read_metrics, rewind_metrics
from dxrun.tracking.monitor import Monitor, plateau, stopped_early
from dxrun.tracking.summary import RunSummary, record_end

__all__ = ["HLO_FILE", "NOTICEABLE_BLOCK_S", "Measured", "MetricsLogger", "Monitor", "Progress",
           "Rewound", "RunSummary", "SaveTotals", "StepTimer", "Tracer", "goodput",
           "job_started_at", "mark", "open_wandb", "plateau", "profile_dir", "read_metrics",
           "record_end", "rewind_metrics", "stopped_early", "traced_steps"]
