"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train.

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from dxrun import run_dir as run_dirs
from dxrun.checkpointing.preempt import SIGNALS, guard_signals
from dxrun.config import (
    check_keys,
    composition_error,
    conf_dir,
    config_warnings,
    register,
    validate,
)
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
from dxrun.multihost.distributed import agree, is_main, join, tell_launcher
from dxrun.run_dir import Claim, relaunch_command
from dxrun.runtime import (
    RunLog,
    claim_run_dir,
    cpu_fallback_refusal,
    dir_refusal,
    enable_compile_cache,
    nvidia_device_node,
    simulate_cpu_devices,
    sweep_group,
    thread_pool_note,
    write_hydra_files,
    write_status,
)


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
    from dxrun.tracking.goodput import job_started_at

    started = job_started_at()  # goodput's wall time counts from here (the process's start)
    SIGNALS.start_job()
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_log = RunLog()  # lines wait in memory until this run has claimed its own dir
    run_dir: Path | None = None
    claim: Claim | None = None  # the run dir this job trains in, held until it ends
    try:
        check_keys(cfg)
        validate(cfg)
        simulated = simulate_cpu_devices(cfg.runtime.cpu_devices)
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
        if jax.default_backend() == "cpu" and simulated:
            log.info("no accelerator found: simulating %d CPU devices (runtime.cpu_devices)",
                     jax.local_device_count())
        elif jax.default_backend() == "cpu" and jax.local_device_count() != cfg.runtime.cpu_devices:
            # Multirun jobs share one process: JAX's device count is fixed by the first job.
            log.warning("runtime.cpu_devices=%d ignored: JAX already runs with %d CPU devices "
                        "in this process (set it once for the multirun, or run each job in "
                        "its own process: hydra/launcher=submitit_local)",
                        cfg.runtime.cpu_devices, jax.device_count())
        enable_compile_cache(cfg.runtime.compile_cache)
        for w in config_warnings(cfg):
            log.warning(w)
        from dxrun.batch import resolved_config
        from dxrun.train import Job, prepare, record_end, train

        if cfg.run.mode == "plan":
            from dxrun.capacity.plan_mode import planned, run_plan

            # A copy of cfg: data.seq_len=null resolved for the target; for parallelism=auto
            # the layout ranked first by the estimate alone, for plan.target.
            plan_cfg, plan = planned(cfg, jax.default_backend())
            run_dir = _claim(Path(hydra_cfg.runtime.output_dir))
            run_log.attach(run_dir)
            # The saved config holds the global batch too.
            write_hydra_files(run_dir, resolved_config(plan_cfg, plan), hydra_cfg)
            return run_plan(plan_cfg, run_dir, plan)
        # Every process uses process 0's run dir (their clocks may name it differently).
        # Claimed and held before the plan and the compile, so that a second launch into a
        # held dir is refused at once (or waits) instead of compiling beside it.
        claim = _claim_to_train(cfg, hydra_cfg, _asked_dir(hydra_cfg))
        run_dir = claim.dir
        # The plan, the data, the checkpoint to resume and the memory preflight: fail before
        # anything is written.
        # From here on the run follows run_cfg, a copy: the W&B job type and group filled in
        # (``_wandb_named``) and, for parallelism=auto, the chosen layout (``prepare``).
        prepared = prepare(_wandb_named(cfg, hydra_cfg, multirun), run_dir)
        run_cfg, resume = prepared.exp.cfg, prepared.resume
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
        if is_main():  # the plan's global batch and sequence length, written once
            write_hydra_files(run_dir, resolved_config(run_cfg, prepared.exp.plan), hydra_cfg)
        _status(run_dir, "running", **_job_fields(hydra_cfg, claim))
        choices = {k: v for k, v in hydra_cfg.runtime.choices.items()
                   if not k.startswith("hydra/") and isinstance(v, str)}
        job = Job(choices=choices, overrides=list(hydra_cfg.overrides.task), started=started,
                  continues=claim.continues)
        try:
            summary = train(run_cfg, run_dir, job, prepared)
        except Stopped as e:  # preempted: the checkpoint is committed; a requeue resumes it
            _status(run_dir, "stopped", signal=e.signal_name, step=e.step,
                    checkpoint=str(e.checkpoint), relaunch=e.relaunch, reason=str(e),
                    **_job_fields(hydra_cfg, claim))
            sys.exit(e.code)
        _status(run_dir, "ok", **_job_fields(hydra_cfg, claim))
        # A sweeper (Optuna) minimises one number; None (a failed job) is a failed trial.
        return summary.get(run_cfg.train.objective) if run_cfg.train.objective else summary
    except Interrupted as e:  # a signal outside the train loop
        _interrupted(e, cfg, hydra_cfg, run_log, claim)
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
        if claim is not None and record_end(claim.dir, e.meta):
            run_log.attach(claim.dir)
            _status(claim.dir, "ok", **_job_fields(hydra_cfg, claim))
            if is_main():
                print(f"dxrun: checkpoint {e.checkpoint} is at the run's end, which it had not "
                      "recorded (stopped or killed after its last save): summary.json (from "
                      "metrics.jsonl) and status ok written", file=sys.stderr)
            return None
        run_log.discard()
        if is_main():
            _give_up(claim, hydra_cfg)
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
            _give_up(claim, hydra_cfg)
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
    finally:
        if claim is not None:  # the next job of a multirun, or a relaunch, may take it
            claim.release()


