"""How a run ends: its outcomes (the exceptions it reports in one line: bad input, failures
with a known cause, a stop on a signal), the status it records and its exit code.

Imports nothing of dxrun: every floor reads it, the launcher included.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

# status.json's "status": running until the run ends ok, stopped (on a signal, after a committed
# save) or failed (its "kind": refused | crashed | nonfinite | disk).
RUNNING, OK, STOPPED, FAILED = "running", "ok", "stopped", "failed"
# A run whose end is not recorded yet: a relaunch naming its dir continues it (run_dir.py).
UNFINISHED = (RUNNING, STOPPED, FAILED)

# Exit codes. A stop on a signal exits with the signal's: 0 for SIGTERM (what SLURM and
# Kubernetes send before a requeue: a clean requeue point), 130 for SIGINT (a shell's 128 + 2).
# SIGUSR1 stops a run only outside the loop (its scheduler's warning: the end is near), as
# SIGTERM does.
EXIT_CODES = {"SIGTERM": 0, "SIGINT": 130, "SIGUSR1": 0}
EXIT_CRASHED = 1  # a crash, a non-finite halt, a write the disk refused
EXIT_REFUSED = 2  # input dxrun cannot run with (ConfigError), said before anything is written


def fail(msg: str, code: int = EXIT_REFUSED) -> None:
    """End the process on ``msg``, one line on stderr, with exit ``code``."""
    print(f"dxrun: error: {msg}", file=sys.stderr)
    sys.exit(code)


class ConfigError(ValueError):
    """A config value dxrun cannot run with. Its message names the key, the value and the fix;
    the launcher prints it as one line and exits non-zero, without a traceback."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient under ``train.nan_policy=halt``. Its message names the step
    and the last good checkpoint; the launcher prints it as one line and exits 1."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message cut to its first line: what a crash shows in one line."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


def named_line(e: BaseException, limit: int = 300) -> str:
    """``<type>: <first line>``: an exception named in a warning that goes on without it."""
    return f"{type(e).__name__}: {first_line(e, limit)}"


class Stopped(Exception):  # noqa: N818 - a normal outcome, not an error
    """The run stopped on a signal after committing ``checkpoint``; exit with ``code``;
    ``relaunch`` is the command that resumes it."""

    def __init__(self, signal_name: str, step: int, checkpoint: Any = None,
                 relaunch: str | None = None):
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.signal_name, self.step, self.code = signal_name, step, EXIT_CODES[signal_name]
        self.checkpoint, self.relaunch = checkpoint, relaunch


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, an outcome
    """A signal outside the train loop stopped the run ``when`` (``signals.Signals.phase``).
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way (JAX's,
    Orbax's, W&B's, dxrun's own) takes it for an error of its own."""

    def __init__(self, signal_name: str, when: str):
        super().__init__(f"stopped by {signal_name} {when}")
        self.signal_name, self.when, self.code = signal_name, when, EXIT_CODES[signal_name]


class NothingToTrain(Exception):  # noqa: N818 - an outcome, not a failure
    """A relaunch whose ``train.steps`` the checkpoint has already reached: the launcher says so
    in one line and exits 0, leaving the run's files as they are (or, for a run that reached
    its end but was stopped before recording it, records it). ``checkpoint``: the step dir,
    ``meta`` its meta."""

    def __init__(self, message: str, checkpoint: object = None, meta: dict | None = None):
        super().__init__(message)
        self.checkpoint, self.meta = checkpoint, meta or {}


class CheckpointReadError(RuntimeError):
    """A checkpoint that could not be read for a reason other than damage (an I/O error, out
    of memory): the run stops with one line and the checkpoint is left as it is."""


class CheckpointGone(ConfigError):
    """A checkpoint that went while it was read: the live run it belongs to rotated it away
    (``checkpoint.keep``). The message names it; a reader of the newest one reads again."""

    def __init__(self, where: object):
        super().__init__(f"checkpoint {where} was removed while it was read (its run, still "
                         "training, rotated it away: checkpoint.keep)")
        self.where = where


class DiskError(RuntimeError):
    """A write the disk refused (no space left, an I/O error). Its message names what was being
    written, why, and what is kept; the launcher prints it as one line and exits 1, with status
    ``failed`` of kind ``disk`` (never an out-of-memory report: tensorstore calls a full disk
    RESOURCE_EXHAUSTED, as XLA calls a full device)."""


# What the disk said, by errno. tensorstore's errors (which Orbax raises as they are, or wraps)
# are not OSErrors: their text carries the errno (``[os_error_code='28']``) and strerror.
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EIO: "input/output error",
               errno.EDQUOT: "disk quota exceeded"}


def disk_error(e: BaseException) -> str | None:
    """What the disk refused, when ``e`` or an exception it was raised from is a disk error
    (``DISK_ERRNOS``); else None."""
    seen: list[BaseException] = []
    link: BaseException | None = e
    while link is not None and link not in seen:
        seen.append(link)
        if isinstance(link, OSError) and link.errno in DISK_ERRNOS:
            return DISK_ERRNOS[link.errno]
        text = str(link)
        for code, what in DISK_ERRNOS.items():
            if f"os_error_code='{code}'" in text or os.strerror(code) in text:
                return what
        link = link.__cause__ or link.__context__
    return None
