"""A run's checkpoints: the Orbax store (where they live, saving one, reading one), what counts as a
damaged one, resuming from them, and saving during the run between two steps (``RunCheckpoints``:
the cadence, SIGUSR1's save, the committed save a stop waits for). Each section's own account
follows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from dxrun.config import (
    CheckpointGone,
    CheckpointReadError,
    ConfigError,
    DiskError,
    NonFiniteError,
    NothingToTrain,
    Stopped,
    disk_error,
    named_line,
)
from dxrun.cost import MAX_CHECKPOINT_OVERHEAD, cadence_text, minutes_for_overhead
from dxrun.data import position
from dxrun.experiment import TrainState
from dxrun.plan import Resume
from dxrun.run import Preemption, ProcessAgreement, faults_from_env, gather, is_main, relaunch_command
from dxrun.tracking.goodput import NOTICEABLE_BLOCK_S, SaveTotals
from dxrun.tracking.logger import Monitor, stopped_early

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig, OptimizerConfig, RunConfig, TrainConfig


# ------------------------------------------------------------------------------------------------
# What counts as a damaged checkpoint, and keeping the failures of reads given up quiet.
#
# A committed checkpoint can still be damaged later (a truncated file); that shows only when it is
# read. Only evidence of damage (missing or truncated files, checksum and format errors, a meta
# without what a resume reads or holding a field of it that cannot be read: ``is_damage``) leads
# a resume to the checkpoint before, the damaged one renamed, never deleted
# (``set_aside_checkpoints``); any other failure to read (an I/O error, out of memory) stops the
# run with one line and leaves the checkpoint as it is. A
# read or write that fails leaves Orbax's other reads and writes in flight, whose late failures
# would print a traceback each: ``quiet_reads_that_finish_late`` and ``quiet_failed_writes``
# drop those, and nothing else.

log = logging.getLogger("dxrun")


# tensorstore's status codes for a file that is missing, shorter than its index says, or
# fails its checksum or decoding.
_DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND")


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from, the root cause first (Orbax wraps
    tensorstore's error in a bare Exception naming the array index)."""
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out[::-1]


class IncompleteMeta(ValueError):
    """A checkpoint's meta that lacks what a resume reads, or holds it in a form a resume
    cannot read (``check_meta``): damage."""


# What a resume reads from a checkpoint's meta, with no default: the saved config (the checks
# of what may change, the batch the data position was counted in) and the data position.
META_KEYS = ("config", "data")


