"""The Orbax store of a run's checkpoints: where they live, saving one, reading one.

A checkpoint is one Orbax step dir with two items: ``state`` (the ``TrainState``, each process
writing its own shards) and ``meta`` (JSON: the data iterator's position, the resolved config,
the mesh plan, the W&B run id). Saves are asynchronous: the disk writes run in a background
thread while training goes on, into a tmp dir renamed when complete, so a crash mid-save never
leaves a dir that looks finished; checkpoints beyond ``checkpoint.keep`` go only after the new
one is committed, except the best one (``checkpoint.keep_best``: ``KeepStep``).

Checkpoints belong to their run: ``<run dir>/checkpoints``, or with ``checkpoint.dir``
``<checkpoint.dir>/<run id>/`` (``run_id``: the run dir's name and a hash of its absolute path,
so a requeue into the same run dir finds them again), named in the run dir's ``checkpoints.txt``
for ``locate`` and for the run dir once moved. Each checkpoint's meta names its run too.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from dxrun.checkpointing.damage import check_meta, quiet_failed_writes
from dxrun.config import (
    DiskError,
    disk_error,
)
from dxrun.experiment import TrainState

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig



log = logging.getLogger("dxrun")

STATE, META = "state", "meta"  # a checkpoint's two items


POINTER = "checkpoints.txt"  # in a run dir whose checkpoints live under checkpoint.dir


def run_id(run_dir: Path) -> str:
    """``<run dir name>-<8 hex>``: stable for a run dir (a requeue finds its checkpoints again),
    distinct for two run dirs of the same name."""
    path = str(Path(run_dir).expanduser().resolve())
    return f"{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def checkpoint_dir(ckpt: CheckpointConfig, run_dir: Path) -> Path:
    """This run's own checkpoints dir: ``<run dir>/checkpoints``, or ``<checkpoint.dir>/<run id>``
    (a shared dir holds many runs' checkpoints, each in its own subdir)."""
    if not ckpt.dir:
        return Path(run_dir).absolute() / "checkpoints"  # absolute: Orbax refuses relative paths
    root = Path(ckpt.dir).expanduser().absolute()
    # A run dir moved after its first save: its run id came from the path it had then, and its
    # checkpoints.txt, written at that save, still names them.
    try:
        named = Path((Path(run_dir) / POINTER).read_text().strip())
    except (OSError, ValueError):
        named = None
    if named is not None and named.name and named.parent.resolve() == root.resolve():
        return root / named.name
    return root / run_id(run_dir)


def committed_steps(directory: Path) -> list[int]:
    """Steps Orbax finished writing (its tmp dirs of interrupted saves are not among them)."""
    return sorted(ocp.path.step.checkpoint_steps(directory)) if directory.is_dir() else []


def rotated_away(directory: Path, step: int, wait: bool) -> bool:
    """Whether checkpoint ``step`` of ``directory``, which failed to read, is going: a live run
    (read by a tool or a warm start while it trains) rotated it away (``checkpoint.keep``)
    during the read. With ``wait``, a step with newer ones beside it, whose files may still be
    being deleted, is waited for up to ``DELETION_S`` (never the newest, which stays)."""
    deadline = time.monotonic() + (DELETION_S if wait else 0)
    while step in (steps := committed_steps(directory)):
        if steps[-1] == step or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


DELETION_S = 2.0


def _one_writer_per_shard() -> None:
    """Each shard is written by its first replica, as Orbax does on GPUs. Orbax's default
    elsewhere splits every replicated shard over its replicas (to spread a TPU pod's writes),
    which on simulated CPU devices compiles and runs a slice program per array and device, and
    holds the loop far longer than the copy to the host. The files are the same either way
    (either kind restores)."""
    default = ocp.type_handlers.get_type_handler(jax.Array)
    if not getattr(default, "_use_replica_parallel", False):
        return  # set already (or an Orbax without it: test_checkpoint.py would say so)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns of every override; this one is on purpose
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False,
            array_metadata_store=getattr(default, "_array_metadata_store", None)),
            override=True)
    finally:
        absl.setLevel(level)


@dataclass
class KeepStep:
    """An Orbax preservation policy: the checkpoint of ``step`` stays whatever the rotation
    says (``checkpoint.keep_best``: the best one's step, moved as the best improves)."""

    step: int | None = None

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        return [c.step == self.step for c in checkpoints]


def _manager(directory: Path, keep: int, best: KeepStep | None = None
             ) -> ocp.CheckpointManager:
    """The saving side (reads go through ``read``)."""
    _one_writer_per_shard()
    policy = ocp.checkpoint_managers.LatestN(keep)
    if best is not None:
        policy = ocp.checkpoint_managers.AnyPreservationPolicy([policy, best])
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True,
        preservation_policy=policy)
    return ocp.CheckpointManager(directory, options=options, item_names=(STATE, META))


