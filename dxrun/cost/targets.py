"""The accelerators a plan can be made for, per device, and the share of a device's memory a
run gets: pure, no JAX (the config check reads the names before JAX starts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dxrun.config import ConfigError

GB = 1e9
GiB = 2**30
USABLE = 0.9  # of a GPU's memory without a pool; the rest is the CUDA context's and libraries'
# Of a TPU's memory: the share XLA's compile lets a program use (its refusals name the chip's
# available HBM; BENCHMARKS.md, the defaults on the chip), the rest the runtime's own.
TPU_USABLE = 15.75 / 16
USABLE_CPU = 0.8  # of the host's RAM: the OS, Python and the data pipeline need the rest


# JAX's GPU client pools this fraction of each GPU's memory (the BFC allocator's bytes_limit,
# which the preflight reads), preallocated or not: jaxlib's xla_client.py and JAX's "GPU memory
# allocation" page.
JAX_GPU_FRACTION = 0.75
MEM_FRACTION_KEYS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


@dataclass(frozen=True)
class Target:
    """One accelerator, per device. The peak comes from flops.PEAK_TFLOPS by ``device_kind``
    (one table of peaks); memory is the driver's total, bandwidths the vendors' datasheets'."""

    name: str
    device_kind: str
    memory_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # interconnect, per device, one direction


# Sources: NVIDIA H100/H200/A100/L40S datasheets (HBM3 3.35 TB/s, HBM3e 4.8 TB/s, HBM2e
# 2.04 TB/s, GDDR6 864 GB/s; NVLink 4: 900 GB/s, NVLink 3: 600 GB/s both directions together;
# L40S has no NVLink: PCIe 4.0 x16, 32 GB/s); Google Cloud TPU v5e/v5p system docs (16 GB at
# 819 GB/s with 1,600 Gbps ICI; 95 GB at 2,765 GB/s with 4,800 Gbps ICI). The v5e's "16 GB" is
# 16 GiB on the chip (binary units, as XLA counts it); the v5p's "95 GB" is taken as 95 GiB the
# same way (as Marin's TPU batch helper counts it; no v5p measured here).
# A GPU's memory is the total its driver reports (nvidia-smi's MiB, each in the table below),
# not the datasheet's rounded GB: JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION) is a fraction of
# that total, so a plan against the rounded figure refuses runs that fit. The Grand Teton H100's
# is torchtitan's docs/performance.md figure.
MiB = 2**20
TARGETS: dict[str, Target] = {
    "h100": Target("H100 SXM 80GB", "NVIDIA H100 80GB HBM3", 81_559 * MiB, 3.35e12, 450 * GB),
    "h200": Target("H200 141GB", "NVIDIA H200", 143_771 * MiB, 4.8e12, 450 * GB),
    "a100": Target("A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 81_920 * MiB, 2.039e12, 300 * GB),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md: 96 GB HBM2e at 2.4 TB/s, NVLink,
    # run at a 500 W power limit): the SXM die (flops.PEAK_TFLOPS), its clock at 500 W in
    # gpu_cost.COST.
    "h100_96gb_500w": Target("H100 96GB HBM2e 500W", "NVIDIA H100 96GB HBM2e", 95 * GiB, 2.4e12,
                             450 * GB),
    "l40s": Target("L40S 48GB", "NVIDIA L40S", 46_068 * MiB, 0.864e12, 32 * GB),
    "v5e": Target("TPU v5e", "TPU v5 lite", 16 * GiB, 0.819e12, 200 * GB),
    "v5p": Target("TPU v5p", "TPU v5", 95 * GiB, 2.765e12, 600 * GB),
    "cpu": Target("this machine (CPU)", "cpu", 0.0, 0.0, 0.0),  # measured: see cpu_target
}


@dataclass(frozen=True)
class Usable:
    """The share of a device's memory a run gets, and where that figure comes from."""

    fraction: float
    source: str


def gpu_memory_fraction(env: Any) -> Usable:
    """The share of each GPU's memory JAX's allocator will give a run started with ``env`` (the
    process environment): the fraction it pools (``XLA_CLIENT_MEM_FRACTION``, or the deprecated
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``; 75% unset). ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    grows the pool on demand up to the same limit, so it changes nothing here;
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool (cudaMalloc per buffer): the device's
    memory less what the CUDA context and libraries keep (``USABLE``)."""
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() == "platform":
        return Usable(USABLE, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool, the rest is the "
                              "CUDA context's")
    given = [k for k in MEM_FRACTION_KEYS if env.get(k)]
    if len(given) == 2:  # jaxlib refuses the pair when the client starts
        raise ConfigError(f"{given[0]} and {given[1]} are both set (JAX refuses that); unset "
                          f"{given[1]}, the deprecated name")
    if not given:
        return Usable(JAX_GPU_FRACTION, "JAX's default; raise it with "
                                        "XLA_PYTHON_CLIENT_MEM_FRACTION=.9")
    key, value = given[0], env[given[0]]
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ConfigError(f"{key}={value} is not a fraction of the GPU's memory; set it in "
                          "(0, 1], e.g. .9, or unset it for JAX's 0.75")
    return Usable(fraction, f"{key}={value}")


def usable_share(target: Target, env: Any = None) -> Usable:
    """The share of ``target``'s memory a plan may use: JAX's pool on a GPU (from ``env``,
    default this process's environment), ``TPU_USABLE`` on a TPU, ``USABLE_CPU`` of a host's
    RAM."""
    if target.device_kind == "cpu":
        return Usable(USABLE_CPU, "of the host's available RAM")
    if target.device_kind.startswith("NVIDIA"):
        return gpu_memory_fraction(os.environ if env is None else env)
    return Usable(TPU_USABLE, "XLA's share of a TPU's memory (its bytes_limit)")


def usable_bytes(target: Target, env: Any = None) -> float:
    """What a plan may use of one device's memory."""
    return target.memory_bytes * usable_share(target, env).fraction


def target_key(target: Target) -> str | None:
    """The TARGETS name of ``target`` (None for a measured CPU target)."""
    return next((k for k, t in TARGETS.items() if t == target), None)


def plan_platform(target: str | None, backend: str) -> str:
    """The platform a plan is for: ``plan.target``'s (a named GPU or TPU, or cpu), else the
    backend this process runs on. What ``data.seq_len=null`` resolves by."""
    if target is None:
        return backend
    kind = TARGETS[target].device_kind
    return "cpu" if kind == "cpu" else "gpu" if kind.startswith("NVIDIA") else "tpu"


def gb_text(nbytes: float) -> str:
    """Bytes in a table: GB, or MiB below a hundredth of one."""
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.01 * GB else f"{nbytes / 2**20:.1f} MiB"