def _claim(asked: Path) -> Path:
    """Claim a new run's dir (plan mode); a used one gets a sibling, said at once rather than
    only in the last line."""
    run_dir = claim_run_dir(asked)
    if run_dir != asked:
        log.warning("%s already holds a run: this run writes to %s", asked, run_dir)
    return run_dir


def _claim_to_train(cfg: DictConfig, hydra_cfg: Any, asked: Path) -> Claim:
    """The dir this training job writes to (``run_dir.claim``), held by process 0 for the
    job's life; every process gets process 0's decision, a refusal included. A move away from
    ``asked`` is said at once rather than only in the last line."""
    from dxrun.checkpointing.store import checkpoint_dir, committed_steps  # JAX: after the device count

    wait_s = run_dirs.wait_seconds(cfg.run.wait_for_lock)
    claim, decision = None, {}
    if is_main():
        try:
            claim = run_dirs.claim(
                asked, named=_names_its_dir(hydra_cfg),
                fresh=str(cfg.checkpoint.resume) == "none", wait_s=wait_s,
                has_checkpoints=lambda d: bool(committed_steps(checkpoint_dir(cfg.checkpoint, d))))
            decision = {"dir": str(claim.dir), "continues": claim.continues}
        except ConfigError as e:
            decision = {"refusal": str(e)}
    # The others wait here while process 0 waits for the lock.
    decision = json.loads(agree(f"run_dir/{_job_key(hydra_cfg)}", json.dumps(decision),
                                timeout_s=300 + int(min(wait_s, 7 * 24 * 3600))))
    if "refusal" in decision:
        raise ConfigError(decision["refusal"])
    if claim is None:  # another process: the dir, never the lock
        claim = Claim(Path(decision["dir"]), earlier={} if decision["continues"] else None)
    if claim.dir != asked:
        log.warning("%s already holds a run: this run %s %s", asked,
                    "continues it in" if claim.continues else "writes to", claim.dir)
    return claim


