"""Checkpoints: Orbax saves of the train state, and resuming from them.

A checkpoint is one Orbax step dir with two items: ``state`` (step, parameters, optimizer state,
NaN counters: the ``TrainState``, each process writing its own shards) and ``meta`` (JSON: the
data iterator's position, the resolved config, the mesh plan, the W&B run id). Dropout keys
derive from (seed, step), so this is everything an exact resume needs.

Saves are asynchronous: ``save`` waits for the state's device work (which also keeps the CPU
in-flight bound of ``TrainStep``), Orbax copies the shards to host memory, and the disk writes
run in a background thread while training goes on. Orbax writes each checkpoint into a tmp dir
and renames it when complete, so a crash mid-save never leaves a dir that looks finished, and it
deletes checkpoints beyond ``checkpoint.keep`` only after the new one is committed. A committed
checkpoint can still be damaged later (a truncated file); that shows only when it is read, so a
resume tries the newest first and falls back to the one before, naming the one it skipped. Only
evidence of damage (missing or truncated files, checksum and format errors: ``is_damage``) leads
to the one before; any other failure to read (an I/O error, out of memory) stops the run with one
line and leaves the checkpoint as it is. In a multi-process run the processes agree on the step
(the newest every process can read) and only process 0 sets damaged ones aside.

Checkpoints belong to their run. Without ``checkpoint.dir`` they live in ``<run dir>/checkpoints``;
with it, in ``<checkpoint.dir>/<run id>/`` (``run_id``: the run dir's name and a hash of its
absolute path, so a requeue into the same run dir finds them again), and the run dir names that
dir in ``checkpoints.txt`` for ``locate`` and for the run dir itself once moved (its run id
changes with its path; ``checkpoint_dir`` follows the file). Each checkpoint's meta also names
its run (``run_id``, ``run_dir``). A resume only ever continues its own run's checkpoints, and
rotation deletes only its own.

Restoring reads straight into the target mesh's shardings (``Experiment.abstract_state``):
every process reads only its own shards, on any mesh, and nothing is gathered on one device.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from dxrun import faults
from dxrun.capacity.plan_mode import MAX_CHECKPOINT_OVERHEAD, minutes_for_overhead
from dxrun.checkpointing.preempt import Preemption, ProcessAgreement, Stopped
from dxrun.checkpointing.vocab_padding import leaf_key, restore_args
from dxrun.config import CheckpointConfig, TrainConfig
from dxrun.errors import (
    CheckpointReadError,
    ConfigError,
    DiskError,
    NonFiniteError,
    NothingToTrain,
    disk_error,
)
from dxrun.multihost.distributed import gather, is_main
from dxrun.step import TrainState
from dxrun.tracking.step_timer import NOTICEABLE_BLOCK_S, SaveTotals

log = logging.getLogger("dxrun")

STATE, META = "state", "meta"

# What a resumed run cannot change: the checkpoint's arrays would not fit, or its data position
# would mean other data. (data.batch_size is checked apart: checkpoint.allow_batch_change.)
MODEL_SHAPE = ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
               "model.d_ff", "model.max_seq_len", "model.bias", "model.norm", "model.mlp",
               "model.pos", "model.tie_embeddings")
VOCABULARY = ("model.vocab_size",)
DATA_SOURCE = ("data.name", "data.path", "data.tokenizer", "data.dtype", "data.seq_len",
               "data.seed", "data.order", "data.symbols", "data.branching")


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


def _one_writer_per_shard() -> None:
    """Each shard is written by its first replica, as Orbax does on GPUs. Orbax's default
    elsewhere splits every replicated shard over its replicas (to spread a TPU pod's writes),
    which on simulated CPU devices compiles and runs a slice program per array and device: a
    tiny model's first save held the loop 2.8 s, its copy to the host took 0.01 s. The files
    are the same either way (either kind restores)."""
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


def _manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    """The saving side (reads go through ``_read``)."""
    _one_writer_per_shard()
    options = ocp.CheckpointManagerOptions(
        enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True,
        preservation_policy=ocp.checkpoint_managers.LatestN(keep))
    return ocp.CheckpointManager(directory, options=options, item_names=(STATE, META))


@dataclass
class Resume:
    """Where a run continues from: ``directory`` (a checkpoints dir) at its newest readable
    step, or at ``step``; ``in_place``: the checkpoints are this run's own."""

    directory: Path
    step: int | None
    in_place: bool
    meta: dict[str, Any] = field(default_factory=dict)  # the newest readable checkpoint's meta
    meta_step: int = 0
    damaged: list[int] = field(default_factory=list)  # newer steps found damaged, newest first
    # Why the optimizer state starts fresh (its tree does not fit the optimizer now); None: it
    # is restored with the rest.
    fresh_optimizer: str | None = None
    state_names: set[str] | None = None  # the leaves of the checkpoint's state tree


def find_resume(cfg: Any, run_dir: Path, saved: dict[str, Any] | None = None) -> Resume | None:
    """Apply ``checkpoint.resume`` (auto | none | <path>) for a launch into ``run_dir``; check
    the checkpoint fits the config (``saved``: the run's config as its files will record it,
    ``batch.saved_config``, its global batch and sequence length resolved; None: ``cfg``). The
    run's own checkpoints come first: a requeued warm start (``checkpoint.resume=<other run>``)
    continues its own. Raises ConfigError; writes nothing."""
    mode = str(cfg.checkpoint.resume)
    if mode == "none":
        return None
    own = checkpoint_dir(cfg.checkpoint, run_dir)
    if committed_steps(own):
        resume = Resume(own, None, in_place=True)
    elif mode == "auto":
        return None
    else:
        resume = locate(Path(mode))
    resume.meta_step, resume.meta = newest_meta(resume, check_state=True)
    if resume.in_place and cfg.checkpoint.dir:
        _refuse_a_copy(run_dir, resume)
    check_compatible(cfg if saved is None else saved, resume.meta["config"],
                     resume.directory / str(resume.meta_step))
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
        return Resume(path.parent, int(path.name), in_place=False)
    if committed_steps(path):
        return Resume(path, None, in_place=False)
    fix = ", or use checkpoint.resume=auto|none" if key == "checkpoint.resume" else ""
    raise ConfigError(f"{key}={path} holds no committed checkpoint; give a run dir, its "
                      f"checkpoints dir or one of its step dirs{fix}")


def _candidates(resume: Resume, upto: int | None = None) -> list[int]:
    """The steps to try, newest first (none newer than ``upto``)."""
    if resume.step is not None:
        return [resume.step]
    return [s for s in committed_steps(resume.directory)[::-1] if upto is None or s <= upto]


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
    """A checkpoint's meta that lacks what a resume reads (``check_meta``): damage."""


# What a resume reads from a checkpoint's meta, with no default: the saved config (the checks
# of what may change, the batch the data position was counted in) and the data position.
META_KEYS = ("config", "data")


def check_meta(meta: dict[str, Any]) -> None:
    """Raise IncompleteMeta naming what ``meta`` lacks of what a resume reads."""
    missing = [k for k in META_KEYS if not isinstance(meta.get(k), dict)]
    if not missing and not isinstance(meta["config"].get("data"), dict):
        missing.append("config.data")
    elif not missing and "batch_size" not in meta["config"]["data"]:
        missing.append("config.data.batch_size")
    if missing:
        raise IncompleteMeta(f"its meta has no {', '.join(missing)}")


def is_damage(e: BaseException) -> bool:
    """Evidence that a checkpoint's files are damaged: missing or truncated files, checksum or
    format errors, a meta without what a resume reads, in ``e`` or what it was raised from.
    Anything else (an I/O error, out of memory, a tree that does not fit) is not, and never
    leads to setting a checkpoint aside."""
    import json

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


def _why(e: BaseException) -> str:
    """The root cause's first line: what a warning or a refusal names."""
    return _first_line(_chain(e)[0])


def _read(step_dir: Path, state: ocp.args.CheckpointArgs | None = None, resuming: bool = True
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


def _quiet_reads_that_finish_late() -> None:
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


def _quiet_failed_writes() -> None:
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
    _quiet_reads_that_finish_late()
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
    exception was never retrieved", one run in five of
    test_processes_agree_on_a_step_one_of_them_cannot_read)."""
    exc = getattr(unraisable, "exc_value", unraisable)  # an UnraisableHookArgs, or the error
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    if (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
            and frames and frames[0].name == "call_soon_threadsafe"):
        return True
    return any(f.name == "_read_array_index_and_device_put" and "orbax" in f.filename
               for f in frames)


def _read_meta(directory: Path, step: int, check_state: bool
               ) -> tuple[dict[str, Any], set[str] | None]:
    meta, _ = _read(directory / str(step))
    names = None
    if check_state:  # the state's tree and array metadata, without reading the arrays
        tree = ocp.StandardCheckpointHandler().metadata(directory / str(step) / STATE).tree
        names = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return meta, names


def _name(path: tuple) -> str:
    """A tree path as Orbax names a saved leaf: ``opt_state.1.0.mu.wte``."""
    return ".".join(leaf_key(path))


def _newest_readable(resume: Resume, check_state: bool
                     ) -> tuple[int, dict[str, Any], set[str] | None] | None:
    """The newest step this process can read: (step, meta, state leaf names), or None."""
    _quiet_reads_that_finish_late()
    for step in _candidates(resume):
        try:
            meta, names = _read_meta(resume.directory, step, check_state)
        except Exception as e:  # noqa: BLE001 - damage: the one before; else: stop
            if not is_damage(e):
                raise ConfigError(
                    f"checkpoint {resume.directory / str(step)} could not be read "
                    f"({_why(e)}); it is not damaged as far as dxrun can tell and "
                    "is left as it is: fix the cause and relaunch, or start fresh with "
                    "checkpoint.resume=none") from e
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before",
                        resume.directory / str(step), _why(e))
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
        raise ConfigError(f"checkpoint.resume: no readable checkpoint in {resume.directory}; "
                          "start fresh with checkpoint.resume=none")
    step, meta, names = found
    resume.damaged = [s for s in _candidates(resume) if s > step]
    resume.state_names = names
    return step, meta


def _flat(cfg: Any) -> dict[str, Any]:
    container = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    out = {}
    for group, values in container.items():
        if isinstance(values, dict):
            out.update({f"{group}.{k}": v for k, v in values.items()})
    return out


def changed(cfg: Any, saved_cfg: dict[str, Any], keys: tuple[str, ...]
            ) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` whose value differs from the checkpoint's: (key, now, then)."""
    now, then = _flat(cfg), _flat(saved_cfg)
    return next(((k, now.get(k), then.get(k)) for k in keys if now.get(k) != then.get(k)), None)


def check_compatible(cfg: Any, saved_cfg: dict[str, Any], where: Path) -> None:
    """Refuse a resume that cannot continue the checkpoint: one line naming both values.
    ``cfg``: the config now, or the dict the run saves of it."""
    for what, keys in (("model shape", MODEL_SHAPE), ("vocabulary", VOCABULARY),
                       ("data source", DATA_SOURCE)):
        if diff := changed(cfg, saved_cfg, keys):
            key, now, then = diff
            raise ConfigError(
                f"{key}={now} but checkpoint {where} was written with {key}={then} (the "
                f"{what} cannot change on resume); resume with {key}={then}, or start fresh "
                "with checkpoint.resume=none")
    now, then = _flat(cfg), _flat(saved_cfg)
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
    from dxrun.data.pipeline import position

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


def plan_resume(cfg: Any, resume: Resume, target: TrainState, global_batch: int) -> None:
    """What a resume into ``target`` (the abstract state of this run) does, decided before
    anything is written: stop when there is nothing to train (NothingToTrain), refuse a data
    position that cannot be continued (ConfigError), and restore the optimizer state only
    when its tree fits the optimizer now. A changed optimizer (``optimizer.name``, clipping on
    or off, SGD momentum) is not refused: the parameters and step are restored and the
    optimizer state starts fresh (its step count continues), with one warning naming why."""
    where = resume.directory / str(resume.meta_step)
    if cfg.train.steps <= resume.meta_step:
        raise NothingToTrain(
            f"nothing to train: train.steps={cfg.train.steps} and checkpoint {where} is at step "
            f"{resume.meta_step}; the run's files are left as they are (raise train.steps to "
            "train on)", where, {**resume.meta, "step": resume.meta_step})
    data_position(resume.meta, global_batch)
    if resume.state_names is None:
        return
    want = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    mine = {n.split(".", 1)[1] for n in want if n.startswith("opt_state.")}
    saved = {n.split(".", 1)[1] for n in resume.state_names if n.startswith("opt_state.")}
    if mine == saved:
        return
    diff = [f"{k}={now} (was {then})" for k, now, then in _changes(cfg, resume.meta["config"],
                                                                    "optimizer.")]
    resume.fresh_optimizer = (", ".join(diff) or "the optimizer") + " changes its state's tree"
    log.warning("checkpoint %s: %s; restoring the parameters and step, with a fresh optimizer "
                "state (its moments start at zero)", where, resume.fresh_optimizer)


def _changes(cfg: Any, saved_cfg: dict[str, Any], prefix: str) -> list[tuple[str, Any, Any]]:
    now, then = _flat(cfg), _flat(saved_cfg)
    return [(k, now.get(k), then.get(k)) for k in sorted(set(now) | set(then))
            if k.startswith(prefix) and now.get(k) != then.get(k)]


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
    _quiet_reads_that_finish_late()
    for step in _candidates(resume, upto):
        try:
            step_dir = resume.directory / str(step)
            # A resume that newest_meta planned reads a run's checkpoints, whose meta must
            # hold what the run reads of it; a bare restore (a test's own save) may not.
            meta, state = _read(step_dir, _restore_args(step_dir / STATE, target,
                                                        resume.fresh_optimizer is None),
                                resuming=bool(resume.meta))
            outcome, err = "ok", ""
        except Exception as e:  # noqa: BLE001 - sorted below: damage or not
            outcome, err = ("damaged" if is_damage(e) else "error"), _why(e)
        # Every process reads its own shards: all go on only from a step all of them read.
        outcomes = gather(f"restore/{step}", outcome)
        where = resume.directory / str(step)
        if "error" in outcomes:
            raise CheckpointReadError(
                f"checkpoint {where} could not be read ({err or 'on another process'}); it is "
                "not damaged as far as dxrun can tell and is left as it is: fix the cause and "
                "relaunch")
        if "damaged" in outcomes:
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before", where,
                        err or f"on process {outcomes.index('damaged')}")
            skipped.append(step)
            continue
        if skipped and resume.in_place and is_main():
            _set_aside(resume.directory, skipped)
        state = dict(state)
        state.setdefault("opt_state", None)
        return TrainState(**state), meta, step
    raise ConfigError(f"checkpoint.resume: no readable checkpoint in {resume.directory}; "
                      "start fresh with checkpoint.resume=none")


