"""The trainer: one object owns an attempt's train state and its step and calls its hooks
(``dxrun.train.hooks``, registered with ``add_hook``) at their cadence; the run's outputs:
plan.json, metrics.jsonl, summary.json, the W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
Step time is measured from device-ready to device-ready over the window between two log
steps; the first (compiling) step is never in a window.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.checkpointing import RunCheckpoints, halted, refused
from dxrun.config import DiskError, first_line
from dxrun.experiment import Experiment
from dxrun.fit import Decided, OutOfMemory, is_out_of_memory, write_breakdown
from dxrun.run import Job, is_main, run_name
from dxrun.tracking import MetricsLogger, Rewound, goodput, rewind_metrics
from dxrun.train.hooks import (
    CheckpointHook,
    Clocks,
    EarlyStopHook,
    EvalHook,
    GoodputHook,
    Hook,
    Hooks,
    LogHook,
    StepInfo,
    SummaryHook,
    TraceHook,
    quietly,
)
from dxrun.train.rows import RunFacts, first_row
from dxrun.train.start import Start, prepare, show_plan, start_state

if TYPE_CHECKING:
    from dxrun.config import RunConfig

log = logging.getLogger("dxrun")


def train(cfg: Any, run_dir: Path, job: Job | None = None,
          prepared: Decided | None = None) -> dict[str, Any]:
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary. The run
    follows ``cfg`` and ``prepared.plan`` (``prepare``'s; None: ``prepare(cfg, run_dir)``):
    the startup on goodput's clock (``open_run``), then the ``Trainer``'s loop."""
    return open_run(cfg, run_dir, job, prepared).train()


def open_run(cfg: RunConfig, run_dir: Path, job: Job | None = None,
             prepared: Decided | None = None) -> Trainer:
    """The run's startup on goodput's clock, up to a ``Trainer`` with its built-in hooks
    registered: a caller may add its own (``Trainer.add_hook``) before ``train()``."""
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
    record.update(started.step)  # the startup on record: a kill before the first row
    return trainer


@dataclass
class Trainer:
    """One attempt of a run (a fresh start or a resume): it owns the train state and the step
    and calls its hooks (``add_hook``). ``train()`` is the loop, a schedule: before each step
    its save point, the step (its trace, its batch), then the hooks whose turn it is; each hook
    closes what it holds however the loop ended, and the summary is written."""

    exp: Experiment
    state: Any  # the TrainState
    start: int  # the steps done before this attempt
    steps: int  # train.steps
    batches: Any  # the training data
    clocks: Clocks
    ckpts: RunCheckpoints
    summary: SummaryHook  # the run's result (``train()``'s), a hook as the others
    run_dir: Path
    main: bool  # the process that writes the run's files
    debug_nans: bool
    hooks: Hooks = field(default_factory=Hooks)

    def __post_init__(self) -> None:
        self.reached, self.metrics = self.start, None  # the last step done and its metrics

    def add_hook(self, fn: Hook | Callable[[StepInfo], Any] | None = None, *,
                 every: int = 1) -> Any:
        """Levanter's ``add_hook``: call ``fn`` after every ``every``-th step and the last
        (``Hooks.add``; without ``fn``, a decorator)."""
        return self.hooks.add(fn, every=every)

    def train(self) -> dict[str, Any]:
        """The loop; the summary."""
        ended = False  # the loop's own end: only then are close()'s errors the ones reported
        # train.debug_nans (debug=nans): a NaN in a step's outputs raises at that step.
        nans = jax.debug_nans(True) if self.debug_nans else contextlib.nullcontext()
        try:
            with self.clocks.progress, self.ckpts.preemption, nans:
                for i in range(self.start, self.steps):
                    if self.hooks.stop_reason:  # train.early_stop: a plateau ends it here
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
        stop = self.hooks.stop_reason
        return self.summary.finish(self.reached, self.reached if stop else self.steps, stop,
                                   self.run_dir, self.main, self.told)

    def step(self, i: int) -> None:
        """Step ``i + 1``: its trace window, its batch (the wait timed by the step timer), the
        jitted step; each part of the wall time booked to goodput's clock."""
        done, clock, timer = i + 1, self.clocks.clock, self.clocks.timer
        with clock.span("productive"):  # the earlier steps drain first
            self.hooks.before_step(i, self.metrics)
        with clock.span("data"), timer.data_wait():
            tokens = self.exp.global_batch(next(self.batches))
        traced = self.hooks.tracing
        with clock.span("compile" if i == self.start else "profile" if traced else "productive"):
            self.state, self.metrics = self.exp.step(self.state, tokens)
            if i == self.start:  # the compiling step: the timing windows start after it
                jax.block_until_ready(self.metrics)
            self.hooks.after_step(done, self.metrics)
        self.clocks.progress.advance()
        self.reached = done
        timer.stepped(done, self.ckpts.cost.totals())

    def after_step(self, done: int) -> None:
        """The step's row from the hooks whose turn it is (a row that holds nothing is no row);
        a new timing window starts after it (evaluation is in none; the next save point is)."""
        if self.hooks.row(StepInfo(done, self.state, self.metrics), self.steps):
            self.clocks.timer.reset(done, self.ckpts.cost.totals())

    def save_point(self, done: int, last: bool = False) -> None:
        self.hooks.save_point(done, self.state, last)

    def close(self, quiet: bool) -> None:
        """The attempt's end, however it ended: each hook's close in turn (the trace, a run
        stopped inside it leaves; the rows of the steps that ran; the save in flight;
        goodput.json and the W&B run), then the data's workers. Each part runs whatever an
        earlier one raised: the first error is raised at the end (``told``), or with ``quiet``
        (the loop's failure is the one reported) each is one warning line."""
        error: Exception | None = None
        for part in (*self.hooks.closing(self.reached, quiet), lambda: _stop(self.batches)):
            if quiet or error is not None:
                quietly(part)
                continue
            try:
                part()
            except Exception as e:  # noqa: BLE001 - raised below, once the rest has run
                error = e
        if error is not None:
            quietly(self.summary.logger.finish)
            if (told := self.told(error)) is None:
                raise error
            raise told from error

    def told(self, e: Exception, step: int | None = None) -> Exception | None:
        return told(e, step, self.ckpts, self.exp, self.run_dir, self.main)