def _count(value: Any) -> bool:
    """A whole number of steps, batches or tokens (JSON's bool is no number)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _whole(fields: dict[str, Any], key: str) -> bool:
    """Whether ``fields[key]`` is a whole number (``_count``); a float that is one (``40.0``,
    another JSON writer's spelling of 40) is read as the int it is, in place."""
    value = fields[key]
    if isinstance(value, float) and value.is_integer():
        fields[key] = int(value)
    return _count(fields[key])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _position_problem(data: dict[str, Any], key: str = "data") -> str | None:
    """Why ``data`` (a saved iterator state) is no position a resume can continue from (None:
    it is): the markov stream's ``{"step": n}``, a corpus reader's ``{"next_index": n}``, or the
    nested state of Grain's workers in older checkpoints (``pipeline.position``)."""
    for name in ("step", "next_index"):
        if name in data:
            return None if _whole(data, name) else (
                f"{key}.{name} is {data[name]!r}, not a whole number")
    nested = data.get("iterators_in_use_states")
    if isinstance(nested, list) and nested:
        for i, state in enumerate(nested):
            where = f"{key}.iterators_in_use_states[{i}]"
            why = (_position_problem(state, where) if isinstance(state, dict)
                   else f"{where} is {state!r}, not an iterator state")
            if why:
                return why
        return None
    return f"{key} holds no data position (step or next_index)"


def _wrong_type(meta: dict[str, Any]) -> str | None:
    """The first field a resume reads that ``meta`` holds in a form it cannot read, named
    with its value; None when every one is readable."""
    config = meta["config"]
    if not _whole(config["data"], "batch_size"):
        return f"config.data.batch_size is {config['data']['batch_size']!r}, not a whole number"
    if (why := _position_problem(meta["data"])) is not None:
        return why
    if "tokens_seen" in meta and not _whole(meta, "tokens_seen"):
        return f"tokens_seen is {meta['tokens_seen']!r}, not a whole number"
    if meta.get("wandb_id") is not None and not isinstance(meta["wandb_id"], str):
        return f"wandb_id is {meta['wandb_id']!r}, not a W&B run id"
    if meta.get("run_dir") is not None and not isinstance(meta["run_dir"], str):
        return f"run_dir is {meta['run_dir']!r}, not a path"
    train = config.get("train", {})
    if not isinstance(train, dict):
        return f"config.train is {train!r}, not a section"
    if "steps" in train and not _whole(train, "steps"):
        return f"config.train.steps is {train['steps']!r}, not a whole number"
    for name in ("keep_best", "early_stop"):  # the monitors a resume continues (monitor.py)
        m = meta.get(name)
        if m is None:
            continue
        if not isinstance(m, dict):
            return f"{name} is {m!r}, not a monitor"
        for key, ok, what in (("stale", _whole, "a whole number"),
                              ("step", lambda f, k: f[k] is None or _whole(f, k), "a step"),
                              ("best", lambda f, k: f[k] is None or _number(f[k]), "a number")):
            if key in m and not ok(m, key):
                return f"{name}.{key} is {m[key]!r}, not {what}"
    return None


def check_meta(meta: dict[str, Any]) -> None:
    """Raise IncompleteMeta naming what ``meta`` lacks of what a resume reads, or the first
    field of it that a resume could not read (a wrong type: ``"data": {"step": "abc"}``)."""
    if not isinstance(meta, dict):
        raise IncompleteMeta(f"its meta is {type(meta).__name__}, not a JSON object")
    missing = [k for k in META_KEYS if not isinstance(meta.get(k), dict)]
    if not missing and not isinstance(meta["config"].get("data"), dict):
        missing.append("config.data")
    elif not missing and "batch_size" not in meta["config"]["data"]:
        missing.append("config.data.batch_size")
    if missing:
        raise IncompleteMeta(f"its meta has no {', '.join(missing)}")
    if (why := _wrong_type(meta)) is not None:
        raise IncompleteMeta(f"its meta's {_short(why)}")


def _short(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters (a damaged field may hold a long value)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_damage(e: BaseException) -> bool:
    """Evidence that a checkpoint's files are damaged: missing or truncated files, checksum or
    format errors, a meta without what a resume reads or with a field of it that cannot be read,
    in ``e`` or what it was raised from. Anything else (an I/O error, out of memory, a tree
    that does not fit) is not, and never leads to setting a checkpoint aside."""
    for link in _chain(e):
        if isinstance(link, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError,
                             EOFError, IncompleteMeta)):
            return True
        if isinstance(link, (OSError, MemoryError)):
            return False
        text = str(link)
        if (any(text.startswith(f"{c}:") or f" {c}: " in text for c in _DAMAGE_CODES)
                or "checksum" in text.lower()):
            return True
    return False


def root_cause(e: BaseException) -> str:
    """The root cause's first line: what a warning or a refusal names."""
    return named_line(_chain(e)[0], 200)


def quiet_reads_that_finish_late() -> None:
    """A read that fails (a truncated file) leaves the checkpoint's other TensorStore reads (of
    its arrays, or of their metadata) in flight. Orbax closes the event loop it read in as the
    error comes out, and each of those reads, finishing, hands its result to that loop
    (``call_soon_threadsafe``), which raises "Event loop is closed" into
    ``sys.unraisablehook``: a traceback per read on stderr, from the resume that sets a
    damaged checkpoint aside and says so in one line. Those results, and the other reads'
    own failures, belong to a read already given up (``is_a_given_up_read``); any other
    unraisable exception still reaches the hook that was there."""
    previous = sys.unraisablehook
    if getattr(previous, "dxrun_late_reads", False):
        return

    def hook(unraisable: Any) -> None:
        if not is_a_given_up_read(unraisable):
            previous(unraisable)

    hook.dxrun_late_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # ...or as asyncio's "Task exception was never retrieved", when their task is collected.
    logging.getLogger("asyncio").addFilter(
        lambda record: not (record.exc_info and "exception was never retrieved" in str(record.msg)
                            and is_a_given_up_read(record.exc_info[1])))


def quiet_failed_writes() -> None:
    """A save the disk refuses fails in Orbax's background threads, which log the failure with
    its traceback (absl, three times), while the writes of the other arrays fail alongside, each
    logged by asyncio as "exception was never retrieved" when collected. The run says it once,
    in one line (DiskError), the traceback in its log: those records of a disk error are
    dropped. Every other failure Orbax logs is logged as it was."""
    def keep(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or disk_error(exc) is None

    # The writes still in flight then finish after Orbax closed their event loop, as a failed
    # read's do: "Event loop is closed" per write, on stderr.
    quiet_reads_that_finish_late()
    keep.dxrun_failed_writes = True  # type: ignore[attr-defined]
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(getattr(f, "dxrun_failed_writes", False) for f in logger.filters):
            logger.addFilter(keep)


def is_a_given_up_read(unraisable: Any) -> bool:
    """An unraisable exception (or an exception) that belongs to a read already given up:
    "Event loop is closed" from a late read's ``call_soon_threadsafe``, or the failure of an
    Orbax array read that was never awaited (several truncated files fail several concurrent
    reads; the first comes out of the restore, the others raise theirs again when collected:
    "Exception ignored in: <coroutine object _read_array_index_and_device_put>" or "Task
    exception was never retrieved", now and then in
    test_processes_agree_on_a_step_one_of_them_cannot_read)."""
    exc = getattr(unraisable, "exc_value", unraisable)  # an UnraisableHookArgs, or the error
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
            and frames and frames[0].name == "call_soon_threadsafe"):
        return True
    return any(f.name == "_read_array_index_and_device_put" and "orbax" in f.filename
               for f in frames)


def set_aside_checkpoints(directory: Path, steps: list[int]) -> None:
    """Damaged checkpoints newer than the one resumed from would be overwritten by the run's
    next saves (same step numbers): rename them out of Orbax's sight, never delete them. Only
    process 0 renames (the dirs are shared)."""
    for step in steps:
        src = directory / str(step)
        if not src.is_dir():
            continue
        dst = directory / f"{step}.corrupt"
        i = 0
        while dst.exists():
            i += 1
            dst = directory / f"{step}.corrupt{i}"
        src.rename(dst)
        log.warning("moved the damaged checkpoint %s to %s", src, dst)


# ------------------------------------------------------------------------------------------------
# The Orbax store of a run's checkpoints: where they live, saving one, reading one.
#
# A checkpoint is one Orbax step dir with two items: ``state`` (the ``TrainState``, each process
# writing its own shards) and ``meta`` (JSON: the data iterator's position, the resolved config,
# the mesh plan, the W&B run id). Saves are asynchronous: the disk writes run in a background
# thread while training goes on, into a tmp dir renamed when complete, so a crash mid-save never
# leaves a dir that looks finished; checkpoints beyond ``checkpoint.keep`` go only after the new
# one is committed, except the best one (``checkpoint.keep_best``: ``KeepStep``).
#
# Checkpoints belong to their run: ``<run dir>/checkpoints``, or with ``checkpoint.dir``
# ``<checkpoint.dir>/<run id>/`` (``run_id``: the run dir's name and a hash of its absolute path,
# so a requeue into the same run dir finds them again), named in the run dir's ``checkpoints.txt``
# for ``locate`` and for the run dir once moved. Each checkpoint's meta names its run too.

STATE, META = "state", "meta"

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
        # never runs more than MAX_IN_FLIGHT steps ahead of the device (see experiment.py). That
        # wait is the steps' own time, not the save's: the clock starts after it.
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


# ------------------------------------------------------------------------------------------------
# Resuming: which checkpoint a run continues from, whether it may, and restoring it.
#
# ``checkpoint.resume`` (auto | none | <path>) names where a launch continues; a run's own
# checkpoints come first, and a resume only ever continues its own run's checkpoints. The newest
# checkpoint is tried first and a damaged one (``is_damage``) falls back to the one
# before, naming the one it skipped; in a multi-process run the processes agree on the step (the
# newest every process can read) and only process 0 sets damaged ones aside. A checkpoint fits
# the run when its model shape, vocabulary and data source are the config's (``check_compatible``).
#
# Restoring reads straight into the target mesh's shardings (``Experiment.abstract_state``):
# every process reads only its own shards, on any mesh, and nothing is gathered on one device.
# Dropout keys derive from (seed, step), so state and meta are all an exact resume needs.

# What a resumed run cannot change: the checkpoint's arrays would not fit, or its data position
# would mean other data. (data.batch_size is checked apart: checkpoint.allow_batch_change.)
MODEL_SHAPE = ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
               "model.d_ff", "model.max_seq_len", "model.bias", "model.norm", "model.mlp",
               "model.pos", "model.tie_embeddings", "model._target_", "model.kwargs")
