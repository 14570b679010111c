"""What a run reports at its end (``summary.json``, the return value of ``train``): the last
value of every logged metric, the best train loss, and the attempt's figures.

The rows a resume in place kept count as logged: their last values and their best loss carry
over. No JAX: tests feed rows by hand.
"""

from __future__ import annotations

from typing import Any

from dxrun.tracking.metrics_row import best_loss


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
