"""What counts as a damaged checkpoint, and keeping the failures of reads given up quiet.

A committed checkpoint can still be damaged later (a truncated file); that shows only when it is
read. Only evidence of damage (missing or truncated files, checksum and format errors, a meta
without what a resume reads: ``is_damage``) leads a resume to the checkpoint before, the
damaged one renamed, never deleted (``set_aside_checkpoints``); any other failure to read (an
I/O error, out of memory) stops the run with one line and leaves the checkpoint as it is. A
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

from dxrun.errors import disk_error, named_line

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
