"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train.

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dxrun.checkpointing.preempt import SIGNALS, guard_signals
from dxrun.composition import composition_refusal
from dxrun.config import check_keys, conf_dir, register
from dxrun.errors import (
    EXIT_CODES,
    EXIT_CRASHED,
    EXIT_REFUSED,
    ConfigError,
    DiskError,
    Interrupted,
    NonFiniteError,
    NothingToTrain,
    Stopped,
    first_line,
)
from dxrun.hf.config import apply_hf_model
from dxrun.job import Job
from dxrun.job_dir import (
    asked_dir,
    claim_new,
    claim_to_train,
    discard_empty_dir,
    give_up,
    remember_start,
)
from dxrun.multihost.distributed import is_main, join, tell_launcher
from dxrun.plan.run_plan import resolved_config
from dxrun.report.callback import SWEEP_DIRS
from dxrun.report.collect import find_jobs
from dxrun.run_dir import Claim, relaunch_command
from dxrun.run_log import RunLog
from dxrun.runtime import (
    accelerator_plan_note,
    claim_run_dir,
    collect_cycles_rarely,
    cpu_fallback_refusal,
    enable_compile_cache,
    nvidia_device_node,
    reuse_pays,
    simulate_cpu_devices,
    simulated_count,
    sweep_group,
    thread_pool_note,
    write_hydra_files,
    write_status,
)
from dxrun.target import check_targets
from dxrun.tracking.goodput import job_started_at, mark
from dxrun.tracking.stores import store_refusal
from dxrun.validation import config_warnings, validate

if TYPE_CHECKING:
    from hydra.conf import HydraConf

    from dxrun.schema import CheckpointConfig, RunConfig


def _conf_dir() -> str:
    return str(conf_dir())  # non-editable install: conf/ ships as dxrun/conf


