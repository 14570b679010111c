"""The train loop and the run's outputs: plan.json, metrics.jsonl, summary.json, W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
Step time is measured from device-ready to device-ready over the window between two log
steps; the first (compiling) step is never in a window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import jax

from dxrun.batch import saved_config
from dxrun.capacity import flops, layout_search, memory_report, plan_mode
from dxrun.capacity.preflight import memory_preflight
from dxrun.checkpointing.preempt import Preemption
from dxrun.checkpointing.resume import (
    Resume,
    data_position,
    find_resume,
    plan_resume,
    restore,
    tokens_seen,
)
from dxrun.checkpointing.saving import RunCheckpoints
from dxrun.checkpointing.store import refused_write
from dxrun.config import model_changes
from dxrun.data import EVAL
from dxrun.errors import UNFINISHED, ConfigError, DiskError, disk_error, first_line
from dxrun.experiment import Experiment, process_data, visible_devices
from dxrun.multihost.distributed import is_main
from dxrun.plan import MeshPlan, make_plan
from dxrun.run_dir import read_status, relaunch_command
from dxrun.runtime import AllocatorPeak, dir_refusal, write_json
from dxrun.trace import Tracer, profile_dir, traced_steps
from dxrun.tracking import goodput
from dxrun.tracking.console import Progress
from dxrun.tracking.logger import MetricsLogger, Rewound, read_metrics, rewind_metrics
from dxrun.tracking.metrics_row import StepCost, first_row, log_row, perplexity
from dxrun.tracking.run_summary import RunSummary
from dxrun.tracking.step_timer import StepTimer

log = logging.getLogger("dxrun")


@dataclass
class Job:
    """Where a run sits among others: Hydra's group choices, the command-line overrides, and
    the W&B group (the experiment or multirun sweep)."""

    choices: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    group: str | None = None
    started: float | None = None  # epoch seconds the job began (goodput's startup); None = now
    # The run dir holds earlier attempts of this run (a relaunch continues them, with or without
    # a checkpoint): their rows after this attempt's start move aside, their goodput is kept.
    continues: bool = False


MAX_NAME = 120


def _model_label(cfg: Any, job: Job) -> str:
    """The preset's name, or the user's own (``model.name=...``) for a custom size."""
    named = any(ov.lstrip("+~").startswith("model.name=") for ov in job.overrides)
    return cfg.model.name if named else job.choices.get("model", cfg.model.name)


def run_name(cfg: Any, job: Job, global_batch: int | None = None) -> str:
    """``tiny-dp4_tp2-bs64`` plus the key overrides, e.g. ``-lr0.01``. No slashes: a path
    value is its last component (``data.path=data/mycorpus`` gives ``pathmycorpus``), and a
    long name is cut between parts, never inside one. ``global_batch``: the plan's (None:
    ``data.batch_size``)."""
    batch = cfg.data.batch_size if global_batch is None else global_batch
    parts = [_model_label(cfg, job), job.choices.get("parallelism", cfg.parallelism.name),
             f"bs{batch}"]
    for ov in job.overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if "." in key and key not in ("data.batch_size", "model.name") and not key.startswith(
                ("logger.", "hydra", "runtime.", "distributed.", "run.")):
            value = (Path(value.rstrip("/")).name or value) if "/" in value else value
            parts.append(f"{key.rsplit('.', 1)[1]}{value}".replace("/", "_"))
    name = parts[0][:MAX_NAME]
    for part in parts[1:]:
        if len(name) + 1 + len(part) > MAX_NAME:
            break
        name += f"-{part}"
    return name


def describe_model(cfg: Any, job: Job) -> str:
    """``tiny``, or ``tiny (modified: n_layers=4, d_model=256)`` when keys differ from the
    preset, or ``mine (tiny modified: ...)`` for a size the user named."""
    preset = job.choices.get("model", cfg.model.name)
    label = _model_label(cfg, job)
    changes = model_changes(cfg.model, preset)
    if not changes:
        return label
    base = "" if label == preset else f"{preset} "
    return f"{label} ({base}modified: {', '.join(changes)})"


def resolve_peak(cfg: Any, device_kind: str, devices: Any = None) -> float | None:
    """Peak TFLOP/s per device: ``runtime.peak_tflops`` (a number or ``measure``: probed on
    all of ``devices`` at once, default all local ones), else the table; None (with one
    warning) when the device is unknown."""
    override = cfg.runtime.peak_tflops
    if override == "measure":
        peak = flops.measure_peak_tflops(devices)
        log.info("measured peak: %.3f TFLOP/s per device, all devices of the mesh probing at "
                 "once (runtime.peak_tflops=measure)", peak)
        return peak
    if override is not None:
        return float(override)
    peak = flops.peak_tflops(device_kind, cfg.train.precision)
    if peak is None:
        log.warning("no peak TFLOP/s known for device kind %r: perf/mfu is not logged; set "
                    "runtime.peak_tflops=<TFLOP/s> or runtime.peak_tflops=measure", device_kind)
    return peak


class Prepared(NamedTuple):
    """What ``prepare`` decided before anything is written."""

    exp: Experiment  # the built experiment, its plan and data inside
    resume: Resume | None  # the checkpoint to continue from; None: a fresh start
    # What parallelism=auto's search made that the run takes over (``layout_search.search``'s
    # ``handover``: the seeded init its timing drew, host arrays, or the state after the first
    # steps its turns trained), popped when taken so that the copy is freed once on this mesh.
    handover: dict[str, Any] | None = None


def prepare(cfg: Any, run_dir: Path | None = None) -> Prepared:
    """Everything that can refuse bad input, before anything is written or allocated: a
    ``checkpoint.dir`` that cannot be made, the mesh plan, the data (its files, tokenizer and
    vocabulary), the checkpoint to resume from (``checkpoint.resume`` for a launch into
    ``run_dir``) and the memory preflight (the step compiled from shapes alone must fit). A
    resume is decided here in full (``resume.plan_resume``): its step, its data position,
    and its optimizer state, which is restored when its tree fits the optimizer now and
    otherwise starts fresh with one warning (a changed optimizer is not refused). Raises
    ConfigError, or NothingToTrain when the checkpoint has reached ``train.steps`` already.
    ``cfg`` is read, never rewritten: ``exp.cfg`` is the config the run follows (``cfg``
    itself, or for ``parallelism=auto`` a copy holding the batch held fixed and the chosen
    layout)."""
    # Every run that trains into a run dir may save (a signal asks for a save at any cadence),
    # so its checkpoint.dir must take a dir before the search and the step compile.
    if run_dir is not None and cfg.checkpoint.dir and (why := dir_refusal(
            "checkpoint.dir", cfg.checkpoint.dir,
            "give a dir you can write to, or leave checkpoint.dir null (<run dir>/checkpoints)")):
        raise ConfigError(why)
    handover: dict[str, Any] = {}  # what the layout search made that the run takes over
    if not layout_search.searches(cfg):
        plan = make_plan(cfg, *visible_devices())  # the global batch, whichever key gave it
        resume = (find_resume(cfg.checkpoint, run_dir, saved_config(cfg, plan))
                  if run_dir is not None else None)
    else:  # parallelism=auto: a copy laid out as the search chose; a resume keeps its own
        cfg = layout_search.fixed_batch(cfg, visible_devices())
        resume = find_resume(cfg.checkpoint, run_dir, cfg) if run_dir is not None else None
        searched = layout_search.search(cfg, resumed=layout_search.resumed_layout(resume),
                                        handover=handover)
        cfg = layout_search.with_layout(cfg, layout_search.chosen_layout(searched))
        plan = replace(make_plan(cfg, *visible_devices()), layout_search=searched)
    exp = handover.pop("exp", None)  # the search compiled the chosen layout: the run's step
    if exp is not None:
        exp = replace(exp, cfg=cfg, plan=plan)
    else:
        exp = Experiment.build(cfg, plan, process_data(cfg, plan))
    if resume is not None:  # its data position, its optimizer state, whether it trains at all
        plan_resume(resume, exp.abstract_state(), cfg.train.steps, plan.global_batch,
                    cfg.optimizer)
    memory_preflight(cfg, exp, exp.compile_step())
    return Prepared(exp, resume, handover)


def evaluate(exp: Experiment, params: dict, batches: Iterable[jax.Array]) -> dict[str, float]:
    """Mean held-out loss and accuracy over ``batches``: in training the same ``eval.batches``
    every time (a list); ``dxrun.evaluate`` passes a generator, so that a whole split is never
    on the devices at once."""
    results = [exp.eval_step(params, b) for b in batches]
    loss = sum(float(r["eval/loss"]) for r in results) / len(results)
    acc = sum(float(r["eval/accuracy"]) for r in results) / len(results)
    return {"eval/loss": loss, "eval/ppl": perplexity(loss), "eval/accuracy": acc}


class Start(NamedTuple):
    """Where training begins."""

    state: Any  # the TrainState on this run's mesh
    step: int  # steps already done: 0, or the checkpoint's step
    # The resumed checkpoint's metadata (its config, W&B run id, data position, tokens seen);
    # {} on a fresh start.
    ckpt_meta: dict[str, Any]


def start_state(exp: Experiment, resume: Resume | None,
                handover: dict[str, Any] | None = None) -> Start:
    """The seeded init, or the resumed checkpoint placed on this run's mesh. ``handover``
    (parallelism=auto's search, ``Prepared.handover``): the init it drew (``params``), or the
    state after the first steps it trained (``state``, ``step``): taken, so that their host or
    device copies are let go once on this mesh."""
    if resume is None:
        handover = handover or {}
        if "state" in handover:  # the search trained the run's first steps
            step = handover.pop("step")
            log.info("parallelism=auto: the layouts' turns trained steps 1-%d; the run goes on "
                     "from step %d", step, step + 1)
            return Start(exp.adopt(handover.pop("state")), step, {})
        return Start(exp.init_state(handover.pop("params", None)), 0, {})
    state, ckpt_meta, step = restore(resume, exp.abstract_state())
    if state.opt_state is None:  # the optimizer changed its state's tree (plan_resume)
        state = fresh_optimizer(exp, state)
    log.info("resuming from step %d (checkpoint %s)", step, resume.directory / str(step))
    return Start(state, step, ckpt_meta)


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


def train(cfg: Any, run_dir: Path, job: Job | None = None,
          prepared: Prepared | None = None) -> dict[str, Any]:
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary. The run
    follows ``prepared.exp.cfg`` (``prepare``'s; None: ``prepare(cfg, run_dir)``). The loop
    is a schedule: a save point, the step (its trace, its data wait), and at a log or eval step
    a log point; ``Attempt`` holds the parts it calls."""
    job = job or Job()
    clock = goodput.Goodput(job.started or time.time())
    prepared = prepared or prepare(cfg, run_dir)
    exp, resume = prepared.exp, prepared.resume
    cfg = exp.cfg  # what the run follows: parallelism=auto's copy holds the chosen layout
    clock.add("compile", exp.step.compile_time_s)  # the preflight compiled the step
    search = exp.plan.layout_search
    if search is not None:  # parallelism=auto: timed apart from the startup, less the seeded
        # init it drew for the run (a run without a search draws it in its startup too), the
        # chosen layout's compile (booked above) and the steps it trained for the run
        # (productive: the run does not take them again); a run that did not search (too short
        # for one to pay, a cached decision, a resume) books none: deciding is startup
        clock.add("search", layout_search.own_s(search))
        clock.add("productive", search.get("trained_s") or 0.0)
    main = is_main()  # writes the run's files; every process trains
    show_plan(exp.plan, run_dir, main)
    # On record from here (goodput.json): an attempt killed in its restore still counts.
    # A relaunch continues the dir's run (its attempts) where it resumes in place, or where
    # the attempt before died ahead of its first checkpoint (``Job.continues``).
    continues = (resume is not None and resume.in_place) or job.continues
    record = goodput.RunRecord(run_dir, clock, continues,
                               resume.meta_step if resume is not None else 0, write=main)
    allocator = AllocatorPeak()  # before this run allocates anything
    state, start, ckpt_meta = start_state(exp, resume, prepared.handover)
    run = Attempt(cfg, exp, state, start, resume, ckpt_meta, run_dir, job, record, allocator, main)
    steps, every, eval_every = cfg.train.steps, cfg.train.log_every, run.eval_every
    timer, tracer, batches = run.timer, run.tracer, run.batches
    metrics: Any = None
    reached = start  # the last step this attempt completed
    clock.end_startup()
    run.write_goodput(start)  # the startup on record: a kill before the first row keeps it
    ended = False  # the loop's own end: only then are close()'s errors the ones reported
    try:
        with Progress(steps, enabled=None if main else False) as progress, run.ckpts.preemption:
            for i in range(start, steps):
                run.save_point(i, state)  # save when due; stop on SIGTERM/SIGINT
                done = i + 1
                with clock.span("productive"):  # the earlier steps drain first
                    if tracer.before(done, metrics):
                        timer.pause(i)
                with clock.span("data"), timer.data_wait():
                    tokens = exp.global_batch(next(batches))
                with clock.span("compile" if i == start else "profile" if tracer.active
                                else "productive"):
                    state, metrics = exp.step(state, tokens)
                    if i == start:  # the compiling step: the timing windows start after it
                        jax.block_until_ready(metrics)
                    if tracer.after(done, metrics):
                        timer.resume(done)
                        run.logger.upload(tracer.where, "profile", "profile")
                progress.advance()
                reached = done
                timer.stepped(done, run.ckpts.totals())
                is_log = done % every == 0 or done == steps
                is_eval = eval_every > 0 and (done % eval_every == 0 or done == steps)
                if is_log or is_eval:
                    run.log_point(done, state, metrics if is_log else None, is_eval, progress)
            timer.end_loop()
            run.save_point(steps, state, last=True)
        ended = True
    except Exception as e:
        if (told := run.told(e)) is None:
            raise
        raise told from e
    finally:
        run.close(reached, quiet=not ended)  # a run stopped or crashed mid-loop writes its files
    return run.finish()


def show_plan(plan: MeshPlan, run_dir: Path, main: bool) -> None:
    """The mesh plan: its warnings and table in the log, ``plan.json`` in the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for w in plan.warnings:
        log.warning(w)
    if main:
        write_json(run_dir / "plan.json", plan.to_json())
    log.info("mesh plan\n%s", plan.table())
    if plan.layout_search:
        log.info("parallelism=auto\n%s", layout_search.table(plan.layout_search))


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

    def __init__(self, cfg: Any, exp: Experiment, state: Any, start: int,
                 resume: Resume | None, ckpt_meta: dict[str, Any], run_dir: Path, job: Job,
                 record: goodput.RunRecord, allocator: AllocatorPeak, main: bool):
        self.exp, self.allocator, self.main = exp, allocator, main
        self.record, self.clock = record, record.clock
        self.run_dir, self.steps = run_dir, cfg.train.steps
        plan, data = exp.plan, exp.data
        self.n_params = exp.count_params(state.params)  # the real vocabulary, without padding
        self.floor = data.entropy_floor
        log.info("model %s: %s parameters; data %s: %s", describe_model(cfg, job),
                 f"{self.n_params:,}", cfg.data.name, data.description)
        log.info("attention kernel: %s", exp.attention_kernel)  # cudnn | xla | reference
        self.device_kind = jax.devices()[0].device_kind
        peak = resolve_peak(cfg, self.device_kind, exp.mesh.devices.flat)
        tokens_per_step = plan.global_batch * plan.seq_len
        self.cost = StepCost(tokens_per_step, flops.flops_per_token(
            cfg.model, self.n_params, plan.seq_len) * tokens_per_step, plan.n_devices, peak)
        run_config = {  # the W&B config and each checkpoint's: the resolved batch written once
            **saved_config(cfg, plan),
            "choices": job.choices,
            "plan": plan.to_json(),
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
            group=job.group,
            choices=job.choices, is_main=main,
            resume_id=ckpt_meta.get("wandb_id") if in_place else None,
            kept=rewound.kept if in_place else None)
        # No held-out data: no eval/*.
        self.eval_every = cfg.train.eval_every if data.has_eval else 0
        self.eval_batches = ([exp.batch(k, EVAL) for k in range(cfg.eval.batches)]
                             if self.eval_every > 0 else [])
        self.summary = RunSummary(rewound.kept)  # a resume's kept rows count as logged
        self.batches = data.train_iterator()
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
        # checkpoint.every=null: by platform, and on an accelerator by the state's size.
        cadence = plan_mode.save_cadence(cfg.checkpoint.every, cfg.checkpoint.every_minutes,
                                         plan.platform, plan_mode.state_bytes(state),
                                         cfg.plan.write_gb_per_s * plan_mode.GB)
        log.info("checkpoints: %s", plan_mode.cadence_text(*cadence))
        self.ckpts = RunCheckpoints(cfg.checkpoint, cfg.train, run_dir, start,
                                    {"config": run_config}, self.batches, self.logger,
                                    Preemption(), cadence, tokens=self.tokens_at,
                                    relaunch=relaunch_command(job.overrides, run_dir))
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
            search = exp.plan.layout_search
            first = None if self.summary.logged else first_row(
                exp.step.compile_time_s, layout_search.own_s(search) if search else None,
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
        # Evaluation is not part of the next timing window (the next save point is: a save
        # holds the loop).
        self.timer.reset(done, self.ckpts.totals())

    def told(self, e: Exception) -> Exception | None:
        """What to raise for ``e``, in one line where its cause is known: a write the disk
        refused (DiskError, naming the checkpoint kept), the device out of memory (OutOfMemory,
        naming where the memory goes, written to the run dir); None: ``e`` as it is."""
        if isinstance(e, (DiskError, memory_report.OutOfMemory)):
            return None
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
            if (told := self.told(error)) is None:
                raise error
            raise told from error

    def finish(self) -> dict[str, Any]:
        """``summary.json`` and the closing lines; the summary."""
        summary = self.summary.record(
            steps=self.steps, n_params=self.n_params,
            flops_per_token=self.cost.flops / self.cost.tokens,
            loop_tokens_per_s=self.timer.loop_tokens_per_s(self.cost.tokens, self.steps),
            compile_time_s=self.exp.step.compile_time_s, entropy_floor=self.floor,
            device_kind=self.device_kind, peak_tflops=self.cost.peak_tflops,
            checkpoint_saves=int(self.record.over_attempts("checkpoint_saves")),
            checkpoint_block_s=self.record.over_attempts("checkpoint_block_s"),
            goodput_total=self.record.total, attempt=self.record.attempt)
        if self.main:
            try:
                write_json(self.run_dir / "summary.json", summary)
            except OSError as e:
                if (told := self.told(e)) is None:
                    raise
                raise told from e
        last, floor = self.summary.last, self.floor
        log.info("done: loss %.4f%s; outputs in %s", last.get("train/loss", float("nan")),
                 f" (floor {floor:.4f})" if floor is not None else "", self.run_dir)
        for line in goodput.lines(self.record.attempt, self.record.total):
            log.info(line)
        return summary


def record_end(run_dir: Path, checkpoint_meta: dict[str, Any]) -> bool:
    """A relaunch of a run whose checkpoint (``checkpoint_meta``: its meta) is at the run's own
    ``train.steps`` but which was stopped or killed before it recorded its end (no summary.json,
    or status.json still unfinished): write summary.json from metrics.jsonl and goodput.json
    (the figures only the last attempt itself measured, its compile and loop times and saves,
    are null or 0) and return True; the launcher then writes status ok. False, writing
    nothing, for a run that recorded its end or had not reached it."""
    steps = checkpoint_meta.get("config", {}).get("train", {}).get("steps")
    summary_path = run_dir / "summary.json"
    recorded = summary_path.is_file() and read_status(run_dir).get("status") not in UNFINISHED
    if steps is None or checkpoint_meta.get("step", 0) < steps or recorded:
        return False
    # Written anew even where a summary is there: an earlier end's, before the run trained on.
    rows, _ = read_metrics(run_dir / "metrics.jsonl")
    attempts = goodput.earlier_attempts(run_dir, True)
    total = goodput.run_total(attempts) if attempts else {"goodput": None, "attempts": 0}
    run_config = checkpoint_meta["config"]
    summary = RunSummary(rows).record(
        steps=steps, n_params=run_config.get("n_params"),
        flops_per_token=run_config.get("flops_per_token"), loop_tokens_per_s=None,
        compile_time_s=None, entropy_floor=None,
        device_kind=run_config.get("jax", {}).get("device_kind"), peak_tflops=None,
        checkpoint_saves=0, checkpoint_block_s=0.0, goodput_total=total,
        attempt=attempts[-1] if attempts else {})
    if is_main():
        write_json(summary_path, summary)
    return True


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
