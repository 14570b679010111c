"""``python -m dxrun.launch --nproc N [--devices-per-proc K] -- <overrides>``: N local
processes of one run, joined through JAX's distributed runtime over loopback.

For development, tests and one node with several processes (one per GPU group). Each process
is ``python -m dxrun <overrides>`` with the coordinator variables ``distributed.mode=auto``
reads, its own GPUs (``gpu_slices``) or K simulated CPU devices, and its output prefixed with
its rank. Signals are passed on to every process; a stop that ends every rank cleanly exits with
the stop's code (``errors.EXIT_CODES``) and the resume command, otherwise with the first
non-zero code a process returned (killed by signal S: 128+S). One run lives and dies as one
(``stop_delay``), and its processes die with the launcher (``die_with_launcher``). On several
nodes use SLURM instead (docs/guide/multi-node.md, which tells the whole story).
"""

from __future__ import annotations

import signal

# Stop signals that come while the launcher imports (most of its first second): kept for its
# ranks (``Forwarder``), where they were Python's KeyboardInterrupt in the launcher.
EARLY: list[int] = []
if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, lambda signum, _frame: EARLY.append(signum))

import argparse
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from dxrun.config import EXIT_CODES, EXIT_REFUSED, FAILED, RUNNING, STOPPED
from dxrun.run import (
    COORDINATOR,
    CUDA_VISIBLE,
    DEVICE_COUNT_FLAG,
    HOSTNAME,
    LAUNCH_RUN_DIR,
    LAUNCH_STARTUP,
    LAUNCHED_BY,
    LOCAL_PROCESSES,
    NUM_PROCESSES,
    PROCESS_ID,
    STATUS,
    Signals,
    relaunch_command,
    run_dir_of,
    stopped_words,
    visible_gpus,
    write_status,
)

