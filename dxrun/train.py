"""The trainer: before anything is written or allocated, the run's decision, the checkpoint it
resumes and the memory preflight, then the decision shown (the log, plan.json) and where
training begins (``prepare``, ``start_state``); then one object owns the attempt's train state
and its step and calls its hooks at their cadence, Levanter's ``every=N`` style: the metrics,
evaluation, the save point, the trace, keep-best and early stop, goodput. The run's outputs:
plan.json, metrics.jsonl, summary.json, the W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
Step time is measured from device-ready to device-ready over the window between two log
steps; the first (compiling) step is never in a window.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from dxrun.autotune import fit
from dxrun.autotune.fit import Decided, Handover, compile_checked, decide, memory_preflight, resolve_peak
from dxrun.checkpointing.store import (
    Resume,
    RunCheckpoints,
    data_position,
    find_resume,
    halted,
    plan_resume,
    refused,
    restore,
    tokens_seen,
)
from dxrun.config import ConfigError, DiskError, first_line
from dxrun.experiment import Experiment, adopt, check_hf_weights
from dxrun.plan.cost import active_params, flops_per_token, mfu
from dxrun.plan.run_plan import RunPlan, saved_config, table
from dxrun.run.runtime import Job, describe_model, dir_refusal, is_main, run_name, write_json
from dxrun.tracking import goodput
from dxrun.tracking.goodput import Measured, StepTimer, Tracer, profile_dir, traced_steps
from dxrun.tracking.logger import (
    MetricsLogger,
    Monitor,
    Progress,
    Rewound,
    RunSummary,
    plateau,
    rewind_metrics,
)

if TYPE_CHECKING:
    from dxrun.config import EarlyStopConfig, ProfileConfig, RunConfig


# ------------------------------------------------------------------------------------------------
# The numbers of a logged row: pure functions of the step's metrics, the timer's window and
# the run's constants (``RunFacts``, measured once when the run opens; the rest needs no JAX and
# no run).
#
# A log row holds, in this order: the step's own metrics (train/*) and train/ppl; perf/* of the
# window since the previous log point (left out when the window has no step or no time);
# perf/profiled when traced steps were in it; on the run's first row the one-off numbers
# (perf/compile_time_s, perf/layout_search_s, mem/step_bytes_per_device); mem/peak_bytes_per_device
# where the allocator keeps statistics; data/tokens_seen and data/entropy_floor.

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


# ------------------------------------------------------------------------------------------------
# Before anything is written or allocated: the run's decision (``autotune.search``), the
# checkpoint it resumes and the memory preflight; then the decision shown (``show_plan``: the log,
# plan.json) and where training begins (``start_state``: the seeded init, what the layout search
# trained, or the resumed checkpoint).



def prepare(cfg: Any, run_dir: Path | None = None) -> Decided:
    """Everything that can refuse bad input, before anything is written or allocated: a
    ``checkpoint.dir`` that cannot be made, the run's decision (``decide``: the mesh plan,
    the layout, the data's files, tokenizer and vocabulary, the checkpoint to resume from for
    a launch into ``run_dir``) and the memory preflight (the step compiled from shapes alone
    must fit). A resume is decided here in full (``store.plan_resume``): its step, its
    data position, and its optimizer state, which is restored when its tree fits the
    optimizer now and otherwise starts fresh with one warning. Raises ConfigError, or
    NothingToTrain when the checkpoint has reached ``train.steps`` already (or its run stopped
    early: ``train.early_stop``). ``cfg`` is read, never rewritten, and is the config the run
    follows (``exp.cfg``); what is derived from it travels in ``Decided.plan``: ``decide``'s
    answer, the one carrier from here to the loop."""
    # Every run that trains into a run dir may save (a signal asks for a save at any cadence),
    # so its checkpoint.dir must take a dir before the search and the step compile.
    if run_dir is not None and cfg.checkpoint.dir and (why := dir_refusal(
            "checkpoint.dir", cfg.checkpoint.dir,
            "give a dir you can write to, or leave checkpoint.dir null (<run dir>/checkpoints)")):
        raise ConfigError(why)
    find = (None if run_dir is None
            else lambda saved: find_resume(cfg.checkpoint, run_dir, saved))
    decided = decide(cfg, find_resume=find)
    exp, plan, resume = decided.exp, decided.plan, decided.resume
    if resume is not None:  # its data position, its optimizer state, whether it trains at all
        plan_resume(resume, exp.abstract_state(), cfg.train.steps, plan.global_batch,
                    cfg.optimizer, cfg.train.early_stop)
    elif cfg.model.init_from:  # the weights' files, read from their headers alone
        check_hf_weights(exp)
    elif (h := decided.handover) is None or (h.params is None and h.state is None):
        exp.seeded.compile()  # the seeded init the run starts from, beside the step's compile
    memory_preflight(cfg, exp, compile_checked(cfg, exp, plan), plan=plan)
    goodput.mark("decide")
    return decided


class Start(NamedTuple):
    """Where training begins."""

    state: Any  # the TrainState on this run's mesh
    step: int  # steps already done: 0, or the checkpoint's step
    # The resumed checkpoint's metadata (its config, W&B run id, data position, tokens seen);
    # {} on a fresh start.
    ckpt_meta: dict[str, Any]
    # This process's devices' allocator statistics before the state was placed: the run's
    # peak memory is measured from them (mem/peak_bytes_per_device).
    allocator: AllocatorPeak

    def place(self, batches: Any, global_batch: int, trained: int) -> None:
        """The training ``batches`` moved to where this attempt begins: the checkpoint's data
        position, or past the ``trained`` batches parallelism=auto's turns read."""
        if self.ckpt_meta:
            batches.set_state(data_position(self.ckpt_meta, global_batch))
        elif trained:
            (key,) = batches.get_state()  # the batches read: "step" or "next_index"
            batches.set_state({key: trained})

    def tokens_before(self, trained: int, tokens_per_step: int) -> int:
        """Tokens actually read before this attempt: the checkpoint's count (a resume may have
        changed the batch size), or the ``trained`` steps' batches."""
        if self.ckpt_meta:
            return tokens_seen(self.ckpt_meta, self.step)
        return trained * tokens_per_step