# Keys newer than some checkpoints: one written before them had their default.
NEWER_KEYS: dict[str, Any] = {"model._target_": None, "model.kwargs": {}, "data._target_": None,
                              "data.kwargs": {}}
VOCABULARY = ("model.vocab_size",)
DATA_SOURCE = ("data.name", "data.path", "data.tokenizer", "data.dtype", "data.seq_len",
               "data.seed", "data.order", "data.symbols", "data.branching", "data._target_",
               "data.kwargs")


def find_resume(ckpt: CheckpointConfig, run_dir: Path, now: RunConfig | dict[str, Any]
                ) -> Resume | None:
    """Apply ``checkpoint.resume`` (auto | none | <path>) for a launch into ``run_dir``; check
    the checkpoint fits ``now``: the run's config, or that config as its files will record it
    (``run_plan.saved_config``, its global batch and sequence length resolved). The run's own
    checkpoints come first: a requeued warm start (``checkpoint.resume=<other run>``)
    continues its own. Raises ConfigError; writes nothing."""
    mode = str(ckpt.resume)
    if mode == "none":
        return None
    own = checkpoint_dir(ckpt, run_dir)
    if committed_steps(own):
        resume = Resume(own, None, in_place=True)
    elif mode == "auto":
        return None
    else:
        resume = locate(Path(mode))
    resume.meta_step, resume.meta = newest_meta(resume, check_state=True)
    if resume.in_place and ckpt.dir:
        _refuse_a_copy(run_dir, resume)
    check_compatible(now, resume.meta["config"], resume.directory / str(resume.meta_step))
    return resume