def _register_sweeper() -> None:
    """Make sure Hydra knows dxrun's Optuna sweeper (sweep=lr_optuna). Hydra instantiates only
    the plugins its scan of the hydra_plugins namespace found, and under setuptools' editable
    install that scan cannot list hydra_plugins/dxrun_sweeper (it sits behind an import hook),
    so the class is added by name when the scan missed it."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.dxrun_sweeper import OptunaSweeper

    name = f"{OptunaSweeper.__module__}.{OptunaSweeper.__name__}"
    Plugins.instance().class_name_to_class.setdefault(name, OptunaSweeper)


log = logging.getLogger("dxrun")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" noise
logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines
logging.getLogger("jax._src.distributed").setLevel(logging.WARNING)  # dxrun says it in one line
register()
_register_sweeper()


@hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")
def main(cfg: DictConfig) -> Any:
    started = job_started_at()  # goodput's wall time counts from here (the process's start)
    mark("compose")
    SIGNALS.start_job()
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_log = RunLog()  # lines wait in memory until this run has claimed its own dir
    run_dir: Path | None = None
    claim: Claim | None = None  # the run dir this job trains in, held until it ends
    held: list[Claim] = []  # the claim from the moment its lock is taken (run_dir.claim)
    try:
        # model.init_from=hf:<dir>: the model section is the checkpoint's config.json
        apply_hf_model(cfg, list(hydra_cfg.overrides.task))
        check_keys(cfg)
        validate(cfg)
        if cfg.run.mode != "plan" and (why := store_refusal(cfg.logger)):
            raise ConfigError(why)  # a logger that cannot start: refused before the run
        # Plan mode simulates plan.devices (the planned run's device count), a run
        # runtime.cpu_devices: set before JAX starts.
        n_cpu, count_note = simulated_count(cfg.run.mode, cfg.plan.devices,
                                            cfg.runtime.cpu_devices)
        simulated = simulate_cpu_devices(n_cpu, reuse=reuse_pays(cfg, n_cpu))
        joined = join(cfg.distributed)  # before anything touches a JAX device
        import jax

        if joined is not None:
            run_log.name = RunLog.name_for(joined.process_id, joined.num_processes)
            if not is_main():
                run_log.quiet_console()
        # Plan mode compiles on CPU for any target: only a training run needs the GPU.
        if cfg.run.mode != "plan" and (refusal := cpu_fallback_refusal(
                jax.default_backend(), nvidia_device_node(), os.environ.get("JAX_PLATFORMS"),
                cfg.runtime.allow_cpu)):
            raise ConfigError(refusal)
        count_key = "plan.devices" if cfg.run.mode == "plan" else "runtime.cpu_devices"
        if count_note is not None:
            log.info("%s", count_note)
        if cfg.run.mode == "plan" and (note := accelerator_plan_note(
                jax.default_backend(), jax.device_count(), n_cpu, cfg.plan.target)):
            log.warning("%s", note)
        if jax.default_backend() == "cpu" and simulated:
            log.info("no accelerator found: simulating %d CPU devices (%s)",
                     jax.local_device_count(), count_key)
        elif jax.default_backend() == "cpu" and jax.local_device_count() != n_cpu:
            # Multirun jobs share one process: JAX's device count is fixed by the first job.
            log.warning("%s=%d ignored: JAX already runs with %d CPU devices "
                        "in this process (set it once for the multirun, or run each job in "
                        "its own process: hydra/launcher=submitit_local)",
                        count_key, n_cpu, jax.device_count())
        enable_compile_cache(cfg.runtime.compile_cache)
        check_targets(cfg)  # your model, data and optimizer take what dxrun passes them
        for w in config_warnings(cfg):
            log.warning(w)
        from dxrun.prepare import prepare  # imports JAX
        from dxrun.train import record_end, train  # imports JAX

        if cfg.run.mode == "plan":
            from dxrun.plan_mode import planned, run_plan  # imports JAX

            # data.seq_len=null resolved for the target; for parallelism=auto the layout
            # ranked first by the estimate alone, for plan.target: in the plan, cfg as it is.
            decided = planned(cfg)
            run_dir = claim_new(Path(hydra_cfg.runtime.output_dir))
            run_log.attach(run_dir)
            # The saved config holds the derived numbers: the global batch, the layout.
            write_hydra_files(run_dir, resolved_config(cfg, decided.plan), hydra_cfg)
            return run_plan(cfg, run_dir, decided)
        # Every process uses process 0's run dir (their clocks may name it differently).
        # Claimed and held before the plan and the compile, so that a second launch into a
        # held dir is refused at once (or waits) instead of compiling beside it.
        claim = claim_to_train(cfg.run, cfg.checkpoint, hydra_cfg, asked_dir(hydra_cfg), held)
        run_dir = claim.dir
        # The plan, the data, the checkpoint to resume and the memory preflight: fail before
        # anything is written. The run follows cfg; what is derived from it (the layout...) is
        # in ``prepared.plan``, where the run sits (its W&B names) in ``job``.
        mark("jax")
        prepared = prepare(cfg, run_dir)
        resume = prepared.resume
        if simulated and not multirun and (note := thread_pool_note(
                len(prepared.exp.plan.device_ids), jax.local_device_count(), os.cpu_count())):
            log.info(note)
        run_log.attach(run_dir)
        if claim.continues and not (resume is not None and resume.in_place):
            last = {"running": "died (killed: its status still said running)",
                    "stopped": "was stopped", "failed": "failed"}.get(
                        (claim.earlier or {}).get("status"), "ended")
            log.warning("%s: attempt %d of its run; the last one %s before its first "
                        "checkpoint, so this one starts again from %s", run_dir, claim.attempt,
                        last, resume.directory if resume is not None else "step 0")
        job = _job(cfg, hydra_cfg, started, claim)
        if is_main():  # the plan's batch and sequence length, the W&B names: written once
            write_hydra_files(run_dir, resolved_config(
                cfg, prepared.plan, job_type=job.job_type, group=job.group), hydra_cfg)
        _status(run_dir, "running", **_job_fields(hydra_cfg, claim))
        try:
            summary = train(cfg, run_dir, job, prepared)
        except Stopped as e:  # preempted: the checkpoint is committed; a requeue resumes it
            _status(run_dir, "stopped", signal=e.signal_name, step=e.step,
                    checkpoint=str(e.checkpoint), relaunch=e.relaunch, reason=str(e),
                    **_job_fields(hydra_cfg, claim))
            sys.exit(e.code)
        stopped_early = {"reason": summary["early_stop"]} if "early_stop" in summary else {}
        _status(run_dir, "ok", **stopped_early, **_job_fields(hydra_cfg, claim))
        # A sweeper (Optuna) minimises one number; None (a failed job) is a failed trial.
        return summary.get(cfg.train.objective) if cfg.train.objective else summary
    except Interrupted as e:  # a signal outside the train loop
        claim = claim or (held[0] if held else None)  # locked, not yet returned: still held
        _interrupted(e, cfg.checkpoint, hydra_cfg, run_log, claim)
    except NonFiniteError as e:  # train.nan_policy=halt: the last good checkpoint is kept
        _status(run_dir, "failed", kind="nonfinite", reason=str(e),
                **_job_fields(hydra_cfg, claim))
        return _job_failed(str(e), crashed=True)
    except DiskError as e:  # a write the disk refused: the checkpoint kept is named
        log_path = run_log.attach(run_dir)
        run_log.write_traceback(e)
        _status(run_dir, "failed", kind="disk", reason=str(e), log=str(log_path),
                **_job_fields(hydra_cfg, claim))
        return _job_failed(str(e), crashed=True)
    except NothingToTrain as e:  # a relaunch of a finished run: its files stay as they are
        # ... unless it reached its end and was stopped or killed before recording it.
        if claim is not None and (ended := record_end(claim.dir, e.meta)) is not None:
            run_log.attach(claim.dir)
            stopped_early = {"reason": ended["early_stop"]} if "early_stop" in ended else {}
            _status(claim.dir, "ok", **stopped_early, **_job_fields(hydra_cfg, claim))
            if is_main():
                print(f"dxrun: checkpoint {e.checkpoint} is at the run's end, which it had not "
                      "recorded (stopped or killed after its last save): summary.json (from "
                      "metrics.jsonl) and status ok written", file=sys.stderr)
            return None
        run_log.discard()
        if is_main():
            give_up(claim, hydra_cfg)
            print(f"dxrun: {e}", file=sys.stderr)
        return None
    except ConfigError as e:
        run_log.discard()
        if multirun and is_main():  # the sweep report lists the refused job beside the others
            run_dir = claim.dir if claim else claim_run_dir(Path(hydra_cfg.runtime.output_dir))
            write_hydra_files(run_dir, cfg, hydra_cfg)
            _status(run_dir, "failed", kind="refused", reason=str(e),
                    **_job_fields(hydra_cfg, claim))
        elif is_main():  # the others share its dir: one process tidies it, never two at once
            give_up(claim, hydra_cfg)
        return _job_failed(str(e), crashed=False)
    except Exception as e:  # noqa: BLE001 - a crash: one line here, the traceback in the log
        if run_dir is None:  # failed before claiming: the traceback still needs a home
            run_dir = (claim_run_dir(Path(hydra_cfg.runtime.output_dir)) if is_main()
                       else Path(hydra_cfg.runtime.output_dir))
        try:
            log_path = run_log.attach(run_dir)
            run_log.write_traceback(e)
        except OSError:  # the dir is gone (removed under us): the traceback goes to stderr
            import traceback

            traceback.print_exception(e)
            log_path = Path("<stderr>")
        first = first_line(e)
        reason = f"{type(e).__name__}: {first}"
        _status(run_dir, "failed", kind="crashed", reason=reason, log=str(log_path),
                **_job_fields(hydra_cfg, claim))
        return _job_failed(f"{reason} (full traceback: {log_path})", crashed=True)
    finally:  # the next job of a multirun, or a relaunch, may take the dir
        for held_claim in (claim, *held):  # (held: locked by a job stopped before it returned)
            if held_claim is not None:
                held_claim.release()


def _interrupted(e: Interrupted, ckpt: CheckpointConfig, hydra_cfg: HydraConf,
                 run_log: RunLog, claim: Claim | None) -> None:
    """A signal outside the train loop: one line, status ``stopped`` naming the newest
    checkpoint (if any) and the command that continues the run, and the signal's exit code. A
    job stopped before it claimed a dir leaves nothing behind."""
    if claim is None:
        log.info("%s: stopped %s; nothing was written", e.signal_name, e.when)
        run_log.discard()
        if is_main():
            discard_empty_dir(Path(hydra_cfg.runtime.output_dir))
        sys.exit(e.code)
    from dxrun.checkpointing.store import checkpoint_dir, committed_steps  # JAX after device count

    run_log.attach(claim.dir)
    steps = committed_steps(checkpoint_dir(ckpt, claim.dir))
    newest = checkpoint_dir(ckpt, claim.dir) / str(steps[-1]) if steps else None
    relaunch = relaunch_command(list(hydra_cfg.overrides.task), claim.dir)
    saved = f"checkpoint {newest} is the newest" if newest else "no checkpoint yet"
    reason = f"{e.signal_name}: stopped {e.when}; {saved}. Resume with: {relaunch}"
    log.info(reason)
    _status(claim.dir, "stopped", signal=e.signal_name, step=steps[-1] if steps else 0,
            checkpoint=str(newest) if newest else None, relaunch=relaunch, reason=reason,
            **_job_fields(hydra_cfg, claim))
    sys.exit(e.code)


def _status(run_dir: Path, status: str, **fields: Any) -> None:
    if is_main():
        write_status(run_dir, status, **fields)
        tell_launcher(run_dir)  # which status.json to mark if the run's ranks are killed


def _job_fields(hydra_cfg: HydraConf, claim: Claim | None = None) -> dict[str, Any]:
    return {"job": hydra_cfg.job.num if hydra_cfg.mode == RunMode.MULTIRUN else None,
            "overrides": list(hydra_cfg.overrides.task),
            "attempt": claim.attempt if claim else 1,
            "lost_attempts": claim.lost_attempts if claim else 0}


def _job(cfg: RunConfig, hydra_cfg: HydraConf, started: float, claim: Claim) -> Job:
    """Where the run sits: Hydra's group choices and overrides, and its W&B job type and group,
    the config's or, where it left them unset, filled in: the jobs of one multirun share the
    group of their sweep dir and have job type "sweep". The run's W&B run and its saved config
    record them alike, so the sweep report (which reads the saved config) agrees with W&B."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    choices = {k: v for k, v in hydra_cfg.runtime.choices.items()
               if not k.startswith("hydra/") and isinstance(v, str)}
    group, job_type = cfg.logger.group, cfg.logger.job_type
    if multirun and group is None:
        group = sweep_group(Path(hydra_cfg.sweep.dir))
    if job_type is None:
        job_type = "sweep" if multirun else "train"
    return Job(choices=choices, overrides=list(hydra_cfg.overrides.task), started=started,
               continues=claim.continues, group=group, job_type=job_type)