def start_state(exp: Experiment, resume: Resume | None,
                handover: Handover | None = None) -> Start:
    """The seeded init, or the resumed checkpoint placed on this run's mesh. ``handover``
    (parallelism=auto's search, ``Decided.handover``): the init it drew (``params``), or the
    state after the first steps it trained (``state``, ``step``): taken, so that their host or
    device copies are let go once on this mesh."""
    allocator = AllocatorPeak()  # before this run allocates anything
    if resume is None and exp.cfg.model.init_from:
        # A fine-tune starts from its checkpoint's weights: what a layout search drew or
        # trained from the seeded init is left behind.
        log.info("weights from %s", exp.cfg.model.init_from)
        return Start(exp.init_state(exp.hf_params()), 0, {}, allocator)
    if resume is None:
        handover = handover or Handover()
        if handover.state is not None:  # the search trained the run's first steps
            step, state, handover.state = handover.step, handover.state, None
            log.info("parallelism=auto: the layouts' turns trained steps 1-%d; the run goes on "
                     "from step %d", step, step + 1)
            return Start(adopt(exp, state), step, {}, allocator)
        params, handover.params = handover.params, None
        return Start(exp.init_state(params), 0, {}, allocator)
    state, ckpt_meta, step = restore(resume, exp.abstract_state())
    if state.opt_state is None:  # the optimizer changed its state's tree (plan_resume)
        state = fresh_optimizer(exp, state)
    log.info("resuming from step %d (checkpoint %s)", step, resume.directory / str(step))
    return Start(state, step, ckpt_meta, allocator)


def fresh_optimizer(exp: Experiment, state: Any) -> Any:
    """``state`` with a freshly initialised optimizer state whose step counts continue from
    ``state.step`` (so the lr schedule goes on where it was)."""
    fresh = exp.init_state(state.params).opt_state

    def count(path: tuple, x: jax.Array) -> jax.Array:
        if path and getattr(path[-1], "name", getattr(path[-1], "key", None)) == "count":
            # A copy: the step donates its input buffers, and one buffer must not appear twice.
            return jax.device_put(state.step.astype(x.dtype).copy(), x.sharding)
        return x

    return state._replace(opt_state=jax.tree_util.tree_map_with_path(count, fresh))


