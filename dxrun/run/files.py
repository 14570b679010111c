"""The files that record a run in its dir, never fatal when damaged: the bookkeeping JSON
(``status.json``, ``goodput.json``, ``eval.json``) read, written atomically or set aside, the Hydra
files and attempts of each launch, the job's status, and the run's log file (held in memory until
the run has claimed its dir, then written there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dxrun.config import (
    named_line,
)

if TYPE_CHECKING:
    from hydra.conf import HydraConf
    from omegaconf import DictConfig


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

ATTEMPTS = Path(".hydra") / "attempts"  # in a run dir: <n>/, each launch's own config


def attempt_numbers(run_dir: Path) -> list[int]:
    """The launches into ``run_dir`` that kept their config (``.hydra/attempts/<n>/``)."""
    where = run_dir / ATTEMPTS
    return sorted(int(p.name) for p in where.iterdir() if p.name.isdigit()) if where.is_dir() else []


def write_hydra_files(run_dir: Path, cfg: DictConfig, hydra_cfg: HydraConf | None) -> None:
    """What Hydra's .hydra/ holds, written only once the config is known to be valid; and
    this launch's own copy in ``.hydra/attempts/<n>/``: a resume may change the optimizer, the
    lr or the mesh, and config.yaml, the latest, would say nothing of what the earlier steps
    ran with."""
    out = run_dir / ".hydra"
    make_dir(out)  # whatever else is there is set aside (bookkeeping.make_dir)
    make_dir(run_dir / ATTEMPTS)
    attempt = run_dir / ATTEMPTS / str(max(attempt_numbers(run_dir), default=0) + 1)
    attempt.mkdir()
    for where in (out, attempt):
        OmegaConf.save(cfg, where / "config.yaml", resolve=True)
        if hydra_cfg is not None:
            OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)),
                           where / "overrides.yaml")
    if hydra_cfg is not None:
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")


STATUS = "status.json"


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """The run's state for the sweep report and the multirun's exit code: ``running`` when it
    starts (a job killed mid-run stays so), then ``ok`` or ``failed`` with ``kind`` (refused |
    crashed | nonfinite | disk), ``reason`` and ``log``. ``started``/``finished`` (epoch
    seconds) let the report see jobs that ran at the same time, whose throughputs are not
    comparable."""
    import time

    path = run_dir / STATUS
    # A damaged status.json is set aside: the status it held is history, this one is news.
    old = read_json(path, lambda x: isinstance(x, dict)) or {}
    now = time.time()
    record = {"status": status, **fields, "started": old.get("started") or now}
    if status != "running":
        record["finished"] = now
    if attempts := _attempts(run_dir, old.get("attempts"), status, now):
        record["attempts"] = attempts
    try:
        write_json(path, record)
    except OSError as e:  # a full disk: the run's own line still says what happened
        log.warning("could not write %s (%s): it still says %r", path, e.strerror or e,
                    old.get("status"))


def _attempts(run_dir: Path, recorded: Any, status: str, now: float) -> list[dict[str, Any]]:
    """status.json's ``attempts``: one per launch into the run dir that kept its config
    (``write_hydra_files``), with when it started and how it ended; the one under way is
    ``status``, and an earlier one that never said how it ended was killed. What the old
    status.json said of each is kept (none of it when that file was damaged)."""
    said = {a.get("attempt"): a for a in recorded if isinstance(a, dict)} if isinstance(
        recorded, list) else {}
    out = [{**said.get(n, {}), "attempt": n, "config": str(ATTEMPTS / str(n) / "config.yaml")}
           for n in attempt_numbers(run_dir)]
    for a in out[:-1]:
        if a.get("status") == "running":
            a["status"] = "killed"
    if out:
        out[-1].setdefault("started", now)
        out[-1]["status"] = status
        if status != "running":
            out[-1]["finished"] = now
    return out

class _LogFile(logging.FileHandler):
    """The run's log file. A line it cannot write (a full disk) costs one line on stderr for
    the whole run, not logging's traceback per line (or, from ``write_traceback``, the crash's
    traceback on the terminal): the console still has every line."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            print(f"dxrun: warning: cannot write {self.baseFilename} ({sys.exc_info()[1]}); "
                  "its lines go to the console only", file=sys.stderr)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)  # type: ignore[arg-type]


class RunLog:
    """The run's log file follows the run dir it claimed. Hydra opens ``<its dir>/dxrun.log``
    before dxrun knows whether that dir is free; this holds the lines in memory until
    ``attach`` names the claimed dir (so a relaunch never writes into an earlier run's log),
    and ``discard`` drops them for a run that never started."""

    NAME = "dxrun.log"

    @staticmethod
    def name_for(rank: int, processes: int) -> str:
        """``dxrun.log``; in a multi-process run each process its own ``dxrun.<rank>.log``."""
        return RunLog.NAME if processes == 1 else f"dxrun.{rank}.log"

    def for_process(self, rank: int, processes: int) -> None:
        """The file of process ``rank`` of a run of ``processes`` (``name_for``)."""
        self.name = self.name_for(rank, processes)

    def __init__(self) -> None:
        import logging.handlers

        root = logging.getLogger()
        hydra_files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        self.formatter = (hydra_files[0].formatter if hydra_files else None) or logging.Formatter(
            "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        for h in hydra_files:
            root.removeHandler(h)
            h.close()
            path = Path(h.baseFilename)
            with contextlib.suppress(FileNotFoundError):  # the ranks of one run share the file
                st = path.stat()
                # Hydra's empty file; an earlier run's log stays, and so does anything that is
                # not a plain file (a handler on /dev/null: deleting it would break the host).
                if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    path.unlink()
        self.buffer = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=100)
        root.addHandler(self.buffer)
        self.file: logging.FileHandler | None = None
        self.name = self.NAME

    def attach(self, run_dir: Path) -> Path:
        import logging

        if self.file is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = _LogFile(run_dir / self.name)
            self.file.setFormatter(self.formatter)
            self.buffer.setTarget(self.file)
            self.buffer.flush()
            root = logging.getLogger()
            root.removeHandler(self.buffer)
            root.addHandler(self.file)
        return Path(self.file.baseFilename)

    def quiet_console(self) -> None:
        """Processes other than 0 print only errors (process 0 says the rest, once); their log
        files still get every line."""
        import logging

        for h in logging.getLogger().handlers:
            if type(h) is logging.StreamHandler:
                h.setLevel(logging.ERROR)

    def write_traceback(self, exc: BaseException) -> None:
        """The full traceback into the log file only: the terminal gets one line."""
        self._error("run failed", (type(exc), exc, exc.__traceback__))

    def write_error(self, line: str) -> None:
        """The error line a run ends with on the terminal (``fail``'s), into its log file too,
        once the run has one: the log alone says how the run ended."""
        if self.file is not None:
            self._error(line)

    def _error(self, msg: str, exc_info: Any = None) -> None:
        """An error record into the log file only."""
        import logging

        record = logging.getLogger("dxrun").makeRecord(
            "dxrun", logging.ERROR, __file__, 0, msg, None, exc_info)
        self.file.handle(record)
        self.file.flush()

    def discard(self) -> None:
        import logging

        logging.getLogger().removeHandler(self.buffer)
        self.buffer.buffer.clear()