def _job_failed(msg: str, crashed: bool) -> None:
    """A single run exits now (2 for refused input, 1 for a crash). In a multirun one bad job
    must not cost the rest of the sweep: its line now, its status.json for the report and the
    exit code (``cli``), and the next job runs."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        _fail(msg, code=EXIT_CRASHED if crashed else EXIT_REFUSED)
    print(f"dxrun: error: job #{hydra_cfg.job.num}: {msg}", file=sys.stderr)


def _fail(msg: str, code: int = EXIT_REFUSED) -> None:
    print(f"dxrun: error: {msg}", file=sys.stderr)
    sys.exit(code)


def cli() -> None:
    mark("launch")  # the interpreter and this module's imports (goodput's startup phases)
    guard_signals()  # before anything slow: a signal from here on ends the run in one line
    collect_cycles_rarely()
    remember_start()
    try:
        if refusal := composition_refusal(sys.argv[1:]):
            _fail(refusal)
        main()
    except Interrupted as e:  # outside a job (composing the config), or while it was failing
        print(f"dxrun: {e.signal_name}: stopped {e.when}", file=sys.stderr)
        sys.exit(e.code)
    for sweep_dir in SWEEP_DIRS:
        _exit_for_failed_jobs(sweep_dir)


def _exit_for_failed_jobs(sweep_dir: Path) -> None:
    """Exit non-zero naming the failed jobs, read from their status.json like the report
    does: this also covers jobs that ran in other processes (submitit) or were killed.

    A job stopped by a signal after committing its checkpoint did not fail: it is named with
    its resume command, and with no failed job the sweep exits as a stopped single run does,
    0 for SIGTERM (a scheduler's requeue point) and 130 once any job was stopped by SIGINT."""
    jobs = find_jobs(sweep_dir)
    stopped = [j for j in jobs if j.status == "stopped"]
    for j in stopped:
        print(f"dxrun: job #{j.label_num} {j.reason}", file=sys.stderr)
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        names = "; ".join(f"#{j.label_num} ({' '.join(j.overrides)})" for j in failed)
        _fail(f"{len(failed)} sweep job(s) failed: {names} (details: {sweep_dir}/report.md)",
              code=EXIT_REFUSED if all(j.kind == "refused" for j in failed) else EXIT_CRASHED)
    if any(j.kind == "SIGINT" for j in stopped):
        sys.exit(EXIT_CODES["SIGINT"])


if __name__ == "__main__":
    cli()
