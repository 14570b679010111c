"""The numbers of a logged row: pure functions of the step's metrics, the timer's window and
the run's constants (``RunFacts``, measured once when the run opens; the rest needs no JAX and
no run).

A log row holds, in this order: the step's own metrics (train/*) and train/ppl; perf/* of the
window since the previous log point (left out when the window has no step or no time);
perf/profiled when traced steps were in it; on the run's first row the one-off numbers
(perf/compile_time_s, perf/layout_search_s, mem/step_bytes_per_device); mem/peak_bytes_per_device
where the allocator keeps statistics; data/tokens_seen and data/entropy_floor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax

from dxrun.cost import active_params, flops_per_token, mfu
from dxrun.experiment import Experiment
from dxrun.fit import resolve_peak
from dxrun.plan import RunPlan, saved_config
from dxrun.run import Job, describe_model
from dxrun.tracking import Measured

if TYPE_CHECKING:
    from dxrun.config import RunConfig



log = logging.getLogger("dxrun")


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged run logs a large number, not inf


@dataclass(frozen=True)
class StepCost:
    """What one step does, the same every step: its tokens and FLOPs, over how many devices,
    against which peak (TFLOP/s per device; None: unknown, no perf/mfu)."""

    tokens: int
    flops: float
    n_devices: int
    peak_tflops: float | None


@dataclass(frozen=True)
class RunFacts:
    """What the rows and the summary say of the run, measured once when it opens."""

    n_params: int  # the real vocabulary, without padding
    floor: float | None  # the data's entropy floor
    device_kind: str
    cost: StepCost
    config: dict[str, Any]  # the W&B config and each checkpoint's: the derived numbers

    @classmethod
    def measure(cls, cfg: RunConfig, exp: Experiment, run_plan: RunPlan, state: Any,
                job: Job) -> RunFacts:
        """The run's facts (its parameters, its step's cost, the config it records), said in the
        log once."""
        plan, data = exp.plan, exp.data
        n_params = exp.count_params(state.params)  # the real vocabulary, without padding
        active = active_params(cfg.model, n_params)  # an MoE model's: fewer
        log.info("model %s: %s parameters%s; data %s: %s", describe_model(cfg.model, job),
                 f"{n_params:,}", f" ({active:,} active per token)" * (active != n_params),
                 cfg.data._target_ or cfg.data.name, data.description)
        if cfg.model._target_:  # dxrun.model.user_model: what a user model's run does differently
            log.info("model._target_=%s: unchunked loss (model.loss_chunk=0), computed in its "
                     "parameters' dtype; 6 FLOPs per parameter per token", cfg.model._target_)
        else:
            log.info("attention kernel: %s", exp.attention_kernel)  # attention_kernel.KERNELS
        device_kind = jax.devices()[0].device_kind
        peak = resolve_peak(cfg.runtime, cfg.train, device_kind, exp.mesh.devices.flat)
        tokens_per_step = plan.global_batch * plan.seq_len
        cost = StepCost(tokens_per_step, flops_per_token(
            cfg.model, n_params, plan.seq_len) * tokens_per_step, plan.n_devices, peak)
        config = {  # the W&B config and each checkpoint's: the derived numbers written once
            **saved_config(cfg, run_plan, job_type=job.job_type, group=job.group),
            "choices": job.choices,
            "plan": run_plan.to_json(),
            "n_params": n_params,
            "n_active_params": active,
            "flops_per_token": cost.flops / cost.tokens,
            "jax": {"version": jax.__version__, "device_kind": device_kind,
                    "device_count": jax.device_count(), "process_count": jax.process_count()},
        }
        return cls(n_params, data.entropy_floor, device_kind, cost, config)


def train_row(fetched: Mapping[str, Any]) -> dict[str, Any]:
    """The step's metrics as floats, and the perplexity of its loss."""
    row: dict[str, Any] = {k: float(v) for k, v in fetched.items()}
    row["train/ppl"] = perplexity(row["train/loss"])
    return row


