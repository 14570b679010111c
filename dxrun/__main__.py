"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train; and,
below ``main``, the job's own part: the run dir it claims (released or tidied away) and how it
ended, written there once (``JobStatus``: status.json).

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dxrun.config import (
    EXIT_CRASHED,
    EXIT_REFUSED,
    ConfigError,
    DiskError,
    Interrupted,
    NonFiniteError,
    NothingToTrain,
    Stopped,
    check_targets,
    fail,
    first_line,
)
from dxrun.config.composition import composition_refusal
from dxrun.config.registry import check_composed, conf_dir, register
from dxrun.config.validation import config_warnings, validate
from dxrun.plan.run_plan import resolved_config
from dxrun.run import runtime
from dxrun.run.runtime import (
    SIGNALS,
    SWEEP_EXITS,
    Claim,
    Job,
    RunLog,
    accelerator_plan_note,
    agree,
    claim_run_dir,
    collect_cycles_rarely,
    command_imports,
    cpu_fallback_refusal,
    enable_compile_cache,
    guard_signals,
    is_main,
    join,
    nvidia_device_node,
    relaunch_command,
    reuse_pays,
    simulate_cpu_devices,
    simulated_count,
    stopped_words,
    store_refusal,
    sweep_group,
    tell_launcher,
    tell_launcher_startup,
    thread_pool_note,
    write_hydra_files,
    write_status,
)
from dxrun.tracking import job_started_at, mark, record_end

if TYPE_CHECKING:
    from hydra.conf import HydraConf

    from dxrun.config import CheckpointConfig, RunConfig, RunSection


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


def multirun_only(target: str, mode: Any) -> str:
    """A ``hydra.callbacks`` entry's ``_target_`` (conf/config.yaml) for a callback of multiruns
    alone: ``target`` in a multirun, else Hydra's callback that does nothing, so that a single
    run imports nothing of ``target``'s package (the sweep report's)."""
    multirun = getattr(mode, "name", str(mode)) == RunMode.MULTIRUN.name
    return target if multirun else "hydra.experimental.callback.Callback"


log = logging.getLogger("dxrun")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" noise
logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines
logging.getLogger("jax._src.distributed").setLevel(logging.WARNING)  # dxrun says it in one line
register()
_register_sweeper()
OmegaConf.register_new_resolver("multirun_only", multirun_only, replace=True)


@hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")
def main(cfg: DictConfig) -> Any:
    """Compose (Hydra), check, start JAX, then plan or train: the job runs inside its
    ``JobStatus``, which writes how it ended (status.json, its line, its exit code)."""
    started = job_started_at()  # goodput's wall time counts from here (the process's start)
    mark("compose")
    SIGNALS.start_job()
    hydra_cfg = HydraConfig.get()
    with JobStatus(cfg, hydra_cfg) as status:
        _check(cfg, hydra_cfg)
        simulated = _start_jax(cfg, status)
        if cfg.run.mode == "plan":
            return _plan(cfg, hydra_cfg, status)
        summary = _train(cfg, hydra_cfg, status, started, simulated)
        # A sweeper (Optuna) minimises one number; None (a failed job) is a failed trial.
        return summary.get(cfg.train.objective) if cfg.train.objective else summary
    return None  # the job failed, and a multirun goes on: its status.json says how


def _check(cfg: RunConfig, hydra_cfg: HydraConf) -> None:
    """The config's keys and values, before JAX starts."""
    # model.init_from=hf:<dir>: the model section is the checkpoint's config.json
    check_composed(cfg, list(hydra_cfg.overrides.task))
    validate(cfg)
    if cfg.run.mode != "plan" and (why := store_refusal(cfg.logger)):
        raise ConfigError(why)  # a logger that cannot start: refused before the run


def _start_jax(cfg: RunConfig, status: JobStatus) -> bool:
    """The devices (simulated CPU ones where asked), joined to a multi-process run, checked
    against the run; the compile cache and the targets. Whether CPU devices are simulated."""
    # Plan mode simulates plan.devices (the planned run's device count), a run
    # runtime.cpu_devices: set before JAX starts.
    n_cpu, count_note = simulated_count(cfg.run.mode, cfg.plan.devices, cfg.runtime.cpu_devices)
    simulated = simulate_cpu_devices(n_cpu, reuse=reuse_pays(cfg, n_cpu))
    joined = join(cfg.distributed)  # before anything touches a JAX device
    import jax

    if joined is not None:
        status.run_log.for_process(joined.process_id, joined.num_processes)
        if not is_main():
            status.run_log.quiet_console()
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
    return simulated