def _names_its_dir(hydra_cfg: Any) -> bool:
    """Whether the run dir was named (``hydra.run.dir=<dir>``, a preset's, a fixed sweep dir)
    rather than generated from the clock (Hydra's default ``outputs/${now:...}``): only a named
    dir is continued by a relaunch; two launches in the same second share a generated name by
    chance and each takes its own dir."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    where = OmegaConf.to_container(hydra_cfg.sweep if multirun else hydra_cfg.run, resolve=False)
    return "${now:" not in str(where.get("dir", "")) + str(where.get("subdir", ""))


def _give_up(claim: Claim | None, hydra_cfg: Any) -> None:
    """A job that trains nothing leaves the dirs as they were: its lock goes, and a dir
    Hydra or the claim made for it goes too when nothing else is in it."""
    if claim is not None:
        claim.release()
        _discard_empty_dir(claim.dir)
    _discard_empty_dir(Path(hydra_cfg.runtime.output_dir))


def _interrupted(e: Interrupted, cfg: DictConfig, hydra_cfg: Any, run_log: RunLog,
                 claim: Claim | None) -> None:
    """A signal outside the train loop: one line, status ``stopped`` naming the newest
    checkpoint (if any) and the command that continues the run, and the signal's exit code. A
    job stopped before it claimed a dir leaves nothing behind."""
    if claim is None:
        log.info("%s: stopped %s; nothing was written", e.signal_name, e.when)
        run_log.discard()
        if is_main():
            _discard_empty_dir(Path(hydra_cfg.runtime.output_dir))
        sys.exit(e.code)
    from dxrun.checkpointing.store import checkpoint_dir, committed_steps  # JAX: after the device count

    run_log.attach(claim.dir)
    steps = committed_steps(checkpoint_dir(cfg.checkpoint, claim.dir))
    ckpt = checkpoint_dir(cfg.checkpoint, claim.dir) / str(steps[-1]) if steps else None
    relaunch = relaunch_command(list(hydra_cfg.overrides.task), claim.dir)
    saved = f"checkpoint {ckpt} is the newest" if ckpt else "no checkpoint yet"
    reason = f"{e.signal_name}: stopped {e.when}; {saved}. Resume with: {relaunch}"
    log.info(reason)
    _status(claim.dir, "stopped", signal=e.signal_name, step=steps[-1] if steps else 0,
            checkpoint=str(ckpt) if ckpt else None, relaunch=relaunch, reason=reason,
            **_job_fields(hydra_cfg, claim))
    sys.exit(e.code)


def _status(run_dir: Path, status: str, **fields: Any) -> None:
    if is_main():
        write_status(run_dir, status, **fields)
        tell_launcher(run_dir)  # which status.json to mark if the run's ranks are killed


def _job_key(hydra_cfg: Any) -> str:
    """Which job of this launch (a multirun's jobs run one after another in every process)."""
    return str(OmegaConf.select(hydra_cfg, "job.num", default=0))


def _asked_dir(hydra_cfg: Any) -> Path:
    """The run dir Hydra named on process 0. Other processes drop the one their own Hydra
    made when it differs (a launch across a second boundary names it differently)."""
    own = Path(hydra_cfg.runtime.output_dir)
    asked = Path(agree(f"asked/{_job_key(hydra_cfg)}", str(own)))
    if asked != own:
        _discard_empty_dir(own)
    return asked


def _job_fields(hydra_cfg: Any, claim: Claim | None = None) -> dict[str, Any]:
    return {"job": hydra_cfg.job.num if hydra_cfg.mode == RunMode.MULTIRUN else None,
            "overrides": list(hydra_cfg.overrides.task),
            "attempt": claim.attempt if claim else 1,
            "lost_attempts": claim.lost_attempts if claim else 0}


def _wandb_named(cfg: DictConfig, hydra_cfg: Any, multirun: bool) -> DictConfig:
    """A copy of ``cfg`` with the W&B group and job type the user left unset filled in, for the
    run to follow, so its W&B run, its saved config and the sweep report (which reads the saved
    config) agree on where it went: the jobs of one multirun share the group of their sweep dir
    and have job type "sweep". ``cfg`` itself is read, never rewritten."""
    import copy

    out = copy.deepcopy(cfg)
    if cfg.logger.job_type is None:
        out.logger.job_type = "sweep" if multirun else "train"
    if multirun and cfg.logger.group is None:
        out.logger.group = sweep_group(Path(hydra_cfg.sweep.dir))
    return out


def _job_failed(msg: str, crashed: bool) -> None:
    """A single run exits now (2 for refused input, 1 for a crash). In a multirun one bad job
    must not cost the rest of the sweep: its line now, its status.json for the report and the
    exit code (``cli``), and the next job runs."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        _fail(msg, code=EXIT_CRASHED if crashed else EXIT_REFUSED)
    print(f"dxrun: error: job #{hydra_cfg.job.num}: {msg}", file=sys.stderr)


# The working dir and what it held when this process started (``cli``): the top dir Hydra
# makes there for a run (``outputs/`` of a first run) is the run's to remove if it never starts.
_started_in: tuple[Path, frozenset[str]] | None = None


def _discard_empty_dir(run_dir: Path) -> None:
    """Hydra made the run dir before the config could be checked; a run that never started
    leaves nothing behind (and never touches a dir that holds anything or was there before)."""
    # The run dir and Hydra's <date>/ above it, never the working dir or a dir above it
    # (hydra.run.dir=run in an empty dir).
    cwd = Path.cwd().resolve()
    dirs = [d for d in (run_dir, run_dir.parent)
            if d.resolve() != cwd and d.resolve() not in cwd.parents]
    if _started_in is not None:
        cwd, had = _started_in
        top = run_dir.parent.parent
        if top.parent == cwd and top.name not in had:
            dirs.append(top)
    for d in dirs:
        try:
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        except OSError:  # removed (or filled) meanwhile by another process of the run
            return


def check_composition(argv: list[str]) -> None:
    """Compose the config the way Hydra will and turn a composition error (unknown option, unknown
    key, wrong type) or a run (sweep) dir that cannot be made into one line naming the key and
    the fix: for a single run, for every value of a multirun's sweeps, and beside ``hydra.*``
    overrides (how schedulers launch). Other Hydra flags (--cfg, --help, -cn, ...) are left to
    Hydra."""
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in ("-m", "--multirun") for f in flags):
        return
    from hydra import compose, initialize_config_dir

    # Hydra makes the run (or sweep) dir before dxrun's main runs: a dir it cannot make would
    # end in Hydra's traceback, so it is tried here first.
    out_key, default_dir = (("hydra.sweep.dir", "multirun/<date>/<time>") if flags
                            else ("hydra.run.dir", "outputs/<date>/<time>"))
    checked: set[str] = set()
    try:
        with initialize_config_dir(config_dir=_conf_dir(), version_base="1.3", job_name="dxrun"):
            for overrides in _one_job_per_sweep_value([a for a in argv if a not in flags]):
                cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
                out_dir = OmegaConf.select(cfg, out_key)
                with open_dict(cfg):
                    del cfg["hydra"]
                check_keys(cfg)
                if out_dir not in checked:
                    checked.add(out_dir)
                    if why := dir_refusal(out_key, out_dir, f"give a dir you can write to, or "
                                          f"leave {out_key} out ({default_dir})"):
                        raise ConfigError(why)
    except ConfigError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - anything we cannot phrase better goes to Hydra
        msg = composition_error(e)
        if msg:
            _fail(msg)


def _one_job_per_sweep_value(argv: list[str]) -> list[list[str]]:
    """Override lists that together use every value of every sweep (``a=1,2 b=x,y`` gives
    ``a=1 b=x``, ``a=2 b=x``, ``a=1 b=y``): each value composes once, not the full grid."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    # glob() sweeps name group options by pattern; Hydra expands (and reports) those itself.
    parsed = [o for o in OverridesParser.create().parse_overrides(argv)
              if o.value_type != ValueType.GLOB_CHOICE_SWEEP]
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
             if o.is_sweep_override() else o.input_line for o in parsed]
    jobs = [first]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                jobs.append([*first[:i], f"{o.get_key_element()}={value}", *first[i + 1:]])
    return jobs


