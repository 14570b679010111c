"""The train loop and the run's outputs: plan.json, metrics.jsonl, summary.json, W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
Step time is measured from device-ready to device-ready over the window between two log
steps; the first (compiling) step is never in a window.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.attempt import Attempt
from dxrun.errors import UNFINISHED
from dxrun.job import Job
from dxrun.multihost.distributed import is_main
from dxrun.plan.ranking import own_s, table
from dxrun.plan.run_plan import RunPlan
from dxrun.prepare import prepare, start_state
from dxrun.run_dir import read_status
from dxrun.runtime import AllocatorPeak, write_json
from dxrun.tracking import goodput
from dxrun.tracking.console import Progress
from dxrun.tracking.logger import read_metrics
from dxrun.tracking.monitor import stopped_early
from dxrun.tracking.run_summary import RunSummary

if TYPE_CHECKING:
    from dxrun.autotune.decide import Decided

log = logging.getLogger("dxrun")


def train(cfg: Any, run_dir: Path, job: Job | None = None,
          prepared: Decided | None = None) -> dict[str, Any]:
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary. The run
    follows ``cfg`` and ``prepared.plan`` (``prepare``'s; None: ``prepare(cfg, run_dir)``). The loop
    is a schedule: a save point, the step (its trace, its data wait), and at a log or eval step
    a log point; ``Attempt`` holds the parts it calls."""
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
        clock.add("search", own_s(search), within="decide")
        clock.add("productive", search.get("trained_s") or 0.0, within="decide")
    main = is_main()  # writes the run's files; every process trains
    show_plan(plan, run_dir, main)
    # On record from here (goodput.json): an attempt killed in its restore still counts.
    # A relaunch continues the dir's run (its attempts) where it resumes in place, or where
    # the attempt before died ahead of its first checkpoint (``Job.continues``).
    continues = (resume is not None and resume.in_place) or job.continues
    record = goodput.RunRecord(run_dir, clock, continues,
                               resume.meta_step if resume is not None else 0, write=main)
    allocator = AllocatorPeak()  # before this run allocates anything
    goodput.mark("files")
    with goodput.compiling() as init_compile:  # the init's programs: compile, not startup
        state, start, ckpt_meta = start_state(exp, resume, prepared.handover)
    clock.add("compile", init_compile[0], within="init")
    goodput.mark("init")
    run = Attempt(cfg, exp, plan, state, start, resume, ckpt_meta, run_dir, job, record,
                  allocator, main)
    goodput.mark("open")
    steps, every, eval_every = cfg.train.steps, cfg.train.log_every, run.eval_every
    timer, tracer, batches = run.timer, run.tracer, run.batches
    metrics: Any = None
    reached = start  # the last step this attempt completed
    clock.end_startup()
    run.write_goodput(start)  # the startup on record: a kill before the first row keeps it
    ended = False  # the loop's own end: only then are close()'s errors the ones reported
    # train.debug_nans (debug=nans): a NaN in a step's outputs raises at that step.
    nans = jax.debug_nans(True) if cfg.train.debug_nans else contextlib.nullcontext()
    try:
        with Progress(steps, enabled=None if main else False) as progress, \
                run.ckpts.preemption, nans:
            for i in range(start, steps):
                if run.stop_reason:  # train.early_stop: a plateau ends the run after step i
                    break
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
            run.save_point(reached, state, last=True)
        ended = True
    except Exception as e:
        if (told := run.told(e, reached + 1)) is None:  # the step running: debug_nans names it
            raise
        raise told from e
    finally:
        run.close(reached, quiet=not ended)  # a run stopped or crashed mid-loop writes its files
    return run.finish()


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
    attempts = goodput.earlier_attempts(run_dir, True)
    total = goodput.run_total(attempts) if attempts else {"goodput": None, "attempts": 0}
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
