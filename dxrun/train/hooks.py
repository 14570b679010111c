"""The trainer's hooks (``dxrun.train.Trainer``): each part of a run the loop calls at its
cadence, Levanter's ``every=N`` style, registered with ``Trainer.add_hook`` as a user's own.
After a step, the hooks whose turn it is (every ``every`` steps and at the last one) add their
part to the step's row (the metrics, the evaluation); once a row is complete every hook sees it
(the summary, a new best checkpoint, the early stop). The save point runs before every step and
the trace around it; each hook closes what it holds when the attempt ends, however it ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.checkpointing import RunCheckpoints
from dxrun.config import first_line
from dxrun.experiment import Experiment
from dxrun.run import write_json
from dxrun.tracking import (
    MetricsLogger,
    Monitor,
    Progress,
    RunSummary,
    StepTimer,
    Tracer,
    goodput,
    plateau,
    profile_dir,
    traced_steps,
)
from dxrun.train.rows import AllocatorPeak, RunFacts, log_row, perplexity

if TYPE_CHECKING:
    from dxrun.config import EarlyStopConfig, ProfileConfig

log = logging.getLogger("dxrun")


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
    """A part of the run, registered with ``Trainer.add_hook(hook, every=N)``: ``on_step``
    after every ``every``-th step and the last (0: never), ``on_row`` with every complete row;
    the loop's other points (the save point, the step, the attempt's end) at every step. Each
    method does nothing unless a hook overrides it."""

    every = 0
    stop_reason: str | None = None  # set: the run ends before its next step (train.early_stop)
    tracing = False  # the step runs inside a trace window: its time is profile, not productive

    def due(self, done: int, last: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == last)

    def on_step(self, info: StepInfo) -> None:
        """Its part of the step's row."""

    def on_row(self, done: int, row: dict[str, Any]) -> None:
        """A row is complete (a log step's, an evaluation's or both)."""

    def save_point(self, done: int, state: Any, last: bool) -> None:
        """Before every step and after the last (``last``), with the steps ``done``."""

    def saved(self, done: int | None) -> None:
        """After every hook's save point (None: one of them failed)."""

    def before_step(self, i: int, metrics: Any) -> None:
        """Before step ``i + 1`` (``metrics``: the step before's, still on the device)."""

    def after_step(self, done: int, metrics: Any) -> None:
        """Once step ``done`` was dispatched, inside its span of goodput's clock."""

    def close(self, reached: int, quiet: bool) -> None:
        """The attempt ended at step ``reached``, however it ended (``quiet``: on a failure,
        which stays the one reported)."""


class FnHook(Hook):
    """A function called with the step's ``StepInfo`` at its cadence (``Trainer.add_hook``)."""

    def __init__(self, fn: Callable[[StepInfo], Any], every: int):
        self.fn, self.every = fn, every

    def on_step(self, info: StepInfo) -> None:
        self.fn(info)