def _refuse_a_copy(run_dir: Path, resume: Resume) -> None:
    """A run dir whose checkpoints.txt names checkpoints that the run dir which wrote them, still
    there, names too is a copy: followed, the two would save into one dir and rotate each
    other's checkpoints away. Refused, naming the original (a moved run dir resumes)."""
    writer = resume.meta.get("run_dir")
    if not writer or Path(writer) == Path(run_dir).resolve():
        return
    try:
        theirs = Path((Path(writer) / POINTER).read_text().strip())
    except (OSError, ValueError):
        return
    if theirs.name == resume.directory.name:
        raise ConfigError(
            f"checkpoints {resume.directory} belong to run dir {writer}, which is still there; "
            f"{run_dir} is a copy of it: train on in {writer}, or start this copy from them "
            f"with checkpoint.resume={writer} after removing {Path(run_dir) / POINTER}")


def locate(path: Path, key: str = "checkpoint.resume") -> Resume:
    """``checkpoint.resume=<path>``: a checkpoints dir, one step dir in it, or a run dir (its
    ``checkpoints/`` or, under ``checkpoint.dir``, the dir its ``checkpoints.txt`` names).
    ``key`` names what the user gave, for the refusal."""
    path = path.expanduser().absolute()  # Orbax refuses relative paths
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    elif (path / POINTER).is_file():
        path = Path((path / POINTER).read_text().strip())
    if path.name.isdigit() and path.parent.is_dir() and int(path.name) in committed_steps(
            path.parent):
        return Resume(path.parent, int(path.name), in_place=False, key=key)
    if committed_steps(path):
        return Resume(path, None, in_place=False, key=key)
    fix = ", or use checkpoint.resume=auto|none" if key == "checkpoint.resume" else ""
    if (path / "plan.json").is_file():  # a run dir: its run wrote its plan first
        raise ConfigError(f"{key}={path} is a run dir whose run saved no checkpoint (it ran "
                          "with checkpoint.every=0, as debug=fast does, or stopped before its "
                          f"first save); train it with checkpoint.every=N to have one{fix}")
    raise ConfigError(f"{key}={path} holds no committed checkpoint; give a run dir, its "
                      f"checkpoints dir or one of its step dirs{fix}")