def _plan(cfg: RunConfig, hydra_cfg: HydraConf, status: JobStatus) -> Any:
    """run.mode=plan: the decision reported for plan.target; nothing trained."""
    with command_imports():
        from dxrun.autotune.fit import planned, run_plan  # imports JAX

    # data.seq_len=null resolved for the target; for parallelism=auto the layout
    # ranked first by the estimate alone, for plan.target: in the plan, cfg as it is.
    decided = planned(cfg)
    status.run_dir = run_dir = claim_new(Path(hydra_cfg.runtime.output_dir))
    status.run_log.attach(run_dir)
    # The saved config holds the derived numbers: the global batch, the layout.
    write_hydra_files(run_dir, resolved_config(cfg, decided.plan), hydra_cfg)
    return run_plan(cfg, run_dir, decided)


def _train(cfg: RunConfig, hydra_cfg: HydraConf, status: JobStatus, started: float,
           simulated: bool) -> dict[str, Any]:
    """Claim the run dir, prepare the run, train it; its summary."""
    import jax

    with command_imports():
        from dxrun.train import (
            prepare,  # imports JAX
            train,  # imports JAX
        )

    # Every process uses process 0's run dir (their clocks may name it differently).
    # Claimed and held before the plan and the compile, so that a second launch into a
    # held dir is refused at once (or waits) instead of compiling beside it.
    claim = claim_to_train(cfg.run, cfg.checkpoint, hydra_cfg, asked_dir(hydra_cfg),
                           status.held)
    run_dir = status.claimed(claim)
    # The plan, the data, the checkpoint to resume and the memory preflight: fail before
    # anything is written. The run follows cfg; what is derived from it (the layout...) is
    # in ``prepared.plan``, where the run sits (its W&B names) in ``job``.
    mark("jax")
    prepared = prepare(cfg, run_dir)
    resume = prepared.resume
    if simulated and not status.multirun and (note := thread_pool_note(
            len(prepared.exp.plan.device_ids), jax.local_device_count(), os.cpu_count())):
        log.info(note)
    status.run_log.attach(run_dir)
    if claim.continues and not (resume is not None and resume.in_place):
        last = {"running": "died (killed: its status still said running)",
                "stopped": "was stopped", "failed": "failed"}.get(
                    (claim.earlier or {}).get("status"), "ended")
        log.warning("%s: attempt %d of its run; the last one %s before its first "
                    "checkpoint, so this one starts again from %s", run_dir, claim.attempt,
                    last, resume.directory if resume is not None else "step 0")
    job = _job(cfg, hydra_cfg, started, claim.continues)
    if is_main():  # the plan's batch and sequence length, the W&B names: written once
        write_hydra_files(run_dir, resolved_config(
            cfg, prepared.plan, job_type=job.job_type, group=job.group), hydra_cfg)
    status.write("running")
    summary = train(cfg, run_dir, job, prepared)
    status.ended(summary)
    return summary


def _job(cfg: RunConfig, hydra_cfg: HydraConf, started: float, continues: bool) -> Job:
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
               continues=continues, group=group, job_type=job_type)


def cli() -> None:
    mark("launch")  # the interpreter and this module's imports (goodput's startup phases)
    guard_signals()  # before anything slow: a signal from here on ends the run in one line
    collect_cycles_rarely()
    remember_start()
    try:
        if refusal := composition_refusal(sys.argv[1:]):
            fail(refusal)
        main()
    except Interrupted as e:  # outside a job (composing the config), or while it was failing
        print(f"dxrun: {e.signal_name}: stopped {e.when}", file=sys.stderr)
        sys.exit(e.code)
    for sweep_exit in SWEEP_EXITS:  # a multirun's, from its jobs (report.SweepReport)
        sweep_exit()



# ------------------------------------------------------------------------------------------------
# The run dir a Hydra job trains in: claimed once for every process, released or tidied away;
# and how the job ended, written there once (``JobStatus``: status.json).
#
# A job that never starts leaves the dirs as they were: Hydra makes its dir before the config is
# checked, so a refused or stopped job removes what was made for it (and nothing else).

