"""How a ``dxrun.launch`` run ended, in the launcher's words: the closing line of a stop that
every rank made cleanly (``clean_stop``; a stop while starting that rank 0 never saw is said
and recorded for it: ``settle_starting_stop``), or of a failure, naming the rank that failed
first, its own last line and where the ranks' logs are (``failure``), and the run's status.json
marked failed where no rank could (``mark_failed``).

And a rank's exit code in a shell's terms, and how long the other ranks get once one ended.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from dxrun.config import EXIT_CODES, FAILED, RUNNING, STOPPED
from dxrun.run import STATUS, Signals, relaunch_command, run_dir_of, stopped_words, write_status

# ------------------------------------------------------------------------------------------------


STOP_LINE = re.compile(r"(SIG\w+): stopped at step (\d+); checkpoint (.+?) committed\. "
                        r"Resume with: (.+)$")
# A rank stopped outside the train loop (``dxrun.__main__._interrupted``): when, and what it kept.
STOPPED_OUTSIDE = re.compile(r"(SIG\w+): stopped (while starting|after the last step); (.+)$")


def describe(returncode: int, by_launcher: bool = False) -> str:
    if by_launcher:
        return "was stopped by the launcher"
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with {returncode}"


def program(launch_args: list[str]) -> str:
    """The launcher's command up to its ranks' overrides."""
    return " ".join(["python -m dxrun.launch", *launch_args, "--"])


def clean_stop(signalled: str | None, returncodes: list[int], stop: re.Match | None,
               launch_args: list[str], overrides: list[str]) -> str | None:
    """The launcher's closing line when a signal it passed on stopped every rank cleanly (each
    exited with the stop's own code after rank 0 committed the checkpoint, or outside the loop:
    then rank 0's words, whose resume command is the launcher's); None otherwise."""
    if signalled is None or any(c != EXIT_CODES[signalled] for c in returncodes):
        return None
    if stop is None or stop.re is STOPPED_OUTSIDE:
        when, kept = (f" {stop[2]}", f"; {stop[3]}") if stop else ("", "")
        return f"dxrun.launch: stopped by {signalled}{when}: every rank stopped{kept}"
    run_dir = run_dir_of(stop.group(4))
    if run_dir is None:
        return None
    command = relaunch_command(overrides, run_dir, program(launch_args))
    return (f"dxrun.launch: stopped by {signalled}: every rank saved and stopped at step "
            f"{stop.group(2)}; checkpoint {stop.group(3)} committed. Resume with: {command}")


def told(startup: Path, what: str) -> list[dict]:
    """What the ranks left in the launcher's ``startup`` folder as ``<what>.<rank>``
    (``tell_launcher_startup``), in rank order ({} for a file that cannot be read)."""
    found = []
    for path in sorted(startup.glob(f"{what}.*"), key=lambda p: int(p.suffix[1:])):
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            found.append({})
    return found


def stopped_while_starting(signalled: list[str], startup: Path) -> bool:
    """Whether a stop the launcher passed on (``signalled``) was made while its ranks were
    starting: none has started its train loop (it may be saving) in ``startup``. A rank inside
    a startup collective never sees the signal, and the others may all be inside one too
    (waiting for each other until JAX's heartbeat, 300 s): from the stop on, --grace bounds
    the run's end."""
    return bool(signalled) and not told(startup, "training")


class Forwarder:
    """The launcher's signal handler: a signal passed on to every rank still running (a stop
    also noted in ``signalled``), held back for a rank until it listens (``release``; one
    not started yet does not): before its handlers (``runtime.guard_signals``) a signal ends
    a rank as Python's KeyboardInterrupt (a traceback), or is lost."""

    def __init__(self, procs: list[subprocess.Popen], nproc: int, startup: Path):
        self.procs, self.startup = procs, startup  # procs: filled as the ranks start
        self.signalled: list[str] = []  # the stop signals passed on
        self.held: list[list[int]] = [[] for _ in range(nproc)]

    def __call__(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:  # the terminal closed: it no longer reaches the ranks
            signum = signal.SIGTERM  # (own session), so they stop as on a requeue, saved
        if signum != signal.SIGUSR1:
            self.signalled.append(signal.Signals(signum).name)
        for rank in range(len(self.held)):
            started = rank < len(self.procs)
            if started and self.procs[rank].poll() is not None:
                continue
            if started and self.listening(rank) and not self.held[rank]:
                self.procs[rank].send_signal(signum)
            else:
                self.held[rank].append(signum)

    def listening(self, rank: int) -> bool:
        return (self.startup / f"listening.{rank}").exists()

    def release(self) -> None:
        """The signals held back for the ranks that listen now."""
        for rank, proc in enumerate(self.procs):
            if self.held[rank] and self.listening(rank) and proc.poll() is None:
                signums, self.held[rank] = self.held[rank], []
                for signum in signums:
                    proc.send_signal(signum)


def settle_starting_stop(signalled: str, stops: list[re.Match], startup: Path,
                         run_dir_file: Path, launch_args: list[str], user_overrides: list[str],
                         overrides: list[str]) -> re.Match:
    """Rank 0's line for a stop while starting (``stops``) or, when it said none (inside a
    startup collective it never saw the signal, and was killed), the words it would have said,
    from its claim of the run dir (``claimed.0`` in ``startup``). The run's status.json is
    written as rank 0 would have (``overrides``: the ranks'), where it did not (it tells the
    launcher after writing it)."""
    claim = (told(startup, "claimed") or [{}])[0]
    said = next((m for m in stops if m.re is STOPPED_OUTSIDE), None)
    if "run_dir" not in claim:
        return said or STOPPED_OUTSIDE.search(f"{signalled}: stopped {Signals.STARTING}; "
                                              "nothing was written")
    command = relaunch_command(user_overrides, claim["run_dir"], program(launch_args))
    words = stopped_words(signalled, Signals.STARTING, claim["checkpoint"], command)
    if _told_status(run_dir_file).get("status") != STOPPED:
        task = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]  # Hydra's
        write_status(Path(claim["run_dir"]), STOPPED, signal=signalled, step=claim["step"],
                     checkpoint=claim["checkpoint"], relaunch=command, reason=words, job=None,
                     overrides=task, attempt=claim["attempt"],
                     lost_attempts=claim["lost_attempts"])
    return said or STOPPED_OUTSIDE.search(words)


def first_failure(ended: dict[int, float], codes: list[int | None]) -> tuple[int, int] | None:
    """(rank, exit code) of the rank that failed first, by ``ended`` (rank -> when it exited);
    None while none has failed."""
    failed = sorted((t, r) for r, t in ended.items() if codes[r])
    return (failed[0][1], codes[failed[0][1]]) if failed else None


def told_run_dir(run_dir_file: Path) -> Path | None:
    """The run dir process 0 wrote to ``run_dir_file`` (None when it never got that far)."""
    try:
        return Path(run_dir_file.read_text(encoding="utf-8"))
    except OSError:
        return None


def failure(procs: list[subprocess.Popen], rank: int, stopped: set[int], said: list[str],
            run_dir: Path | None) -> str:
    """The launcher's line for a run whose rank ``rank`` failed first: how each rank ended,
    the failed rank's own last line (``said``) and where the ranks' logs are, if anywhere."""
    others = ", ".join(f"rank {r} {describe(p.returncode, r in stopped)}"
                       for r, p in enumerate(procs) if r != rank)
    line = f"rank {rank} {describe(procs[rank].returncode)} first; then {others}"
    if said:
        line += f"; rank {rank} said: {said[-1]}"
    logs = [str(run_dir / f"dxrun.{r}.log") for r in range(len(procs))
            if run_dir is not None and (run_dir / f"dxrun.{r}.log").is_file()]
    return line + (f" (a process that loses another stops: see {', '.join(logs)})" if logs
                   else " (no rank kept a log: their output is above)")


def _told_status(run_dir_file: Path) -> dict:
    """The status.json of the run dir process 0 wrote to ``run_dir_file`` ({}: none, or one
    that cannot be read)."""
    run_dir = told_run_dir(run_dir_file)
    try:
        status = json.loads((run_dir / STATUS).read_text()) if run_dir else {}
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def mark_failed(run_dir_file: Path, reason: str, rank: int) -> None:
    """The run's status.json says ``failed`` (crashed, ``reason``) where it still says
    ``running``: its processes were killed before they could write their own end. The run dir
    is the one process 0 wrote to ``run_dir_file`` (nothing when it never got that far)."""
    run_dir, status = told_run_dir(run_dir_file), _told_status(run_dir_file)
    if run_dir is None or status.get("status") != RUNNING:
        return  # a process said how the run ended
    log = run_dir / f"dxrun.{rank}.log"
    write_status(run_dir, FAILED, kind="crashed", reason=reason,
                 log=str(log) if log.is_file() else None,
                 **{k: status[k] for k in ("job", "overrides") if k in status})


def exit_code(returncode: int) -> int:
    """A shell's convention: killed by signal S -> 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def stop_delay(returncode: int, grace: float) -> float | None:
    """Seconds the other processes get to end by themselves once one ended with
    ``returncode``; None: no need to stop them. A process killed by a signal leaves the others
    waiting in a collective that cannot complete (JAX's heartbeat would end them only after
    ``distributed.heartbeat_timeout_s``): they go at once. One that exited with an error may
    share it with the others (a refusal every process makes, each saying it): ``grace``. One
    that ended with a stop's code (0, or 130 after a SIGINT) stopped at a step the others agreed
    on and are stopping at too, saving first."""
    if returncode < 0:
        return 0.0
    return None if returncode in (0, *EXIT_CODES.values()) else grace


# gloo's line for every communicator it sets up (two threads' lines may interleave): chatter