# ------------------------------------------------------------------------------------------------
# How a ``dxrun.launch`` run ended, in the launcher's words: the closing line of a stop that
# every rank made cleanly (``clean_stop``; a stop while starting that rank 0 never saw is said
# and recorded for it: ``settle_starting_stop``), or of a failure, naming the rank that failed
# first, its own last line and where the ranks' logs are (``failure``), and the run's status.json
# marked failed where no rank could (``mark_failed``).

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_refusal(port: int) -> str | None:
    """Why ``--port`` cannot take this run's coordinator, or None when it can: asked before any
    process starts, since ranks pointed at another run's coordinator would join that run (and
    abort it) rather than fail by themselves."""
    with socket.socket() as s:
        # A run that has ended leaves connections in TIME_WAIT on the port: not a user of it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return (f"--port={port} is in use on this host ({e.strerror}; another run's "
                    "coordinator?): give a free port, or leave --port out to take a free one")
    return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the process when the launcher dies,
    however it dies (SIGKILL and the OOM killer included): each process runs in a session of
    its own, so nothing else would end it. Linux only (``prctl``); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    launcher, kill = os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, kill)
        if os.getppid() != launcher:  # the launcher died before the request took hold
            os._exit(1)

    return preexec


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` minus the host device-count flag (what each process sets itself)."""
    return " ".join(f for f in flags.split()
                    if not f.startswith(f"{DEVICE_COUNT_FLAG}="))


def gpu_slices(gpus: list[str], nproc: int, devices_per_proc: int | None) -> list[list[str]]:
    """Each rank's own GPUs: consecutive slices of ``gpus``, ``devices_per_proc`` each (None:
    all of them divided evenly). Raises ValueError (the flag to change) when they do not go
    round."""
    n = len(gpus)
    k = devices_per_proc or n // nproc
    if devices_per_proc is None and n % nproc:
        fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise ValueError(f"--nproc={nproc} does not divide the {n} visible GPUs; pick --nproc "
                         f"from {fits}, or give each process --devices-per-proc GPUs")
    if k < 1 or k * nproc > n:
        raise ValueError(f"--nproc={nproc} x --devices-per-proc={k} needs {nproc * max(k, 1)} "
                         f"GPUs but {n} are visible; start fewer processes or give each fewer")
    return [gpus[r * k:(r + 1) * k] for r in range(nproc)]


def child_env(base: dict[str, str], rank: int, nproc: int, port: int,
              devices_per_proc: int | None, gpus: list[str] | None = None,
              hosts: int = 1) -> dict[str, str]:
    """Rank ``rank``'s environment: the coordinator variables, its GPUs (``gpus``: its slice
    as ``CUDA_VISIBLE_DEVICES``; every accelerator it sees is its own) and, with ``hosts`` > 1,
    the host it declares (``DXRUN_HOSTNAME``: consecutive ranks share a host), so one machine
    rehearses a multi-node layout. All ``nproc`` still share this machine's RAM
    (``DXRUN_LOCAL_PROCESSES``, what the memory preflight divides)."""
    env = {**base, COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(nproc),
           PROCESS_ID: str(rank), LOCAL_PROCESSES: str(nproc), "PYTHONUNBUFFERED": "1"}
    # Each process sets its own simulated device count; the user's other flags stay.
    flags = without_device_count(base.get("XLA_FLAGS", ""))
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.pop("JAX_LOCAL_DEVICE_IDS", None)  # ids within the slice below: all of it, the default
    if gpus:
        env[CUDA_VISIBLE] = ",".join(gpus)
    if hosts > 1:
        env[HOSTNAME] = f"{socket.gethostname()}/host{rank * hosts // nproc}"
    return env


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
_NOISE = "peer ranks. Expected number of connected peer ranks"


def _pump(stream: IO[str], out: IO[str], prefix: str, stops: list[re.Match] | None = None,
          said: list[str] | None = None) -> None:
    """Copy a rank's ``stream`` to ``out``: rank 0's stop lines into ``stops``, the rank's own
    one-line ends (``dxrun: ...``: a refusal, a crash) into ``said``."""
    for line in stream:
        if _NOISE in line:
            continue
        text = line.rstrip("\n")
        if stops is not None and (m := STOP_LINE.search(text) or STOPPED_OUTSIDE.search(text)):
            stops.append(m)
        if said is not None and text.startswith("dxrun: "):
            said.append(text)
        out.write(prefix + line)
        out.flush()


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    else:
        overrides = []
    p = argparse.ArgumentParser(prog="python -m dxrun.launch", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="processes to start")
    p.add_argument("--devices-per-proc", type=int, default=None,
                   help="devices each process drives (CPU: simulated; GPU: its own K of the "
                        "visible GPUs; default: the visible GPUs / --nproc)")
    p.add_argument("--hosts", type=int, default=1,
                   help="hosts the processes declare (DXRUN_HOSTNAME; consecutive ranks share "
                        "one): rehearse a multi-node layout on one machine")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free one)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the others get to stop by themselves after one exits with an "
                        "error or stops while they start (after one is killed by a signal "
                        "they are stopped at once)")
    args, unknown = p.parse_known_args(argv)
    if unknown:  # overrides given without "--" are accepted too
        overrides = [*unknown, *overrides]
    if args.nproc < 1:
        p.error(f"--nproc={args.nproc} must be at least 1")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        p.error(f"--devices-per-proc={args.devices_per_proc} must be at least 1")
    if args.hosts < 1 or args.nproc % args.hosts:
        p.error(f"--hosts={args.hosts} must divide --nproc={args.nproc} (the same number of "
                "processes on every host)")
    return args, overrides


def launch(nproc: int, overrides: list[str], devices_per_proc: int | None = None,
           port: int = 0, grace: float = 10.0, hosts: int = 1) -> int:
    launch_args = ([f"--nproc={nproc}"]
                   + ([f"--devices-per-proc={devices_per_proc}"] if devices_per_proc else [])
                   + ([f"--hosts={hosts}"] if hosts > 1 else []))
    user_overrides = list(overrides)
    gpus = visible_gpus(dict(os.environ))
    try:
        slices = gpu_slices(gpus, nproc, devices_per_proc) if gpus else [None] * nproc
    except ValueError as e:
        print(f"dxrun.launch: error: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    if port and (why := port_refusal(port)):
        print(f"dxrun.launch: error: {why}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    port = port or free_port()
    if devices_per_proc:
        overrides = [*overrides, f"runtime.cpu_devices={devices_per_proc}"]
    with tempfile.TemporaryDirectory(prefix="dxrun-launch-") as tmp:
        return _run(nproc, overrides, port, slices, devices_per_proc, hosts, grace,
                    Path(tmp) / "run_dir", launch_args, user_overrides)


def _run(nproc: int, overrides: list[str], port: int, slices: list, devices_per_proc: int | None,
         hosts: int, grace: float, run_dir_file: Path, launch_args: list[str],
         user_overrides: list[str]) -> int:
    procs: list[subprocess.Popen] = []
    # Every process is started before any thread: a preexec_fn runs between fork and exec,
    # where another thread's lock could be held for ever.
    preexec = die_with_launcher()
    startup = run_dir_file.with_name("startup")  # how each rank's startup went
    startup.mkdir()
    # Before the first rank starts: a signal from here on is passed on, never the launcher's
    # own KeyboardInterrupt.
    forward = Forwarder(procs, nproc, startup)
    signalled = forward.signalled
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, forward)
    for signum in EARLY:  # (from here on the handler is the Forwarder)
        forward(signum, None)
    for rank in range(nproc):
        env = child_env(dict(os.environ), rank, nproc, port, devices_per_proc, slices[rank],
                        hosts)
        env[LAUNCH_RUN_DIR], env[LAUNCH_STARTUP] = str(run_dir_file), str(startup)
        env[LAUNCHED_BY] = json.dumps({"program": program(launch_args),
                                       "added": overrides[len(user_overrides):]})
        proc = subprocess.Popen(
            [sys.executable, "-m", "dxrun", *overrides], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            # Not in the terminal's process group: a Ctrl-C reaches the processes once, passed
            # on by ``forward`` (twice would be "exit now without saving").
            start_new_session=True, preexec_fn=preexec)
        procs.append(proc)
        gpu_note = f" (GPUs {','.join(slices[rank])})" if slices[rank] else ""
        print(f"dxrun.launch: rank {rank} pid {proc.pid}{gpu_note}", flush=True)
    pumps: list[threading.Thread] = []
    stops: list[re.Match] = []  # rank 0's stop line: its checkpoint and resume command
    said: list[list[str]] = [[] for _ in procs]  # each rank's own one-line ends
    for rank, proc in enumerate(procs):
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, daemon=True, args=(
                stream, out, f"[rank {rank}] ", stops if rank == 0 else None,
                said[rank] if stream is proc.stderr else None))
            t.start()
            pumps.append(t)

    # Each rank's exit is timed by a thread blocked in its wait: a rank killed outright and the
    # rank that aborts on losing it (gloo's "Received data size doesn't match") often both end
    # between two looks of the loop below, which then named rank 0 first whichever died first.
    ended: dict[int, float] = {}

    def waiter(rank: int, proc: subprocess.Popen) -> None:
        proc.wait()
        ended[rank] = time.monotonic()

    for rank, proc in enumerate(procs):
        threading.Thread(target=waiter, args=(rank, proc), daemon=True).start()
    deadline: float | None = None  # when the ranks still running are stopped
    seen: set[int] = set()
    stopped: set[int] = set()  # the ranks the launcher killed
    # A stop made while the ranks were starting: a rank that has not seen it may wait inside a
    # startup collective for one that left, until JAX's heartbeat. From then every rank's end
    # is that stop's; those still running after --grace are killed (never once one trains).
    starting_stop = False
    while len(ended) < len(procs):
        forward.release()
        if not starting_stop and stopped_while_starting(signalled, startup):
            starting_stop, deadline = True, time.monotonic() + grace
        for t, rank in sorted((t, r) for r, t in dict(ended).items() if r not in seen):
            seen.add(rank)
            delay = stop_delay(procs[rank].returncode, grace)
            if delay is not None and len(ended) < len(procs) and not starting_stop:
                deadline = min(deadline or float("inf"), t + delay)
        if deadline is not None and time.monotonic() >= deadline:
            if starting_stop and told(startup, "training"):  # a rank trains: it may be saving
                starting_stop, deadline = False, None
            why = ("the run was stopped while starting and it did not end within "
                   f"--grace={grace:g} s (inside a collective a rank does not see a signal)"
                   if starting_stop else "the run cannot go on without the rank that failed")
            for rank, proc in enumerate(procs):
                if deadline is not None and proc.poll() is None and rank not in stopped:
                    print(f"dxrun.launch: stopping rank {rank}: {why}", file=sys.stderr,
                          flush=True)
                    proc.kill()
                    stopped.add(rank)
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=5)
    first = first_failure(ended, [p.returncode for p in procs])
    if first is None and not signalled:
        return 0
    # A stop the ranks agreed on (ProcessAgreement) ends every rank with its code, SIGTERM's
    # winning over SIGINT's, as each rank's own exit does.
    agreed = "SIGTERM" if "SIGTERM" in signalled else signalled[0] if signalled else None
    codes = [EXIT_CODES[agreed] if starting_stop else p.returncode for p in procs]
    if starting_stop:  # rank 0 may not have said it: stuck in a startup collective, killed
        stops[:] = [settle_starting_stop(agreed, stops, startup, run_dir_file, launch_args,
                                         user_overrides, overrides)]
    done = clean_stop(agreed, codes, stops[0] if stops else None, launch_args, user_overrides)
    if done is not None:
        print(done, file=sys.stderr, flush=True)
        return EXIT_CODES[agreed]
    if first is None:
        return 0
    rank, code = first
    reason = failure(procs, rank, stopped, said[rank], told_run_dir(run_dir_file))
    mark_failed(run_dir_file, reason, rank)
    print(f"dxrun.launch: error: {reason}", file=sys.stderr, flush=True)
    return exit_code(code)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    sys.exit(launch(args.nproc, overrides, args.devices_per_proc, args.port, args.grace,
                    args.hosts))


if __name__ == "__main__":
    main()