def show_plan(plan: RunPlan, run_dir: Path, main: bool) -> None:
    """The run plan: its warnings and table in the log, ``plan.json`` in the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for w in plan.mesh.warnings:
        log.warning(w)
    if main:
        write_json(run_dir / "plan.json", plan.to_json())
    log.info("mesh plan\n%s", plan.mesh.table())
    if plan.search:
        log.info("parallelism=auto\n%s", table(plan.search))


# ------------------------------------------------------------------------------------------------
# The trainer's hooks (``dxrun.train.Trainer``): each part of a run the loop calls at its cadence,
# Levanter's ``every=N`` style. After a step, the hooks whose turn it is (every ``every`` steps and
# at the last one) add their part to the step's row (the metrics, the evaluation); once a row is
# complete every hook sees it (the summary, a new best checkpoint, the early stop). The save point
# runs before every step and the trace around it; each hook closes what it holds when the attempt
# ends, however it ended.

def evaluate(exp: Experiment, params: dict, batches: Iterable[jax.Array]) -> dict[str, float]:
    """Mean held-out loss and accuracy over ``batches``: in training the same ``eval.batches``
    every time (a list); ``dxrun.evaluate`` passes a generator, so that a whole split is never
    on the devices at once. A batch's index seeds masked diffusion's noise (``model.objectives``)."""
    results = [exp.eval_step(params, b, k) for k, b in enumerate(batches)]
    loss = sum(float(r["eval/loss"]) for r in results) / len(results)
    acc = sum(float(r["eval/accuracy"]) for r in results) / len(results)
    return {"eval/loss": loss, "eval/ppl": perplexity(loss), "eval/accuracy": acc}


@dataclass
class StepInfo:
    """A step the trainer ran (``done``: the steps done) and the row its hooks build."""

    done: int
    state: Any
    metrics: Any  # the step's metrics, still on the device
    row: dict[str, Any] = field(default_factory=dict)


@dataclass
class Clocks:
    """What the hooks share: goodput's clock, the step timer and the progress line."""

    clock: goodput.Goodput
    timer: StepTimer
    progress: Progress

    @classmethod
    def open(cls, clock: goodput.Goodput, start: int, steps: int, main: bool) -> Clocks:
        """An attempt's from step ``start`` to ``steps``; the progress line on the ``main``
        process only."""
        return cls(clock, StepTimer(start, steps), Progress(steps, None if main else False))


class Hook:
    """A part of the run: ``on_step`` after every ``every``-th step and the last (0: never),
    ``on_row`` with every complete row."""

    every = 0

    def due(self, done: int, last: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == last)

    def on_step(self, info: StepInfo) -> None:
        """Its part of the step's row."""

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        """A row is complete (a log step's, an evaluation's or both)."""


class GoodputHook(Hook):
    """``goodput.json``: the attempt's wall time by part, written before any row (an attempt
    killed outright keeps what it had) and when the attempt ends (``goodput.RunRecord``)."""

    def __init__(self, record: goodput.RunRecord, ckpts: RunCheckpoints):
        self.record, self.ckpts = record, ckpts

    def write(self, last_step: int) -> None:
        self.record.update(last_step, self.ckpts.cost.saves, self.ckpts.cost.block_total_s)

    def behind(self) -> bool:
        """A save since the last write (a save off the log steps is accounted for too)."""
        return self.ckpts.cost.saves != self.record.attempt["checkpoint_saves"]

    def lines(self) -> list[str]:
        return goodput.lines(self.record.attempt, self.record.total)


class TraceHook(Hook):
    """``train.profile``'s trace window around its steps: the step timer is paused out of it,
    and the trace uploaded once it closed."""

    def __init__(self, tracer: Tracer, timer: StepTimer, logger: MetricsLogger):
        self.tracer, self.timer, self.logger = tracer, timer, logger

    @classmethod
    def open(cls, profile: ProfileConfig, exp: Experiment, start: int, steps: int,
             run_dir: Path, timer: StepTimer, logger: MetricsLogger) -> TraceHook:
        """``train.profile``'s window over this attempt's steps ``start + 1``..``steps`` (a
        warning where it lies before them), each process's trace in its own dir."""
        compiled = exp.step.compiled
        tracer = Tracer(traced_steps(profile.start, profile.steps, start, steps),
                        profile_dir(run_dir, jax.process_index(), jax.process_count()), run_dir,
                        compiled.as_text() if compiled is not None else None)
        if profile.start and not tracer.steps:
            log.warning("train.profile.start=%d is past this attempt's steps %d-%d: no trace",
                        profile.start, start + 2, steps)
        return cls(tracer, timer, logger)

    @property
    def active(self) -> bool:
        return self.tracer.active

    def before(self, i: int, metrics: Any) -> None:
        """Before step ``i + 1`` (``metrics``: the step before's, drained first)."""
        if self.tracer.before(i + 1, metrics):
            self.timer.pause(i)

    def after(self, done: int, metrics: Any) -> None:
        if self.tracer.after(done, metrics):
            self.timer.resume(done)
            self.logger.upload(self.tracer.where, "profile", "profile")

    def close(self) -> None:
        self.tracer.stop()  # a run stopped inside the window still leaves its trace


