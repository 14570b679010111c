"""The run's log file (dxrun/run/files.py): Hydra's file handlers taken over, and only Hydra's empty
log file removed, never a file that is not a plain one."""

from __future__ import annotations

import logging
import os
import stat

from dxrun.run import RunLog


def test_only_an_empty_plain_log_file_is_removed(tmp_path):
    """Hydra opens its log file before dxrun knows the run's dir: an empty one goes, a log with
    lines stays, and a handler on something that is not a plain file (a handler on /dev/null
    in a process that ran dxrun in-process deleted the host's /dev/null) is left on disk."""
    empty, kept, fifo = tmp_path / "dxrun.log", tmp_path / "earlier.log", tmp_path / "pipe"
    empty.touch()
    kept.write_text("an earlier run's line\n")
    os.mkfifo(fifo)
    handlers = [logging.FileHandler(p, delay=True) for p in (empty, kept, fifo)]
    root = logging.getLogger()
    for h in handlers:
        root.addHandler(h)
    try:
        run_log = RunLog()
        run_log.discard()
    finally:
        for h in handlers:
            root.removeHandler(h)
    assert not empty.exists()
    assert kept.read_text() == "an earlier run's line\n"
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert not any(h in root.handlers for h in handlers)  # the run's own file replaces them
