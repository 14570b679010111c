"""The process set up before JAX is imported: simulated CPU devices (XLA_FLAGS), glibc's allocator,
the accelerator found or refused, the compile cache, a command's imports and the collector. No JAX
import at module level: ``simulate_cpu_devices`` has to set XLA_FLAGS first.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dxrun.config import (
    RunConfig,
    axis_sizes,
)

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# glibc's mallopt parameters (malloc.h), and the device nodes of accelerators whose hosts keep
# glibc's defaults: NVIDIA, AMD (ROCm), TPU.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# malloc arenas under reuse_freed_memory: two compile faster but slow model=small's fsdp8 step
# (BENCHMARKS.md, "How many malloc arenas", with the command that measures it)
ARENAS = 1
_ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel0", "/dev/vfio/0")


def reuse_freed_memory() -> bool:
    """On a CPU-only glibc host, serve every block from one heap that keeps up to 1 GiB freed.

    XLA:CPU mallocs each device's temporaries at every execution and frees them after. glibc
    gives blocks of 32 MiB or more a fresh mmap, and a thread's own arena a fresh 64 MiB heap
    that it unmaps again once empty, so the pages of the step's temporaries fault in anew at
    every step, on one device as on eight. No mmap, a 1 GiB trim threshold and one arena make
    the next step reuse the same pages. One arena's lock, taken by every thread (XLA's compile
    threads, a thread per simulated device), slows XLA:CPU's compiles against two arenas; but
    two slow model=small's fsdp8 step (twice the faults), and more than two unmap a thread's
    heaps again (BENCHMARKS.md, "CPU runs: glibc's allocator", has the measurements).
    Must run before JAX starts its threads (they keep the arena they started with). Returns
    whether it applied."""
    libc = _glibc()
    if libc is None or accelerator_host():
        return False
    settings = {_M_ARENA_MAX: ARENAS, _M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**30}
    return all(libc.mallopt(k, v) == 1 for k, v in settings.items())


# runtime.reuse_freed_memory=auto: one arena from this many bytes a device (reuse_pays' guess),
# between BENCHMARKS.md's arena-table shapes where glibc's defaults win and where one arena does.
REUSE_FROM_BYTES = 16 * 2**20


def reuse_pays(cfg: RunConfig, n_devices: int) -> bool:
    """``runtime.reuse_freed_memory``; ``auto`` decided before JAX starts from the config: one
    device's fp32 weights, gradients and moments (split over fsdp and tensor) and each layer's
    activations of its share of the batch (16 values of width d_model a token), guessed from
    the ``parallelism`` section's axes (an inferred one takes the rest of the devices)."""
    setting = cfg.runtime.reuse_freed_memory
    if setting != "auto":
        return setting == "always"
    m, d, par = cfg.model, cfg.data, cfg.parallelism
    used = par.n_devices or n_devices
    named = math.prod(max(1, v) for v in axis_sizes(par).values())
    n = {k: max(1, used // named if v == -1 else v) for k, v in axis_sizes(par).items()}
    tokens = ((d.batch_size or (d.per_device_batch_size or 1) * used)
              * (d.seq_len or m.max_seq_len or 1024) / (n["dp"] * n["fsdp"] * n.get("ep", 1) * n["cp"]))
    params = 12 * m.n_layers * m.d_model**2 + 2 * m.vocab_size * m.d_model
    return (16 * params / (n["fsdp"] * n["tp"]) + 64 * tokens * m.d_model * m.n_layers
            >= REUSE_FROM_BYTES)


def accelerator_host() -> bool:
    """Whether JAX may find an accelerator here, told before it starts: a GPU's or TPU's device
    node, or Google's TPU runtime installed (a TPU VM under a sandbox shows no node)."""
    return (any(map(os.path.exists, _ACCELERATOR_NODES))
            or importlib.util.find_spec("libtpu") is not None)


def release_freed_memory() -> None:
    """Hand the pages of freed blocks back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing). ``reuse_freed_memory`` keeps freed blocks for the next step of the same program;
    a process that moves on to programs of other shapes (the layout search times nine) would
    otherwise hold the union of their peaks, well above what its largest layout needs alone."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> Any:
    """The C library when it is glibc (whose allocator the two functions above tune), else
    None."""
    import ctypes
    import platform

    return ctypes.CDLL("libc.so.6") if platform.libc_ver()[0] == "glibc" else None


def simulate_cpu_devices(n: int, reuse: bool = True) -> bool:
    """Make the CPU platform expose ``n`` devices (and, with ``reuse``, reuse freed memory: see
    ``reuse_freed_memory``). Returns False if JAX already started (the device count is then
    fixed, e.g. in later jobs of a multirun) or the user set it."""
    if reuse:
        reuse_freed_memory()
    if "jax" in sys.modules and "jax._src.xla_bridge" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge._backends:  # backends initialised: too late to change anything
            return False
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        flags = f"{flags} {DEVICE_COUNT_FLAG}={n}"
    os.environ["XLA_FLAGS"] = flags.strip()
    return True


def simulated_count(mode: str, plan_devices: int, cpu_devices: int) -> tuple[int, str | None]:
    """(the CPU devices to simulate, a note or None). A run: ``runtime.cpu_devices``. Plan mode:
    ``plan.devices``, the device count of the run it plans; ``runtime.cpu_devices`` (the older
    spelling) still sets it when ``plan.devices`` is left at its default, and is ignored with a
    note when both are set and differ."""
    defaults = RunConfig()
    if mode != "plan" or cpu_devices in (plan_devices, defaults.runtime.cpu_devices):
        return (cpu_devices if mode != "plan" else plan_devices), None
    if plan_devices == defaults.plan.devices:
        return cpu_devices, (f"plan mode: runtime.cpu_devices={cpu_devices} taken as the plan's "
                             f"device count; plan.devices={cpu_devices} is its key")
    return plan_devices, (f"plan mode: plan.devices={plan_devices} devices planned; "
                          f"runtime.cpu_devices={cpu_devices} is a run's, not the plan's")


def accelerator_plan_note(backend: str, visible: int, plan_devices: int,
                          target: str | None) -> str | None:
    """Plan mode for a ``plan.target`` in a process whose JAX runs on an accelerator: it plans
    the visible devices, not ``plan.devices`` simulated ones (only the CPU platform simulates);
    the line says so and how to get the count asked. None elsewhere."""
    if backend == "cpu" or target is None or visible == plan_devices:
        return None
    return (f"plan.devices={plan_devices} not simulated: JAX runs on {backend} with {visible} "
            f"devices, which the plan is for; JAX_PLATFORMS=cpu plans {plan_devices} simulated "
            "devices")


def thread_pool_note(used: int, simulated: int, cores: int | None) -> str | None:
    """The line for a run whose mesh uses fewer simulated CPU devices than the process has,
    where there are more of them than cores; None elsewhere. XLA:CPU's client gives its thread
    pool a thread per device (or per core, whichever is more), and every program of the process
    runs on that pool, so a one-device step among more simulated devices than cores is slower
    than with one (BENCHMARKS.md measures it, with ``NPROC``)."""
    if cores is None or used >= simulated or simulated <= cores:
        return None
    return (f"the mesh uses {used} of {simulated} simulated CPU devices, and XLA:CPU runs every "
            f"program on a thread per device ({simulated} on {cores} cores), which slows this "
            f"step (dp1 on 2 cores: 1.35x); runtime.cpu_devices={used} gives it the threads it "
            "uses")


# The device nodes the NVIDIA driver creates (relative to the filesystem root).
NVIDIA_NODES = ("dev/nvidiactl", "dev/nvidia0")
GPU_INSTALL = "pip install -e '.[gpu]'"


def nvidia_device_node(root: str | Path = "/") -> Path | None:
    """The first NVIDIA device node under ``root`` (``/dev/nvidiactl``, ``/dev/nvidia0``):
    this host has an NVIDIA GPU and its driver loaded, whatever JAX found. None without."""
    for rel in NVIDIA_NODES:
        if (path := Path(root) / rel).exists():
            return path
    return None


def gpus_excluded(jax_platforms: str | None) -> bool:
    """Whether ``JAX_PLATFORMS`` (None/empty: unset) leaves CUDA out, e.g. ``cpu``: JAX will
    not use a GPU whatever the host has (the test suite sets it)."""
    return bool(jax_platforms) and not {"cuda", "gpu"} & {
        p.strip().lower() for p in jax_platforms.split(",")}


def cpu_fallback_refusal(backend: str, gpu_node: Path | None, jax_platforms: str | None,
                         allow_cpu: bool) -> str | None:
    """The refusal of a run that would train on CPU on a GPU host, or None to go ahead.

    JAX without its CUDA plugin (``pip install -e .``) falls back to CPU on a GPU host with a
    warning nobody reads, and dxrun then simulates CPU devices: the run "works", far slower.
    CPU is taken as chosen when ``JAX_PLATFORMS`` leaves CUDA out (the test suite sets cpu) or
    with ``runtime.allow_cpu=true``."""
    if backend != "cpu" or gpu_node is None or allow_cpu:
        return None
    if gpus_excluded(jax_platforms):
        return None
    return (f"JAX's backend is cpu but this host has an NVIDIA GPU ({gpu_node}): the installed "
            f"JAX has no CUDA support; run {GPU_INSTALL} (or runtime.allow_cpu=true to train "
            "on the CPU anyway)")


def user_cache_dir() -> str:
    """dxrun's cache dir: ``$XDG_CACHE_HOME/dxrun`` (``~/.cache/dxrun``): the compile cache and
    the layout search's decisions."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dxrun")


def enable_compile_cache(setting: str | None) -> str | None:
    """JAX's persistent compilation cache, so a second launch of the same config skips XLA's
    compile. ``auto`` = ``$XDG_CACHE_HOME/dxrun/jax`` (``~/.cache/dxrun/jax``). Programs that
    compile in under 0.5 s are not worth a disk entry, unless JAX's own
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise (the test suite sets 0)."""
    if setting in (None, "", "off", "none"):
        return None
    import jax

    path = os.path.join(user_cache_dir(), "jax") if setting == "auto" else setting
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX's own knob wins
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def collect_cycles_rarely() -> None:
    """Python's cyclic garbage collector for a dxrun command's process: tracing, compiling and
    restoring make millions of short-lived objects, almost none of them in a reference cycle,
    and the default thresholds (a collection every 700 new objects) spend a few percent of the
    command's CPU finding nothing (docs/tests.md). Set by the commands only, never on import:
    a notebook that imports dxrun keeps its own."""
    gc.set_threshold(20_000, 10, 10)


@contextlib.contextmanager
def command_imports() -> Iterator[None]:
    """Around a command's imports of JAX, Flax, Optax and Orbax, then frozen (``freeze_imported``).
    Inside, IPython is hidden: Flax asks it on import whether this is a notebook (a command's
    process never is), and importing IPython to hear "no" is most of Flax's import."""
    hidden = "IPython" not in sys.modules
    if hidden:
        sys.modules["IPython"] = None  # type: ignore[assignment]  # its import raises ImportError
    try:
        yield
    finally:
        if hidden and sys.modules.get("IPython", "") is None:
            del sys.modules["IPython"]
    freeze_imported()


def freeze_imported() -> None:
    """Every object the process holds now moved out of the collector's sight, once a process:
    after a command's imports, which live as long as the process, each collection the trace and
    the compile trigger walks only what was made since (docs/tests.md). Once: a second freeze
    (a multirun's next job, same process) would hide what the job before left to collect."""
    if not gc.get_freeze_count():
        gc.freeze()