def open_trainer(cfg: RunConfig, run_dir: Path, job: Job, prepared: Decided, started: Start,
                 record: goodput.RunRecord) -> Trainer:
    """The trainer of one attempt with its built-in hooks added, in the order they build a
    row: the tracer, the metrics (with the step timer and the step's cost), the evaluation,
    the summary, the checkpoints, the early stop, goodput.

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
    evaluation = EvalHook(exp, exp.held_out(n) if eval_every > 0 else [], record.clock)
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
    gp = GoodputHook(record, ckpts, logger)
    summary = SummaryHook(rewound.kept, facts, logger, exp.step.compile_time_s,
                          (clocks.timer, ckpts, gp))
    step = exp.step

    def first() -> dict[str, Any]:  # the compiled step's, and the layout search's time
        return first_row(step.compile_time_s, run_plan.search_s, step.memory_bytes())

    logs = LogHook(logger, summary.summary, facts, first, tokens_at, clocks,
                   (started.allocator, ckpts, trace, gp))
    evaluation.ending = (logs, early)
    trainer = Trainer(exp, state, start, steps, batches, clocks, ckpts, summary, run_dir, main,
                      cfg.train.debug_nans)
    for hook, every in ((trace, 0), (logs, cfg.train.log_every), (evaluation, eval_every),
                        (summary, 0), (CheckpointHook(ckpts, record.clock), 0), (early, 0),
                        (gp, 0)):
        trainer.add_hook(hook, every=every)
    return trainer


def told(e: Exception, step: int | None, ckpts: RunCheckpoints, exp: Experiment,
         run_dir: Path, main: bool) -> Exception | None:
    """What to raise for ``e``, in one line where its cause is known: a write the disk
    refused (DiskError, naming the checkpoint kept), the device out of memory (OutOfMemory,
    naming where the memory goes, written to the run dir), a NaN under train.debug_nans
    (NonFiniteError, naming ``step``: the step that was running); None: ``e`` as it is."""
    if isinstance(e, (DiskError, OutOfMemory)):
        return None
    if isinstance(e, FloatingPointError) or type(e).__name__ == "InternalFloatingPointError":
        # jax.debug_nans checks each step's outputs as it returns: the step that raised is
        # the one after the last completed (``reached``, which the loop passes).
        at = f" of step {step}" if step is not None else ""
        return halted(ckpts.saver, f"train.debug_nans: a NaN in the outputs{at}",
                      "set train.debug_nans=false train.nan_policy=skip to leave such steps out")
    if (disk := refused(e, ckpts.saver)) is not None:
        return disk
    if is_out_of_memory(e) and main:
        path = write_breakdown(run_dir, exp.step.compiled, exp.abstract_state(),
                               exp.plan.platform)
        return OutOfMemory(f"{first_line(e)}; where the memory goes: {path}")
    return None


def _stop(batches: Any) -> None:
    if hasattr(batches, "close"):  # Grain's worker processes end with the run
        batches.close()
