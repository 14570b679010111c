"""The run dir's bookkeeping files (``status.json``, ``goodput.json``, ``eval.json``) and dirs
(``.hydra/``): read, or made, so that damage is never fatal.

A run writes them atomically (``write_json``, a non-finite number as null), but a file can
still be damaged afterwards (a disk error, a careless edit, a copy cut short). They record a
run; they never decide whether it can go on, so an unreadable one is renamed to
``<name>.damaged`` (kept, never deleted) with one warning, and the run goes on as if it were
not there; so is anything else where the run keeps a dir (a file named ``.hydra``:
``make_dir``). ``metrics.jsonl``'s damaged lines go the way of its other set-aside lines
(``tracking.logger.rewind_metrics``); a checkpoint's meta is checked with its checkpoint
(``checkpointing.store``). Imports nothing of dxrun but its errors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dxrun.config import named_line

log = logging.getLogger("dxrun")

DAMAGED = ".damaged"


def set_aside(path: Path, why: str) -> Path | None:
    """Rename the damaged ``path`` to ``<name>.damaged`` (``.damaged1``, ... when that is
    taken: an earlier damage is never overwritten) and say so in one line; None, also in one
    line, when it cannot be renamed (the next write replaces it)."""
    dst, i = path.with_name(path.name + DAMAGED), 0
    while dst.exists():
        i += 1
        dst = path.with_name(f"{path.name}{DAMAGED}{i}")
    try:
        path.rename(dst)
    except OSError as e:
        log.warning("%s is damaged (%s) and could not be moved aside (%s); the run goes on "
                    "without it", path, why, e.strerror or e)
        return None
    log.warning("%s is damaged (%s); moved it to %s, the run goes on without it", path, why,
                dst.name)
    return dst


def read_json(path: Path, valid: Callable[[Any], bool] = lambda _: True) -> Any | None:
    """The JSON value in ``path``; None when there is none. A file that is not UTF-8 JSON, or
    whose value ``valid`` refuses, is damaged: set aside (``set_aside``), None. One that cannot
    be read at all (an I/O error) is left where it is, with one warning, None."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("could not read %s (%s); the run goes on without it", path, e.strerror or e)
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        set_aside(path, named_line(e, 120))
        return None
    if not valid(value):
        set_aside(path, "not the structure dxrun writes")
        return None
    return value


def make_dir(path: Path) -> None:
    """``path`` as a dir (made, with its parents, if need be). Anything else in its place (a
    file, a link to nowhere) is damaged bookkeeping: set aside (``set_aside``) and the dir
    made anew; a ``path`` that cannot be set aside still fails, in ``mkdir``."""
    if os.path.lexists(path) and not path.is_dir():
        set_aside(path, "a file where the run keeps a directory")
    path.mkdir(parents=True, exist_ok=True)


def finite_or_null(obj: Any, key: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every NaN/inf float replaced by None, and the keys where that happened.

    JSON has no NaN or Infinity: Python writes them anyway and most readers then refuse the
    whole file. A diverged run's numbers become ``null`` instead (W&B shows a gap)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [key or "value"]
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite_or_null(v, f"{key}.{k}" if key else str(k))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        pairs = [finite_or_null(v, f"{key}[{i}]") for i, v in enumerate(obj)]
        return [v for v, _ in pairs], [k for _, b in pairs for k in b]
    return obj, []


def write_json(path: Path, obj: Any) -> None:
    """Atomically; non-finite floats are written as null (see ``finite_or_null``)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(finite_or_null(obj)[0], indent=2, allow_nan=False) + "\n")
        tmp.replace(path)
    except OSError:  # a full disk: no half-written tmp file left beside the intact one
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
