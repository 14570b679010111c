"""The run dir a Hydra job trains in: claimed once for every process, released or tidied away;
and how the job ended, written there once (``JobStatus``: status.json).

A job that never starts leaves the dirs as they were: Hydra makes its dir before the config is
checked, so a refused or stopped job removes what was made for it (and nothing else).
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

from hydra.types import RunMode
from omegaconf import OmegaConf

from dxrun.config import (
    EXIT_CRASHED,
    EXIT_REFUSED,
    ConfigError,
    DiskError,
    Interrupted,
    NonFiniteError,
    NothingToTrain,
    Stopped,
    fail,
    first_line,
)
from dxrun.run import (
    Claim,
    RunLog,
    agree,
    claim_run_dir,
    is_main,
    relaunch_command,
    stopped_words,
    tell_launcher,
    tell_launcher_startup,
    wait_seconds,
    write_hydra_files,
    write_status,
)
from dxrun.run import claim as claim_dir
from dxrun.tracking import record_end

if TYPE_CHECKING:
    from hydra.conf import HydraConf

    from dxrun.config import CheckpointConfig, RunConfig, RunSection



log = logging.getLogger("dxrun")


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
    """The dir this training job writes to (``dxrun.run.claim``), held by process 0 for the
    job's life; every process gets process 0's decision, a refusal included. A move away from
    ``asked`` is said at once rather than only in the last line. ``held``: as ``dxrun.run.claim``
    (the caller's hold on the dir from the moment it is locked)."""
    wait_s = wait_seconds(run.wait_for_lock)
    claim, decision = None, {}
    if is_main():
        try:
            claim = claim_dir(
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