class CheckpointHook(Hook):
    """The save point before every step and after the last (``RunCheckpoints.between_steps``:
    save when due, stop on SIGTERM/SIGINT, halt on a non-finite step); a row may make a new
    best (checkpoint.keep_best: saved at that step)."""

    def __init__(self, ckpts: RunCheckpoints, clock: goodput.Goodput):
        self.ckpts, self.clock = ckpts, clock

    def save_point(self, done: int, state: Any, last: bool) -> None:
        with self.clock.span("checkpoint"):
            self.ckpts.between_steps(done, state, last=last)

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        self.ckpts.observe(done, row)

    def close(self) -> None:
        with self.clock.span("checkpoint"):
            self.ckpts.close()  # waits for a save in flight


class EvalHook(Hook):
    """Every ``train.eval_every`` steps and at the last: the held-out loss of the same
    ``eval.batches`` (none without held-out data). Its row off the log steps may end the run
    (train.early_stop; ``ending``: the log and early-stop hooks): the log's part is then built
    first, as at a log step (its window before the evaluation), and kept if the row ends the
    run, whose last row holds train/* as a normal end's does."""

    def __init__(self, every: int, exp: Experiment, batches: list[jax.Array],
                 clock: goodput.Goodput):
        self.every, self.exp, self.batches, self.clock = every, exp, batches, clock
        self.ending: tuple[LogHook, EarlyStopHook] | None = None

    def on_step(self, info: StepInfo) -> None:
        log, early = self.ending or (None, None)
        spare = None
        if log is not None and not info.row and early.watching:  # no log step's part
            spare = StepInfo(info.done, info.state, info.metrics)
            log.on_step(spare)
        with self.clock.span("eval"):
            info.row.update(evaluate(self.exp, info.state.params, self.batches))
        if spare is not None and early.would_stop(info.done, info.row):
            info.row = {**spare.row, **info.row}


class EarlyStopHook(Hook):
    """``train.early_stop``: its monitor sees every row and travels in each checkpoint's meta
    (``ckpts.watch``); ``stop_reason`` once its metric has not improved for its patience (a
    resume from a checkpoint that had stopped so stops before its first step)."""

    def __init__(self, es: EarlyStopConfig, ckpts: RunCheckpoints, meta: dict[str, Any]):
        self.watch, self.patience = ckpts.watch, es.patience
        self.stop_reason: str | None = None
        if es.monitor:
            self.watch["early_stop"] = Monitor.from_json(meta.get("early_stop"), es.monitor,
                                                         es.mode, es.min_delta)
            self._check()

    @property
    def watching(self) -> bool:
        return "early_stop" in self.watch and self.stop_reason is None

    def would_stop(self, done: int, row: dict[str, Any]) -> bool:
        """Whether ``row`` would end the run (its monitor left as it is)."""
        if not self.watching:
            return False
        m = replace(self.watch["early_stop"])
        m.see(done, row)
        return plateau(m, self.patience) is not None

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        if "early_stop" in self.watch:
            self.watch["early_stop"].see(done, row)
            self._check()

    def _check(self) -> None:
        if self.stop_reason is None and (why := plateau(self.watch["early_stop"],
                                                        self.patience)):
            self.stop_reason = why
            log.info("%s", self.stop_reason)