def claim_new(asked: Path) -> Path:
    """Claim a new run's dir (plan mode); a used one gets a sibling, said at once rather than
    only in the last line."""
    run_dir = claim_run_dir(asked)
    if run_dir != asked:
        log.warning("%s already holds a run: this run writes to %s", asked, run_dir)
    return run_dir


def _committed(ckpt: CheckpointConfig, run_dir: Path) -> tuple[Path, list[int]]:
    """The run dir's checkpoint dir and the steps committed there."""
    from dxrun.checkpointing import checkpoint_dir, committed_steps  # JAX after devices

    checkpoints = checkpoint_dir(ckpt, run_dir)
    return checkpoints, committed_steps(checkpoints)


def claim_to_train(run: RunSection, ckpt: CheckpointConfig, hydra_cfg: HydraConf,
                   asked: Path, held: list[Claim] | None = None) -> Claim:
    """The dir this training job writes to (``runtime.claim``), held by process 0 for the
    job's life; every process gets process 0's decision, a refusal included. A move away from
    ``asked`` is said at once rather than only in the last line. ``held``: as ``runtime.claim``
    (the caller's hold on the dir from the moment it is locked)."""
    wait_s = runtime.wait_seconds(run.wait_for_lock)
    claim, decision = None, {}
    if is_main():
        try:
            claim = runtime.claim(
                asked, named=names_its_dir(hydra_cfg),
                fresh=str(ckpt.resume) == "none", wait_s=wait_s, held=held,
                has_checkpoints=lambda d: bool(_committed(ckpt, d)[1]))
            decision = {"dir": str(claim.dir), "continues": claim.continues}
            _tell_launcher(claim, *_committed(ckpt, claim.dir))
        except ConfigError as e:
            decision = {"refusal": str(e)}
    # The others wait here while process 0 waits for the lock.
    decision = json.loads(agree(f"run_dir/{job_key(hydra_cfg)}", json.dumps(decision),
                                timeout_s=300 + int(min(wait_s, 7 * 24 * 3600))))
    if "refusal" in decision:
        raise ConfigError(decision["refusal"])
    if claim is None:  # another process: the dir, never the lock
        claim = Claim(Path(decision["dir"]), earlier={} if decision["continues"] else None)
    if claim.dir != asked:
        log.warning("%s already holds a run: this run %s %s", asked,
                    "continues it in" if claim.continues else "writes to", claim.dir)
    return claim


def _tell_launcher(claim: Claim, checkpoints: Path, steps: list[int]) -> None:
    """What process 0's status.json would say after a stop while starting (nothing is saved
    before the train loop; ``steps``: the committed ones), for ``dxrun.launch`` to write if
    process 0 cannot: stuck inside a startup collective, where the signal never reaches it."""
    tell_launcher_startup("claimed", {
        "run_dir": str(claim.dir), "step": steps[-1] if steps else 0,
        "checkpoint": str(checkpoints / str(steps[-1])) if steps else None,
        "attempt": claim.attempt, "lost_attempts": claim.lost_attempts})