def perf_row(window: Measured, cost: StepCost) -> dict[str, Any]:
    """perf/* of a window; perf/profiled when traced steps were left out of it."""
    row: dict[str, Any] = {}
    if window.steps > 0 and window.seconds > 0:
        step_time = window.seconds / window.steps
        tflops = cost.flops / step_time / cost.n_devices / 1e12
        row["perf/step_time_s"] = step_time
        row["perf/tokens_per_s"] = cost.tokens / step_time
        row["perf/tokens_per_s_per_device"] = row["perf/tokens_per_s"] / cost.n_devices
        row["perf/tflops_per_device"] = tflops
        row["perf/data_wait_frac"] = window.waited / window.seconds
        if cost.peak_tflops:
            row["perf/mfu"] = mfu(tflops, cost.peak_tflops)
    if window.profiled:
        row["perf/profiled"] = True
    return row


def first_row(compile_time_s: float, layout_search_s: float | None,
              step_bytes: float | None) -> dict[str, Any]:
    """The one-off numbers, on the first row of a run: the step's compile, the layout search
    (parallelism=auto) and the compiled step's memory per device."""
    row: dict[str, Any] = {"perf/compile_time_s": compile_time_s}
    if layout_search_s is not None:
        row["perf/layout_search_s"] = layout_search_s
    if step_bytes is not None:
        row["mem/step_bytes_per_device"] = step_bytes
    return row


def data_row(tokens_seen: int, entropy_floor: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"data/tokens_seen": float(tokens_seen)}
    if entropy_floor is not None:
        row["data/entropy_floor"] = entropy_floor
    return row


def log_row(fetched: Mapping[str, Any], window: Measured, cost: StepCost,
            first: dict[str, Any] | None, peak_bytes: float | None, tokens_seen: int,
            entropy_floor: float | None) -> dict[str, Any]:
    """A log step's row. ``first``: the one-off numbers (``first_row``) on the run's first
    row, else None; ``peak_bytes``: the allocator's peak (None: CPU keeps no statistics)."""
    row = {**train_row(fetched), **perf_row(window, cost), **(first or {})}
    if peak_bytes is not None:
        row["mem/peak_bytes_per_device"] = peak_bytes
    return {**row, **data_row(tokens_seen, entropy_floor)}


def peak_bytes_since(start: dict | None, now: dict | None) -> float | None:
    """This run's allocator peak from ``Device.memory_stats()`` taken at its start and now.

    The allocator's ``peak_bytes_in_use`` is process-wide and JAX cannot reset it, so in a
    multirun it still holds the largest earlier job's peak. If it rose during this run, the new
    high-water mark was set by this run and is exact; if not, this run's peak is unknown (at most
    the old one) and None is returned, never an earlier job's number. None also where the
    backend keeps no statistics (CPU)."""
    if not now or "peak_bytes_in_use" not in now:
        return None
    before = (start or {}).get("peak_bytes_in_use", 0)
    return float(now["peak_bytes_in_use"]) if now["peak_bytes_in_use"] > before else None


class AllocatorPeak:
    """The allocator statistics of this process's devices at the start of a run, to report the
    peak reached during the run (``peak_bytes_since``), the largest over the devices."""

    def __init__(self) -> None:
        self.devices = jax.local_devices()
        self.start = [d.memory_stats() for d in self.devices]

    def peak_since_start(self) -> float | None:
        return peak_over_devices(self.start, [d.memory_stats() for d in self.devices])


def peak_over_devices(starts: list[dict | None], nows: list[dict | None]) -> float | None:
    """``mem/peak_bytes_per_device`` of a log row: the largest ``peak_bytes_since`` over this
    process's devices (None on CPU, or where no device's peak rose during this run)."""
    peaks = [peak_bytes_since(s, n) for s, n in zip(starts, nows, strict=True)]
    return max((p for p in peaks if p is not None), default=None)
