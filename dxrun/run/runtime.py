"""The run's process: set up before JAX is imported (simulated CPU devices, the compile cache, a
command's imports and collector), joined to the run's other processes (``join``), its signals
turned into flags the loop reads, where it sits among other runs (``Job``), its log file, and
the run dir it claims, holds for its life and names the relaunch command of, with its
bookkeeping files (never fatal when damaged) and the tests' faults (set through the environment,
never a config key). No JAX import at module level: ``simulate_cpu_devices`` has to set
XLA_FLAGS first. Each section's own account follows.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import unquote, urlparse

from omegaconf import ListConfig, OmegaConf

from dxrun.config import (
    EXIT_CODES,
    INT32,
    NON_NEGATIVE,
    RUNNING,
    UNFINISHED,
    ConfigError,
    Interrupted,
    LoggerConfig,
    Range,
    RunConfig,
    axis_sizes,
    first_line,
    named_line,
)
from dxrun.config.registry import model_changes

if TYPE_CHECKING:
    from hydra.conf import HydraConf
    from omegaconf import DictConfig

    from dxrun.config import DistributedConfig, ModelConfig


# ------------------------------------------------------------------------------------------------
# The run dir's bookkeeping files (``status.json``, ``goodput.json``, ``eval.json``) and dirs
# (``.hydra/``): read, or made, so that damage is never fatal.
#
# A run writes them atomically (``write_json``, a non-finite number as null), but a file can
# still be damaged afterwards (a disk error, a careless edit, a copy cut short). They record a
# run; they never decide whether it can go on, so an unreadable one is renamed to
# ``<name>.damaged`` (kept, never deleted) with one warning, and the run goes on as if it were
# not there; so is anything else where the run keeps a dir (a file named ``.hydra``:
# ``make_dir``). ``metrics.jsonl``'s damaged lines go the way of its other set-aside lines
# (``tracking.logger.rewind_metrics``); a checkpoint's meta is checked with its checkpoint
# (``checkpointing.store``).

log = logging.getLogger("dxrun")

DAMAGED = ".damaged"


def set_aside(path: Path, why: str) -> Path | None:
    """Rename the damaged ``path`` to ``<name>.damaged`` (``.damaged1``, ... when that is
    taken: an earlier damage is never overwritten) and say so in one line; None, also in one
    line, when it cannot be renamed (the next write replaces it)."""
    dst, i = path.with_name(path.name + DAMAGED), 0
    while dst.exists():
        i += 1
        dst = path.with_name(f"{path.name}{DAMAGED}{i}")
    try:
        path.rename(dst)
    except OSError as e:
        log.warning("%s is damaged (%s) and could not be moved aside (%s); the run goes on "
                    "without it", path, why, e.strerror or e)
        return None
    log.warning("%s is damaged (%s); moved it to %s, the run goes on without it", path, why,
                dst.name)
    return dst


def read_json(path: Path, valid: Callable[[Any], bool] = lambda _: True) -> Any | None:
    """The JSON value in ``path``; None when there is none. A file that is not UTF-8 JSON, or
    whose value ``valid`` refuses, is damaged: set aside (``set_aside``), None. One that cannot
    be read at all (an I/O error) is left where it is, with one warning, None."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("could not read %s (%s); the run goes on without it", path, e.strerror or e)
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        set_aside(path, named_line(e, 120))
        return None
    if not valid(value):
        set_aside(path, "not the structure dxrun writes")
        return None
    return value


def make_dir(path: Path) -> None:
    """``path`` as a dir (made, with its parents, if need be). Anything else in its place (a
    file, a link to nowhere) is damaged bookkeeping: set aside (``set_aside``) and the dir
    made anew; a ``path`` that cannot be set aside still fails, in ``mkdir``."""
    if os.path.lexists(path) and not path.is_dir():
        set_aside(path, "a file where the run keeps a directory")
    path.mkdir(parents=True, exist_ok=True)