def _fail(msg: str, code: int = EXIT_REFUSED) -> None:
    print(f"dxrun: error: {msg}", file=sys.stderr)
    sys.exit(code)


def cli() -> None:
    global _started_in
    guard_signals()  # before anything slow: a signal from here on ends the run in one line
    _started_in = (Path.cwd(), frozenset(os.listdir()))
    try:
        check_composition(sys.argv[1:])
        main()
    except Interrupted as e:  # outside a job (composing the config), or while it was failing
        print(f"dxrun: {e.signal_name}: stopped {e.when}", file=sys.stderr)
        sys.exit(e.code)
    from dxrun.report.callback import SWEEP_DIRS

    for sweep_dir in SWEEP_DIRS:
        _exit_for_failed_jobs(sweep_dir)


def _exit_for_failed_jobs(sweep_dir: Path) -> None:
    """Exit non-zero naming the failed jobs, read from their status.json like the report
    does: this also covers jobs that ran in other processes (submitit) or were killed.

    A job stopped by a signal after committing its checkpoint did not fail: it is named with
    its resume command, and with no failed job the sweep exits as a stopped single run does,
    0 for SIGTERM (a scheduler's requeue point) and 130 once any job was stopped by SIGINT."""
    from dxrun.report.collect import find_jobs

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