def _candidates(resume: Resume, upto: int | None = None) -> list[int]:
    """The steps to try, newest first (none newer than ``upto``)."""
    if resume.step is not None:
        return [resume.step]
    return [s for s in committed_steps(resume.directory)[::-1] if upto is None or s <= upto]


def _name(path: tuple) -> str:
    """A tree path as Orbax names a saved leaf: ``opt_state.1.0.mu.wte``."""
    return ".".join(leaf_key(path))


def _read_meta(directory: Path, step: int, check_state: bool
               ) -> tuple[dict[str, Any], set[str] | None]:
    meta, _ = read(directory / str(step))
    names = None
    if check_state:  # the state's tree and array metadata, without reading the arrays
        tree = ocp.StandardCheckpointHandler().metadata(directory / str(step) / STATE).tree
        names = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return meta, names


def gone(resume: Resume, step: int) -> bool:
    """``rotated_away``: a run's own checkpoints no one else writes, so none goes while read."""
    return rotated_away(resume.directory, step, wait=not resume.in_place)


def _newest_readable(resume: Resume, check_state: bool
                     ) -> tuple[int, dict[str, Any], set[str] | None] | None:
    """The newest step this process can read: (step, meta, state leaf names), or None. A step
    rotated away while read gives way to the newest committed one then (a live run's); one
    asked for (``resume.step``) raises CheckpointGone."""
    quiet_reads_that_finish_late()
    tried: list[int] = []
    while (step := next((s for s in _candidates(resume) if s not in tried), None)) is not None:
        tried.append(step)
        try:
            meta, names = _read_meta(resume.directory, step, check_state)
        except Exception as e:  # noqa: BLE001 - damage: the one before; else: stop
            where = resume.directory / str(step)
            if gone(resume, step):
                if resume.step is not None:
                    raise CheckpointGone(where) from None
                log.info("checkpoint %s was rotated away while read; reading the newest one", where)
                continue
            if not is_damage(e):
                raise ConfigError(
                    f"checkpoint {where} could not be read ({root_cause(e)}); it is not damaged "
                    "as far as dxrun can tell and is left as it is: fix the cause and "
                    f"try again, or {resume.fix()}") from e
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before",
                        where, root_cause(e))
            continue
        return step, meta, names
    return None


def newest_meta(resume: Resume, check_state: bool = False) -> tuple[int, dict[str, Any]]:
    """The newest step whose meta (and with ``check_state`` its state's tree metadata) every
    process can read, and that meta. Damaged newer steps are named once and recorded in
    ``resume.damaged``; any other read failure stops with one line (ConfigError)."""
    found = _newest_readable(resume, check_state)
    # Several processes: each reads its own view; all continue from the oldest of theirs.
    agreed = min(int(v) for v in gather("resume_step", str(found[0] if found else -1)))
    if found is not None and agreed >= 0 and found[0] != agreed:
        log.warning("checkpoint %s cannot be read by every process; using step %d",
                    resume.directory / str(found[0]), agreed)
        found = _newest_readable(Resume(resume.directory, agreed, resume.in_place), check_state)
    if agreed < 0 or found is None:
        raise ConfigError(f"{resume.key}: no readable checkpoint in {resume.directory}; "
                          f"{resume.fix()}")
    step, meta, names = found
    resume.damaged = [s for s in _candidates(resume) if s > step]
    resume.state_names = names
    return step, meta


def _flat(config: RunConfig | dict[str, Any]) -> dict[str, Any]:
    """``section.key`` -> value, over the sections of ``config`` (a config or its saved dict)."""
    container = (config if isinstance(config, dict)
                 else OmegaConf.to_container(config, resolve=True))
    out = {}
    for group, values in container.items():
        if isinstance(values, dict):
            out.update({f"{group}.{k}": v for k, v in values.items()})
    return out


