"""What counts as a damaged checkpoint, and keeping the failures of reads given up quiet.

A committed checkpoint can still be damaged later (a truncated file); that shows only when it is
read. Only evidence of damage (missing or truncated files, checksum and format errors, a meta
without what a resume reads or holding a field of it that cannot be read: ``is_damage``) leads
a resume to the checkpoint before, the damaged one renamed, never deleted
(``set_aside_checkpoints``); any other failure to read (an I/O error, out of memory) stops the
run with one line and leaves the checkpoint as it is. A
read or write that fails leaves Orbax's other reads and writes in flight, whose late failures
would print a traceback each: ``quiet_reads_that_finish_late`` and ``quiet_failed_writes``
drop those, and nothing else.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from dxrun.config import (
    disk_error,
    named_line,
)

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