def finite_or_null(obj: Any, key: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every NaN/inf float replaced by None, and the keys where that happened.

    JSON has no NaN or Infinity: Python writes them anyway and most readers then refuse the
    whole file. A diverged run's numbers become ``null`` instead (W&B shows a gap)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [key or "value"]
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite_or_null(v, f"{key}.{k}" if key else str(k))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        pairs = [finite_or_null(v, f"{key}[{i}]") for i, v in enumerate(obj)]
        return [v for v, _ in pairs], [k for _, b in pairs for k in b]
    return obj, []


def write_json(path: Path, obj: Any) -> None:
    """Atomically; non-finite floats are written as null (see ``finite_or_null``)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(finite_or_null(obj)[0], indent=2, allow_nan=False) + "\n")
        tmp.replace(path)
    except OSError:  # a full disk: no half-written tmp file left beside the intact one
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# ------------------------------------------------------------------------------------------------
# Test-only faults, set through the environment and read here alone, so that no key of the
# user's config exists for the tests' sake: a test poisons a step, holds the loop at a known step
# or makes it crash, on any host, by starting ``python -m dxrun`` with
#
#     DXRUN_TEST_NAN_AT_STEP=k    step k's loss (so its gradients) is NaN: train.nan_policy's path
#     DXRUN_TEST_HOLD_AT_STEP=k   from step k on, the loop waits before each step for a SIGUSR1
#                                 (which also asks for a save), so signals land at known steps
#     DXRUN_TEST_ERROR_AT_STEP=k  after step k the loop raises an error that is not bad input
#     DXRUN_TEST_DEAF_RANK=k      rank k (0 too) of a launch does not act on SIGINT or SIGTERM
#                                 while starting, and holds there until sent one (``deafen``)
#     DXRUN_TEST_CHIP_MIB=k       a chip of k MiB: a step compile whose program needs more
#                                 fails as XLA's TPU compile does (RESOURCE_EXHAUSTED), so a CPU
#                                 test meets what only a real accelerator's compile refuses
#
# Unset: off (a step fault at 0 too: steps count from 1). Any other value than an integer in its
# range is refused in one line.

# Each fault's variable and the steps it accepts (the NaN step is compared with the int32 step
# counter inside the jitted step).
FAULT_VARIABLES: dict[str, tuple[str, Range]] = {
    "nan_at_step": ("DXRUN_TEST_NAN_AT_STEP", Range(0, INT32)),
    "hold_at_step": ("DXRUN_TEST_HOLD_AT_STEP", NON_NEGATIVE),
    "error_at_step": ("DXRUN_TEST_ERROR_AT_STEP", NON_NEGATIVE),
    "deaf_rank": ("DXRUN_TEST_DEAF_RANK", NON_NEGATIVE),
    "chip_mib": ("DXRUN_TEST_CHIP_MIB", NON_NEGATIVE),
}


@dataclass(frozen=True)
class Faults:
    nan_at_step: int = 0
    hold_at_step: int = 0
    error_at_step: int = 0
    deaf_rank: int | None = None
    chip_mib: int = 0

    def steps(self) -> tuple[int, int, int]:
        """The steps at which the loop does more than step (0: none)."""
        return self.nan_at_step, self.hold_at_step, self.error_at_step

    def after_step(self, done: int, signalled: Callable[[], bool]) -> None:
        """Between steps, after step ``done``: from ``hold_at_step`` on, each step waits for a
        SIGUSR1 (``signalled``), so a test knows the step its signals are acted on at (a stop
        waits for one too); after ``error_at_step``, a failure."""
        while self.hold_at_step and done >= self.hold_at_step and not signalled():
            time.sleep(0.01)
        if self.error_at_step and done == self.error_at_step:
            raise RuntimeError(f"injected failure after step {done} "
                               "(DXRUN_TEST_ERROR_AT_STEP, a test-only fault)")


def xla_bytes(n: float) -> str:
    """Bytes as XLA's messages write them (binary units: 15.75G is 15.75 GiB)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}B"


def check_chip(compiled: Any, need: float | None) -> Any:
    """``compiled`` (a step's executable needing ``need`` bytes per device), or under
    ``DXRUN_TEST_CHIP_MIB`` the error XLA's TPU compile raises for a program over the chip's
    memory, in its own words (what ``fit.is_out_of_memory`` and ``fit.xla_need`` read)."""
    limit = faults_from_env().chip_mib * 2**20
    if not limit or need is None or need <= limit:
        return compiled
    from jax.errors import JaxRuntimeError

    raise JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        f"temporaries ({xla_bytes(need)}) exceeds available HBM ({xla_bytes(limit)}). "
        "(DXRUN_TEST_CHIP_MIB, a test-only fault)")


def faults_from_env(environ: Mapping[str, str] = os.environ) -> Faults:
    values = {}
    for name, (variable, accepted) in FAULT_VARIABLES.items():
        text = environ.get(variable, "").strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value not in accepted:
            raise ConfigError(f"{variable}={text} is outside its range {accepted}; "
                              f"{accepted.fix(variable)} (a test-only fault)")
        values[name] = value
    return Faults(**values)


_HEARD: list[int] = []  # the stops the deaf rank was sent


def deafen(rank: int) -> None:
    """Rank ``deaf_rank`` notes SIGINT and SIGTERM and does nothing else (``join`` calls this):
    a stop never reaches its startup, as for a rank inside a collective, where no Python
    handler runs. (Not a blocked signal mask: a thread started earlier would take the signal.)"""
    if rank == faults_from_env().deaf_rank:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: _HEARD.append(signum))


def hold_until_stopped(rank: int) -> None:
    """Rank ``deaf_rank`` waits here until it has been sent a stop: the others wait for it in
    their next collective, so the stop reaches them inside their startup, whenever it comes."""
    if rank == faults_from_env().deaf_rank:
        while not _HEARD:
            time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# Process setup that must happen before JAX is imported, and the run directory.
#
# No JAX import at module level: ``simulate_cpu_devices`` has to set XLA_FLAGS first.

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


def claim_run_dir(run_dir: Path) -> Path:
    """The run dir Hydra made, claimed for a new run: the claim is creating ``.hydra/`` with an
    atomic mkdir: a dir whose ``.hydra/`` exists belongs to an earlier or a concurrent run (two
    launches in the same second, a SLURM array), and this run takes the first free sibling
    ``<name>_1``, ``<name>_2``, ... so no two runs ever share a dir. (A relaunch that continues
    a run claims its dir through ``dxrun.run.runtime.claim``.)"""
    candidate, i = run_dir, 0
    while True:
        nameable(run_dir, candidate)
        candidate.mkdir(parents=True, exist_ok=True)
        try:
            (candidate / ".hydra").mkdir()
            return candidate
        except FileExistsError:
            i += 1
            candidate = run_dir.with_name(f"{run_dir.name}_{i}")


