"""A monitored metric: its best value so far, the step of it, and the rows since it improved.

One concept behind two features: ``checkpoint.keep_best`` (the checkpoint of the best value is
kept beside the newest ``checkpoint.keep``, never rotated out) and ``train.early_stop`` (the run
ends once ``patience`` rows in a row have not improved on the best). Both travel in each
checkpoint's meta (``to_json``/``from_json``), so a resume continues their counts where the
checkpoint left them. Pure: values in, values out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Monitor:
    metric: str
    mode: str = "min"  # min: lower is better; max: higher is better
    min_delta: float = 0.0  # an improvement is a change by more than this
    best: float | None = None
    step: int | None = None  # the step of ``best``
    stale: int = 0  # rows of the metric since ``best`` (0: the last one was the best)

    def see(self, step: int, row: dict[str, Any]) -> bool | None:
        """Take step ``step``'s row: whether its value is a new best (None: the row has no
        finite value of the metric, and counts for nothing)."""
        value = row.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.step, self.stale = float(value), step, 0
            return True
        self.stale += 1
        return False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None, metric: str, mode: str,
                  min_delta: float = 0.0) -> Monitor:
        """The monitor a checkpoint saved, if it watched the same metric the same way; else a
        fresh one (a resume that changed the metric starts counting anew)."""
        fresh = cls(metric, mode, min_delta)
        if not saved or (saved.get("metric"), saved.get("mode")) != (metric, mode):
            return fresh
        return cls(metric, mode, min_delta, saved.get("best"), saved.get("step"),
                   int(saved.get("stale", 0)))


def plateau(m: Monitor, patience: int) -> str | None:
    """``train.early_stop``'s reason to end the run once ``m`` has gone ``patience`` rows
    without improving on its best; None before."""
    if m.best is None or m.stale < patience:
        return None
    return (f"early stop: {m.metric} has not improved on {m.best:.6g} (step {m.step}) by "
            f"more than {m.min_delta:g} in {m.stale} rows (train.early_stop.patience={patience})")


def stopped_early(meta: Mapping[str, Any], early_stop: Mapping[str, Any] | None) -> str | None:
    """Why a run resumed from a checkpoint (``meta``: its meta, which holds the monitor as it
    left it) under ``early_stop`` (a ``train.early_stop`` section, a config's or as a
    checkpoint saved it) would stop before its first step: the reason, as the run that
    stopped gave it; None when it trains on."""
    if not isinstance(early_stop, Mapping) or not early_stop.get("monitor"):
        return None
    m = Monitor.from_json(meta.get("early_stop"), early_stop["monitor"],
                          early_stop.get("mode", "min"), early_stop.get("min_delta", 0.0))
    return plateau(m, int(early_stop.get("patience", 3)))
