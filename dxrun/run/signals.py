"""Preemption: signals turn into flags the train loop reads once per step.

SIGTERM (what SLURM and Kubernetes send before killing a job) and SIGINT (Ctrl-C) ask the loop to
finish its step, save, wait for the save to be committed and stop (``errors.Stopped``, with the
signal's exit code). A second SIGINT exits at once. SIGUSR1 (SLURM's ``--signal`` warning)
asks for a save and training goes on. A handler only sets a flag: the
loop acts between steps, so no device work is interrupted and nothing syncs per step.

Outside the loop (from the launcher's start: the plan, the compile, the layout search, the
init; and after the last step: the final commit, W&B's finish, the summary) there is no step
to finish and nothing new to save: ``guard_signals``' handlers raise ``errors.Interrupted`` for
any of the three, which the launcher turns into one line and status ``stopped``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

from dxrun.config import (
    EXIT_CODES,
    Interrupted,
)
from dxrun.run.distributed import tell_launcher_startup

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Signals:
    """The process's answer to a signal outside the loop: ``phase`` says where the run is
    (the launcher sets it at each job's start, ``Preemption`` after the loop), ``stopping`` the
    signal a stop is already under way for (a later SIGTERM or SIGUSR1 then changes nothing;
    a later SIGINT exits at once, as in the loop)."""

    STARTING, FINISHING = "while starting", "after the last step"

    def __init__(self) -> None:
        self.phase = self.STARTING
        self.stopping: str | None = None
        self.redeliver = False  # the stop was raised where Python drops exceptions: again
        self.in_hook = False  # inside ``unraisable``: a stop raised here is dropped too
        self.came_back = False  # the resent signal came while the hook still ran
        self.holding = False  # inside ``held_back``: a stop waits for its end
        self.held: str | None = None  # the signal that came while holding

    def start_job(self) -> None:
        self.phase, self.stopping, self.redeliver = self.STARTING, None, False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping is not None and not self.redeliver:
            if signum == signal.SIGINT:
                os.write(2, b"dxrun: second SIGINT: exiting now\n")
                os._exit(EXIT_CODES["SIGINT"])
            return
        if self.in_hook:  # the resent signal came before the hook returned: the hook resends
            self.came_back = True
            return
        if self.holding:
            self.held = self.held or name
            return
        self.stop(name)

    def stop(self, name: str) -> NoReturn:
        """Stop the process for signal ``name``. One that stops while starting tells
        ``dxrun.launch``: another process may wait for it inside a startup collective, where
        no signal reaches it, and the launcher then ends that one."""
        self.stopping, self.redeliver = name, False
        if self.phase == self.STARTING:
            with contextlib.suppress(OSError):  # the stop is the news, not the telling
                tell_launcher_startup("stopped")
        raise Interrupted(name, self.phase)

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """A stop signal that comes inside the block is raised at its end: what the block
        takes (a run dir's lock) is recorded before the stop unwinds past it."""
        self.holding, self.held = True, None
        try:
            yield
        finally:
            self.holding = False
        if self.held is not None:
            self.stop(self.held)

    def unraisable(self, unraisable: Any, previous: Any) -> None:
        """``sys.unraisablehook``: a handler's exception raised inside a callback Python cannot
        propagate from (a gc callback such as JAX's, a finalizer) is printed and dropped, and
        the run would go on. Such a stop is sent again, from a thread a moment later (sent from
        here, it would be raised inside this hook, and dropped again), to be raised in ordinary
        code. Starting that thread waits for it, so on a busy host the signal can come back
        while this hook still runs: then it is sent again, each time a moment later. Anything
        else goes to the hook before."""
        if isinstance(unraisable.exc_value, Interrupted) and self.stopping is not None:
            signum, delay = signal.Signals[unraisable.exc_value.signal_name], 0.05
            self.redeliver, self.in_hook, self.came_back = True, True, True
            try:
                while self.came_back:
                    self.came_back = False
                    send_later(signum, delay)
                    delay *= 2
            finally:
                self.in_hook = False
            return
        previous(unraisable)


def send_later(signum: int, delay: float) -> None:
    """``signum`` to this process from a thread, ``delay`` seconds from now."""
    threading.Timer(delay, os.kill, (os.getpid(), signum)).start()


SIGNALS = Signals()


def guard_signals() -> None:
    """From here on SIGTERM, SIGINT and SIGUSR1 stop the process through ``Interrupted``
    (the train loop swaps in its own handlers while it runs). The launcher calls this first.
    A rank of ``dxrun.launch`` then says it listens (``listening.<rank>``): the launcher holds
    back a stop until then, which before would have ended the rank in Python's own way (a
    KeyboardInterrupt traceback) or been lost."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, SIGNALS.handle)
        if not isinstance(sys.unraisablehook, functools.partial):  # once per process
            sys.unraisablehook = functools.partial(SIGNALS.unraisable,
                                                   previous=sys.unraisablehook)
        with contextlib.suppress(OSError):  # untold, the launcher's grace ends a stop here
            tell_launcher_startup("listening")


class Preemption:
    """While active (a context manager around the train loop), SIGTERM/SIGINT set ``stop`` and
    SIGUSR1 sets ``save``; the previous handlers come back on exit. Outside the main thread
    (where Python cannot install handlers) it does nothing."""

    def __init__(self) -> None:
        self.stop: str | None = None  # the name of the signal that asked to stop
        self.save = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        tell_launcher_startup("training")  # a stop from here is the loop's: saved, never killed
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        SIGNALS.phase = Signals.FINISHING
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
            os._exit(EXIT_CODES["SIGINT"])
        if self.stop is None:
            self.stop = SIGNALS.stopping = name  # the shutdown after the loop: no second stop
            # Logging from a signal handler can deadlock on the handler's lock; write directly.
            os.write(2, f"dxrun: {name} received: finishing the step, then saving\n".encode())

    def take_save(self) -> bool:
        """Whether a save was asked for (SIGUSR1) since the last call."""
        asked, self.save = self.save, False
        return asked


class ProcessAgreement:
    """Signals in a multi-process run: every process acts on them at the same step.

    SLURM signals every task, but not at the same instant, and the processes' hosts may be some
    steps apart; a save is a collective (all processes write their shards) and a stop must
    happen everywhere, so each process acting on its own signal would hang or split the run.
    Every ``EVERY`` steps the processes publish what they received to the distributed
    runtime's key-value store, meet at a barrier, and all read the same union: the same
    save, the same stop, at the same step. Between those steps nothing is exchanged."""

    EVERY = 10
    _runs = 0  # agreements made in this process: keys stay distinct across multirun jobs

    def __init__(self, timeout_s: int = 24 * 3600):
        import jax
        from jax._src.distributed import global_state

        # The barrier waits for the slowest process, which may still be compiling or
        # evaluating; a dead one is caught by the runtime's heartbeat, not by this timeout.
        self.client, self.rank = global_state.client, jax.process_index()
        self.timeout_ms = timeout_s * 1000
        self.pending_save = False
        ProcessAgreement._runs += 1
        self.prefix = f"dxrun/signals/{ProcessAgreement._runs}"

    def __call__(self, done: int, stop: str | None, save: bool) -> tuple[str | None, bool]:
        self.pending_save |= save
        if done % self.EVERY:
            return None, False
        key = f"{self.prefix}/{done}"
        self.client.key_value_set(f"{key}/{self.rank}", f"{stop or ''}|{int(self.pending_save)}")
        self.client.wait_at_barrier(key, self.timeout_ms)
        seen = [v for _, v in self.client.key_value_dir_get(f"{key}/")]
        if done >= self.EVERY:  # everyone has read the round before: drop it
            self.client.key_value_delete(f"{self.prefix}/{done - self.EVERY}/")
        stops = {v.split("|")[0] for v in seen} - {""}
        agreed_save = any(v.endswith("|1") for v in seen)
        if agreed_save:
            self.pending_save = False
        # SIGTERM (a requeue: exit 0) wins over SIGINT when both arrived.
        return (max(stops) if stops else None), agreed_save
