"""Preemption: signals turn into flags the train loop reads once per step.

SIGTERM (what SLURM and Kubernetes send before killing a job) and SIGINT (Ctrl-C) ask the loop to
finish its step, save, wait for the save to be committed and stop: exit code 0 for SIGTERM (a
clean requeue point), 130 for SIGINT. A second SIGINT exits at once. SIGUSR1 (SLURM's
``--signal`` warning) asks for a save and training goes on. A handler only sets a flag: the
loop acts between steps, so no device work is interrupted and nothing syncs per step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("dxrun")

EXIT_CODES = {"SIGTERM": 0, "SIGINT": 130}


class Stopped(Exception):  # noqa: N818 - a normal outcome, not an error
    """The run stopped on a signal after committing its checkpoint; exit with ``code``."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.signal_name, self.step, self.code = signal_name, step, EXIT_CODES[signal_name]


class Preemption:
    """While active (a context manager around the train loop), SIGTERM/SIGINT set ``stop`` and
    SIGUSR1 sets ``save``; the previous handlers come back on exit. Outside the main thread
    (where Python cannot install handlers) it does nothing."""

    def __init__(self) -> None:
        self.stop: str | None = None  # the name of the signal that asked to stop
        self.save = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:
            self.save = True
            return
        if self.stop == "SIGINT" and signum == signal.SIGINT:
            # The user insists: no save, no cleanup. Committed checkpoints are complete; a save
            # in flight stays in its tmp dir, never taken for a finished one.
            os.write(2, b"dxrun: second SIGINT: exiting now without saving\n")
            os._exit(130)
        if self.stop is None:
            self.stop = name
            # Logging from a signal handler can deadlock on the handler's lock; write directly.
            os.write(2, f"dxrun: {name} received: finishing the step, then saving\n".encode())

    def take_save(self) -> bool:
        """Whether a save was asked for (SIGUSR1) since the last call."""
        asked, self.save = self.save, False
        return asked