class LogHook(Hook):
    """Every ``train.log_every`` steps and at the last: the step's metrics fetched (the loop's
    only wait on the device) into its row (``train.py``: the window's timing, the
    first row's one-off numbers: the compiled ``step``'s, ``search_s``; mem/*). A complete row
    holds the saves inside its window (perf/checkpoint_block_s: those since the row before, the
    one at its step included) and waits for its step's save point (``write_rows``)."""

    def __init__(self, every: int, logger: MetricsLogger, summary: RunSummary, facts: RunFacts,
                 step: Any, search_s: float | None, tokens_at: Callable[[int], int], clocks: Clocks,
                 parts: tuple[AllocatorPeak, RunCheckpoints, TraceHook, GoodputHook]):
        self.every, self.logger, self.summary, self.facts = every, logger, summary, facts
        self.step, self.search_s, self.tokens_at, self.clocks = step, search_s, tokens_at, clocks
        self.allocator, self.ckpts, self.trace, self.goodput = parts
        self.pending: list[tuple[int, dict[str, Any]]] = []

    def on_step(self, info: StepInfo) -> None:
        clock, facts = self.clocks.clock, self.facts
        with clock.span("profile" if self.trace.active else "productive"):
            fetched = jax.device_get(info.metrics)  # waits for the device
        t_log = clock.clock()
        window = self.clocks.timer.measure(info.done)
        first = None if self.summary.logged else first_row(
            self.step.compile_time_s, self.search_s, self.step.memory_bytes())
        # mem/peak_bytes_per_device: every row on an accelerator (CPU keeps no statistics).
        info.row.update(log_row(fetched, window, facts.cost, first,
                                self.allocator.peak_since_start(), self.tokens_at(info.done),
                                facts.floor))
        clock.add("logging", clock.clock() - t_log)

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        # The saves since the last row held the loop inside this row's window (its tokens/s
        # and its save time are one window's); the last step's save is in summary.json only.
        if blocks := self.ckpts.cost.take_blocks():
            row["perf/checkpoint_block_s"] = sum(blocks)
        with self.clocks.clock.span("logging"):
            self.pending.append((done, row))
            # A save inside the window slows its tokens/s: the line says so.
            self.clocks.progress.update(done, row, self.clocks.timer.note(
                self.ckpts.cost.totals(), "perf/tokens_per_s" in row))

    def write_rows(self, done: int | None = None) -> None:
        """The rows waiting for their save point (``done``: its step), after goodput.json up
        to them (a row logged is a row accounted for, and so is a save off the log steps)."""
        with self.clocks.clock.span("logging"):
            last = self.pending[-1][0] if self.pending else done
            if last is not None and (self.pending or self.goodput.behind()):
                self.goodput.write(last)
            for step, row in self.pending:
                self.logger.log(step, row)
            self.pending.clear()

    def close(self, quiet: bool) -> None:
        """The attempt's goodput into the W&B summary; with ``quiet`` (the loop failed) the
        logger ends here, else once it had the run's summary (``SummaryHook.finish``)."""
        record = self.goodput.record
        self.logger.summary({"goodput": record.total["goodput"],
                             **{f"goodput/{k}": v for k, v in record.attempt.items()
                                if not k.startswith("checkpoint_")}})
        if quiet:
            self.logger.finish()


class SummaryHook(Hook):
    """``summary.json`` (``tracking/logger.py``): the last value of every logged metric
    and the best train loss (a resume's kept rows count as logged), with the attempt's
    figures; and the run's closing lines."""

    def __init__(self, kept: list[dict[str, Any]], facts: RunFacts, logger: MetricsLogger,
                 compile_time_s: float | None,
                 parts: tuple[StepTimer, RunCheckpoints, GoodputHook]):
        # A resume's kept rows (``logger.rewind_metrics``) count as logged.
        self.summary, self.facts, self.logger = RunSummary(kept), facts, logger
        self.compile_time_s = compile_time_s
        self.timer, self.ckpts, self.goodput = parts

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        self.summary.add(row)

    def finish(self, reached: int, steps: int, early_stop: str | None, run_dir: Path,
               main: bool, told: Callable[[Exception], Exception | None]) -> dict[str, Any]:
        """The summary of a run of ``steps`` whose attempt ran to step ``reached`` (written by
        the ``main`` process)."""
        facts, record = self.facts, self.goodput.record
        summary = self.summary.record(
            steps=steps, n_params=facts.n_params,
            flops_per_token=facts.cost.flops / facts.cost.tokens,
            loop_tokens_per_s=self.timer.loop_tokens_per_s(facts.cost.tokens, reached),
            compile_time_s=self.compile_time_s, entropy_floor=facts.floor,
            device_kind=facts.device_kind, peak_tflops=facts.cost.peak_tflops,
            checkpoint_saves=int(record.over_attempts("checkpoint_saves")),
            checkpoint_block_s=record.over_attempts("checkpoint_block_s"),
            goodput_total=record.total, attempt=record.attempt)
        if (best := self.ckpts.best()) is not None:
            summary["best_checkpoint"] = best
        if early_stop:
            summary["early_stop"] = early_stop
        if main:
            try:
                write_json(run_dir / "summary.json", summary)
            except OSError as e:
                if (error := told(e)) is None:
                    raise
                raise error from e
            finally:
                self.logger.summary(summary)  # every backend gets the run's summary
                self.logger.finish()
        last, floor = self.summary.last, facts.floor
        log.info("done: loss %.4f%s; outputs in %s", last.get("train/loss", float("nan")),
                 f" (floor {floor:.4f})" if floor is not None else "", run_dir)
        for line in self.goodput.lines():
            log.info(line)
        return summary


