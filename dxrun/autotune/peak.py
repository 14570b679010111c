"""A device's achieved matmul TFLOP/s, probed on all devices at once: a stand-in peak for
CPUs (``runtime.peak_tflops=measure``) and the CPU target's compute figure."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.plan import flops

if TYPE_CHECKING:
    from dxrun.config.schema import RuntimeConfig, TrainConfig

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
    peak = flops.peak_tflops(device_kind, train.precision)
    if peak is None and flops.normalize_kind(device_kind) != "cpu":
        log.warning("no peak TFLOP/s known for device kind %r: perf/mfu is not logged; set "
                    "runtime.peak_tflops=<TFLOP/s> or runtime.peak_tflops=measure", device_kind)
    return peak