def changed(config: RunConfig | dict[str, Any], saved_cfg: dict[str, Any],
            keys: tuple[str, ...]) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` whose value differs from the checkpoint's: (key, now, then)."""
    now, then = _flat(config), _flat(saved_cfg)
    then = {k: then.get(k, NEWER_KEYS.get(k)) for k in keys}
    return next(((k, now.get(k), then[k]) for k in keys if now.get(k) != then[k]), None)


def check_compatible(config: RunConfig | dict[str, Any], saved_cfg: dict[str, Any],
                     where: Path) -> None:
    """Refuse a resume that cannot continue the checkpoint: one line naming both values.
    ``config``: the config now, or the dict the run saves of it."""
    for what, keys in (("model shape", MODEL_SHAPE), ("vocabulary", VOCABULARY),
                       ("data source", DATA_SOURCE)):
        if diff := changed(config, saved_cfg, keys):
            key, now, then = diff
            raise ConfigError(
                f"{key}={now} but checkpoint {where} was written with {key}={then} (the "
                f"{what} cannot change on resume); resume with {key}={then}, or start fresh "
                "with checkpoint.resume=none")
    now, then = _flat(config), _flat(saved_cfg)
    key = "data.batch_size"
    if now[key] != then[key] and not now["checkpoint.allow_batch_change"]:
        raise ConfigError(
            f"{key}={now[key]} but checkpoint {where} was written with {key}={then[key]}; "
            f"resume with {key}={then[key]}, or set checkpoint.allow_batch_change=true to "
            "continue from the same number of tokens seen")


def data_position(meta: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The data iterator state to continue with. Under a new global batch size (allowed by
    ``checkpoint.allow_batch_change``) the position is recomputed so that the same number of
    tokens has been read: batches seen x old batch / new batch, rounded down. Grain's nested
    state of a run with ``data.workers`` > 0 (older checkpoints) becomes the one position it
    stands for, so the worker count may change."""
    state = dict(meta["data"])
    if "step" not in state:  # a token corpus (Grain): one position, whatever the workers
        state = {"next_index": position(state)}
    old = meta["config"]["data"]["batch_size"]
    if old == batch_size:
        return state
    (key,) = [k for k in ("step", "next_index") if k in state]
    moved = state[key] * old // batch_size
    log.info("data.batch_size %d -> %d: data position %d -> %d batches (same tokens seen)",
             old, batch_size, state[key], moved)
    return {key: moved}


def tokens_seen(meta: dict[str, Any], step: int) -> int:
    """Tokens trained on up to checkpoint ``step``: carried in its meta, or for a checkpoint
    that predates it, its steps at its own batch size."""
    if "tokens_seen" in meta:
        return int(meta["tokens_seen"])
    data = meta["config"]["data"]
    return step * data["batch_size"] * data["seq_len"]


def plan_resume(resume: Resume, target: TrainState, steps: int, global_batch: int,
                optimizer: OptimizerConfig, early_stop: Any = None) -> None:
    """What a resume into ``target`` (the abstract state of this run, which trains to
    ``steps`` at ``global_batch`` with ``optimizer``, and ``early_stop``: its
    ``train.early_stop``) does, decided before anything is written: stop when there is
    nothing to train (NothingToTrain: the checkpoint is at ``train.steps``, or its run stopped
    early and would stop again before its first step), refuse a data position that cannot be
    continued (ConfigError), and restore the optimizer state only when its tree fits the
    optimizer now. A changed optimizer (``optimizer.name``, clipping on or off, SGD momentum)
    is not refused: the parameters and step are restored and the optimizer state starts fresh
    (its step count continues), with one warning naming why."""
    where = resume.directory / str(resume.meta_step)
    meta = {**resume.meta, "step": resume.meta_step}
    if steps <= resume.meta_step:
        raise NothingToTrain(
            f"nothing to train: train.steps={steps} and checkpoint {where} is at step "
            f"{resume.meta_step}; the run's files are left as they are (raise train.steps to "
            "train on)", where, meta)
    if why := stopped_early(resume.meta, early_stop):
        raise NothingToTrain(
            f"nothing to train: checkpoint {where} is where the run stopped early, "
            f"{why.removeprefix('early stop: ')}; the run's files are left as they are (raise "
            "train.early_stop.patience, or set train.early_stop.monitor=null, to train on)",
            where, meta)
    data_position(resume.meta, global_batch)
    if resume.state_names is None:
        return
    want = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    mine = {n.split(".", 1)[1] for n in want if n.startswith("opt_state.")}
    saved = {n.split(".", 1)[1] for n in resume.state_names if n.startswith("opt_state.")}
    if mine == saved:
        return
    diff = [f"{k}={now} (was {then})"
            for k, now, then in _optimizer_changes(optimizer, resume.meta["config"])]
    resume.fresh_optimizer = (", ".join(diff) or "the optimizer") + " changes its state's tree"
    log.warning("checkpoint %s: %s; restoring the parameters and step, with a fresh optimizer "
                "state (its moments start at zero)", where, resume.fresh_optimizer)


def _optimizer_changes(optimizer: OptimizerConfig, saved_cfg: dict[str, Any]
                       ) -> list[tuple[str, Any, Any]]:
    """The ``optimizer.*`` keys whose value differs from the checkpoint's: (key, now, then)."""
    now = _flat({"optimizer": OmegaConf.to_container(optimizer, resolve=True)})
    then = _flat({"optimizer": saved_cfg.get("optimizer")})
    return [(k, now.get(k), then.get(k)) for k in sorted(set(now) | set(then))
            if now.get(k) != then.get(k)]


def _restore_args(state_dir: Path, target: TrainState, with_optimizer: bool
                  ) -> ocp.args.CheckpointArgs:
    tree = target._asdict()
    if not with_optimizer:
        tree.pop("opt_state")
    # Another mesh or platform may pad the vocabulary differently (vocab_padding.py).
    return restore_args(state_dir, tree, partial=not with_optimizer)


def restore(resume: Resume, target: TrainState) -> tuple[TrainState, dict[str, Any], int]:
    """The newest readable checkpoint of ``resume`` (from ``resume.meta_step`` down, when
    ``newest_meta`` chose it), its arrays placed per ``target``'s shardings
    (``Experiment.abstract_state``). Returns (state, meta, step); the state's ``opt_state`` is
    None when ``resume.fresh_optimizer`` says it does not fit. A step any process finds damaged
    is skipped by all; one that cannot be read for another reason stops the run
    (CheckpointReadError) and is left as it is."""
    upto = resume.meta_step if resume.meta else None
    skipped = list(resume.damaged)
    quiet_reads_that_finish_late()
    for step in _candidates(resume, upto):
        try:
            step_dir = resume.directory / str(step)
            # A resume that newest_meta planned reads a run's checkpoints, whose meta must
            # hold what the run reads of it; a bare restore (a test's own save) may not.
            meta, state = read(step_dir, _restore_args(step_dir / STATE, target,
                                                       resume.fresh_optimizer is None),
                               resuming=bool(resume.meta))
            outcome, err = "ok", ""
        except Exception as e:  # noqa: BLE001 - sorted below: rotated away, damage or not
            outcome = ("gone" if gone(resume, step) else "damaged" if is_damage(e) else "error")
            err = root_cause(e)
        # Every process reads its own shards: all go on only from a step all of them read.
        outcomes = gather(f"restore/{step}", outcome)
        where = resume.directory / str(step)
        if "gone" in outcomes:
            raise CheckpointGone(where)
        if "error" in outcomes:
            raise CheckpointReadError(
                f"checkpoint {where} could not be read ({err or 'on another process'}); it is "
                "not damaged as far as dxrun can tell and is left as it is: fix the cause and "
                "try again")
        if "damaged" in outcomes:
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before", where,
                        err or f"on process {outcomes.index('damaged')}")
            skipped.append(step)
            continue
        if skipped and resume.in_place and is_main():
            set_aside_checkpoints(resume.directory, skipped)
        state = dict(state)
        state.setdefault("opt_state", None)
        return TrainState(**state), meta, step
    raise ConfigError(f"{resume.key}: no readable checkpoint in {resume.directory}; "
                      f"{resume.fix()}")


# ------------------------------------------------------------------------------------------------
# Saving during a run: what the train loop does between two steps (``RunCheckpoints``).
#
# A save is due every ``checkpoint.every`` steps, every ``checkpoint.every_minutes`` of wall
# clock, at the last step and on SIGUSR1; SIGTERM/SIGINT stop the run after a committed save
# (``dxrun.run.signals`` turns the signals into flags). With several processes the processes
# agree on the step a signal or a clock acts at (``ProcessAgreement``): a save is collective.

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


# ------------------------------------------------------------------------------------------------
# A checkpoint restored where the vocabulary, or ZeRO-1's optimizer state, is padded differently.
#
# The vocab axis of ``wte`` / ``lm_head`` (and of their optimizer moments) has
# ``plan.padded_vocab`` rows: a multiple of tp and of the platform's alignment (128 on GPU/TPU).
# So a checkpoint of vocab 65 has 65 rows under dp1 on CPU, 66 under tp2 and 128 on a GPU. Its
# arrays are read at the target's padding: the rows both have, read straight into the target's
# shards, zeros beyond (Orbax's non-strict read). That is exact: padding rows start at zero, their
# logits are masked and their gradients are zero, so every padding row of a checkpoint is zero,
# and the real rows always come first.
#
# ZeRO-1's padding of the optimizer state to a multiple of the data axis (``dxrun.model.sharding``)
# is read the same way: zeros after the real rows. Only those differences are read this way; the
# callers have already refused a checkpoint of another model shape or vocabulary
# (``check_compatible``, ``load``), and any other difference fails as before.

Shapes = dict[tuple[str, ...], tuple[int, ...]]


def leaf_key(path: tuple) -> tuple[str, ...]:
    """A leaf's path by names and indices alone: the target's optimizer states are named
    tuples (attributes), the checkpoint's metadata holds them as dicts and lists."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def shapes(tree: Any) -> Shapes:
    """Every array leaf's shape, by its path (``leaf_key``)."""
    return {leaf_key(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(x, "shape")}


def stored_shapes(state_dir: Path) -> Shapes:
    """The shapes a checkpoint's ``state`` item was written with (its metadata alone)."""
    return shapes(ocp.StandardCheckpointHandler().metadata(state_dir).tree)


def padding_differs(stored: Shapes, target: Shapes, partial: bool = False) -> bool:
    """True when the two differ only by one padding: the same leaves, and every leaf that
    differs does so in one axis with the same (stored, target) sizes as every other
    (``partial``: the target may leave stored leaves out)."""
    if not (target.keys() <= stored.keys() if partial else target.keys() == stored.keys()):
        return False
    pairs = set()
    for key, want in target.items():
        have = stored[key]
        if have == want:
            continue
        axes = [i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b]
        if len(have) != len(want) or len(axes) != 1:
            return False
        pairs.add((have[axes[0]], want[axes[0]]))
    return len(pairs) == 1


def without_zero_padding(tree_shapes: Shapes) -> Shapes:
    """``tree_shapes`` (a train state's) with each optimizer-state leaf that is larger than its
    parameter (the ``params`` leaf of the same trailing path) in some axes given the
    parameter's shape: ZeRO-1 pads the state it splits (``dxrun.model.sharding``), never the
    parameters, and every optimizer dxrun builds keeps a parameter-shaped state otherwise."""
    out = dict(tree_shapes)
    for key, shape in tree_shapes.items():
        if key[0] == "params":
            continue
        param = next((tree_shapes[("params", *key[i:])] for i in range(1, len(key))
                      if ("params", *key[i:]) in tree_shapes), None)
        if (param is not None and len(param) == len(shape)
                and all(a >= b for a, b in zip(shape, param, strict=True))):
            out[key] = param
    return out


def restore_args(state_dir: Path, target: dict[str, Any], partial: bool = False
                 ) -> ocp.args.CheckpointArgs:
    """How to read ``state_dir`` (a step dir's ``state`` item) into ``target`` (abstract arrays
    with this mesh's shardings): strictly, or re-padded when only the vocab padding or ZeRO-1's
    padding of the optimizer state (another data-parallel size) differs; ``partial``: only the
    target's leaves (a fresh optimizer state is not read)."""
    stored, want = stored_shapes(state_dir), shapes(target)
    real_stored, real_want = without_zero_padding(stored), without_zero_padding(want)
    only_zero = (want.keys() <= stored.keys() and want != {k: stored[k] for k in want}
                 and all(real_stored[k] == real_want[k] for k in want)
                 and (partial or want.keys() == stored.keys()))
    repad = only_zero or padding_differs(real_stored, real_want, partial)
    if not partial:
        return ocp.args.StandardRestore(target, strict=not repad)
    return ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(
                                      target, strict=not repad))
