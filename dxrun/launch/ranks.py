"""The launcher of a run's N local processes: a free port for their coordinator, each rank's
environment (its devices, the coordinator variables, dying with the launcher), its output
copied with its rank's prefix, and the loop that starts them and waits for them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from dxrun.config import EXIT_CODES, EXIT_REFUSED
from dxrun.launch import EARLY
from dxrun.launch.ending import (
    STOP_LINE,
    STOPPED_OUTSIDE,
    Forwarder,
    clean_stop,
    exit_code,
    failure,
    first_failure,
    mark_failed,
    program,
    settle_starting_stop,
    stop_delay,
    stopped_while_starting,
    told,
    told_run_dir,
)
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
    visible_gpus,
)


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
