"""One attempt of a run (a fresh start or a resume): what it opens around the train loop (the
metrics logger, the checkpoints, the tracer, the step timer, the step's cost, the summary) and
the loop's points that use them."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.autotune import memory_report
from dxrun.autotune.peak import resolve_peak
from dxrun.checkpointing.cadence import cadence_text
from dxrun.checkpointing.preempt import Preemption
from dxrun.checkpointing.resume import Resume, data_position, tokens_seen
from dxrun.checkpointing.saving import RunCheckpoints
from dxrun.checkpointing.store import refused_write
from dxrun.data import EVAL
from dxrun.data.repeated import Repeated
from dxrun.errors import DiskError, disk_error, first_line
from dxrun.experiment import Experiment
from dxrun.job import Job, describe_model, run_name
from dxrun.plan import flops
from dxrun.plan.ranking import own_s
from dxrun.plan.run_plan import RunPlan, saved_config
from dxrun.run_dir import relaunch_command
from dxrun.runtime import AllocatorPeak, write_json
from dxrun.trace import Tracer, profile_dir, traced_steps
from dxrun.tracking import goodput
from dxrun.tracking.console import Progress
from dxrun.tracking.logger import MetricsLogger, Rewound, rewind_metrics
from dxrun.tracking.metrics_row import StepCost, first_row, log_row, perplexity
from dxrun.tracking.monitor import Monitor, plateau
from dxrun.tracking.run_summary import RunSummary
from dxrun.tracking.step_timer import StepTimer

if TYPE_CHECKING:
    from dxrun.schema import RunConfig

log = logging.getLogger("dxrun")


def evaluate(exp: Experiment, params: dict, batches: Iterable[jax.Array]) -> dict[str, float]:
    """Mean held-out loss and accuracy over ``batches``: in training the same ``eval.batches``
    every time (a list); ``dxrun.evaluate`` passes a generator, so that a whole split is never
    on the devices at once. A batch's index seeds masked diffusion's noise (``dxrun.mdlm``)."""
    results = [exp.eval_step(params, b, k) for k, b in enumerate(batches)]
    loss = sum(float(r["eval/loss"]) for r in results) / len(results)
    acc = sum(float(r["eval/accuracy"]) for r in results) / len(results)
    return {"eval/loss": loss, "eval/ppl": perplexity(loss), "eval/accuracy": acc}


class Attempt:
    """What one attempt of a run (a fresh start or a resume) opens around its loop: the metrics
    logger, the checkpoints, the tracer, the step timer, the step's cost and the summary; and
    the loop's points that use them.

    A row holds how long the saves inside its own timing window held the loop
    (perf/checkpoint_block_s): those made since the previous row, the one at that row's step
    included (it runs after that row's window closed). The save after the last step falls in no
    window: summary.json's checkpoint_block_s counts it with the others. A save off the log
    steps (SIGUSR1, the wall clock) adds no row of its own: the rows stay those of an unsaved
    run. A step's row is written after the save point that follows the step (a halt or a stop
    there still writes it)."""

    def __init__(self, cfg: RunConfig, exp: Experiment, run_plan: RunPlan, state: Any, start: int,
                 resume: Resume | None, ckpt_meta: dict[str, Any], run_dir: Path, job: Job,
                 record: goodput.RunRecord, allocator: AllocatorPeak, main: bool):
        self.exp, self.allocator, self.main = exp, allocator, main
        self.search = run_plan.search  # parallelism=auto's record: its seconds in the first row
        self.record, self.clock = record, record.clock
        self.run_dir, self.steps = run_dir, cfg.train.steps
        plan, data = exp.plan, exp.data
        self.n_params = exp.count_params(state.params)  # the real vocabulary, without padding
        self.floor = data.entropy_floor
        log.info("model %s: %s parameters; data %s: %s", describe_model(cfg.model, job),
                 f"{self.n_params:,}", cfg.data._target_ or cfg.data.name, data.description)
        if cfg.model._target_:  # dxrun.user_model: what a user model's run does differently
            log.info("model._target_=%s: unchunked loss (model.loss_chunk=0), computed in its "
                     "parameters' dtype; 6 FLOPs per parameter per token", cfg.model._target_)
        else:
            log.info("attention kernel: %s", exp.attention_kernel)  # attention_kernel.KERNELS
        self.device_kind = jax.devices()[0].device_kind
        peak = resolve_peak(cfg.runtime, cfg.train, self.device_kind, exp.mesh.devices.flat)
        tokens_per_step = plan.global_batch * plan.seq_len
        self.cost = StepCost(tokens_per_step, flops.flops_per_token(
            cfg.model, self.n_params, plan.seq_len) * tokens_per_step, plan.n_devices, peak)
        run_config = {  # the W&B config and each checkpoint's: the derived numbers written once
            **saved_config(cfg, run_plan, job_type=job.job_type, group=job.group),
            "choices": job.choices,
            "plan": run_plan.to_json(),
            "n_params": self.n_params,
            "flops_per_token": self.cost.flops / self.cost.tokens,
            "jax": {"version": jax.__version__, "device_kind": self.device_kind,
                    "device_count": jax.device_count(), "process_count": jax.process_count()},
        }
        in_place = resume is not None and resume.in_place
        continues = in_place or job.continues
        # A fresh start past step 0: parallelism=auto's turns trained the steps before it, in
        # this attempt, on the batches before it.
        self.trained = start if resume is None else 0
        record.first_step = start - self.trained  # the restore may have fallen back
        rewound = rewind_metrics(run_dir, start) if continues and main else Rewound([], 0)
        # The W&B run continues as metrics.jsonl reads: what was moved aside out of it, the
        # kept rows it lacks into it.
        self.logger = MetricsLogger(
            run_dir, cfg.logger, run_config, name=run_name(cfg, job, plan.global_batch),
            group=job.group, job_type=job.job_type, choices=job.choices, is_main=main,
            resume_id=ckpt_meta.get("wandb_id") if in_place else None,
            kept=rewound.kept if in_place else None)
        # No held-out data: no eval/*.
        self.eval_every = cfg.train.eval_every if data.has_eval else 0
        n, capped = data.eval_batches(cfg.eval.batches)
        if capped and self.eval_every > 0:
            log.warning(capped)
        self.eval_batches = [exp.batch(k, EVAL) for k in range(n)] if self.eval_every > 0 else []
        self.summary = RunSummary(rewound.kept)  # a resume's kept rows count as logged
        self.batches = data.train_iterator()
        if cfg.train.overfit_batches:  # debug=overfit: the same few batches, over and over
            self.batches = Repeated(self.batches, cfg.train.overfit_batches)
        if ckpt_meta:
            self.batches.set_state(data_position(ckpt_meta, plan.global_batch))
        elif self.trained:
            (key,) = self.batches.get_state()  # the batches read: "step" or "next_index"
            self.batches.set_state({key: self.trained})
        # Tokens actually read: the checkpoint's count, then this attempt's batches (a resume
        # may have changed the batch size).
        self.tokens_before = (tokens_seen(ckpt_meta, start) if ckpt_meta
                              else self.trained * tokens_per_step)
        self.start = start
        cadence = run_plan.cadence  # checkpoint.every=null: decided by platform and state
        log.info("checkpoints: %s", cadence_text(*cadence))
        self.ckpts = RunCheckpoints(cfg.checkpoint, cfg.train, run_dir, start,
                                    {"config": run_config}, self.batches, self.logger,
                                    Preemption(), cadence, tokens=self.tokens_at,
                                    relaunch=relaunch_command(job.overrides, run_dir),
                                    resumed=ckpt_meta)
        # train.early_stop: its monitor travels in each checkpoint's meta (``ckpts.watch``).
        # A relaunch of a run that stopped so has nothing to train (``plan_resume``); one that
        # fell back to an older checkpoint which had stopped too stops before its first step.
        es = cfg.train.early_stop
        self.patience, self.stop_reason = es.patience, None
        if es.monitor:
            self.ckpts.watch["early_stop"] = Monitor.from_json(
                ckpt_meta.get("early_stop"), es.monitor, es.mode, es.min_delta)
            self._check_plateau()
        self.reached = start
        self.pending: list[tuple[int, dict[str, Any]]] = []  # rows before their save point
        rank, procs = jax.process_index(), jax.process_count()
        self.tracer = Tracer(
            traced_steps(cfg.train.profile.start, cfg.train.profile.steps, start, self.steps),
            profile_dir(run_dir, rank, procs), run_dir,
            exp.step.compiled.as_text() if exp.step.compiled is not None else None)
        if cfg.train.profile.start and not self.tracer.steps:
            log.warning("train.profile.start=%d is past this attempt's steps %d-%d: no trace",
                        cfg.train.profile.start, start + 2, self.steps)
        self.timer = StepTimer(start, self.steps)

    def tokens_at(self, done: int) -> int:
        return self.tokens_before + (done - self.start) * self.cost.tokens

    def write_rows(self, done: int | None = None) -> None:
        """The rows waiting for their save point (``done``: that save point's step), after
        the attempt so far (a row logged is a row accounted for, and so is a save off the log
        steps)."""
        with self.clock.span("logging"):
            last = self.pending[-1][0] if self.pending else done
            if last is not None and (self.pending or self.ckpts.saves != self.record.attempt[
                    "checkpoint_saves"]):
                self.write_goodput(last)
            for step, row in self.pending:
                self.logger.log(step, row)
            self.pending.clear()

    def write_goodput(self, last_step: int) -> None:
        """``goodput.json`` with this attempt up to ``last_step`` (``goodput.RunRecord``)."""
        self.record.update(last_step, self.ckpts.saves, self.ckpts.block_total_s)

    def save_point(self, done: int, state: Any, last: bool = False) -> None:
        """Save when due, stop on a signal (``RunCheckpoints.between_steps``), then write the
        row of step ``done``, if it has one, whatever that raised (the save's failure stays
        the one reported)."""
        try:
            with self.clock.span("checkpoint"):
                self.ckpts.between_steps(done, state, last=last)
        except BaseException:
            _quietly(self.write_rows)
            raise
        self.write_rows(done)

    def log_point(self, done: int, state: Any, metrics: Any, is_eval: bool,
                  progress: Progress) -> None:
        """Step ``done``'s row: its ``metrics`` (None: not a log step) and its evaluation,
        queued for its save point, and its progress line. A new timing window starts after."""
        clock, exp = self.clock, self.exp
        row: dict[str, Any] = {}
        if metrics is not None:
            with clock.span("profile" if self.tracer.active else "productive"):
                fetched = jax.device_get(metrics)  # waits for the device
            t_log = clock.clock()
            window = self.timer.measure(done)
            search = self.search
            first = None if self.summary.logged else first_row(
                exp.step.compile_time_s, own_s(search) if search else None,
                exp.step.memory_bytes())
            # mem/peak_bytes_per_device: every row on an accelerator (CPU keeps no statistics).
            row = log_row(fetched, window, self.cost, first, self.allocator.peak_since_start(),
                          self.tokens_at(done), self.floor)
            clock.add("logging", clock.clock() - t_log)
        if is_eval:
            with clock.span("eval"):
                row.update(evaluate(exp, state.params, self.eval_batches))
        # The saves since the last row (the one made at that row's step included) held the
        # loop inside this row's window: a row's tokens/s and its save time are one window's.
        # The save after the last step has no window: summary.json's total counts it.
        if blocks := self.ckpts.take_blocks():
            row["perf/checkpoint_block_s"] = sum(blocks)
        with clock.span("logging"):
            self.pending.append((done, row))  # written after this step's save point
            # A save inside the window slows its tokens/s: the line says so.
            progress.update(done, row, self.timer.note(self.ckpts.totals(),
                                                       "perf/tokens_per_s" in row))
        self.summary.add(row)
        self.ckpts.observe(done, row)  # a new best of checkpoint.keep_best: saved at this step
        if "early_stop" in self.ckpts.watch:
            self.ckpts.watch["early_stop"].see(done, row)
            self._check_plateau()
        # Evaluation is not part of the next timing window (the next save point is: a save
        # holds the loop).
        self.timer.reset(done, self.ckpts.totals())

    def _check_plateau(self) -> None:
        """``stop_reason`` once train.early_stop's metric has not improved for its patience."""
        if self.stop_reason is None and (
                why := plateau(self.ckpts.watch["early_stop"], self.patience)):
            self.stop_reason = why
            log.info("%s", self.stop_reason)

    def told(self, e: Exception, step: int | None = None) -> Exception | None:
        """What to raise for ``e``, in one line where its cause is known: a write the disk
        refused (DiskError, naming the checkpoint kept), the device out of memory (OutOfMemory,
        naming where the memory goes, written to the run dir), a NaN under train.debug_nans
        (NonFiniteError, naming ``step``: the step that was running); None: ``e`` as it is."""
        if isinstance(e, (DiskError, memory_report.OutOfMemory)):
            return None
        if isinstance(e, FloatingPointError) or type(e).__name__ == "InternalFloatingPointError":
            # jax.debug_nans checks each step's outputs as it returns: the step that raised is
            # the one after the last completed (``reached``, which the loop passes).
            at = f" of step {step}" if step is not None else ""
            return self.ckpts.halted(f"train.debug_nans: a NaN in the outputs{at}",
                                     "set train.debug_nans=false train.nan_policy=skip to "
                                     "leave such steps out")
        if (why := disk_error(e)) is not None:
            return refused_write(_written(e), why, self.ckpts.saver.directory)
        if memory_report.is_out_of_memory(e) and self.main:
            path = memory_report.write(self.run_dir, self.exp.step.compiled,
                                       self.exp.abstract_state(), self.exp.plan.platform)
            return memory_report.OutOfMemory(f"{first_line(e)}; where the memory goes: {path}")
        return None

    def close(self, reached: int, quiet: bool = False) -> None:
        """The end of the attempt, however it ended: the trace, the rows of the steps that ran,
        the save in flight, the data's workers, the attempt's goodput and the W&B run. Each
        part runs whatever an earlier one raised; the first error is raised at the end
        (``told``), or with ``quiet`` (the loop failed: its failure is the one reported) each
        is one warning line."""
        self.reached = reached

        def stop_batches() -> None:
            if hasattr(self.batches, "close"):  # Grain's worker processes end with the run
                self.batches.close()

        def wait_for_saves() -> None:
            with self.clock.span("checkpoint"):
                self.ckpts.close()  # waits for a save in flight

        def end_logger() -> None:
            attempt = self.record.attempt
            self.logger.summary({"goodput": self.record.total["goodput"],
                                 **{f"goodput/{k}": v for k, v in attempt.items()
                                    if not k.startswith("checkpoint_")}})
            if quiet:  # else ``finish`` closes the logger, once it had the run's summary
                self.logger.finish()

        error: Exception | None = None
        # The trace first (a run stopped inside it still leaves it), then the rows of the
        # steps that ran (a crash mid-loop).
        for part in (self.tracer.stop, self.write_rows, wait_for_saves, stop_batches,
                     lambda: self.write_goodput(reached), end_logger):
            if quiet or error is not None:
                _quietly(part)
                continue
            try:
                part()
            except Exception as e:  # noqa: BLE001 - raised below, once the rest has run
                error = e
        if error is not None:
            _quietly(self.logger.finish)
            if (told := self.told(error)) is None:
                raise error
            raise told from error

    def finish(self) -> dict[str, Any]:
        """``summary.json`` and the closing lines; the summary."""
        summary = self.summary.record(
            steps=self.reached if self.stop_reason else self.steps, n_params=self.n_params,
            flops_per_token=self.cost.flops / self.cost.tokens,
            loop_tokens_per_s=self.timer.loop_tokens_per_s(self.cost.tokens, self.reached),
            compile_time_s=self.exp.step.compile_time_s, entropy_floor=self.floor,
            device_kind=self.device_kind, peak_tflops=self.cost.peak_tflops,
            checkpoint_saves=int(self.record.over_attempts("checkpoint_saves")),
            checkpoint_block_s=self.record.over_attempts("checkpoint_block_s"),
            goodput_total=self.record.total, attempt=self.record.attempt)
        if (best := self.ckpts.best()) is not None:
            summary["best_checkpoint"] = best
        if self.stop_reason:
            summary["early_stop"] = self.stop_reason
        if self.main:
            try:
                write_json(self.run_dir / "summary.json", summary)
            except OSError as e:
                if (told := self.told(e)) is None:
                    raise
                raise told from e
            finally:
                self.logger.summary(summary)  # every backend gets the run's summary
                self.logger.finish()
        last, floor = self.summary.last, self.floor
        log.info("done: loss %.4f%s; outputs in %s", last.get("train/loss", float("nan")),
                 f" (floor {floor:.4f})" if floor is not None else "", self.run_dir)
        for line in goodput.lines(self.record.attempt, self.record.total):
            log.info(line)
        return summary


def _quietly(part: Any) -> None:
    """``part()`` while a failure is under way: its own error is one warning line, and the
    failure stays the one reported."""
    try:
        part()
    except Exception as e:  # noqa: BLE001
        log.warning("%s: %s (while the run ends on an earlier error)", type(e).__name__,
                    first_line(e))


def _written(e: BaseException) -> str:
    """The file a refused write was writing (an OSError's filename), for its one line."""
    while e is not None:
        if isinstance(e, OSError) and e.filename:
            return str(e.filename).removesuffix(".tmp")  # write_json's tmp file: its target
        e = e.__cause__ or e.__context__
    return "a run file"