def names_its_dir(hydra_cfg: HydraConf) -> bool:
    """Whether the run dir was named (``hydra.run.dir=<dir>``, a preset's, a fixed sweep dir)
    rather than generated from the clock (Hydra's default ``outputs/${now:...}``): only a named
    dir is continued by a relaunch; two launches in the same second share a generated name by
    chance and each takes its own dir."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    where = OmegaConf.to_container(hydra_cfg.sweep if multirun else hydra_cfg.run, resolve=False)
    return "${now:" not in str(where.get("dir", "")) + str(where.get("subdir", ""))


def give_up(claim: Claim | None, hydra_cfg: HydraConf) -> None:
    """A job that trains nothing leaves the dirs as they were: its lock goes, and a dir
    Hydra or the claim made for it goes too when nothing else is in it."""
    if claim is not None:
        claim.release()
        discard_empty_dir(claim.dir)
    discard_empty_dir(Path(hydra_cfg.runtime.output_dir))


def job_key(hydra_cfg: HydraConf) -> str:
    """Which job of this launch (a multirun's jobs run one after another in every process)."""
    return str(OmegaConf.select(hydra_cfg, "job.num", default=0))


def asked_dir(hydra_cfg: HydraConf) -> Path:
    """The run dir Hydra named on process 0. Other processes drop the one their own Hydra
    made when it differs (a launch across a second boundary names it differently)."""
    own = Path(hydra_cfg.runtime.output_dir)
    asked = Path(agree(f"asked/{job_key(hydra_cfg)}", str(own)))
    if asked != own:
        discard_empty_dir(own)
    return asked


# The working dir and what it held when this process started (``cli``): the top dir Hydra
# makes there for a run (``outputs/`` of a first run) is the run's to remove if it never starts.
_started_in: tuple[Path, frozenset[str]] | None = None


def remember_start() -> None:
    """Note the working dir and what it holds, before Hydra makes anything there."""
    global _started_in
    _started_in = (Path.cwd(), frozenset(os.listdir()))


def discard_empty_dir(run_dir: Path) -> None:
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


class JobStatus:
    """How a job ended, written by this one object: its run dir's status.json (``running``
    once it trains, then ``ok``, ``stopped`` or ``failed`` of kind refused | crashed |
    nonfinite | disk), its one line and its exit code. The job runs inside it (``with``); an
    exception that ends the job is mapped to its ending in ``__exit__``. It holds the job's
    claim on its dir (``held``: from the moment the lock is taken), released at the end, and
    the run log, attached to the dir once the run has one."""

    def __init__(self, cfg: RunConfig, hydra_cfg: HydraConf, run_log: RunLog | None = None):
        # the run log's lines wait in memory until this run has claimed its own dir
        self.cfg, self.hydra_cfg, self.run_log = cfg, hydra_cfg, run_log or RunLog()
        self.multirun = hydra_cfg.mode == RunMode.MULTIRUN
        self.run_dir: Path | None = None
        self.claim: Claim | None = None  # the run dir this job trains in, held until it ends
        self.held: list[Claim] = []  # the claim from the moment its lock is taken

    def claimed(self, claim: Claim) -> Path:
        self.claim, self.run_dir = claim, claim.dir
        return claim.dir

    def write(self, status: str, run_dir: Path | None = None, **fields: Any) -> None:
        """status.json in ``run_dir`` (the job's), with the job's own fields."""
        if is_main():
            claim = self.claim
            write_status(run_dir or self.run_dir, status, **fields,
                         job=self.hydra_cfg.job.num if self.multirun else None,
                         overrides=list(self.hydra_cfg.overrides.task),
                         attempt=claim.attempt if claim else 1,
                         lost_attempts=claim.lost_attempts if claim else 0)
            tell_launcher(run_dir or self.run_dir)  # which status.json to mark if killed

    def ended(self, summary: dict[str, Any], run_dir: Path | None = None) -> None:
        """The run reached its end (train.steps, or train.early_stop's plateau)."""
        self.write("ok", run_dir, **({"reason": summary["early_stop"]}
                                     if "early_stop" in summary else {}))

    def __enter__(self) -> JobStatus:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> bool:
        """The job's ending for ``e``; True: the job is over and, in a multirun, the next one
        runs (a single run exits here with its code)."""
        try:
            ending = next((end for cls, end in ENDINGS if isinstance(e, cls)), None)
            if ending is None:  # no exception, or one that is no ending (SystemExit)
                return False
            ending(self, e)
            return True
        finally:  # the next job of a multirun, or a relaunch, may take the dir
            for claim in (self.claim, *self.held):  # held: locked before it was returned
                if claim is not None:
                    claim.release()

    def failed(self, msg: str, crashed: bool) -> None:
        """A single run exits now (2 for refused input, 1 for a crash). In a multirun one bad
        job must not cost the rest of the sweep: its line now, its status.json for the report
        and the exit code (``cli``), and the next job runs."""
        job = f"job #{self.hydra_cfg.job.num}: " if self.multirun else ""
        self.run_log.write_error(f"dxrun: error: {job}{msg}")  # the log ends as the terminal
        if not self.multirun:
            fail(msg, code=EXIT_CRASHED if crashed else EXIT_REFUSED)
        print(f"dxrun: error: {job}{msg}", file=sys.stderr)


def _stopped(status: JobStatus, e: Stopped) -> None:
    """Preempted in the loop: the checkpoint is committed; a requeue resumes it."""
    status.write("stopped", signal=e.signal_name, step=e.step, checkpoint=str(e.checkpoint),
                 relaunch=e.relaunch, reason=str(e))
    sys.exit(e.code)


def _interrupted(status: JobStatus, e: Interrupted) -> None:
    """A signal outside the train loop: one line, status ``stopped`` naming the newest
    checkpoint (if any) and the command that continues the run, and the signal's exit
    code. A job stopped before it claimed a dir leaves nothing behind."""
    claim = status.claim = status.claim or (status.held[0] if status.held else None)
    if claim is None:
        log.info("%s: stopped %s; nothing was written", e.signal_name, e.when)
        status.run_log.discard()
        if is_main():
            discard_empty_dir(Path(status.hydra_cfg.runtime.output_dir))
        sys.exit(e.code)
    status.run_log.attach(claim.dir)
    ckpts, steps = _committed(status.cfg.checkpoint, claim.dir)
    newest = ckpts / str(steps[-1]) if steps else None
    relaunch = relaunch_command(list(status.hydra_cfg.overrides.task), claim.dir)
    reason = stopped_words(e.signal_name, e.when, newest, relaunch)
    log.info(reason)
    status.write("stopped", claim.dir, signal=e.signal_name, step=steps[-1] if steps else 0,
                 checkpoint=str(newest) if newest else None, relaunch=relaunch, reason=reason)
    sys.exit(e.code)


def _nonfinite(status: JobStatus, e: NonFiniteError) -> None:
    """train.nan_policy=halt: the last good checkpoint is kept."""
    status.write("failed", kind="nonfinite", reason=str(e))
    status.failed(str(e), crashed=True)


def _disk(status: JobStatus, e: DiskError) -> None:
    """A write the disk refused: the checkpoint kept is named."""
    log_path = status.run_log.attach(status.run_dir)
    status.run_log.write_traceback(e)
    status.write("failed", kind="disk", reason=str(e), log=str(log_path))
    status.failed(str(e), crashed=True)


def _nothing_to_train(status: JobStatus, e: NothingToTrain) -> None:
    """A relaunch of a finished run: its files stay as they are, unless it reached its end
    and was stopped or killed before recording it."""
    claim = status.claim
    if claim is not None and (summary := record_end(claim.dir, e.meta)) is not None:
        status.run_log.attach(claim.dir)
        status.ended(summary, claim.dir)
        if is_main():
            print(f"dxrun: checkpoint {e.checkpoint} is at the run's end, which it had not "
                  "recorded (stopped or killed after its last save): summary.json (from "
                  "metrics.jsonl) and status ok written", file=sys.stderr)
        return
    status.run_log.discard()
    if is_main():
        give_up(claim, status.hydra_cfg)
        print(f"dxrun: {e}", file=sys.stderr)


def _refused(status: JobStatus, e: ConfigError) -> None:
    status.run_log.discard()
    if status.multirun and is_main():  # the sweep report lists it beside the other jobs
        run_dir = status.claim.dir if status.claim else claim_run_dir(
            Path(status.hydra_cfg.runtime.output_dir))
        write_hydra_files(run_dir, status.cfg, status.hydra_cfg)
        status.write("failed", run_dir, kind="refused", reason=str(e))
    elif is_main():  # the others share its dir: one process tidies it, never two at once
        give_up(status.claim, status.hydra_cfg)
    status.failed(str(e), crashed=False)


def _crashed(status: JobStatus, e: Exception) -> None:
    """A crash: one line, the traceback in the run's log."""
    run_dir = status.run_dir
    if run_dir is None:  # failed before claiming: the traceback still needs a home
        output_dir = Path(status.hydra_cfg.runtime.output_dir)
        run_dir = claim_run_dir(output_dir) if is_main() else output_dir
    try:
        log_path = status.run_log.attach(run_dir)
        status.run_log.write_traceback(e)
    except OSError:  # the dir is gone (removed under us): the traceback goes to stderr
        import traceback

        traceback.print_exception(e)
        log_path = Path("<stderr>")
    reason = f"{type(e).__name__}: {first_line(e)}"
    status.write("failed", run_dir, kind="crashed", reason=reason, log=str(log_path))
    status.failed(f"{reason} (full traceback: {log_path})", crashed=True)


# How a job ends, by what ended it (the first class that matches).
ENDINGS: tuple[tuple[type[BaseException], Callable[[JobStatus, Any], None]], ...] = (
    (Stopped, _stopped), (Interrupted, _interrupted), (NonFiniteError, _nonfinite),
    (DiskError, _disk), (NothingToTrain, _nothing_to_train), (ConfigError, _refused),
    (Exception, _crashed))


if __name__ == "__main__":
    cli()
