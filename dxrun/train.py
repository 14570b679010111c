"""The train loop and the run's outputs: plan.json, metrics.jsonl, summary.json, W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
Step time is measured from device-ready to device-ready over the window between two log
steps; the first (compiling) step is never in a window.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import jax
from omegaconf import OmegaConf

from dxrun import checkpoint, flops, goodput, layout_search, memory_report, plan_mode
from dxrun.batch import resolve_batch
from dxrun.checkpoint import NOTICEABLE_BLOCK_S, Resume, RunCheckpoints
from dxrun.config import model_changes
from dxrun.console import Progress, save_note
from dxrun.data import EVAL
from dxrun.distributed import is_main
from dxrun.errors import first_line
from dxrun.experiment import Experiment, process_data, visible_devices
from dxrun.logger import MetricsLogger, Rewound, rewind_metrics
from dxrun.plan import make_plan
from dxrun.preempt import Preemption, relaunch_command
from dxrun.preflight import memory_preflight
from dxrun.runtime import AllocatorPeak, write_json
from dxrun.trace import Tracer, profile_dir, traced_steps

log = logging.getLogger("dxrun")


@dataclass
class Job:
    """Where a run sits among others: Hydra's group choices, the command-line overrides, and
    the W&B group (the experiment or multirun sweep)."""

    choices: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    group: str | None = None
    started: float | None = None  # epoch seconds the job began (goodput's startup); None = now


MAX_NAME = 120


def _model_label(cfg: Any, job: Job) -> str:
    """The preset's name, or the user's own (``model.name=...``) for a custom size."""
    named = any(ov.lstrip("+~").startswith("model.name=") for ov in job.overrides)
    return cfg.model.name if named else job.choices.get("model", cfg.model.name)


def run_name(cfg: Any, job: Job) -> str:
    """``tiny-dp4_tp2-bs64`` plus the key overrides, e.g. ``-lr0.01``. No slashes: a path
    value is its last component (``data.path=data/mycorpus`` gives ``pathmycorpus``), and a
    long name is cut between parts, never inside one."""
    parts = [_model_label(cfg, job), job.choices.get("parallelism", cfg.parallelism.name),
             f"bs{cfg.data.batch_size}"]
    for ov in job.overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if "." in key and key not in ("data.batch_size", "model.name") and not key.startswith(
                ("logger.", "hydra", "runtime.", "distributed.")):
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


def prepare(cfg: Any, run_dir: Path | None = None) -> Prepared:
    """Everything that can refuse bad input, before anything is written or allocated: the mesh
    plan, the data (its files, tokenizer and vocabulary), the checkpoint to resume from
    (``checkpoint.resume`` for a launch into ``run_dir``) and the memory preflight (the step
    compiled from shapes alone must fit). A resume is decided here in full
    (``checkpoint.plan_resume``): its step, its data position, and its optimizer state, which
    is restored when its tree fits the optimizer now and otherwise starts fresh with one
    warning (a changed optimizer is not refused). Raises ConfigError, or NothingToTrain when the
    checkpoint has reached ``train.steps`` already."""
    if cfg.parallelism.search == "none":
        plan = make_plan(cfg, *visible_devices())
        resolve_batch(cfg, plan)  # data.per_device_batch_size -> the global batch, for all
        resume = checkpoint.find_resume(cfg, run_dir) if run_dir is not None else None
    else:  # parallelism=auto: the chosen layout written into cfg; a resume keeps its own
        layout_search.fix_batch(cfg, visible_devices())
        resume = checkpoint.find_resume(cfg, run_dir) if run_dir is not None else None
        searched = layout_search.search(cfg, resumed=layout_search.resumed_layout(resume))
        plan = replace(make_plan(cfg, *visible_devices()), layout_search=searched)
        resolve_batch(cfg, plan)
    data = process_data(cfg, plan)
    exp = Experiment.build(cfg, plan, data)
    if resume is not None:  # its data position, its optimizer state, whether it trains at all
        checkpoint.plan_resume(cfg, resume, exp.abstract_state())
    memory_preflight(cfg, exp, exp.compile_step())
    return Prepared(exp, resume)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # capped: a diverged run logs a large number, not inf


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


def start_state(exp: Experiment, resume: Resume | None) -> Start:
    """The seeded init, or the resumed checkpoint placed on this run's mesh."""
    if resume is None:
        return Start(exp.init_state(), 0, {})
    state, ckpt_meta, step = checkpoint.restore(resume, exp.abstract_state())
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
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary."""
    job = job or Job()
    clock = goodput.Goodput(job.started or time.time())
    exp, resume = prepared or prepare(cfg, run_dir)
    clock.add("compile", exp.step.compile_time_s)  # the preflight compiled the step
    plan, data = exp.plan, exp.data
    main = is_main()  # writes the run's files; every process trains
    run_dir.mkdir(parents=True, exist_ok=True)
    for w in plan.warnings:
        log.warning(w)
    if main:
        write_json(run_dir / "plan.json", plan.to_json())
    log.info("mesh plan\n%s", plan.table())
    if plan.layout_search:
        log.info("parallelism=auto\n%s", layout_search.table(plan.layout_search))

    allocator = AllocatorPeak()  # before this run allocates anything
    state, start, ckpt_meta = start_state(exp, resume)
    n_params = exp.count_params(state.params)  # the real vocabulary, without padding
    floor = data.entropy_floor
    log.info("model %s: %s parameters; data %s: %s", describe_model(cfg, job), f"{n_params:,}",
             cfg.data.name, data.description)
    log.info("attention kernel: %s", exp.attention_kernel)  # cudnn | xla | reference
    device_kind = jax.devices()[0].device_kind
    peak = resolve_peak(cfg, device_kind, exp.mesh.devices.flat)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops_per_step = flops.flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens_per_step

    run_config = {
        **OmegaConf.to_container(cfg, resolve=True),
        "choices": job.choices,
        "plan": plan.to_json(),
        "n_params": n_params,
        "flops_per_token": flops_per_step / tokens_per_step,
        "jax": {"version": jax.__version__, "device_kind": device_kind,
                "device_count": jax.device_count(), "process_count": jax.process_count()},
    }
    in_place = resume is not None and resume.in_place
    rewound = rewind_metrics(run_dir, start) if in_place and main else Rewound([], 0)
    kept = rewound.kept
    # The W&B run holds what was moved aside too: rewind it to the last row kept.
    logger = MetricsLogger(run_dir, cfg, run_config, name=run_name(cfg, job), group=job.group,
                           choices=job.choices, is_main=main,
                           resume_id=ckpt_meta.get("wandb_id") if in_place else None,
                           rewind_to=max((r["step"] for r in kept), default=0)
                           if rewound.moved else None)
    steps, every = cfg.train.steps, cfg.train.log_every
    eval_every = cfg.train.eval_every if data.has_eval else 0  # no held-out data: no eval/*
    eval_batches = ([exp.batch(k, EVAL) for k in range(cfg.eval.batches)]
                    if eval_every > 0 else [])
    last: dict[str, float] = {k: v for row in kept for k, v in row.items() if k != "step"}
    # The lowest finite train/loss (None: none was finite), over the kept rows of a resume too.
    best_loss: float | None = min((r["train/loss"] for r in kept
                                   if isinstance(r.get("train/loss"), float)
                                   and math.isfinite(r["train/loss"])), default=None)
    batches = exp.data.train_iterator()
    if ckpt_meta:
        batches.set_state(checkpoint.data_position(ckpt_meta, cfg.data.batch_size))
    # Tokens actually read: the checkpoint's count, then this attempt's batches (a resume may
    # have changed the batch size).
    tokens_before = checkpoint.tokens_seen(ckpt_meta, start) if ckpt_meta else 0

    def tokens_at(done: int) -> int:
        return tokens_before + (done - start) * tokens_per_step

    # checkpoint.every=null: by platform, and on an accelerator by the state's size.
    cadence = plan_mode.save_cadence(cfg.checkpoint.every, cfg.checkpoint.every_minutes,
                                     plan.platform, plan_mode.state_bytes(state),
                                     cfg.plan.write_gb_per_s * plan_mode.GB)
    log.info("checkpoints: %s", plan_mode.cadence_text(*cadence))
    ckpts = RunCheckpoints(cfg, run_dir, start, {"config": run_config}, batches, logger,
                           Preemption(), cadence, tokens=tokens_at,
                           relaunch=relaunch_command(job.overrides, run_dir))
    # A step's row is written after the save point that follows the step, so that it holds
    # how long the saves since the previous row held the loop, this step's save included
    # (perf/checkpoint_block_s). A save off the log steps (SIGUSR1, the wall clock) adds no
    # row of its own: the rows stay those of an unsaved run.
    pending: list[tuple[int, dict[str, float]]] = []

    def write_row() -> None:
        with clock.span("logging"):
            for step, row in pending:
                if blocks := ckpts.take_blocks():
                    row["perf/checkpoint_block_s"] = sum(blocks)
                logger.log(step, row)
            pending.clear()

    def save_point(done: int, state: Any, last: bool = False) -> None:
        """Save when due, stop on a signal (``RunCheckpoints.between_steps``), then write the
        row of step ``done``, if it has one, whatever that raised."""
        try:
            with clock.span("checkpoint"):
                ckpts.between_steps(done, state, last=last)
        finally:
            write_row()

    rank, procs = jax.process_index(), jax.process_count()
    tracer = Tracer(traced_steps(cfg.train.profile.start, cfg.train.profile.steps, start, steps),
                    profile_dir(run_dir, rank, procs), run_dir,
                    exp.step.compiled.as_text() if exp.step.compiled is not None else None)
    if cfg.train.profile.start and not tracer.steps:
        log.warning("train.profile.start=%d is past this attempt's steps %d-%d: no trace",
                    cfg.train.profile.start, start + 2, steps)
    attempts = goodput.earlier_attempts(run_dir, in_place)
    reached = start  # the last step this attempt completed
    clock.end_startup()
    try:
        with Progress(steps, enabled=None if main else False) as progress, ckpts.preemption:
            window = goodput.StepWindow()
            held0, saves0 = 0.0, 0  # checkpoint saving before this window (ckpts' totals)
            loop_t, loop_step = 0.0, steps  # from the compiling step's end: the whole loop
            metrics: Any = None
            for i in range(start, steps):
                save_point(i, state)  # save when due; stop on SIGTERM/SIGINT
                done = i + 1
                with clock.span("productive"):  # the earlier steps drain first
                    if tracer.before(done, metrics):
                        window.pause(i)
                with clock.span("data"):
                    t_wait = time.perf_counter()
                    tokens = exp.global_batch(next(batches))
                    window.wait(time.perf_counter() - t_wait)
                part = ("compile" if i == start else "profile" if tracer.active
                        else "productive")
                with clock.span(part):
                    state, metrics = exp.step(state, tokens)
                    if i == start:  # the compiling step: the timing windows start after it
                        jax.block_until_ready(metrics)
                    if tracer.after(done, metrics):
                        window.resume(done)
                        logger.upload(tracer.where, "profile", "profile")
                progress.advance()
                reached = done
                if i == start:
                    window.reset(done)
                    held0, saves0 = ckpts.block_total_s, ckpts.saves
                    loop_t, loop_step = window.t, done
                is_log = done % every == 0 or done == steps
                is_eval = eval_every > 0 and (done % eval_every == 0 or done == steps)
                if not (is_log or is_eval):
                    continue
                row: dict[str, Any] = {}
                if is_log:
                    with clock.span("profile" if tracer.active else "productive"):
                        fetched = jax.device_get(metrics)  # waits for the device
                    t_log = clock.clock()
                    row = {k: float(v) for k, v in fetched.items()}
                    row["train/ppl"] = perplexity(row["train/loss"])
                    seconds, n_steps, waited = window.measure(done)
                    if n_steps > 0 and seconds > 0:
                        step_time = seconds / n_steps
                        tflops = flops_per_step / step_time / plan.n_devices / 1e12
                        row["perf/step_time_s"] = step_time
                        row["perf/tokens_per_s"] = tokens_per_step / step_time
                        row["perf/tokens_per_s_per_device"] = (row["perf/tokens_per_s"]
                                                               / plan.n_devices)
                        row["perf/tflops_per_device"] = tflops
                        row["perf/data_wait_frac"] = waited / seconds
                        if peak:
                            row["perf/mfu"] = flops.mfu(tflops, peak)
                    if window.profiled:  # traced steps in this window: left out of perf/*
                        row["perf/profiled"] = True
                    if not last:  # first log row: the one-off numbers
                        row["perf/compile_time_s"] = exp.step.compile_time_s
                        if plan.layout_search:
                            row["perf/layout_search_s"] = plan.layout_search["search_s"]
                        if (need := exp.step.memory_bytes()) is not None:
                            row["mem/step_bytes_per_device"] = need
                    # Every row on an accelerator (CPU keeps no allocator statistics).
                    if (high := allocator.peak_since_start()) is not None:
                        row["mem/peak_bytes_per_device"] = high
                    row["data/tokens_seen"] = float(tokens_at(done))
                    if floor is not None:
                        row["data/entropy_floor"] = floor
                    loss = row["train/loss"]
                    if math.isfinite(loss) and (best_loss is None or loss < best_loss):
                        best_loss = loss
                    clock.add("logging", clock.clock() - t_log)
                if is_eval:
                    with clock.span("eval"):
                        row.update(evaluate(exp, state.params, eval_batches))
                with clock.span("logging"):
                    pending.append((done, row))  # written after this step's save point
                    # A save inside the window slows its tokens/s: the line says so (the first
                    # save of a process is the slow one: seconds on CPU).
                    held = ckpts.block_total_s - held0
                    first = saves0 < ckpts.process_first_save <= ckpts.saves
                    note = (save_note(held, first) if "perf/tokens_per_s" in row
                            and held >= NOTICEABLE_BLOCK_S else "")
                    progress.update(done, row, note)  # an evaluation off the log steps too
                last = {**last, **row}
                # Evaluation is not part of the next timing window (the next save point is:
                # a save holds the loop).
                window.reset(done)
                held0, saves0 = ckpts.block_total_s, ckpts.saves
            loop_s = time.perf_counter() - loop_t  # the last step was logged: it is done
            save_point(steps, state, last=True)
    except Exception as e:
        if not memory_report.is_out_of_memory(e) or not main:
            raise
        path = memory_report.write(run_dir, exp.step.compiled, exp.abstract_state(),
                                   plan.platform)
        raise memory_report.OutOfMemory(
            f"{first_line(e)}; where the memory goes: {path}") from e
    finally:
        tracer.stop()  # a run stopped inside the trace still leaves its trace
        write_row()  # a crash mid-loop: the rows of the steps that ran
        with clock.span("checkpoint"):
            ckpts.close()  # waits for a save in flight
        if hasattr(batches, "close"):  # Grain's worker processes end with the run
            batches.close()
        attempt = {**clock.breakdown(), "first_step": start,
                   "last_step": reached}
        total = goodput.run_total([*attempts, attempt])
        if main:
            write_json(run_dir / goodput.FILE, goodput.file_content(attempts, attempt, total))
        logger.summary({"goodput": total["goodput"],
                        **{f"goodput/{k}": v for k, v in attempt.items()}})
        logger.finish()
    summary = {
        "step": steps,
        **last,
        "train/loss": last.get("train/loss"),
        "best/train_loss": best_loss,
        "n_params": n_params,
        "flops_per_token": flops_per_step / tokens_per_step,
        "tokens_per_s": last.get("perf/tokens_per_s"),
        # Data, the step, logging, evaluation, saves and the progress bar after the first step,
        # where tokens_per_s is the last window's step time alone.
        "loop_tokens_per_s": (tokens_per_step * (steps - loop_step) / loop_s
                              if steps > loop_step else None),
        "compile_time_s": exp.step.compile_time_s,
        "entropy_floor": floor,
        "device_kind": device_kind,
        "peak_tflops": peak,
        # This attempt's saves (a resumed run counts its own) and the time they held the loop.
        "checkpoint_saves": ckpts.saves,
        "checkpoint_block_s": ckpts.block_total_s,
        # Productive step time / wall time over the run's attempts (goodput.json holds each).
        "goodput": total["goodput"],
        "goodput_s": attempt,  # this attempt's wall time by part (goodput.PARTS, rest)
        "attempts": total["attempts"],
    }
    if main:
        write_json(run_dir / "summary.json", summary)
    log.info("done: loss %.4f%s; outputs in %s", last.get("train/loss", float("nan")),
             f" (floor {floor:.4f})" if floor is not None else "", run_dir)
    for line in goodput.lines(attempt, total):
        log.info(line)
    return summary
