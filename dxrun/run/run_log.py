"""The run's log file: held in memory until the run has claimed its dir, then written there.

Hydra opens ``<its dir>/dxrun.log`` before dxrun knows whether that dir is free (``RunLog``).
"""

from __future__ import annotations

import contextlib
import logging
import stat
import sys
from pathlib import Path


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
        import logging

        record = logging.getLogger("dxrun").makeRecord(
            "dxrun", logging.ERROR, __file__, 0, "run failed", None,
            (type(exc), exc, exc.__traceback__))
        self.file.handle(record)
        self.file.flush()

    def discard(self) -> None:
        import logging

        logging.getLogger().removeHandler(self.buffer)
        self.buffer.buffer.clear()
