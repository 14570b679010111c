"""This host's own figures, measured once per machine and kept in dxrun's cache dir: its memory, its
matmul peak and its memory bandwidth (a CPU target's numbers), the memory one device may use here
(``device_budget``), the target an estimate is made for, and the peak a run's MFU is measured
against (``resolve_peak``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.config import ConfigError
from dxrun.cost import (
    TARGETS,
    USABLE_CPU,
    GiB,
    Target,
    normalize_kind,
    peak_tflops,
)
from dxrun.plan import (
    precision_of,
)
from dxrun.run import (
    faults_from_env,
    local_processes,
    user_cache_dir,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig, RuntimeConfig, TrainConfig


def host_memory_bytes() -> float:
    """Memory this host can give the run now (MemAvailable), the preflight's CPU budget."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return float(info["MemAvailable"].split()[0]) * 1024


def cpu_target(n_devices: int) -> Target:
    """This machine: its RAM shared by the simulated devices, a measured matmul peak and a
    measured memory bandwidth (collectives between simulated devices are memory copies). Each
    figure is one device's share when all run at once, as the peak is
    (``measure_peak_tflops``): the simulated devices share the host's memory bus, so a
    layout that moves n times the bytes on each of n devices takes n times as long."""
    share = host_bus_bytes_per_s() / n_devices  # the whole host's bus shared
    return Target("this machine (CPU)", "cpu", host_memory_bytes() / n_devices, share, share)


HOST_FILE = "host.json"  # in dxrun's cache dir: the host's measured figures, by machine


