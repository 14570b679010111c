"""Joining a multi-process run: JAX's own distributed runtime (``jax.distributed``), started
by the scheduler (SLURM's ``srun``), by ``python -m dxrun.launch`` or by hand.

Which processes make one run is decided before JAX touches a device (``join``), from
``distributed.mode``: ``auto`` (default) joins when the environment says this process is one
of several (an ``srun`` step with more than one task, or what ``dxrun.launch`` sets), ``off``
stays one process, ``manual`` reads ``distributed.coordinator`` / ``num_processes`` /
``process_id``. ``detect`` is pure (it reads a given environment), so every branch is tested
without a cluster. The processes are grouped by host (``process_hosts``) so the plan keeps
tensor groups inside a host. On CPU the cross-process collectives go through gloo, so a
multi-process run works on one laptop over loopback.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dxrun.config import (
    ConfigError,
    first_line,
)
from dxrun.run.faults import deafen, hold_until_stopped
from dxrun.run.process import gpus_excluded

if TYPE_CHECKING:

    from dxrun.config import DistributedConfig

log = logging.getLogger("dxrun")


# The variables python -m dxrun.launch sets (JAX reads the first itself).
COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
# The host name a process declares for grouping processes by host (default: the machine's):
# for clusters whose hostnames do not tell nodes apart, and for rehearsing several hosts on one
# machine (python -m dxrun.launch --hosts).
HOSTNAME = "DXRUN_HOSTNAME"
_SLURM = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")
# A file python -m dxrun.launch names, where process 0 writes its run dir: a launcher whose
# ranks died before they could say so in status.json (killed) marks the run failed there.
LAUNCH_RUN_DIR = "DXRUN_LAUNCH_RUN_DIR"
# A folder python -m dxrun.launch names, where each process says how its startup went, in a
# file ``<what>.<rank>`` (``tell_launcher_startup``): ``claimed`` (process 0 holds the run dir),
# ``stopped`` (it stopped while starting: a process inside a startup collective never sees the
# signal, and the launcher ends it) or ``training`` (its loop started: it may be saving, a
# checkpoint being every process's, and the launcher never kills it to end such a stop).
LAUNCH_STARTUP = "DXRUN_LAUNCH_STARTUP"


@dataclass(frozen=True)
class Join:
    """How this process joins the run. ``None`` fields are left to JAX's own cluster
    detection (SLURM's coordinator host and port). ``local_device_ids``: None = JAX's default
    (under SLURM: one accelerator per task), [] = every accelerator of the host."""

    source: str  # manual | launch | slurm
    num_processes: int
    process_id: int
    coordinator: str | None = None
    local_device_ids: tuple[int, ...] | None = None


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={env[key]!r} is not an integer; "
                          "fix the launch script, or set distributed.mode=off") from None


def visible_gpus(env: Mapping[str, str], dev: str = "/dev") -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` entries: that variable's (indices or
    UUIDs, as given), else one per NVIDIA device node (``/dev/nvidia0`` ...: CUDA ordinals
    0..n-1; counting them never starts a GPU runtime). [] = no GPUs, or JAX told to use
    none (``JAX_PLATFORMS`` without cuda/gpu, e.g. ``cpu``)."""
    if gpus_excluded(env.get("JAX_PLATFORMS")):
        return []
    if CUDA_VISIBLE in env:
        entries = [e.strip() for e in env[CUDA_VISIBLE].split(",")]
        # CUDA stops at the first invalid entry ("-1" by convention: hide every GPU).
        return list(itertools.takewhile(lambda e: e and e != "-1", entries))
    try:
        nodes = [n for n in os.listdir(dev) if re.fullmatch(r"nvidia\d+", n)]
    except OSError:
        return []
    return [str(i) for i in range(len(nodes))]


def slurm_device_ids(env: Mapping[str, str], tasks_per_node: int) -> tuple[int, ...] | None:
    """The accelerators (ordinals among the ones this task sees) a SLURM task drives; () =
    every one it sees, None = JAX's default (ordinal ``SLURM_LOCALID``). One task per node
    drives the node; a task bound to its own GPUs (``CUDA_VISIBLE_DEVICES`` with fewer
    entries than the node has tasks, or exactly ``SLURM_GPUS_PER_TASK``) drives all of them,
    where JAX's default would name an ordinal that does not exist; tasks sharing the node's
    GPUs divide them in ``SLURM_LOCALID`` order."""
    if tasks_per_node <= 1:
        return ()
    if CUDA_VISIBLE not in env:
        return None
    n = len(visible_gpus(env))
    per_task = env.get("SLURM_GPUS_PER_TASK", "").rpartition(":")[2]
    if n and (n < tasks_per_node or (per_task.isdigit() and n == int(per_task))):
        return ()
    if n and n % tasks_per_node == 0 and "SLURM_LOCALID" in env:
        k, local = n // tasks_per_node, _int(env, "SLURM_LOCALID")
        return tuple(range(local * k, (local + 1) * k))
    return None


def _tasks_per_node(env: Mapping[str, str]) -> int:
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return max(1, _int(env, "SLURM_NTASKS") // max(1, int(nodes)))


# Set by python -m dxrun.launch: how many of the run's processes share this host.
LOCAL_PROCESSES = "DXRUN_LOCAL_PROCESSES"


def local_processes(env: Mapping[str, str], num_processes: int) -> int:
    """How many processes of this run (``num_processes`` in all) share this host and its RAM:
    the launcher's count, SLURM's tasks per node, else 1 per host (manual joins, whose hosts
    dxrun cannot see)."""
    if num_processes <= 1:
        return 1
    if LOCAL_PROCESSES in env:
        return max(1, min(_int(env, LOCAL_PROCESSES), num_processes))
    if all(k in env for k in _SLURM):
        return min(_tasks_per_node(env), num_processes)
    return 1


def check_address(key: str, address: str) -> None:
    """A coordinator address is ``host:port``: refuse one without a port before JAX (or the
    reachability probe) trips over it."""
    host, sep, port = address.rpartition(":")
    if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{key}={address} is not host:port; give the address of process 0 "
                          "with its port, e.g. host0:12345")


def detect(dist: DistributedConfig, env: Mapping[str, str]) -> Join | None:
    """This process's place in a multi-process run per ``distributed`` and ``env``; None for
    a single-process run. Raises ConfigError (key, value, fix)."""
    ids = tuple(dist.local_device_ids) if dist.local_device_ids is not None else None
    if dist.mode == "off":
        return None
    if dist.mode == "manual":
        missing = [k for k in ("coordinator", "num_processes", "process_id")
                   if getattr(dist, k) is None]
        if missing:
            raise ConfigError(
                f"distributed.mode=manual needs {', '.join('distributed.' + k for k in missing)}"
                "; set them (e.g. distributed.coordinator=host0:12345 "
                "distributed.num_processes=2 distributed.process_id=0), or use "
                "distributed.mode=auto")
        if not 0 <= dist.process_id < dist.num_processes:
            raise ConfigError(
                f"distributed.process_id={dist.process_id} is not in [0, "
                f"distributed.num_processes={dist.num_processes}); number the processes "
                f"0..{dist.num_processes - 1}")
        if dist.num_processes == 1:
            return None
        check_address("distributed.coordinator", dist.coordinator)
        return Join("manual", dist.num_processes, dist.process_id, dist.coordinator, ids)
    if env.get(COORDINATOR) and NUM_PROCESSES in env:
        n = _int(env, NUM_PROCESSES)
        if n <= 1:
            return None
        if PROCESS_ID not in env:
            raise ConfigError(f"{COORDINATOR} and {NUM_PROCESSES}={n} are set but "
                              f"{PROCESS_ID} is not; set it for every process (0..{n - 1}), "
                              "or set distributed.mode=off")
        check_address(f"environment variable {COORDINATOR}", env[COORDINATOR])
        return Join("launch", n, _int(env, PROCESS_ID), env[COORDINATOR], ids)
    if all(k in env for k in _SLURM) and _int(env, "SLURM_NTASKS") > 1:
        if ids is None:
            ids = slurm_device_ids(env, _tasks_per_node(env))
        return Join("slurm", _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID"), None, ids)
    return None


def join(dist: DistributedConfig, env: Mapping[str, str] | None = None) -> Join | None:
    """Start JAX's distributed runtime if this process is one of several. Call before anything
    touches a JAX device; a second call (the next job of a multirun) does nothing."""
    import jax

    spec = detect(dist, os.environ if env is None else env)
    if spec is not None:
        deafen(spec.process_id)  # test-only
    if spec is None or jax.distributed.is_initialized():
        return spec
    # gloo: cross-process collectives of XLA:CPU (accelerators use their own, NCCL on GPUs).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if spec.source == "slurm":
        kwargs["cluster_detection_method"] = "slurm"
    where = spec.coordinator or "the SLURM coordinator"
    # JAX ends the process (a C++ abort, no Python error) when the coordinator cannot be
    # reached: check that first, so the common mistake (process 0 not started, a wrong
    # address) gets one line. A process that never arrives still ends the others through JAX.
    if spec.coordinator and spec.process_id != 0 and not reachable(spec.coordinator,
                                                                   dist.init_timeout_s):
        raise ConfigError(
            f"process {spec.process_id} of {spec.num_processes} could not reach the "
            f"coordinator {where} within distributed.init_timeout_s={dist.init_timeout_s}; "
            "check that process 0 was started and that its host and port are reachable")
    log.info("joining a %d-process run as process %d at %s (waiting up to "
             "distributed.init_timeout_s=%d s for all of them)", spec.num_processes,
             spec.process_id, where, dist.init_timeout_s)
    try:
        jax.distributed.initialize(
            spec.coordinator, spec.num_processes, spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids is not None
            else None,
            initialization_timeout=dist.init_timeout_s,
            heartbeat_timeout_seconds=dist.heartbeat_timeout_s, **kwargs)
    except Exception as e:  # noqa: BLE001 - JAX raises XlaRuntimeError / RuntimeError here
        first = first_line(e, 200)
        raise ConfigError(
            f"process {spec.process_id} of {spec.num_processes} could not join the run at "
            f"{where} within distributed.init_timeout_s="
            f"{dist.init_timeout_s} ({first}); check that every process was started and can "
            "reach process 0's host and port") from None
    log.info("joined a %d-process run as process %d (%s, coordinator %s)", spec.num_processes,
             spec.process_id, spec.source, where)
    return spec


# How often a rank looks again for process 0's coordinator: the ranks of a launch start
# together, and a rank that looked just before the coordinator listened waits this long, idle.
REACH_RETRY_S = 0.05


def reachable(address: str, timeout_s: float) -> bool:
    """Whether something listens at ``host:port`` within ``timeout_s`` (retrying every
    ``REACH_RETRY_S``)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(REACH_RETRY_S)


def is_main() -> bool:
    """Process 0 (or the only process): the one that writes the run's shared files (config,
    plan, metrics, summary, status, report, W&B). Never starts a JAX backend to find out."""
    if "jax" not in sys.modules:
        return True
    import jax

    return not jax.distributed.is_initialized() or jax.process_index() == 0


def tell_launcher(run_dir: os.PathLike | str, env: Mapping[str, str] | None = None) -> None:
    """Write ``run_dir`` where the launcher asked (``DXRUN_LAUNCH_RUN_DIR``); nothing when no
    launcher did. Whole or not at all: the launcher may read it at any moment."""
    path = (os.environ if env is None else env).get(LAUNCH_RUN_DIR)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(os.fspath(run_dir))
        os.replace(tmp, path)


def tell_launcher_startup(what: str, record: dict[str, Any] | None = None,
                          env: Mapping[str, str] | None = None) -> None:
    """Leave ``<what>.<rank>`` (holding ``record``) in ``DXRUN_LAUNCH_STARTUP``: how this
    process's startup went (nothing when no launcher asked). Whole or not at all."""
    env = os.environ if env is None else env
    if folder := env.get(LAUNCH_STARTUP):
        name = f"{what}.{env.get(PROCESS_ID, '0')}"
        tmp = os.path.join(folder, f".{name}")  # a name the launcher does not look for
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record or {}, f)
        os.replace(tmp, os.path.join(folder, name))