def _set_aside(directory: Path, steps: list[int]) -> None:
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


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

    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.manager = _manager(directory, keep)
        self.in_flight: int | None = None  # the step whose writes may still be running
        _quiet_failed_writes()

    def save(self, step: int, state: TrainState, meta: dict[str, Any]
             ) -> tuple[Path, float | None]:
        """Start saving ``state`` after step ``step``; returns, once the disk writes begin,
        the checkpoint's path and how long the save held the loop (None: saved already)."""
        path = self.directory / str(step)
        if step in self.manager.all_steps():
            return path, None  # already saved (e.g. the step this run resumed from)
        # Wait for the state's steps to finish: Orbax then copies settled shards, and the host
        # never runs more than MAX_IN_FLIGHT steps ahead of the device (see step.py). That
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
        self._on_disk(self.manager.wait_until_finished)
        self.in_flight = None

    def close(self) -> None:
        self._on_disk(self.manager.close)
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


def time_due(now: float, last_save: float, every_s: float) -> bool:
    """The wall-clock cadence (``checkpoint.every_minutes``): a save is due when ``every_s``
    seconds (> 0; 0 = off) have passed since the last save (or the start)."""
    return every_s > 0 and now - last_save >= every_s


class RunCheckpoints:
    """What the train loop does between two steps: save when due (``checkpoint.every`` steps,
    ``checkpoint.every_minutes`` of wall clock, the last step, SIGUSR1), stop after a committed
    save on SIGTERM/SIGINT, and halt on a non-finite step (``train.nan_policy=halt``). The
    finiteness flag is read only where the host waits anyway (log and save steps), so a halt
    reports the exact first bad step, at the next of those, without a save of the bad state.

    A save's cost to the loop (``Checkpointer.save``'s blocking time) is kept until the loop's
    next metrics row takes it (``take_blocks``: ``perf/checkpoint_block_s``) and in total; above
    ``MAX_CHECKPOINT_OVERHEAD`` of the time since the previous save, one warning names a cadence that
    costs less. With several processes a wall-clock save goes through the same agreement as a
    signal (``ProcessAgreement``): every process saves at the same step, whichever clock said so."""

    def __init__(self, ckpt: CheckpointConfig, train: TrainConfig, run_dir: Path, start: int,
                 meta: dict[str, Any], iterator: Any, logger: Any, preemption: Preemption,
                 cadence: tuple[int, float], tokens: Callable[[int], int] | None = None,
                 relaunch: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.start = start  # the step this attempt began at: saved already, or the init
        every, minutes = cadence  # (steps, minutes) between saves: plan_mode.save_cadence
        self.every, self.log_every = every, train.log_every
        self.every_s = 60.0 * minutes
        self.clock = clock  # time.monotonic; a test passes its own
        self.last_save_t = clock()
        self.block_total_s, self.saves = 0.0, 0
        self.unlogged: list[float] = []  # saves' blocking times the metrics do not hold yet
        self.warned_cost = False
        self.halt = train.nan_policy == "halt"
        test_faults = faults.from_env()  # test-only: see between_steps
        self.hold, self.fail_at = test_faults.hold_at_step, test_faults.error_at_step
        # A SIGUSR1 not yet answered by a save: with several processes the save comes at the
        # step they agree on, some steps after the signal cleared its flag.
        self.usr1_pending = False
        # Every checkpoint names the run that wrote it (evaluation writes its results there).
        self.meta = {**meta, "run_id": run_id(run_dir), "run_dir": str(Path(run_dir).resolve())}
        self.iterator, self.logger, self.preemption = iterator, logger, preemption
        self.tokens = tokens  # tokens trained on after a step (carried across resumes)
        directory = checkpoint_dir(ckpt, run_dir)
        if ckpt.dir and is_main():  # the run dir leads to its checkpoints (locate)
            (Path(run_dir) / POINTER).write_text(f"{directory}\n")
        self.saver = Checkpointer(directory, ckpt.keep)
        self.last_saved: Path | None = None
        self.relaunch = relaunch  # the command that resumes this run, for the stop line
        # Several processes act on a signal at one agreed step (a save is collective).
        self.agreement = ProcessAgreement() if jax.process_count() > 1 else None

    def between_steps(self, done: int, state: TrainState, last: bool = False) -> None:
        """After step ``done`` (the iterator has given exactly ``done`` batches)."""
        # Test-only (DXRUN_TEST_HOLD_AT_STEP): from that step on, each step waits for a SIGUSR1, so a
        # test knows the step its signals are acted on at (a stop waits for one too).
        while self.hold and done >= self.hold and not self.preemption.save:
            time.sleep(0.01)
        if self.fail_at and done == self.fail_at:  # test-only (DXRUN_TEST_ERROR_AT_STEP)
            raise RuntimeError(f"injected failure after step {done} "
                               "(DXRUN_TEST_ERROR_AT_STEP, a test-only fault)")
        stop, signalled = self.preemption.stop, self.preemption.take_save()
        self.usr1_pending |= signalled
        ran = done > self.start
        timed = ran and time_due(self.clock(), self.last_save_t, self.every_s)
        asked = signalled or timed
        if self.agreement is not None:
            stop, asked = self.agreement(done, stop, asked)
        cadence = bool(self.every) or self.every_s > 0
        due = ran and ((bool(self.every) and done % self.every == 0) or (last and cadence))
        if due or stop or asked:
            self._check_finite(done, state)
            meta = {**self.meta, "step": done, "data": self.iterator.get_state(),
                    "wandb_id": self.logger.run_id}
            if self.tokens is not None:
                meta["tokens_seen"] = self.tokens(done)
            self.last_saved, block_s = self.saver.save(done, state, meta)
            if block_s is not None:
                self._count(block_s)
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

    def _count(self, block_s: float) -> None:
        """One save held the loop ``block_s``: record it, and warn once when saves cost more
        than ``MAX_CHECKPOINT_OVERHEAD`` of the time since the previous one."""
        now = self.clock()
        since = now - self.last_save_t
        self.last_save_t = now
        self.unlogged.append(block_s)
        self.block_total_s += block_s
        self.saves += 1
        # A small state's saves (tens of ms: the tiny models on CPU) are not worth a warning
        # whatever their share; the first save's interval holds the compile: not judged.
        over = block_s > MAX_CHECKPOINT_OVERHEAD * since and block_s >= NOTICEABLE_BLOCK_S
        if self.saves > 1 and over and not self.warned_cost:
            self.warned_cost = True
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

    def _check_finite(self, done: int, state: TrainState) -> None:
        if not self.halt:
            return
        bad = int(jax.device_get(state.nonfinite_step))
        if bad:
            self.saver.wait()
            good = committed_steps(self.saver.directory)
            where = (f"the last good checkpoint is {self.saver.directory / str(good[-1])}"
                     if good else "no checkpoint was saved before it")
            raise NonFiniteError(
                f"non-finite loss or gradients at step {bad} (stopped at step {done}, "
                f"train.nan_policy=halt); {where}; lower optimizer.lr or set "
                "train.nan_policy=skip to leave such steps out")

    def close(self) -> None:
        """Wait for the last save to be committed."""
        self.saver.close()