def _host_key() -> str:
    """What the host's figures depend on: the CPU model and cores, JAX's devices and version."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
    except OSError:  # not Linux: the machine's type and cores still tell hosts apart
        pass
    return (f"{platform.machine()} {model} x{os.cpu_count()}: {jax.device_count()} "
            f"{jax.default_backend()} devices, jax {jax.__version__}")


def host_figure(name: str, measure: Any) -> float:
    """A host figure ``measure()`` gives, measured once per machine: kept in dxrun's cache dir
    (``host.json``, under ``_host_key``), since every plan on a CPU target and every
    ``parallelism=auto`` run reads it and measuring took most of their deciding. A missing,
    unreadable or implausible entry is measured again; delete the file to measure afresh (a
    figure taken while other jobs loaded the host stays until then)."""
    path, key = Path(user_cache_dir()) / HOST_FILE, _host_key()
    try:
        figures = json.loads(path.read_text())
        value = figures[key][name]
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            return float(value)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    value = float(measure())
    try:  # another process may write it too: its own tmp file, and the last write wins
        figures = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(figures, dict):
            figures = {}
    except (OSError, ValueError):
        figures = {}
    entry = figures.get(key) if isinstance(figures.get(key), dict) else {}
    figures[key] = {**entry, name: value}
    tmp = path.with_name(f"{HOST_FILE}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(figures, indent=2) + "\n")
        tmp.replace(path)
    except OSError:  # a read-only or full cache dir: measured again next time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return value


def _measure_bus() -> float:
    x = jnp.ones((32 * 2**20,), jnp.float32)
    f = jax.jit(lambda v: v * 2.0)
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(5))
    return 2 * x.nbytes / best


@functools.cache
def host_bus_bytes_per_s() -> float:
    """The host's memory bandwidth (read + write of 128 MiB, beyond the caches), measured once
    per machine (``host_figure``), as ``host_peak_tflops``."""
    return host_figure("bus_bytes_per_s", _measure_bus)


@functools.cache
def host_peak_tflops() -> float:
    """``measure_peak_tflops`` of this process's devices, measured once per machine
    (``host_figure``)."""
    return host_figure("peak_tflops", measure_peak_tflops)


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def resolve_target(cfg: RunConfig, n_devices: int) -> tuple[Target, float | None]:
    """The target's numbers and its peak TFLOP/s for the run's precision."""
    name = cfg.plan.target
    if name is None:
        kind = jax.devices()[0].device_kind
        name = next((k for k, t in TARGETS.items() if t.device_kind == kind),
                    "cpu" if jax.default_backend() == "cpu" else None)
        if name is None:
            raise ConfigError(f"plan.target is unset and device kind {kind!r} is not in the "
                              f"table; set plan.target to one of {', '.join(TARGETS)}")
    if name == "cpu":
        override = cfg.runtime.peak_tflops
        peak = (float(override) if isinstance(override, (int, float)) and override
                else host_peak_tflops())
        target = cpu_target(n_devices)
        if cfg.runtime.memory_gb is not None:
            target = replace(target, memory_bytes=cfg.runtime.memory_gb * GiB / n_devices)
        return target, peak
    target = TARGETS[name]
    return target, peak_tflops(target.device_kind, precision_of(
        cfg.train.precision, normalize_kind(target.device_kind)))


# A device's achieved matmul TFLOP/s, probed on all devices at once: a stand-in peak for CPUs
# (``runtime.peak_tflops=measure``) and the CPU target's compute figure.
log = logging.getLogger("dxrun")


def matmul_probe(devices: Any, n: int) -> tuple[Any, Any]:
    """A compiled batched fp32 matmul with one ``n x n`` matrix per device, and its input,
    sharded one matrix per device, so that all ``devices`` run the probe at once."""
    mesh = Mesh(np.array(devices), ("probe",), axis_types=(AxisType.Auto,))
    one_per_device = NamedSharding(mesh, P("probe"))
    x = jax.jit(lambda: jnp.ones((len(devices), n, n), jnp.float32),
                out_shardings=one_per_device)()
    f = jax.jit(lambda a: a @ a, in_shardings=one_per_device, out_shardings=one_per_device)
    return f.lower(x).compile(), x


def measure_peak_tflops(devices: Any = None, n: int = 1024, repeats: int = 10) -> float:
    """Achieved TFLOP/s per device of a square fp32 matmul run on all ``devices`` (default: this
    process's) at once: a stand-in peak for CPUs. Simulated CPU devices share the host's cores,
    so one device probed alone would get the whole host and MFU would be capped near 1/n."""
    devices = [d for d in (jax.local_devices() if devices is None else devices)
               if d.process_index == jax.process_index()]
    compiled, x = matmul_probe(devices, n)
    compiled(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        compiled(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12  # every device did one n x n matmul in `best` seconds


def resolve_peak(runtime: RuntimeConfig, train: TrainConfig, device_kind: str,
                 devices: Any = None) -> float | None:
    """Peak TFLOP/s per device: ``runtime.peak_tflops`` (a number or ``measure``: probed on
    all of ``devices`` at once, default all local ones), else the table; None when the device
    is not in it: a CPU quietly (no table has a CPU's peak, and every CPU run would say so), an
    unknown accelerator with one warning."""
    override = runtime.peak_tflops
    if override == "measure":
        peak = measure_peak_tflops(devices)
        log.info("measured peak: %.3f TFLOP/s per device, all devices of the mesh probing at "
                 "once (runtime.peak_tflops=measure)", peak)
        return peak
    if override is not None:
        return float(override)
    kind = normalize_kind(device_kind)
    peak = peak_tflops(device_kind, precision_of(train.precision, kind))
    if peak is None and kind != "cpu":
        log.warning("no peak TFLOP/s known for device kind %r: perf/mfu is not logged; set "
                    "runtime.peak_tflops=<TFLOP/s> or runtime.peak_tflops=measure", device_kind)
    return peak


def cpu_device_budget(available: float, local_devices: int, processes: int) -> float:
    """Bytes one simulated CPU device may use: the host's usable RAM split over every device
    of every process on the host (each process sees the whole host's MemAvailable)."""
    return available * USABLE_CPU / (local_devices * processes)


def device_budget(runtime: RuntimeConfig) -> tuple[float, int, str]:
    """(bytes one device may use, devices sharing that memory, where the figure comes from)."""
    local = jax.local_device_count()
    procs = local_processes(os.environ, jax.process_count())
    per = f" / {procs} processes on this host" if procs > 1 else ""
    if runtime.memory_gb is None and (chip := faults_from_env().chip_mib):
        return chip * 2**20, 1, f"the simulated chip (DXRUN_TEST_CHIP_MIB={chip})"
    if runtime.memory_gb is not None:
        if jax.default_backend() != "cpu":
            return runtime.memory_gb * GiB, 1, f"runtime.memory_gb={runtime.memory_gb}"
        return (runtime.memory_gb * GiB / (local * procs), local,
                f"runtime.memory_gb={runtime.memory_gb}{per}")
    if jax.default_backend() == "cpu":  # simulated devices share the host's RAM
        return (cpu_device_budget(host_memory_bytes(), local, procs), local,
                f"this host's available RAM{per}")
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return float("inf"), 1, "unknown"
    return float(limit), 1, f"{jax.devices()[0].device_kind} memory (bytes_limit)"