ATTEMPTS = Path(".hydra") / "attempts"  # in a run dir: <n>/, each launch's own config


def attempt_numbers(run_dir: Path) -> list[int]:
    """The launches into ``run_dir`` that kept their config (``.hydra/attempts/<n>/``)."""
    where = run_dir / ATTEMPTS
    return sorted(int(p.name) for p in where.iterdir() if p.name.isdigit()) if where.is_dir() else []


def write_hydra_files(run_dir: Path, cfg: DictConfig, hydra_cfg: HydraConf | None) -> None:
    """What Hydra's .hydra/ holds, written only once the config is known to be valid; and
    this launch's own copy in ``.hydra/attempts/<n>/``: a resume may change the optimizer, the
    lr or the mesh, and config.yaml, the latest, would say nothing of what the earlier steps
    ran with."""
    out = run_dir / ".hydra"
    make_dir(out)  # whatever else is there is set aside (bookkeeping.make_dir)
    make_dir(run_dir / ATTEMPTS)
    attempt = run_dir / ATTEMPTS / str(max(attempt_numbers(run_dir), default=0) + 1)
    attempt.mkdir()
    for where in (out, attempt):
        OmegaConf.save(cfg, where / "config.yaml", resolve=True)
        if hydra_cfg is not None:
            OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)),
                           where / "overrides.yaml")
    if hydra_cfg is not None:
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")


STATUS = "status.json"


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """The run's state for the sweep report and the multirun's exit code: ``running`` when it
    starts (a job killed mid-run stays so), then ``ok`` or ``failed`` with ``kind`` (refused |
    crashed | nonfinite | disk), ``reason`` and ``log``. ``started``/``finished`` (epoch
    seconds) let the report see jobs that ran at the same time, whose throughputs are not
    comparable."""
    import time

    path = run_dir / STATUS
    # A damaged status.json is set aside: the status it held is history, this one is news.
    old = read_json(path, lambda x: isinstance(x, dict)) or {}
    now = time.time()
    record = {"status": status, **fields, "started": old.get("started") or now}
    if status != "running":
        record["finished"] = now
    if attempts := _attempts(run_dir, old.get("attempts"), status, now):
        record["attempts"] = attempts
    try:
        write_json(path, record)
    except OSError as e:  # a full disk: the run's own line still says what happened
        log.warning("could not write %s (%s): it still says %r", path, e.strerror or e,
                    old.get("status"))


def _attempts(run_dir: Path, recorded: Any, status: str, now: float) -> list[dict[str, Any]]:
    """status.json's ``attempts``: one per launch into the run dir that kept its config
    (``write_hydra_files``), with when it started and how it ended; the one under way is
    ``status``, and an earlier one that never said how it ended was killed. What the old
    status.json said of each is kept (none of it when that file was damaged)."""
    said = {a.get("attempt"): a for a in recorded if isinstance(a, dict)} if isinstance(
        recorded, list) else {}
    out = [{**said.get(n, {}), "attempt": n, "config": str(ATTEMPTS / str(n) / "config.yaml")}
           for n in attempt_numbers(run_dir)]
    for a in out[:-1]:
        if a.get("status") == "running":
            a["status"] = "killed"
    if out:
        out[-1].setdefault("started", now)
        out[-1]["status"] = status
        if status != "running":
            out[-1]["finished"] = now
    return out


# What each multirun started in this process exits with, once Hydra returns: the sweep report's
# callback (``report.sweep.SweepReport``) puts in its check of the jobs' status.json files, and
# the launcher (``dxrun.__main__.cli``) calls them. Hydra keeps no handle on a sweep dir once the
# multirun is over, and with submitit the jobs ran elsewhere.
SWEEP_EXITS: list[Callable[[], None]] = []


def sweep_group(sweep_dir: Path) -> str:
    """The W&B group of a multirun's jobs: ``sweep-<date>_<time>`` from its sweep dir."""
    return "sweep-" + "_".join(Path(sweep_dir).parts[-2:])


# ------------------------------------------------------------------------------------------------
# The run's log file: held in memory until the run has claimed its dir, then written there.
#
# Hydra opens ``<its dir>/dxrun.log`` before dxrun knows whether that dir is free (``RunLog``).