def read(step_dir: Path, state: ocp.args.CheckpointArgs | None = None, resuming: bool = True
         ) -> tuple[dict[str, Any], Any]:
    """This process's read of one checkpoint: its meta (``resuming``: checked to hold what a
    resume reads, ``check_meta``) and, given ``state`` (restore args), its arrays. Through
    Orbax's handlers, which read without the manager's closing barrier across processes: a
    process that fails to read must still reach the agreement on the step (``gather``), not
    wait in a barrier the others never reach."""
    meta = ocp.JsonCheckpointHandler().restore(step_dir / META, args=ocp.args.JsonRestore())
    if resuming:
        check_meta(meta)
    if state is None:
        return dict(meta), None
    handler = (ocp.PyTreeCheckpointHandler() if isinstance(state, ocp.args.PyTreeRestore)
               else ocp.StandardCheckpointHandler())
    try:
        return dict(meta), handler.restore(step_dir / STATE, args=state)
    finally:
        handler.close()


def refused_write(what: str, why: str, directory: Path) -> DiskError:
    """The one line of a write the disk refused (``errors.disk_error``'s ``why``): what was
    being written, and the newest checkpoint of ``directory``, which the relaunch resumes."""
    kept = committed_steps(directory)
    then = (f"checkpoint {kept[-1]} kept); free space and relaunch the same command to resume "
            "from it" if kept else "no checkpoint kept); free space and relaunch")
    return DiskError(f"{what}: {why} ({then}")


class Checkpointer:
    """Saves of one run into one checkpoints dir, every ``checkpoint.every`` steps.

    A save the disk refuses (``errors.disk_error``: no space left, an I/O error), whether its
    own call or its background writes fail (those show at the next save, ``wait`` or
    ``close``), raises DiskError naming that save's step and the checkpoint kept, never
    tensorstore's RESOURCE_EXHAUSTED (which would read as out of memory); the failed save's
    partial files go, so that the space they took is the run's again for its last records."""

    def __init__(self, directory: Path, keep: int, best: KeepStep | None = None):
        self.directory = directory
        self.keep, self.best = keep, best
        # Orbax's manager makes its directory: made at the first save, so a run that never saves
        # (debug=fast, checkpoint.every=0 cut short) leaves no empty checkpoints/. Every process
        # saves at the same steps, so each makes it at the same point.
        self._manager: ocp.CheckpointManager | None = None
        self.in_flight: int | None = None  # the step whose writes may still be running
        quiet_failed_writes()

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = _manager(self.directory, self.keep, self.best)
        return self._manager

    def save(self, step: int, state: TrainState, meta: dict[str, Any]
             ) -> tuple[Path, float | None]:
        """Start saving ``state`` after step ``step``; returns, once the disk writes begin,
        the checkpoint's path and how long the save held the loop (None: saved already)."""
        path = self.directory / str(step)
        if step in self.manager.all_steps():
            return path, None  # already saved (e.g. the step this run resumed from)
        # Wait for the state's steps to finish: Orbax then copies settled shards, and the host
        # never runs more than MAX_IN_FLIGHT steps ahead of the device (experiment/step.py).
        # That wait is the steps' own time, not the save's: the clock starts after it.
        jax.block_until_ready(state)
        t = time.perf_counter()
        # Blocks for the previous save's writes when they are still running (as Orbax's save
        # would: waited for here, a failure of theirs is named as theirs), and for the copy of
        # this state to host memory.
        self.wait()
        self.in_flight = step
        self._on_disk(lambda: self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state._asdict()), META: ocp.args.JsonSave(meta)})))
        return path, time.perf_counter() - t

    def wait(self) -> None:
        """Block until the last save is committed (renamed into place)."""
        if self._manager is not None:  # none yet: nothing saved, nothing to wait for
            self._on_disk(self._manager.wait_until_finished)
        self.in_flight = None

    def close(self) -> None:
        if self._manager is not None:
            self._on_disk(self._manager.close)
        self.in_flight = None

    def _on_disk(self, call: Callable[[], Any]) -> None:
        """``call()``, a disk error of the save in flight raised as DiskError."""
        try:
            call()
        except Exception as e:
            why, step = disk_error(e), self.in_flight
            if why is None or step is None:
                raise
            self.in_flight = None
            # Orbax deletes an unfinished save's tmp dir only at the next start.
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
            raise refused_write(f"checkpoint {self.directory / str(step)}", why,
                                self.directory) from e