# ------------------------------------------------------------------------------------------------
# The trainer: one object owns an attempt's train state and its step and calls its hooks
# (``dxrun.train``) at their cadence; the run's outputs: plan.json, metrics.jsonl, summary.json,
# the W&B run.
#
# The host waits on the device only at log steps: metrics of the other steps stay on device.
# Step time is measured from device-ready to device-ready over the window between two log
# steps; the first (compiling) step is never in a window.

def train(cfg: Any, run_dir: Path, job: Job | None = None,
          prepared: Decided | None = None) -> dict[str, Any]:
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary. The run
    follows ``cfg`` and ``prepared.plan`` (``prepare``'s; None: ``prepare(cfg, run_dir)``):
    the startup on goodput's clock, then the ``Trainer``'s loop."""
    job = job or Job()
    clock = goodput.Goodput(job.started or time.time())
    prepared = prepared or prepare(cfg, run_dir)
    exp, plan, resume = prepared.exp, prepared.plan, prepared.resume
    # the preflight compiled the step, inside prepare (goodput's startup phase "decide")
    clock.add("compile", exp.step.compile_time_s, within="decide")
    search = plan.search
    if search is not None:  # parallelism=auto: timed apart from the startup, less the seeded
        # init it drew for the run (a run without a search draws it in its startup too), the
        # chosen layout's compile (booked above) and the steps it trained for the run
        # (productive: the run does not take them again); a run that did not search (too short
        # for one to pay, a cached decision, a resume) books none: deciding is startup
        clock.add("search", plan.search_s, within="decide")
        clock.add("productive", search.get("trained_s") or 0.0, within="decide")
    main = is_main()  # writes the run's files; every process trains
    show_plan(plan, run_dir, main)
    # On record from here (goodput.json): an attempt killed in its restore still counts.
    # A relaunch continues the dir's run (its attempts) where it resumes in place, or where
    # the attempt before died ahead of its first checkpoint (``Job.continues``).
    continues = (resume is not None and resume.in_place) or job.continues
    record = goodput.RunRecord(run_dir, clock, continues,
                               resume.meta_step if resume is not None else 0, write=main)
    goodput.mark("files")
    with goodput.compiling() as init_compile:  # the init's programs: compile, not startup
        started = start_state(exp, resume, prepared.handover)
    clock.add("compile", init_compile[0], within="init")
    goodput.mark("init")
    trainer = open_trainer(cfg, run_dir, job, prepared, started, record)
    goodput.mark("open")
    clock.end_startup()
    trainer.goodput.write(started.step)  # the startup on record: a kill before the first row
    return trainer.train()


@dataclass
class Trainer:
    """One attempt of a run (a fresh start or a resume): it owns the train state and the step
    and calls its hooks. ``train()`` is the loop, a schedule: before each step its save point,
    the step (its trace, its batch), then the hooks whose turn it is; each hook closes what it
    holds however the loop ended, and the summary is written."""

    exp: Experiment
    state: Any  # the TrainState
    start: int  # the steps done before this attempt
    steps: int  # train.steps
    batches: Any  # the training data
    clocks: Clocks
    run_dir: Path
    main: bool  # the process that writes the run's files
    debug_nans: bool
    trace: TraceHook
    ckpt: CheckpointHook
    log: LogHook
    evaluation: EvalHook
    summary: SummaryHook
    early: EarlyStopHook
    goodput: GoodputHook

    def __post_init__(self) -> None:
        self.reached, self.metrics = self.start, None  # the last step done and its metrics
        # After a step: the row's parts in this order, then each sees the complete row.
        self.hooks: list[Hook] = [self.log, self.evaluation, self.summary, self.ckpt, self.early]

    def train(self) -> dict[str, Any]:
        """The loop; the summary."""
        ended = False  # the loop's own end: only then are close()'s errors the ones reported
        # train.debug_nans (debug=nans): a NaN in a step's outputs raises at that step.
        nans = jax.debug_nans(True) if self.debug_nans else contextlib.nullcontext()
        try:
            with self.clocks.progress, self.ckpt.ckpts.preemption, nans:
                for i in range(self.start, self.steps):
                    if self.early.stop_reason:  # train.early_stop: a plateau ends it here
                        break
                    self.save_point(i)  # save when due; stop on SIGTERM/SIGINT
                    self.step(i)
                    self.after_step(i + 1)
                self.clocks.timer.end_loop()
                self.save_point(self.reached, last=True)
            ended = True
        except Exception as e:
            if (error := self.told(e, self.reached + 1)) is None:  # debug_nans names the step
                raise
            raise error from e
        finally:
            self.close(quiet=not ended)  # a run stopped or crashed mid-loop writes its files
        stop = self.early.stop_reason
        return self.summary.finish(self.reached, self.reached if stop else self.steps, stop,
                                   self.run_dir, self.main, self.told)

    def step(self, i: int) -> None:
        """Step ``i + 1``: its trace window, its batch (the wait timed by the step timer), the
        jitted step; each part of the wall time booked to goodput's clock."""
        done, clock, timer = i + 1, self.clocks.clock, self.clocks.timer
        with clock.span("productive"):  # the earlier steps drain first
            self.trace.before(i, self.metrics)
        with clock.span("data"), timer.data_wait():
            tokens = self.exp.global_batch(next(self.batches))
        with clock.span("compile" if i == self.start else "profile" if self.trace.active
                        else "productive"):
            self.state, self.metrics = self.exp.step(self.state, tokens)
            if i == self.start:  # the compiling step: the timing windows start after it
                jax.block_until_ready(self.metrics)
            self.trace.after(done, self.metrics)
        self.clocks.progress.advance()
        self.reached = done
        timer.stepped(done, self.ckpt.ckpts.cost.totals())

    def after_step(self, done: int) -> None:
        """The hooks whose turn it is build the step's row; every hook sees it complete; a new
        timing window starts after it (evaluation is in none; the next save point is)."""
        due = [hook for hook in self.hooks if hook.due(done, self.steps)]
        if not due:
            return
        info = StepInfo(done, self.state, self.metrics)
        for hook in due:
            hook.on_step(info)
        for hook in self.hooks:
            hook.on_row(done, info.row)
        self.clocks.timer.reset(done, self.ckpt.ckpts.cost.totals())

    def save_point(self, done: int, last: bool = False) -> None:
        """The save point, then step ``done``'s row, if it has one, whatever the save point
        raised (its failure stays the one reported)."""
        try:
            self.ckpt.save_point(done, self.state, last)
        except BaseException:
            _quietly(self.log.write_rows)
            raise
        self.log.write_rows(done)

    def close(self, quiet: bool) -> None:
        """The attempt's end, however it ended: the trace (a run stopped inside it leaves it),
        the rows of the steps that ran, the save in flight, the data's workers, goodput.json
        and the W&B run. Each part runs whatever an earlier one raised: the first error is
        raised at the end (``told``), or with ``quiet`` (the loop's failure is the one
        reported) each is one warning line."""
        error: Exception | None = None
        for part in (self.trace.close, self.log.write_rows, self.ckpt.close,
                     lambda: _stop(self.batches),
                     lambda: self.goodput.write(self.reached), lambda: self.log.close(quiet)):
            if quiet or error is not None:
                _quietly(part)
                continue
            try:
                part()
            except Exception as e:  # noqa: BLE001 - raised below, once the rest has run
                error = e
        if error is not None:
            _quietly(self.log.logger.finish)
            if (told := self.told(error)) is None:
                raise error
            raise told from error

    def told(self, e: Exception, step: int | None = None) -> Exception | None:
        return told(e, step, self.ckpt.ckpts, self.exp, self.run_dir, self.main)


def open_trainer(cfg: RunConfig, run_dir: Path, job: Job, prepared: Decided, started: Start,
                 record: goodput.RunRecord) -> Trainer:
    """The trainer of one attempt and its hooks: the metrics logger, the evaluation, the
    checkpoints, the early stop, the tracer, the step timer, the step's cost and the summary.

    A row holds how long the saves inside its own timing window held the loop
    (perf/checkpoint_block_s): those made since the previous row, the one at that row's step
    included (it runs after that row's window closed). The save after the last step falls in no
    window: summary.json's checkpoint_block_s counts it with the others. A save off the log
    steps (SIGUSR1, the wall clock) adds no row of its own: the rows stay those of an unsaved
    run."""
    exp, run_plan, resume, main = prepared.exp, prepared.plan, prepared.resume, record.write
    state, start, ckpt_meta = started.state, started.step, started.ckpt_meta
    plan, data, steps = exp.plan, exp.data, cfg.train.steps
    facts = RunFacts.measure(cfg, exp, run_plan, state, job)
    in_place = resume is not None and resume.in_place
    continues = in_place or job.continues
    # A fresh start past step 0: parallelism=auto's turns trained the steps before it, in
    # this attempt, on the batches before it.
    trained = start if resume is None else 0
    record.first_step = start - trained  # the restore may have fallen back
    rewound = rewind_metrics(run_dir, start) if continues and main else Rewound([], 0)
    # The W&B run continues as metrics.jsonl reads: what was moved aside out of it, the
    # kept rows it lacks into it.
    logger = MetricsLogger(
        run_dir, cfg.logger, facts.config, name=run_name(cfg, job, plan.global_batch),
        group=job.group, job_type=job.job_type, choices=job.choices, is_main=main,
        resume_id=ckpt_meta.get("wandb_id") if in_place else None,
        kept=rewound.kept if in_place else None)
    eval_every = cfg.train.eval_every if data.has_eval else 0  # no held-out data: no eval/*
    n, capped = data.eval_batches(cfg.eval.batches)
    if capped and eval_every > 0:
        log.warning(capped)
    evaluation = EvalHook(eval_every, exp, exp.held_out(n) if eval_every > 0 else [],
                          record.clock)
    batches = data.train_iterator(cfg.train.overfit_batches)  # debug=overfit: a few, repeated
    started.place(batches, plan.global_batch, trained)
    tokens_before = started.tokens_before(trained, facts.cost.tokens)

    def tokens_at(done: int) -> int:
        return tokens_before + (done - start) * facts.cost.tokens

    ckpts = RunCheckpoints(cfg.checkpoint, cfg.train, run_dir, start, {"config": facts.config},
                           batches, logger, run_plan.cadence, tokens=tokens_at,
                           overrides=job.overrides, resumed=ckpt_meta)
    # A relaunch of a run that stopped early has nothing to train (``plan_resume``); one that
    # fell back to an older checkpoint which had stopped too stops before its first step.
    early = EarlyStopHook(cfg.train.early_stop, ckpts, ckpt_meta)
    clocks = Clocks.open(record.clock, start, steps, main)
    trace = TraceHook.open(cfg.train.profile, exp, start, steps, run_dir, clocks.timer, logger)
    gp = GoodputHook(record, ckpts)
    summary = SummaryHook(rewound.kept, facts, logger, exp.step.compile_time_s,
                          (clocks.timer, ckpts, gp))
    logs = LogHook(cfg.train.log_every, logger, summary.summary, facts, exp.step,
                   run_plan.search_s, tokens_at, clocks, (started.allocator, ckpts, trace, gp))
    evaluation.ending = (logs, early)
    return Trainer(
        exp, state, start, steps, batches, clocks, run_dir, main, cfg.train.debug_nans, trace,
        CheckpointHook(ckpts, record.clock), logs, evaluation, summary, early, gp)


def told(e: Exception, step: int | None, ckpts: RunCheckpoints, exp: Experiment,
         run_dir: Path, main: bool) -> Exception | None:
    """What to raise for ``e``, in one line where its cause is known: a write the disk
    refused (DiskError, naming the checkpoint kept), the device out of memory (OutOfMemory,
    naming where the memory goes, written to the run dir), a NaN under train.debug_nans
    (NonFiniteError, naming ``step``: the step that was running); None: ``e`` as it is."""
    if isinstance(e, (DiskError, fit.OutOfMemory)):
        return None
    if isinstance(e, FloatingPointError) or type(e).__name__ == "InternalFloatingPointError":
        # jax.debug_nans checks each step's outputs as it returns: the step that raised is
        # the one after the last completed (``reached``, which the loop passes).
        at = f" of step {step}" if step is not None else ""
        return halted(ckpts.saver, f"train.debug_nans: a NaN in the outputs{at}",
                      "set train.debug_nans=false train.nan_policy=skip to leave such steps out")
    if (disk := refused(e, ckpts.saver)) is not None:
        return disk
    if fit.is_out_of_memory(e) and main:
        path = fit.write(run_dir, exp.step.compiled, exp.abstract_state(),
                                   exp.plan.platform)
        return fit.OutOfMemory(f"{first_line(e)}; where the memory goes: {path}")
    return None


def _stop(batches: Any) -> None:
    if hasattr(batches, "close"):  # Grain's worker processes end with the run
        batches.close()


def _quietly(part: Any) -> None:
    """``part()`` while a failure is under way: its own error is one warning line, and the
    failure stays the one reported."""
    try:
        part()
    except Exception as e:  # noqa: BLE001
        log.warning("%s: %s (while the run ends on an earlier error)", type(e).__name__,
                    first_line(e))