class _LogFile(logging.FileHandler):
    """The run's log file. A line it cannot write (a full disk) costs one line on stderr for
    the whole run, not logging's traceback per line (or, from ``write_traceback``, the crash's
    traceback on the terminal): the console still has every line."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if not self.failed:
            self.failed = True
            print(f"dxrun: warning: cannot write {self.baseFilename} ({sys.exc_info()[1]}); "
                  "its lines go to the console only", file=sys.stderr)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)  # type: ignore[arg-type]


class RunLog:
    """The run's log file follows the run dir it claimed. Hydra opens ``<its dir>/dxrun.log``
    before dxrun knows whether that dir is free; this holds the lines in memory until
    ``attach`` names the claimed dir (so a relaunch never writes into an earlier run's log),
    and ``discard`` drops them for a run that never started."""

    NAME = "dxrun.log"

    @staticmethod
    def name_for(rank: int, processes: int) -> str:
        """``dxrun.log``; in a multi-process run each process its own ``dxrun.<rank>.log``."""
        return RunLog.NAME if processes == 1 else f"dxrun.{rank}.log"

    def for_process(self, rank: int, processes: int) -> None:
        """The file of process ``rank`` of a run of ``processes`` (``name_for``)."""
        self.name = self.name_for(rank, processes)

    def __init__(self) -> None:
        import logging.handlers

        root = logging.getLogger()
        hydra_files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        self.formatter = (hydra_files[0].formatter if hydra_files else None) or logging.Formatter(
            "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        for h in hydra_files:
            root.removeHandler(h)
            h.close()
            path = Path(h.baseFilename)
            with contextlib.suppress(FileNotFoundError):  # the ranks of one run share the file
                st = path.stat()
                # Hydra's empty file; an earlier run's log stays, and so does anything that is
                # not a plain file (a handler on /dev/null: deleting it would break the host).
                if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    path.unlink()
        self.buffer = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=100)
        root.addHandler(self.buffer)
        self.file: logging.FileHandler | None = None
        self.name = self.NAME

    def attach(self, run_dir: Path) -> Path:
        import logging

        if self.file is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = _LogFile(run_dir / self.name)
            self.file.setFormatter(self.formatter)
            self.buffer.setTarget(self.file)
            self.buffer.flush()
            root = logging.getLogger()
            root.removeHandler(self.buffer)
            root.addHandler(self.file)
        return Path(self.file.baseFilename)

    def quiet_console(self) -> None:
        """Processes other than 0 print only errors (process 0 says the rest, once); their log
        files still get every line."""
        import logging

        for h in logging.getLogger().handlers:
            if type(h) is logging.StreamHandler:
                h.setLevel(logging.ERROR)

    def write_traceback(self, exc: BaseException) -> None:
        """The full traceback into the log file only: the terminal gets one line."""
        self._error("run failed", (type(exc), exc, exc.__traceback__))

    def write_error(self, line: str) -> None:
        """The error line a run ends with on the terminal (``fail``'s), into its log file too,
        once the run has one: the log alone says how the run ended."""
        if self.file is not None:
            self._error(line)

    def _error(self, msg: str, exc_info: Any = None) -> None:
        """An error record into the log file only."""
        import logging

        record = logging.getLogger("dxrun").makeRecord(
            "dxrun", logging.ERROR, __file__, 0, msg, None, exc_info)
        self.file.handle(record)
        self.file.flush()

    def discard(self) -> None:
        import logging

        logging.getLogger().removeHandler(self.buffer)
        self.buffer.buffer.clear()


# ------------------------------------------------------------------------------------------------
# Where a run sits among others (Hydra's group choices, the overrides, the W&B group and job
# type) and the names that follow from it: the run's name and its model's description.

@dataclass
class Job:
    """Where a run sits among others: Hydra's group choices, the command-line overrides, and
    the W&B group (the experiment or multirun sweep) and job type. The W&B names are decided
    for the run (``logger.group``/``logger.job_type``, or what the launch fills in where they
    are unset) and carried here, never written into the config the run follows; the run's
    saved config records them (``run_plan.saved_config``). None: the config's own."""

    choices: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    group: str | None = None
    job_type: str | None = None
    started: float | None = None  # epoch seconds the job began (goodput's startup); None = now
    # The run dir holds earlier attempts of this run (a relaunch continues them, with or without
    # a checkpoint): their rows after this attempt's start move aside, their goodput is kept.
    continues: bool = False


MAX_NAME = 120


def _model_label(model: ModelConfig, job: Job) -> str:
    """The preset's name, or the user's own (``model.name=...``) for a custom size."""
    named = any(ov.lstrip("+~").startswith("model.name=") for ov in job.overrides)
    return model.name if named else job.choices.get("model", model.name)


def run_name(cfg: RunConfig, job: Job, global_batch: int | None = None) -> str:
    """``tiny-dp4_tp2-bs64`` plus the key overrides, e.g. ``-lr0.01``. No slashes: a path
    value is its last component (``data.path=data/mycorpus`` gives ``pathmycorpus``), and a
    long name is cut between parts, never inside one. ``global_batch``: the plan's (None:
    ``data.batch_size``)."""
    batch = cfg.data.batch_size if global_batch is None else global_batch
    parts = [_model_label(cfg.model, job), job.choices.get("parallelism", cfg.parallelism.name),
             f"bs{batch}"]
    for ov in job.overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if "." in key and key not in ("data.batch_size", "model.name") and not key.startswith(
                ("logger.", "hydra", "runtime.", "distributed.", "run.")):
            value = (Path(value.rstrip("/")).name or value) if "/" in value else value
            parts.append(f"{key.rsplit('.', 1)[1]}{value}".replace("/", "_"))
    name = parts[0][:MAX_NAME]
    for part in parts[1:]:
        if len(name) + 1 + len(part) > MAX_NAME:
            break
        name += f"-{part}"
    return name


def describe_model(model: ModelConfig, job: Job) -> str:
    """``tiny``, or ``tiny (modified: n_layers=4, d_model=256)`` when keys differ from the
    preset, or ``mine (tiny modified: ...)`` for a size the user named; an imported model is
    its own, ``hf-gpt2 (hf:gpt2)``: its shape is the checkpoint's, not the preset's."""
    if model.init_from:
        return f"{model.name} ({model.init_from})"
    preset = job.choices.get("model", model.name)
    label = _model_label(model, job)
    changes = model_changes(model, preset)
    if not changes:
        return label
    base = "" if label == preset else f"{preset} "
    return f"{label} ({base}modified: {', '.join(changes)})"


# ------------------------------------------------------------------------------------------------
# Joining a multi-process run: JAX's own distributed runtime (``jax.distributed``), started
# by the scheduler (SLURM's ``srun``), by ``python -m dxrun.launch`` or by hand.
#
# Which processes make one run is decided before JAX touches a device (``join``), from
# ``distributed.mode``: ``auto`` (default) joins when the environment says this process is one
# of several (an ``srun`` step with more than one task, or what ``dxrun.launch`` sets), ``off``
# stays one process, ``manual`` reads ``distributed.coordinator`` / ``num_processes`` /
# ``process_id``. ``detect`` is pure (it reads a given environment), so every branch is tested
# without a cluster. The processes are grouped by host (``process_hosts``) so the plan keeps
# tensor groups inside a host. On CPU the cross-process collectives go through gloo, so a
# multi-process run works on one laptop over loopback.

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


# ------------------------------------------------------------------------------------------------
# Preemption: signals turn into flags the train loop reads once per step.
#
# SIGTERM (what SLURM and Kubernetes send before killing a job) and SIGINT (Ctrl-C) ask the loop to
# finish its step, save, wait for the save to be committed and stop (``errors.Stopped``, with the
# signal's exit code). A second SIGINT exits at once. SIGUSR1 (SLURM's ``--signal`` warning)
# asks for a save and training goes on. A handler only sets a flag: the
# loop acts between steps, so no device work is interrupted and nothing syncs per step.
#
# Outside the loop (from the launcher's start: the plan, the compile, the layout search, the
# init; and after the last step: the final commit, W&B's finish, the summary) there is no step
# to finish and nothing new to save: ``guard_signals``' handlers raise ``errors.Interrupted`` for
# any of the three, which the launcher turns into one line and status ``stopped``.

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


# ------------------------------------------------------------------------------------------------
# Which run dir a training launch writes to, holding it for the run's life, and the command
# that relaunches into it.
#
# One owner per run dir: the launch that trains in a dir holds an exclusive ``flock`` on
# ``.hydra/lock`` (``RunLock``, naming its holder) from before its plan and compile until it ends;
# the kernel drops the lock of a process that dies, however it dies. A second launch into a held
# dir refuses in one line, or waits (``run.wait_for_lock``). A generated run dir or a fresh start
# (``checkpoint.resume=none``) takes the dir, or its first sibling ``<dir>_1``, ``<dir>_2``, ...
# no run has taken; a named dir (a scheduler's requeue) continues the newest run of its chain
# when unfinished or holding checkpoints of its own, else starts the next sibling (``pick``),
# whatever its overrides, under a resume's checks. A stopped run names the command that
# relaunches it (``relaunch_command``); a dir the config names that cannot be made is refused in
# one line before anything is (``dir_refusal``). No JAX: the claim precedes plan and compile.

LOCK = Path(".hydra") / "lock"
# What says a dir holds a run (a plan-mode dir included), beside its checkpoints.
_RUN_FILES = (STATUS, "summary.json", "metrics.jsonl", ".hydra/config.yaml", "checkpoints",
              "checkpoints.txt")
POLL_S = 0.5  # how often a waiting launch tries the lock again


def wait_seconds(setting: bool | float | None) -> float:
    """``run.wait_for_lock``: false = do not wait (0), true = as long as it takes (inf), a
    number = at most that many seconds."""
    if setting is True:
        return math.inf
    return float(setting or 0)


@dataclass(frozen=True)
class Holder:
    """The live run a lock file names (what the refusal says)."""

    pid: int | None = None
    host: str | None = None
    since: float | None = None

    def describe(self, now: float | None = None) -> str:
        if self.pid is None:
            return "a live run (its lock file names no holder yet)"
        ago = "" if self.since is None else (
            f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}, "
            f"{max(0, int((now or time.time()) - self.since))} s ago")
        return f"pid {self.pid} on {self.host}{ago}"


def holder(run_dir: Path) -> Holder:
    """Who the lock file of ``run_dir`` names (a half-written or missing file: nobody named)."""
    try:
        info = json.loads((Path(run_dir) / LOCK).read_text())
        return Holder(int(info["pid"]), str(info["host"]), float(info["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder()


class RunLock:
    """An exclusive ``flock`` on ``<run dir>/.hydra/lock``, held until ``release`` or the
    process's end. The file exists only while a run holds it (or after a holder was killed):
    ``release`` unlinks it while still holding it, and ``acquire`` checks that the file it
    locked is still the one at the path, so a launch that locked a file just unlinked tries
    again instead of holding a lock nobody else sees."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = Path(run_dir), fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock | None:
        """The lock of ``run_dir`` (its ``.hydra/`` made if need be), or None while a live
        process holds it."""
        path = Path(run_dir) / LOCK
        while True:
            make_dir(path.parent)  # a file named .hydra: set aside (bookkeeping.make_dir)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # .hydra/ removed by a launch discarding it: again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError as e:  # a filesystem without flock (Lustre without -o flock)
                log.warning("%s: this filesystem takes no lock (%s): the run dir is not held "
                            "against a second launch", path, e.strerror)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # unlinked by its last holder between our open and our lock
                os.close(fd)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
            return cls(run_dir, fd)

    def release(self) -> None:
        """Give the dir up; ``.hydra/`` goes too when the lock was all it held."""
        if self.fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.run_dir / LOCK)
        os.close(self.fd)
        self.fd = -1
        with contextlib.suppress(OSError):  # holds the run's config: stays
            (self.run_dir / LOCK.parent).rmdir()


def holds_run(run_dir: Path) -> bool:
    """Whether a run (training or plan mode) has written into ``run_dir``."""
    return any((Path(run_dir) / name).exists() for name in _RUN_FILES)


def read_status(run_dir: Path) -> dict[str, Any]:
    """The run's status.json ({} when there is none or it cannot be read)."""
    try:
        status = json.loads((Path(run_dir) / STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def continues(run_dir: Path, has_checkpoints: Callable[[Path], bool]) -> bool:
    """Whether a relaunch naming the dir continues the run in ``run_dir``: it holds checkpoints
    of its own (a resume, or "nothing to train"), or it is unfinished."""
    return has_checkpoints(run_dir) or read_status(run_dir).get("status") in UNFINISHED


def chain(asked: Path) -> list[Path]:
    """``asked`` and its siblings ``<asked>_1``, ``<asked>_2``, ... that exist, in order."""
    asked = Path(asked)
    pattern = re.compile(re.escape(asked.name) + r"_(\d+)")
    siblings = []
    with contextlib.suppress(OSError):
        for p in asked.parent.iterdir():
            if (m := pattern.fullmatch(p.name)) and p.is_dir():
                siblings.append((int(m.group(1)), p))
    return [asked, *(p for _, p in sorted(siblings))]


def sibling(asked: Path, i: int) -> Path:
    return asked if i == 0 else asked.with_name(f"{asked.name}_{i}")


def pick(asked: Path, has_checkpoints: Callable[[Path], bool]) -> tuple[Path, bool]:
    """Where a launch naming ``asked`` trains: (dir, whether it continues the run there)."""
    dirs = chain(asked)
    runs = [d for d in dirs if holds_run(d)]
    if not runs:
        return asked, False
    newest = runs[-1]
    if continues(newest, has_checkpoints):
        return newest, True
    index = 0 if newest == asked else int(newest.name.rsplit("_", 1)[1])
    return sibling(asked, index + 1), False


@dataclass
class Claim:
    """The run dir a launch trains in, held (``lock``) until ``release``."""

    dir: Path
    lock: RunLock | None = None
    # The status.json of the run it continues ({}: a new run); its attempt number and the
    # attempts that ended without recording their end (killed outright) carry on.
    earlier: dict[str, Any] | None = None

    @property
    def continues(self) -> bool:
        return self.earlier is not None

    @property
    def attempt(self) -> int:
        """This launch's number among the run's attempts (1: a new run)."""
        if self.earlier is None:
            return 1
        return int(self.earlier.get("attempt") or 1) + 1

    @property
    def lost_attempts(self) -> int:
        """Earlier attempts that died without saying how they ended (status still running)."""
        if not self.earlier:
            return 0
        return (int(self.earlier.get("lost_attempts") or 0)
                + (self.earlier.get("status") == RUNNING))

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def claim(asked: Path, *, named: bool, fresh: bool, has_checkpoints: Callable[[Path], bool],
          wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
          held: list[Claim] | None = None) -> Claim:
    """The dir a training launch asking for ``asked`` trains in, locked (module docstring).
    ``named``: the user named the dir (no generated timestamp); ``fresh``: a new run
    (``checkpoint.resume=none``). A named dir held by a live run: wait up to ``wait_s``, then
    ConfigError naming the holder. ``held`` gets the claim the moment its lock is taken, so
    that a signal before this returns still stops the run as one that holds its dir."""
    held = [] if held is None else held
    if fresh or not named:
        while True:
            run_dir = claim_run_dir(asked)  # the first dir whose .hydra/ this launch made
            with SIGNALS.held_back():  # a stop comes after the lock is in ``held``
                if (lock := RunLock.acquire(run_dir)) is not None:
                    held[:] = [Claim(run_dir, lock)]
            if lock is not None:
                return held[0]
    deadline, said = clock() + wait_s, False
    while True:
        target, cont = pick(asked, has_checkpoints)
        nameable(asked, target)
        with SIGNALS.held_back():
            lock = RunLock.acquire(target)
            held[:] = [] if lock is None else [Claim(target, lock)]
        if lock is None:
            if clock() >= deadline:
                raise ConfigError(busy(target, wait_s))
            if not said:
                log.info("%s is held by %s: waiting for it to end (run.wait_for_lock=%s)",
                         target, holder(target).describe(),
                         "true" if math.isinf(wait_s) else f"{wait_s:g}")
                said = True
            time.sleep(POLL_S)
            continue
        if pick(asked, has_checkpoints) != (target, cont):  # it changed before we held it
            held.clear()
            lock.release()
            continue
        held[:] = [Claim(target, lock, read_status(target) if cont else None)]
        return held[0]


def busy(run_dir: Path, wait_s: float) -> str:
    """The refusal of a launch into a dir a live run holds."""
    waited = f" (waited {wait_s:g} s, run.wait_for_lock)" if wait_s > 0 else ""
    return (f"{run_dir} is in use by a live run: {holder(run_dir).describe()}{waited}; let it "
            "end or stop it, or set run.wait_for_lock=true (or a number of seconds) to wait "
            "for it")


def hydra_value(text: str) -> str:
    """``text`` written as the value of a Hydra override that reads back as ``text``: as it
    is where Hydra's grammar takes it unchanged as a string, else double-quoted. Inside the
    quotes Hydra unescapes only backslashes before a quote (so a quote gets one, and a run of
    backslashes before a quote or the end is doubled); OmegaConf would still resolve ``${``,
    so it is escaped too. ``=``, quotes, spaces, commas and non-ASCII need the quotes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "${" not in text:
        try:
            if OverridesParser.create().parse_override(f"k={text}").value() == text:
                return text
        except Exception:  # noqa: BLE001 - Hydra's grammar refused it: quote it
            pass
    body = re.sub(r'(\\*)"', lambda m: m[1] * 2 + '\\"', text)
    body = re.sub(r"(\\+)$", lambda m: m[1] * 2, body).replace("${", "\\${")
    return f'"{body}"'


# Set by ``dxrun.launch`` for its ranks: {"program": its own command up to "--", "added": the
# overrides it adds to the user's}, so that a rank's resume command is the launcher's.
LAUNCHED_BY = "DXRUN_LAUNCHED_BY"


def stopped_words(signal_name: str, when: str, checkpoint: object, relaunch: str) -> str:
    """The one line a run stopped by a signal ends with (status.json's reason): what stopped
    it and when, the newest checkpoint kept (None: none yet) and the command that resumes it."""
    kept = f"checkpoint {checkpoint} is the newest" if checkpoint else "no checkpoint yet"
    return f"{signal_name}: stopped {when}; {kept}. Resume with: {relaunch}"


def relaunch_command(overrides: list[str], run_dir: Path | str, program: str | None = None
                     ) -> str:
    """The command that resumes a stopped run in place: its overrides (Hydra's task
    overrides, which leave out ``hydra.*``, each as the user wrote it) and its run dir (a path,
    written for Hydra by ``hydra_value``), quoted for a POSIX shell. ``program``: by default
    ``python -m dxrun``, or in a rank of ``dxrun.launch`` the launcher's (``LAUNCHED_BY``)."""
    launcher = json.loads(os.environ.get(LAUNCHED_BY) or "{}") if program is None else {}
    program = program or launcher.get("program", "python -m dxrun")
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    added = launcher.get("added", [])
    if added and kept[-len(added):] == added:
        kept = kept[:-len(added)]
    run_dir_override = f"hydra.run.dir={hydra_value(str(run_dir))}"
    return " ".join([program, *map(shlex.quote, kept), shlex.quote(run_dir_override)])


def run_dir_of(command: str) -> str | None:
    """The run dir a ``relaunch_command`` resumes in, read from its ``hydra.run.dir=`` word as
    the shell, Hydra and OmegaConf (which undoes the escaped ``${``) read it; None without."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    word = next((w for w in shlex.split(command) if w.startswith("hydra.run.dir=")), None)
    if word is None:
        return None
    return OmegaConf.create({"dir": OverridesParser.create().parse_override(word).value()}).dir

def dir_refusal(key: str, value: Any, fix: str) -> str | None:
    """Why the dir ``key=value`` cannot be made or written, in one line ending in ``fix``;
    None when it can. A name longer than the filesystem takes (NAME_MAX, or the whole path
    PATH_MAX) is refused by its length; otherwise the dir, or its nearest parent that exists,
    is tried with a real mkdir (removed at once): permission bits pass root, and /proc or a
    read-only mount refuse only the mkdir itself. Nothing is left behind."""
    path = Path(str(value)).expanduser()  # relative stays relative: named as the user gave it
    nearest = _nearest(path)
    if why := _too_long(path, nearest):
        return f"{key}={_shortened(str(value))} cannot be created: {why}; shorten it, {fix}"
    where = f"{key}={value}" if nearest == path else f"{key}={value} cannot be created: {nearest}"
    if not nearest.is_dir():
        kind = "a file, not a directory" if nearest.is_file() else "not a directory"
        return f"{where} is {kind}; {fix}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dxrun-probe-", dir=nearest))
    except OSError as e:
        # ENOENT from a mkdir in an existing dir (/proc): the filesystem takes no new dirs.
        reason = "" if e.errno == errno.ENOENT else f" ({e.strerror.lower()})"
        return f"{where} is not writable{reason}; {fix}"
    return None


def nameable(asked: Path, sibling: Path) -> None:
    """A new run's dir ``sibling`` of ``asked`` (``<asked>_N``: ``asked`` holds a run) that
    the filesystem cannot name, ``asked`` being near NAME_MAX, refused in one line before
    anything is made (``dir_refusal`` checked ``asked`` alone)."""
    if sibling != asked and (why := _too_long(sibling, _nearest(sibling))):
        raise ConfigError(f"the run dir {_shortened(asked.name)} holds a run, and this run's "
                          f"own dir beside it cannot be created: {why}; give a shorter "
                          "hydra.run.dir")


def _nearest(path: Path) -> Path:
    """``path`` or its nearest parent that exists (a parent that is a file ends the walk)."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def _too_long(path: Path, nearest: Path) -> str | None:
    """Why ``path`` cannot be made for its length alone (None: it can): a name to be made under
    ``nearest`` (its nearest part that exists) longer than the filesystem's NAME_MAX, or the
    whole path longer than PATH_MAX, both in bytes (the kernel's ENAMETOOLONG)."""
    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf(nearest, name)
        except (OSError, ValueError):
            return default

    name_max = limit("PC_NAME_MAX", 255)
    for part in path.parts[len(nearest.parts):]:
        if (n := len(os.fsencode(part))) > name_max:
            return (f"its name {_shortened(part, count=False)} is {n} bytes, over the {name_max} "
                    "a file name may have on this filesystem (NAME_MAX)")
    path_max = limit("PC_PATH_MAX", 4096)
    if (n := len(os.fsencode(os.path.abspath(path)))) >= path_max:
        return f"its path is {n} bytes, over the {path_max - 1} a path may have (PATH_MAX)"
    return None


def _shortened(text: str, keep: int = 48, count: bool = True) -> str:
    """``text`` for a one-line message: as it is up to ``keep`` characters, else its start and
    end around ``...`` (and, ``count``, its length)."""
    if len(text) <= keep:
        return text
    head = keep * 2 // 3
    return f"{text[:head]}...{text[head - keep:]}" + (f" ({len(text)} characters)" if count else "")


# ------------------------------------------------------------------------------------------------
# The ``logger`` section checked before a run starts: an MLflow store that cannot be written
# is refused in one line (``store_refusal``), a plain directory is MLflow's file store
# (``mlflow_store_uri``), and a key the chosen logger does not read is one warning
# (``unread_logger_keys``). No MLflow, W&B or JAX import.

# The keys each backend reads (MLflow: the experiment, the store, and the names as tags).
NAMES = ("project", "group", "job_type", "tags")
READS = {"wandb": {*NAMES, "entity", "mode"}, "mlflow": {*NAMES, "mlflow_uri"},
         "tensorboard": set(), "csv": set(), "none": set()}
WHO = {"entity": "logger=wandb", "mode": "logger=wandb", "mlflow_uri": "logger=mlflow",
       "backends": "logger=many", **{k: "logger=wandb or logger=mlflow" for k in NAMES}}


def mlflow_store_uri(uri: str | None, run_dir: Path) -> str:
    """The tracking URI the MLflow backend opens: ``uri`` as given, a plain path as its
    ``file:`` URI (MLflow's file store, as the run dir's own ``mlruns/``, the default)."""
    if uri is None:
        return (run_dir / "mlruns").resolve().as_uri()
    if _local_path(uri) is not None and not uri.startswith("file:"):
        return Path(uri).expanduser().absolute().as_uri()
    return uri


def _local_path(uri: str) -> Path | None:
    """The directory a local file store URI (a path, ``file:``) names; None for another."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(uri).expanduser() if not parsed.scheme else None


def store_refusal(lc: LoggerConfig) -> str | None:
    """Why MLflow could not write ``logger.mlflow_uri`` (a file store's dir, or a
    ``sqlite:///`` database's dir, that cannot be made or written), in one line naming the
    key, the value and the fix; None when it can, or when the store is a server (MLflow
    reaches it when the backend opens)."""
    if lc.mlflow_uri is None or "mlflow" not in _backends(lc):
        return None
    fix = "give one you can write to, or leave logger.mlflow_uri null (<run dir>/mlruns)"
    if lc.mlflow_uri.startswith("sqlite:///"):
        db = Path(lc.mlflow_uri.removeprefix("sqlite:///")).expanduser()
        return dir_refusal(f"logger.mlflow_uri={lc.mlflow_uri}: the database's dir",
                           db.parent, fix)
    path = _local_path(lc.mlflow_uri)
    if path is None:
        return None
    plain = not lc.mlflow_uri.startswith("file:")
    return dir_refusal("logger.mlflow_uri" if plain else f"logger.mlflow_uri={lc.mlflow_uri}: "
                       "the store's dir", path, fix)


def _backends(lc: LoggerConfig) -> list[str]:
    return list(lc.backends) if lc.name == "many" else [lc.name]


def unread_logger_keys(lc: LoggerConfig) -> list[str]:
    """A warning for each ``logger.*`` key set away from its default that no backend of this
    run reads (``logger=csv logger.entity=me``): the setting would do nothing. ``tags`` aside:
    the experiments set theirs for whichever logger the run picks (``logger=none`` too)."""
    reads = set().union(*(READS.get(b, set()) for b in _backends(lc)))
    if lc.name == "many":
        reads.add("backends")
    defaults = LoggerConfig()
    out = []
    for f in fields(LoggerConfig):
        value = getattr(lc, f.name)
        if f.name in ("name", "tags") or f.name in reads or value == getattr(defaults, f.name):
            continue
        shown = f"[{','.join(value)}]" if isinstance(value, (list, ListConfig)) else value
        out.append(f"logger.{f.name}={shown} does nothing with logger={lc.name} (only "
                   f"{WHO[f.name]} reads it); drop it, or choose a logger that reads it")
    return out