class Hooks:
    """The trainer's hooks in the order they were added (Levanter's ``TrainerHooks``), and the
    loop's points each is called at: after a step each hook whose turn it is builds its part of
    the row in turn, then every hook sees the complete row."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def add(self, fn: Hook | Callable[[StepInfo], Any] | None = None, *, every: int = 1) -> Any:
        """Call ``fn`` after every ``every``-th step and the last (0: only at the loop's other
        points): a function gets the step's ``StepInfo`` (its row holds the parts of the hooks
        added before it); a ``Hook`` gets every call of the loop. Without ``fn``: a
        decorator."""
        if fn is None:
            return lambda f: self.add(f, every=every)
        hook = fn if isinstance(fn, Hook) else FnHook(fn, every)
        hook.every = every
        self.hooks.append(hook)
        return fn

    @property
    def stop_reason(self) -> str | None:
        """Why the run ends before its next step (a hook's: train.early_stop), or None."""
        return next((h.stop_reason for h in self.hooks if h.stop_reason), None)

    @property
    def tracing(self) -> bool:
        return any(h.tracing for h in self.hooks)

    def before_step(self, i: int, metrics: Any) -> None:
        for hook in self.hooks:
            hook.before_step(i, metrics)

    def after_step(self, done: int, metrics: Any) -> None:
        for hook in self.hooks:
            hook.after_step(done, metrics)

    def row(self, info: StepInfo, last: int) -> bool:
        """The parts of ``info``'s row from the hooks whose turn it is, then every hook sees the
        row; False where no hook's turn came or the row holds nothing (it is no row)."""
        due = [hook for hook in self.hooks if hook.due(info.done, last)]
        for hook in due:
            hook.on_step(info)
        if not info.row:
            return False
        for hook in self.hooks:
            hook.on_row(info.done, info.row)
        return True

    def save_point(self, done: int, state: Any, last: bool) -> None:
        """Every hook's save point, then what waited for it (step ``done``'s row), whatever
        the save point raised (its failure stays the one reported)."""
        try:
            for hook in self.hooks:
                hook.save_point(done, state, last)
        except BaseException:
            for hook in self.hooks:
                quietly(lambda hook=hook: hook.saved(None))
            raise
        for hook in self.hooks:
            hook.saved(done)

    def closing(self, reached: int, quiet: bool) -> list[Callable[[], None]]:
        """Each hook's close, in turn."""
        return [lambda hook=hook: hook.close(reached, quiet) for hook in self.hooks]


def quietly(part: Callable[[], Any]) -> None:
    """``part()`` while a failure is under way: its own error is one warning line, and the
    failure stays the one reported."""
    try:
        part()
    except Exception as e:  # noqa: BLE001
        log.warning("%s: %s (while the run ends on an earlier error)", type(e).__name__,
                    first_line(e))


class GoodputHook(Hook):
    """``goodput.json``: the attempt's wall time by part, written before any row (an attempt
    killed outright keeps what it had) and when the attempt ends (``goodput.RunRecord``)."""

    def __init__(self, record: goodput.RunRecord, ckpts: RunCheckpoints, logger: MetricsLogger):
        self.record, self.ckpts, self.logger = record, ckpts, logger

    def write(self, last_step: int) -> None:
        self.record.update(last_step, self.ckpts.cost.saves, self.ckpts.cost.block_total_s)

    def behind(self) -> bool:
        """A save since the last write (a save off the log steps is accounted for too)."""
        return self.ckpts.cost.saves != self.record.attempt["checkpoint_saves"]

    def lines(self) -> list[str]:
        return goodput.lines(self.record.attempt, self.record.total)

    def close(self, reached: int, quiet: bool) -> None:
        """goodput.json at the attempt's end, and its goodput into the W&B summary; with
        ``quiet`` (the loop failed) the logger ends here, else once it had the run's summary
        (``SummaryHook.finish``)."""
        self.write(reached)
        record = self.record
        self.logger.summary({"goodput": record.total["goodput"],
                             **{f"goodput/{k}": v for k, v in record.attempt.items()
                                if not k.startswith("checkpoint_")}})
        if quiet:
            self.logger.finish()


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
    def tracing(self) -> bool:
        return self.tracer.active

    def before_step(self, i: int, metrics: Any) -> None:
        """Before step ``i + 1`` (``metrics``: the step before's, drained first)."""
        if self.tracer.before(i + 1, metrics):
            self.timer.pause(i)

    def after_step(self, done: int, metrics: Any) -> None:
        if self.tracer.after(done, metrics):
            self.timer.resume(done)
            self.logger.upload(self.tracer.where, "profile", "profile")

    def close(self, reached: int, quiet: bool) -> None:
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

    def close(self, reached: int, quiet: bool) -> None:
        with self.clock.span("checkpoint"):
            self.ckpts.close()  # waits for a save in flight


class EvalHook(Hook):
    """Every ``train.eval_every`` steps and at the last: the held-out loss of the same
    ``eval.batches`` (none without held-out data). Its row off the log steps may end the run
    (train.early_stop; ``ending``: the log and early-stop hooks): the log's part is then built
    first, as at a log step (its window before the evaluation), and kept if the row ends the
    run, whose last row holds train/* as a normal end's does."""

    def __init__(self, exp: Experiment, batches: list[jax.Array], clock: goodput.Goodput):
        self.exp, self.batches, self.clock = exp, batches, clock
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
    only wait on the device) into its row (``rows.py``: the window's timing, the
    first row's one-off numbers, ``first``; mem/*). A complete row
    holds the saves inside its window (perf/checkpoint_block_s: those since the row before, the
    one at its step included) and waits for its step's save point (``write_rows``)."""

    def __init__(self, logger: MetricsLogger, summary: RunSummary, facts: RunFacts,
                 first: Callable[[], dict[str, Any]], tokens_at: Callable[[int], int],
                 clocks: Clocks, parts: tuple[AllocatorPeak, RunCheckpoints, TraceHook,
                                              GoodputHook]):
        # ``first``: the run's one-off numbers (``rows.first_row``), asked for on its first row
        self.logger, self.summary, self.facts, self.first = logger, summary, facts, first
        self.tokens_at, self.clocks = tokens_at, clocks
        self.allocator, self.ckpts, self.trace, self.goodput = parts
        self.pending: list[tuple[int, dict[str, Any]]] = []

    def on_step(self, info: StepInfo) -> None:
        clock, facts = self.clocks.clock, self.facts
        with clock.span("profile" if self.trace.tracing else "productive"):
            fetched = jax.device_get(info.metrics)  # waits for the device
        t_log = clock.clock()
        window = self.clocks.timer.measure(info.done)
        first = None if self.summary.logged else self.first()
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

    def saved(self, done: int | None) -> None:
        self.write_rows(done)

    def close(self, reached: int, quiet: bool) -> None:
        self.write_rows()  # the rows of the steps that ran


class SummaryHook(Hook):
    """``summary.json`` (``tracking/summary.py``): the last value of every logged metric
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
