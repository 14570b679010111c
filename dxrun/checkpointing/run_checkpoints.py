"""Saving during a run: what the train loop does between two steps (``RunCheckpoints``).

A save is due every ``checkpoint.every`` steps, every ``checkpoint.every_minutes`` of wall
clock, at the last step and on SIGUSR1; SIGTERM/SIGINT stop the run after a committed save
(``dxrun.run.signals`` turns the signals into flags). With several processes the processes
agree on the step a signal or a clock acts at (``ProcessAgreement``): a save is collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.checkpointing.store import (
    POINTER,
    Checkpointer,
    KeepStep,
    checkpoint_dir,
    committed_steps,
    refused_write,
    run_id,
)
from dxrun.config import (
    DiskError,
    NonFiniteError,
    Stopped,
    disk_error,
)
from dxrun.cost import MAX_CHECKPOINT_OVERHEAD, cadence_text, minutes_for_overhead
from dxrun.experiment import TrainState
from dxrun.run import Preemption, ProcessAgreement, faults_from_env, is_main, relaunch_command
from dxrun.tracking import NOTICEABLE_BLOCK_S, Monitor, SaveTotals

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig, TrainConfig



log = logging.getLogger("dxrun")


def time_due(now: float, last_save: float, every_s: float) -> bool:
    """The wall-clock cadence (``checkpoint.every_minutes``): a save is due when ``every_s``
    seconds (> 0; 0 = off) have passed since the last save (or the start)."""
    return every_s > 0 and now - last_save >= every_s


class SaveCost:
    """What saving costs the loop, on the clock that also times ``checkpoint.every_minutes``
    (``every_s``). A save's blocking time (``Checkpointer.save``'s) is kept until the loop's next
    metrics row takes it (``take_blocks``: ``perf/checkpoint_block_s``) and in total; above
    ``MAX_CHECKPOINT_OVERHEAD`` of the time since the previous save, one warning names a cadence
    that costs less."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s  # 0: no wall-clock cadence
        self.clock = clock  # time.monotonic; a test passes its own
        self.last_save_t = clock()
        self.block_total_s, self.saves = 0.0, 0
        self.unlogged: list[float] = []  # saves' blocking times the metrics do not hold yet
        self.warned = False

    def due(self) -> bool:
        """``checkpoint.every_minutes`` have passed since the last save (or the start)."""
        return time_due(self.clock(), self.last_save_t, self.every_s)

    def count(self, block_s: float) -> None:
        """One save held the loop ``block_s``: record it, and warn once when saves cost more
        than ``MAX_CHECKPOINT_OVERHEAD`` of the time since the previous one."""
        now = self.clock()
        since = now - self.last_save_t
        self.last_save_t = now
        self.unlogged.append(block_s)
        self.block_total_s += block_s
        self.saves += 1
        # A small state's saves (the tiny models on CPU) are not worth a warning whatever their
        # share; the first save's interval holds the compile: not judged.
        over = block_s > MAX_CHECKPOINT_OVERHEAD * since and block_s >= NOTICEABLE_BLOCK_S
        if self.saves > 1 and over and not self.warned:
            self.warned = True
            log.warning("checkpoint saves hold the loop %.2f s every %.1f s (%.0f%% of the "
                        "run, above %.0f%%); save less often: checkpoint.every=0 "
                        "checkpoint.every_minutes=%d", block_s, since, 100 * block_s / since,
                        100 * MAX_CHECKPOINT_OVERHEAD, minutes_for_overhead(block_s))

    def totals(self) -> SaveTotals:
        """This attempt's saves so far (what the step timer's note compares)."""
        return SaveTotals(self.block_total_s, self.saves)

    def take_blocks(self) -> list[float]:
        """The blocking times of the saves since the last call."""
        taken, self.unlogged = self.unlogged, []
        return taken


