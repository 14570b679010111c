"""What a run reports at its end (``summary.json``, the return value of ``train``): the last
value of every logged metric, the best train loss, and the attempt's figures.

The rows a resume in place kept count as logged: their last values and their best loss carry
over. A relaunch of a run that reached its end without recording it writes it from the run's
files (``record_end``). No JAX: tests feed rows by hand.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from dxrun.config import UNFINISHED
from dxrun.run import is_main, read_status, write_json
from dxrun.tracking.goodput import earlier_attempts, run_total
from dxrun.tracking.logger import read_metrics
from dxrun.tracking.monitor import stopped_early

log = logging.getLogger("dxrun")


def best_loss(best: float | None, loss: float | None) -> float | None:
    """The lower finite train/loss of the two (None: none was finite)."""
    if not isinstance(loss, float) or not math.isfinite(loss):
        return best
    return loss if best is None or loss < best else best


class RunSummary:
    def __init__(self, kept: list[dict[str, Any]] | None = None):
        self.last: dict[str, Any] = {}
        self.best_loss: float | None = None  # the lowest finite train/loss; None: none was
        for row in kept or []:
            self.add({k: v for k, v in row.items() if k != "step"})

    def add(self, row: dict[str, Any]) -> None:
        """A logged row (a log step's, an evaluation's, or both)."""
        self.best_loss = best_loss(self.best_loss, row.get("train/loss"))
        self.last = {**self.last, **row}

    @property
    def logged(self) -> bool:
        """Any row yet (a resume's kept rows count): the one-off numbers went on the first."""
        return bool(self.last)

    def record(self, *, steps: int, n_params: int, flops_per_token: float,
               loop_tokens_per_s: float | None, compile_time_s: float,
               entropy_floor: float | None, device_kind: str, peak_tflops: float | None,
               checkpoint_saves: int, checkpoint_block_s: float,
               goodput_total: dict[str, Any], attempt: dict[str, float]) -> dict[str, Any]:
        """``summary.json``: the run's figures after its last values."""
        return {
            "step": steps,
            **self.last,
            "train/loss": self.last.get("train/loss"),
            "best/train_loss": self.best_loss,
            "n_params": n_params,
            "flops_per_token": flops_per_token,
            "tokens_per_s": self.last.get("perf/tokens_per_s"),  # the last window's steps alone
            "loop_tokens_per_s": loop_tokens_per_s,  # the whole loop after the compiling step
            "compile_time_s": compile_time_s,
            "entropy_floor": entropy_floor,
            "device_kind": device_kind,
            "peak_tflops": peak_tflops,
            # The run's saves over its attempts (goodput.json's records), and the time they held
            # the loop.
            "checkpoint_saves": checkpoint_saves,
            "checkpoint_block_s": checkpoint_block_s,
            # Productive step time / wall time over the run's attempts (goodput.json holds each).
            "goodput": goodput_total["goodput"],
            "goodput_s": attempt,  # this attempt's wall time by part (goodput.PARTS, rest)
            "attempts": goodput_total["attempts"],
        }


def record_end(run_dir: Path, checkpoint_meta: dict[str, Any]) -> dict[str, Any] | None:
    """A relaunch of a run whose checkpoint (``checkpoint_meta``: its meta) is at the run's
    end (its own ``train.steps``, or where its own ``train.early_stop`` ended it) but which was
    stopped or killed before it recorded that end (no summary.json, or status.json still
    unfinished): write summary.json from metrics.jsonl and goodput.json (the figures only the
    last attempt itself measured, its compile and loop times and saves, are null or 0) and
    return it; the launcher then writes status ok. None, writing nothing, for a run that
    recorded its end or had not reached it."""
    run_config = checkpoint_meta.get("config", {})
    train_config = run_config.get("train", {})
    steps, step = train_config.get("steps"), checkpoint_meta.get("step", 0)
    stopped = stopped_early(checkpoint_meta, train_config.get("early_stop"))
    summary_path = run_dir / "summary.json"
    recorded = summary_path.is_file() and read_status(run_dir).get("status") not in UNFINISHED
    if steps is None or (step < steps and not stopped) or recorded:
        return None
    # Written anew even where a summary is there: an earlier end's, before the run trained on.
    rows, _ = read_metrics(run_dir / "metrics.jsonl")
    attempts = earlier_attempts(run_dir, True)
    total = run_total(attempts) if attempts else {"goodput": None, "attempts": 0}
    summary = RunSummary(rows).record(
        steps=step if stopped else steps, n_params=run_config.get("n_params"),
        flops_per_token=run_config.get("flops_per_token"), loop_tokens_per_s=None,
        compile_time_s=None, entropy_floor=None,
        device_kind=run_config.get("jax", {}).get("device_kind"), peak_tflops=None,
        checkpoint_saves=0, checkpoint_block_s=0.0, goodput_total=total,
        attempt=attempts[-1] if attempts else {})
    if stopped:
        summary["early_stop"] = stopped
    if is_main():
        write_json(summary_path, summary)
    return summary