def agree(key: str, value: str, timeout_s: int = 300) -> str:
    """Process 0's ``value`` on every process (the run dir, chosen once). Single process: the
    value itself. Goes through the distributed runtime's key-value store."""
    import jax
    from jax._src.distributed import global_state

    if jax.process_count() == 1 or global_state.client is None:
        return value
    key = f"dxrun/{key}"
    if jax.process_index() == 0:
        global_state.client.key_value_set(key, value, allow_overwrite=True)
        return value
    return global_state.client.blocking_key_value_get(key, timeout_s * 1000)


_GATHERS = [0]  # gathers made in this process: each uses its own keys


def gather(key: str, value: str, timeout_s: int = 300) -> list[str]:
    """Every process's ``value``, in process order (the same list on every process). Single
    process: ``[value]``. Goes through the distributed runtime's key-value store."""
    import jax
    from jax._src.distributed import global_state

    if jax.process_count() == 1 or global_state.client is None:
        return [value]
    _GATHERS[0] += 1
    key = f"dxrun/gather/{_GATHERS[0]}/{key}"
    client = global_state.client
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    return [client.blocking_key_value_get(f"{key}/{r}", timeout_s * 1000)
            for r in range(jax.process_count())]


def hostname(env: Mapping[str, str]) -> str:
    """The host this process declares: ``DXRUN_HOSTNAME``, else the machine's name."""
    return env.get(HOSTNAME) or socket.gethostname()


def host_indices(names: list[str]) -> tuple[int, ...]:
    """Each process's host (``names`` in process order) as an index, numbered in order of
    first appearance: process 0's host is host 0."""
    order: dict[str, int] = {}
    return tuple(order.setdefault(n, len(order)) for n in names)


_HOSTS: list[tuple[int, ...]] = []  # this run's process_hosts(), gathered once


def process_hosts(timeout_s: int = 300) -> tuple[int, ...] | None:
    """The host of every process of this run (``host_indices`` of their hostnames, exchanged
    once through the key-value store under fixed keys, so any process may ask first); None for
    one process."""
    import jax
    from jax._src.distributed import global_state

    if jax.process_count() == 1 or global_state.client is None:
        return None
    if not _HOSTS:
        client, me = global_state.client, jax.process_index()
        hold_until_stopped(me)  # test-only
        client.key_value_set(f"dxrun/hostname/{me}", hostname(os.environ))
        _HOSTS.append(host_indices(
            [client.blocking_key_value_get(f"dxrun/hostname/{r}", timeout_s * 1000)
             for r in range(jax.process_count())]))
    return _HOSTS[0]