class RunCheckpoints:
    """What the train loop does between two steps: save when due (``checkpoint.every`` steps,
    ``checkpoint.every_minutes`` of wall clock, the last step, SIGUSR1), stop after a committed
    save on SIGTERM/SIGINT, and halt on a non-finite step (``train.nan_policy=halt``). The
    finiteness flag is read only where the host waits anyway (log and save steps), so a halt
    reports the exact first bad step, at the next of those, without a save of the bad state.
    What the saves cost the loop: ``cost`` (``SaveCost``). With several processes a wall-clock
    save goes through the same agreement as a signal (``ProcessAgreement``): every process saves
    at the same step, whichever clock said so."""

    def __init__(self, ckpt: CheckpointConfig, train: TrainConfig, run_dir: Path, start: int,
                 meta: dict[str, Any], iterator: Any, logger: Any, cadence: tuple[int, float],
                 tokens: Callable[[int], int] | None = None, overrides: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 resumed: dict[str, Any] | None = None):
        log.info("checkpoints: %s", cadence_text(*cadence))  # decided by platform, state
        self.start = start  # the step this attempt began at: saved already, or the init
        every, minutes = cadence  # (steps, minutes) between saves: cadence.save_cadence
        self.every, self.log_every = every, train.log_every
        self.cost = SaveCost(60.0 * minutes, clock)
        self.halt = train.nan_policy == "halt"
        self.faults = faults_from_env()  # test-only: see between_steps
        # A SIGUSR1 not yet answered by a save: with several processes the save comes at the
        # step they agree on, some steps after the signal cleared its flag.
        self.usr1_pending = False
        # Every checkpoint names the run that wrote it (evaluation writes its results there).
        self.meta = {**meta, "run_id": run_id(run_dir), "run_dir": str(Path(run_dir).resolve())}
        self.iterator, self.logger, self.preemption = iterator, logger, Preemption()
        self.tokens = tokens  # tokens trained on after a step (carried across resumes)
        directory = checkpoint_dir(ckpt, run_dir)
        if ckpt.dir and is_main():  # the run dir leads to its checkpoints (locate)
            (Path(run_dir) / POINTER).write_text(f"{directory}\n")
        # checkpoint.keep_best: the best value's checkpoint, saved when the metric improves,
        # stays beside the newest ``keep``; every monitor in ``watch`` (train.early_stop's too)
        # is saved in each checkpoint's meta, and a resume continues it from there.
        self.watch: dict[str, Monitor] = {}
        self.keep_best, self.best_due = None, False
        if ckpt.keep_best:
            self.watch["keep_best"] = Monitor.from_json(
                (resumed or {}).get("keep_best"), ckpt.keep_best, ckpt.keep_best_mode)
            self.keep_best = KeepStep(self.watch["keep_best"].step)
        self.saver = Checkpointer(directory, ckpt.keep, self.keep_best)
        self.last_saved: Path | None = None
        # the command that resumes this run (the launch's ``overrides``), for the stop line
        self.relaunch = relaunch_command(overrides, run_dir) if overrides is not None else None
        # Several processes act on a signal at one agreed step (a save is collective).
        self.agreement = ProcessAgreement() if jax.process_count() > 1 else None

    def between_steps(self, done: int, state: TrainState, last: bool = False) -> None:
        """After step ``done`` (the iterator has given exactly ``done`` batches)."""
        self.faults.after_step(done, lambda: self.preemption.save)  # test-only faults
        stop, signalled = self.preemption.stop, self.preemption.take_save()
        self.usr1_pending |= signalled
        ran = done > self.start
        timed = ran and self.cost.due()
        asked = signalled or timed
        if self.agreement is not None:
            stop, asked = self.agreement(done, stop, asked)
        cadence = bool(self.every) or self.cost.every_s > 0
        due = ran and ((bool(self.every) and done % self.every == 0) or (last and cadence)
                       or self.best_due)
        if due or stop or asked:
            self._check_finite(done, state)
            meta = {**self.meta, "step": done, "data": self.iterator.get_state(),
                    "wandb_id": self.logger.run_id,
                    **{k: m.to_json() for k, m in self.watch.items()}}
            if self.best_due:
                self.keep_best.step, self.best_due = done, False
            if self.tokens is not None:
                meta["tokens_seen"] = self.tokens(done)
            self.last_saved, block_s = self.saver.save(done, state, meta)
            if block_s is not None:
                self.cost.count(block_s)
            if self.usr1_pending and not stop:
                log.info("SIGUSR1: saving checkpoint %s; training goes on", self.last_saved)
            self.usr1_pending = False
        elif ran and (done % self.log_every == 0 or last):
            self._check_finite(done, state)
        if stop:
            self.saver.wait()
            log.info("%s: stopped at step %d; checkpoint %s committed. Resume with: %s", stop,
                     done, self.last_saved, self.relaunch or "the same command and run dir")
            raise Stopped(stop, done, self.last_saved, self.relaunch)

    def observe(self, done: int, row: dict[str, Any]) -> None:
        """Step ``done``'s row: a new best of ``checkpoint.keep_best`` makes a save due at
        this step's save point (which follows its row)."""
        if "keep_best" in self.watch and self.watch["keep_best"].see(done, row):
            self.best_due = True

    def best(self) -> dict[str, Any] | None:
        """summary.json's ``best_checkpoint``: the metric, its best value, its step and dir."""
        if self.keep_best is None or self.keep_best.step is None:
            return None
        m = self.watch["keep_best"]
        return {"metric": m.metric, "mode": m.mode, "value": m.best, "step": m.step,
                "path": str(self.saver.directory / str(self.keep_best.step))}

    def _check_finite(self, done: int, state: TrainState) -> None:
        if not self.halt:
            return
        bad = int(jax.device_get(state.nonfinite_step))
        if bad:
            raise halted(self.saver, f"non-finite loss or gradients at step {bad} (stopped at step "
                              f"{done}, train.nan_policy=halt)",
                              "set train.nan_policy=skip to leave such steps out")

    def close(self) -> None:
        """Wait for the last save to be committed."""
        self.saver.close()


def halted(saver: Checkpointer, what: str, fix: str) -> NonFiniteError:
    """The one line of a run stopped by a non-finite step (train.nan_policy=halt, or
    train.debug_nans): ``what`` happened, the last good checkpoint (only one that was
    committed: the save in flight is waited for) and the fix."""
    saver.wait()
    good = committed_steps(saver.directory)
    where = (f"the last good checkpoint is {saver.directory / str(good[-1])}"
             if good else "no checkpoint was saved before it")
    return NonFiniteError(f"{what}; {where}; lower optimizer.lr or {fix}")


def refused(e: BaseException, saver: Checkpointer) -> DiskError | None:
    """The one line of a write the disk refused (``errors.disk_error``), naming the file it
    was writing and the checkpoint kept; None where ``e`` is no disk error."""
    if (why := disk_error(e)) is None:
        return None
    return refused_write(_written(e), why, saver.directory)


def _written(e: BaseException) -> str:
    """The file a refused write was writing (an OSError's filename), for its one line."""
    while e is not None:
        if isinstance(e, OSError) and e.filename:
            return str(e.filename).removesuffix(".tmp")  # write_json's tmp file: its target
        e = e.__cause__ or e.__context__
    return "a run file"
