"""Plan mode: the mesh plan extended with what the compiled step needs.

The train step is compiled for the requested mesh from shapes alone (``Experiment.compile_step``:
no weight is allocated), and XLA's own analyses of that executable give the per-device memory
(arguments, outputs, temporaries), FLOPs, bytes accessed and collectives. From those:

* **fits**: the per-device footprint against a target's memory, and when it does not fit, the
  nearest setting that does, found by compiling the candidates (also what the memory preflight
  of every real run suggests: ``dxrun.capacity.preflight``);
* **speed** (an estimate): on an accelerator target, ``dxrun.capacity.gpu_cost``'s model of the GPU/TPU
  program (FLOPs and bytes counted from the shapes, collectives from the compiled HLO, constants
  per target with their sources), since XLA:CPU's FLOPs and bytes describe a CPU program; on
  ``plan.target=cpu`` a roofline of XLA's own counts: compute time = FLOPs / peak, memory time =
  bytes accessed / memory bandwidth, collective time = bytes sent / bandwidth; step time =
  max(compute, memory) + collectives (no overlap assumed, so it errs slow).

No JAX import at module level: the config check reads TARGETS before JAX starts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dxrun.errors import ConfigError

if TYPE_CHECKING:
    from dxrun.plan import MeshPlan

log = logging.getLogger("dxrun")

GB = 1e9
GiB = 2**30
USABLE = 0.9  # of a TPU's memory (or a GPU's without a pool); the rest is the runtime's own
USABLE_CPU = 0.8  # of the host's RAM: the OS, Python and the data pipeline need the rest
# JAX's GPU client pools this fraction of each GPU's memory (the BFC allocator's bytes_limit,
# which the preflight reads), preallocated or not: jaxlib's xla_client.py and JAX's "GPU memory
# allocation" page.
JAX_GPU_FRACTION = 0.75
MEM_FRACTION_KEYS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


@dataclass(frozen=True)
class Target:
    """One accelerator, per device. The peak comes from flops.PEAK_TFLOPS by ``device_kind``
    (one table of peaks); memory and bandwidths are the vendors' datasheet figures."""

    name: str
    device_kind: str
    memory_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # interconnect, per device, one direction


# Sources: NVIDIA H100/H200/A100/L40S datasheets (HBM3 3.35 TB/s, HBM3e 4.8 TB/s, HBM2e
# 2.04 TB/s, GDDR6 864 GB/s; NVLink 4: 900 GB/s, NVLink 3: 600 GB/s both directions together;
# L40S has no NVLink: PCIe 4.0 x16, 32 GB/s); Google Cloud TPU v5e/v5p system docs (16 GB at
# 819 GB/s with 1,600 Gbps ICI; 95 GB at 2,765 GB/s with 4,800 Gbps ICI).
TARGETS: dict[str, Target] = {
    "h100": Target("H100 SXM 80GB", "NVIDIA H100 80GB HBM3", 80 * GB, 3.35e12, 450 * GB),
    "h200": Target("H200 141GB", "NVIDIA H200", 141 * GB, 4.8e12, 450 * GB),
    "a100": Target("A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 80 * GB, 2.039e12, 300 * GB),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md: 96 GB HBM2e at 2.4 TB/s, NVLink,
    # run at a 500 W power limit): the SXM die (flops.PEAK_TFLOPS), its clock at 500 W in
    # gpu_cost.COST.
    "h100_96gb_500w": Target("H100 96GB HBM2e 500W", "NVIDIA H100 96GB HBM2e", 96 * GB, 2.4e12,
                             450 * GB),
    "l40s": Target("L40S 48GB", "NVIDIA L40S", 48 * GB, 0.864e12, 32 * GB),
    "v5e": Target("TPU v5e", "TPU v5 lite", 16 * GB, 0.819e12, 200 * GB),
    "v5p": Target("TPU v5p", "TPU v5", 95 * GB, 2.765e12, 600 * GB),
    "cpu": Target("this machine (CPU)", "cpu", 0.0, 0.0, 0.0),  # measured: see cpu_target
}


def host_memory_bytes() -> float:
    """Memory this host can give the run now (MemAvailable), the preflight's CPU budget."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return float(info["MemAvailable"].split()[0]) * 1024


def cpu_target(n_devices: int) -> Target:
    """This machine: its RAM shared by the simulated devices, a measured matmul peak and a
    measured memory bandwidth (collectives between simulated devices are memory copies). Each
    figure is one device's share when all run at once, as the peak is
    (``flops.measure_peak_tflops``): the simulated devices share the host's memory bus, so a
    layout that moves 8x the bytes on each of 8 devices takes 8x the time, not the same."""
    share = host_bus_bytes_per_s() / n_devices  # the whole host's bus shared
    return Target("this machine (CPU)", "cpu", host_memory_bytes() / n_devices, share, share)


HOST_FILE = "host.json"  # in dxrun's cache dir: the host's measured figures, by machine


def _host_key() -> str:
    """What the host's figures depend on: the CPU model and cores, JAX's devices and version."""
    import platform

    import jax

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
    from dxrun.runtime import user_cache_dir

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
    import jax
    import jax.numpy as jnp

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
    """``flops.measure_peak_tflops`` of this process's devices, measured once per machine
    (``host_figure``)."""
    from dxrun.capacity import flops

    return host_figure("peak_tflops", flops.measure_peak_tflops)


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@dataclass
class Footprint:
    """What one device holds and does for one train step, from the compiled executable."""

    params_bytes: float
    opt_state_bytes: float
    grads_bytes: float  # inside the temporaries: one fp32 gradient per parameter shard
    batch_bytes: float
    temp_bytes: float  # XLA's temporaries: gradients, activations, workspace
    total_bytes: float  # arguments + outputs - donated + temporaries: the device's peak need
    flops: float  # XLA's count for this device
    bytes_accessed: float
    collectives: dict[str, dict[str, float]]

    @property
    def activations_bytes(self) -> float:
        return max(0.0, self.temp_bytes - self.grads_bytes)


def _shard_bytes(tree: Any) -> float:
    import jax

    total = 0.0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += x.dtype.itemsize * float(math.prod(shape))
    return total


def footprint(exp: Any, compiled: Any, xla_cost: bool = True) -> Footprint:
    """``xla_cost=False``: skip XLA's FLOPs and bytes (two more compiles of a scanned model;
    an accelerator target's time model counts its own from the shapes): reported as 0."""
    from dxrun.capacity.hlo import collective_traffic
    from dxrun.step import step_bytes

    state, batch = exp.abstract_state(), exp.abstract_batch()
    m = compiled.memory_analysis()
    params = _shard_bytes(state.params)
    flops, bytes_accessed = cost_per_device(exp) if xla_cost else (0.0, 0.0)
    return Footprint(
        params_bytes=params,
        opt_state_bytes=_shard_bytes(state.opt_state),
        grads_bytes=params,
        batch_bytes=_shard_bytes(batch),
        temp_bytes=float(m.temp_size_in_bytes),
        total_bytes=step_bytes(compiled),
        flops=flops,
        bytes_accessed=bytes_accessed,
        collectives=collective_traffic(compiled.as_text(), exp.plan.n_devices),
    )


def accelerator_memory(exp: Any, target: Target) -> Any:
    """The memory model's per-device estimate (``dxrun.capacity.memory_model``) of ``exp``'s step on
    ``target``: the state's shards read from the abstract state's shardings, activations
    from the shapes, with the attention kernel a run on that target would use."""
    from dxrun.capacity import memory_model

    cfg = exp.cfg
    state = exp.abstract_state()
    kernel = memory_model.target_kernel(cfg.model.attention, target.device_kind,
                                        cfg.train.precision,
                                        cfg.model.d_model // cfg.model.n_heads)
    return memory_model.estimate_memory(
        memory_model.shapes(cfg, exp.plan, kernel), _shard_bytes(state.params),
        _shard_bytes(state.opt_state), _shard_bytes(exp.abstract_batch()), exp.plan.fsdp)


def _cost(compiled: Any) -> tuple[float, float]:
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def cost_per_device(exp: Any) -> tuple[float, float]:
    """FLOPs and bytes accessed per device for one step. XLA's cost analysis counts a loop body
    once, so a scanned model is measured as the unrolled 1- and 2-layer steps of the same
    config and extrapolated in depth (every layer is the same): cost(n) = c1 + (n-1)(c2 - c1)."""
    from omegaconf import OmegaConf

    from dxrun.experiment import Experiment

    cfg = exp.cfg
    if not cfg.model.scan_layers:
        return _cost(exp.compile_step())
    costs = []
    for n in (1, 2):
        small = OmegaConf.merge(cfg, {"model": {"n_layers": n, "scan_layers": False}})
        costs.append(_cost(Experiment.build(small, exp.plan, data=_NoData()).analyse_step()))
    (f1, b1), (f2, b2) = costs
    n = cfg.model.n_layers
    return f1 + (n - 1) * (f2 - f1), b1 + (n - 1) * (b2 - b1)


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
    default this process's environment), ``USABLE`` on a TPU, ``USABLE_CPU`` of a host's RAM."""
    if target.device_kind == "cpu":
        return Usable(USABLE_CPU, "of the host's available RAM")
    if target.device_kind.startswith("NVIDIA"):
        return gpu_memory_fraction(os.environ if env is None else env)
    return Usable(USABLE, "the rest is the runtime's own")


def usable_bytes(target: Target, env: Any = None) -> float:
    """What a plan may use of one device's memory."""
    return target.memory_bytes * usable_share(target, env).fraction


def estimate(fp: Footprint, target: Target, peak_tflops: float | None, model_flops: float,
             tokens: int, n_devices: int, precision: str,
             timing: dict[str, Any] | None = None,
             need_bytes: float | None = None) -> dict[str, Any]:
    """Fit and speed for one target (per device; labelled as an estimate). ``timing``: the
    accelerator time model's step (``gpu_cost.step_time``); None: the roofline of XLA's counts
    (``plan.target=cpu``). ``need_bytes``: the per-device need when it does not come from the
    compile (an accelerator target's memory model, ``dxrun.capacity.memory_model``)."""
    share = usable_share(target)
    usable = target.memory_bytes * share.fraction
    need = fp.total_bytes if need_bytes is None else need_bytes
    out: dict[str, Any] = {
        "target": target.name,
        "memory_per_device_gb": target.memory_bytes / GB,
        "usable_per_device_gb": usable / GB,
        "usable_fraction": share.fraction,
        "usable_source": share.source,
        "needs_per_device_gb": need / GB,
        "needs_from": "XLA:CPU compile" if need_bytes is None else "memory model",
        "fits": need <= usable,
        "headroom_gb": (usable - need) / GB,
        "peak_tflops": peak_tflops,
        "precision": precision,
    }
    if not peak_tflops or not target.hbm_bytes_per_s or (timing is None and not fp.flops):
        return out  # no peak, or an accelerator footprint without XLA's counts and no timing
    if timing is not None:
        from dxrun.capacity.gpu_cost import basis_text

        step = timing["step_time_s"]
        parts = {"compute": timing["matmul_s"] + timing["attention_s"],
                 "memory": timing["elementwise_s"], "collectives": timing["exposed_collective_s"]}
        out.update({
            "estimate": basis_text(), "timing": timing,
            "compute_s": parts["compute"], "memory_s": parts["memory"],
            "collective_s": parts["collectives"], "step_time_s": step,
            "bound": max((v, k) for k, v in parts.items())[1],
            "tokens_per_s": tokens / step,
            "mfu": model_flops / n_devices / step / (peak_tflops * 1e12),
        })
        return out
    compute = fp.flops / (peak_tflops * 1e12)
    memory = fp.bytes_accessed / target.hbm_bytes_per_s
    comm = sum(c["bytes"] for c in fp.collectives.values()) / max(target.link_bytes_per_s, 1.0)
    step = max(compute, memory) + comm
    out.update({
        "estimate": "roofline: max(compute, memory) + collectives, no overlap assumed",
        "compute_s": compute, "memory_s": memory, "collective_s": comm, "step_time_s": step,
        "bound": max((compute, "compute"), (memory, "memory"), (comm, "collectives"))[1],
        "tokens_per_s": tokens / step,
        "mfu": model_flops / n_devices / step / (peak_tflops * 1e12),
    })
    return out


# --- checkpoint cost -------------------------------------------------------------------------

MAX_CHECKPOINT_OVERHEAD = 0.02  # of the run's time: above it plan mode and the run warn


def checkpoint_interval_s(every_steps: int, every_minutes: float,
                          step_time_s: float | None) -> float | None:
    """Seconds between two saves: the step cadence at ``step_time_s`` or the wall-clock one,
    whichever comes first; None when neither is known (no cadence, or no step time)."""
    options = [60.0 * every_minutes] if every_minutes > 0 else []
    if every_steps > 0 and step_time_s:
        options.append(every_steps * step_time_s)
    return min(options) if options else None


def minutes_for_overhead(save_s: float, overhead: float = MAX_CHECKPOINT_OVERHEAD) -> int:
    """The shortest whole-minute wall-clock cadence at which a save of ``save_s`` seconds costs
    at most ``overhead`` of the run."""
    return max(1, math.ceil(save_s / overhead / 60))


CPU_EVERY_STEPS = 100  # checkpoint.every=null on CPU: a save every 100 steps
MIN_AUTO_MINUTES = 10  # the automatic wall-clock cadence is never shorter (work a crash loses)


def save_cadence(every: int | None, every_minutes: float, platform: str, state_bytes: float,
                 write_bytes_per_s: float) -> tuple[int, float]:
    """(steps, minutes) between saves, 0 = that cadence off. ``checkpoint.every`` as given,
    except null (the default): on CPU every 100 steps; on an accelerator no step cadence and a
    wall-clock one, ``checkpoint.every_minutes`` if set, else the shortest whole minute at which
    a save of the state (at ``plan.write_gb_per_s``) costs at most 2% of the run, and at least
    10 minutes. A step count cannot be right for every step time: 100 steps of ``model=large``
    at ~50 ms is a 9.3 GB save every 5 s, a write-bound loop."""
    if every is not None:
        return every, every_minutes
    if platform == "cpu":
        return CPU_EVERY_STEPS, every_minutes
    if every_minutes > 0:
        return 0, every_minutes
    save_s = state_bytes / write_bytes_per_s
    return 0, float(max(MIN_AUTO_MINUTES, minutes_for_overhead(save_s)))


def cadence_text(every_steps: int, every_minutes: float) -> str:
    """``every 100 steps``, ``every 10 min``, both with ``and``, or ``never``."""
    parts = [f"every {every_steps} steps" if every_steps else "",
             f"every {every_minutes:g} min" if every_minutes else ""]
    return " and ".join(filter(None, parts)) or "never"


def checkpoint_cost(state_bytes: float, write_bytes_per_s: float, every_steps: int,
                    every_minutes: float, step_time_s: float | None) -> dict[str, Any]:
    """What a save of the whole train state costs at the assumed write bandwidth, and its
    share of the run at the configured cadence. Counted as if the whole write blocked the loop:
    Orbax's copy to host does, and the background write does too whenever the next save comes
    before it finished, so this errs high, like the roofline."""
    save_s = state_bytes / write_bytes_per_s
    interval = checkpoint_interval_s(every_steps, every_minutes, step_time_s)
    overhead = save_s / interval if interval else None
    return {
        "every_steps": every_steps, "every_minutes": every_minutes,
        "state_bytes": state_bytes, "write_bytes_per_s": write_bytes_per_s, "save_s": save_s,
        "interval_s": interval, "overhead": overhead,
        "too_costly": overhead is not None and overhead > MAX_CHECKPOINT_OVERHEAD,
        "suggest_every_minutes": minutes_for_overhead(save_s),
    }


def checkpoint_line(c: dict[str, Any]) -> str:
    """The plan table's checkpoint row: the save's cost and, when too costly, the fix."""
    every_steps, every_minutes = c["every_steps"], c["every_minutes"]
    head = (f"{_gb(c['state_bytes'])} per save, ~{c['save_s']:.1f} s at "
            f"{c['write_bytes_per_s'] / GB:g} GB/s (plan.write_gb_per_s)")
    cadence = cadence_text(every_steps, every_minutes)
    if c["overhead"] is None:
        return f"{head}; {'no cadence (checkpoint.every=0)' if cadence == 'never' else cadence}"
    text = (f"{head}; {cadence} = a save every {c['interval_s']:.1f} s: "
            f"{100 * c['overhead']:.1f}% of the run")
    if c["too_costly"]:
        text += (f", above {100 * MAX_CHECKPOINT_OVERHEAD:.0f}%: set checkpoint.every=0 "
                 f"checkpoint.every_minutes={c['suggest_every_minutes']}")
    return text


def state_bytes(state: Any) -> float:
    """Bytes of the whole train state (every array once, as a checkpoint holds it)."""
    import jax

    return float(sum(x.dtype.itemsize * math.prod(x.shape) for x in jax.tree.leaves(state)))


def resolve_target(cfg: Any, n_devices: int) -> tuple[Target, float | None]:
    """The target's numbers and its peak TFLOP/s for the run's precision."""
    import jax

    from dxrun.capacity import flops

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
    return target, flops.peak_tflops(target.device_kind, cfg.train.precision)


# --- suggestions: the nearest setting that fits ---------------------------------------------

def candidates(cfg: Any) -> list[list[str]]:
    """Overrides to try, nearest first: recompute activations (same mesh, same batch), shard
    the weights and optimizer state over the data replicas (FSDP), accumulate gradients over
    micro-batches, then a smaller batch."""
    par = cfg.parallelism
    out: list[list[str]] = []
    remat = [] if cfg.model.remat == "full" else ["model.remat=full"]
    if remat:
        out.append(remat)
    if par.fsdp == 1 and par.dp != 1:
        fsdp = ["parallelism.dp=1", "parallelism.fsdp=-1", f"parallelism.tp={par.tp}"]
        out += [fsdp, fsdp + remat] if remat else [fsdp]
    # The same update in micro-batches (train.grad_accum), then a smaller update.
    a, per = cfg.train.grad_accum, cfg.data.per_device_batch_size
    if per is None:
        out += [[f"train.grad_accum={a * k}", *remat] for k in (2, 4, 8)]
        b = cfg.data.batch_size
        out += [[f"data.batch_size={b // k}", *remat] for k in (2, 4)]
        return out
    # The user gave the per-device batch (the global batch is refused beside it): the same
    # update is k times the micro-batches at 1/k of the per-device batch.
    out += [[f"train.grad_accum={a * k}", f"data.per_device_batch_size={per // k}", *remat]
            for k in (2, 4, 8) if per % k == 0]
    out += [[f"data.per_device_batch_size={per // k}", *remat] for k in (2, 4) if per // k]
    return out


def first_that_fits(cfg: Any, budget_bytes: float, plan: MeshPlan,
                    max_tries: int = 8, time_budget_s: float = 40.0,
                    need: Any = None) -> list[str] | None:
    """Compile the candidates in order (shapes only), each laid out over ``plan``'s devices,
    processes and hosts, and return the first whose per-device need is within
    ``budget_bytes``; None if none does within ``time_budget_s`` (a refused run must answer
    within a minute, whatever the model). ``need(exp)``: the per-device bytes of a candidate
    when not its compiled step's (an accelerator target's memory model: nothing compiled)."""
    deadline = time.perf_counter() + time_budget_s
    from omegaconf import OmegaConf

    from dxrun.experiment import Experiment
    from dxrun.plan import make_plan
    from dxrun.step import step_bytes

    for overrides in candidates(cfg)[:max_tries]:
        if time.perf_counter() > deadline:
            return None
        trial = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        try:
            # Over the run's processes too: a trial planned for one process would put this
            # process's devices at other rows of the batch than its plan reads (refused).
            exp = Experiment.build(trial, make_plan(
                trial, plan.n_visible, plan.platform, plan.processes,
                plan.process_hosts or None), data=_NoData())
        except ConfigError:
            continue
        needs = step_bytes(exp.analyse_step()) if need is None else need(exp)
        if needs is not None and needs <= budget_bytes:
            return overrides
    return None


class _NoData:
    """Plan mode and suggestions compile the step only; they never read data."""


# --- plan mode ----------------------------------------------------------------------------------

def target_key(target: Target) -> str | None:
    """The TARGETS name of ``target`` (None for a measured CPU target)."""
    return next((k for k, t in TARGETS.items() if t == target), None)


TYPICAL_STEP = ("a typical pretraining step uses the model's full context and 0.5M-4M tokens "
                "(GPT-3 125M: 0.5M, Llama 2: 4M)")
MIN_TOKENS_PER_STEP = 65_536


def shape_warning(platform: str, seq_len: int, max_seq_len: int, tokens: int) -> str | None:
    """One line when a plan for an accelerator is for a toy shape (shorter sequences than the
    model's context, or under 64k tokens per step): its memory and speed say little about a
    real run. None when the shape is a real one, or the target is this CPU."""
    if platform == "cpu" or (seq_len >= max_seq_len and tokens >= MIN_TOKENS_PER_STEP):
        return None
    return (f"planning {tokens:,} tokens per step (data.batch_size x data.seq_len={seq_len}, "
            f"model.max_seq_len={max_seq_len}): {TYPICAL_STEP}; set data.seq_len and "
            f"data.batch_size to the run's")


@dataclass
class StepEstimate:
    """Plan mode's figures for one compiled step: footprint, the accelerator memory model's
    need (None on a CPU target), the fit-and-speed estimate, FLOPs counted from the shapes."""

    fp: Footprint
    mem: Any
    est: dict[str, Any]
    parts: dict[str, float]
    model_flops: float
    n_params: int


def step_estimate(cfg: Any, exp: Any, compiled: Any, target: Target,
                  peak: float | None, xla_cost: bool = True) -> StepEstimate:
    """Fit and speed of ``exp``'s compiled step on ``target`` (plan mode, and the layout
    search's ranking): the accelerator time model on a GPU/TPU target, else the roofline of
    XLA's counts. ``xla_cost=False`` (the layout search: one compile per candidate, not three):
    on a CPU target the FLOPs are counted from the shapes and the bytes are the compile's own
    count (a scanned layer loop counted once)."""
    from dxrun.capacity import flops, gpu_cost

    key = target_key(target)
    accelerator = key in gpu_cost.COST
    fp = footprint(exp, compiled, xla_cost=xla_cost and not accelerator)
    state = exp.abstract_state()
    n_params = exp.count_params(state.params)  # the real vocabulary, without padding
    tokens = exp.plan.global_batch * cfg.data.seq_len
    model_flops = flops.flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens
    timing = None
    if accelerator and peak:
        from dxrun.capacity.hlo import collective_list

        w = gpu_cost.workload(cfg, exp.plan, n_params, fp.params_bytes / 4)
        t = TARGETS[key]
        timing = gpu_cost.step_time(w, gpu_cost.COST[key], peak, t.hbm_bytes_per_s,
                                    t.link_bytes_per_s,
                                    collective_list(compiled.as_text(), exp.plan.n_devices))
        parts = flops.step_flops(cfg.model, tokens, cfg.data.seq_len, w.vocab, cfg.model.remat,
                                 timing["fused_attention"])
    else:
        parts = flops.step_flops(cfg.model, tokens, cfg.data.seq_len, exp.plan.padded_vocab,
                                 cfg.model.remat)
        if not xla_cost:
            # The bytes: the compile's own count (free). A scanned model's layer loop is
            # counted once, on every candidate alike: a ranking of layouts more than a time
            # (on simulated devices the bytes decide it: model=small's step time follows them).
            fp = replace(fp, flops=parts["hardware"] / exp.plan.n_devices,
                         bytes_accessed=_cost(compiled)[1])
    # An accelerator's need comes from the memory model: XLA:CPU's temporaries describe a CPU
    # program (bf16 through fp32 temporaries); the compile's figure is kept beside it.
    mem = accelerator_memory(exp, target) if target.device_kind != "cpu" else None
    est = estimate(fp, target, peak, model_flops, tokens, exp.plan.n_devices,
                   cfg.train.precision, timing, None if mem is None else mem.total_bytes)
    return StepEstimate(fp, mem, est, parts, model_flops, n_params)


def plan_report(cfg: Any, exp: Any, suggest: bool = True) -> dict[str, Any]:
    """Everything plan mode prints and writes into plan.json (beside the mesh plan).
    ``suggest=False``: no search for a setting that fits (the published-runs benchmark)."""
    target, peak = resolve_target(cfg, exp.plan.n_devices)
    t0 = time.perf_counter()
    compiled = exp.compile_step()
    compile_s = time.perf_counter() - t0
    s = step_estimate(cfg, exp, compiled, target, peak)
    fp, mem, est, parts, model_flops = s.fp, s.mem, s.est, s.parts, s.model_flops
    state = exp.abstract_state()
    tokens = exp.plan.global_batch * cfg.data.seq_len
    warning = shape_warning(plan_platform(cfg.plan.target, exp.plan.platform), cfg.data.seq_len,
                            cfg.model.max_seq_len, tokens)
    from dxrun.chunked_loss import loss_chunk_for
    from dxrun.experiment import shard_optimizer
    from dxrun.sharding import replicated_bytes_over

    zero = shard_optimizer(cfg.parallelism, exp.plan)
    report: dict[str, Any] = {
        "n_params": s.n_params,
        "per_device": {k: v for k, v in asdict(fp).items() if k != "collectives"}
        | {"activations_bytes": fp.activations_bytes},
        "shard_optimizer": zero,
        # ZeRO-1 (parallelism.shard_optimizer): per device, the optimizer state no axis of
        # which the data replicas divide, held whole by every replica (counters at least)
        "opt_state_unsplit_bytes": replicated_bytes_over(state.opt_state) if zero else 0.0,
        "loss_chunk": loss_chunk_for(cfg.model, cfg.train.grad_accum, exp.plan),
        "model_flops_per_step": model_flops,
        # counted from the shapes (flops.step_flops): per step, all devices; MFU's numerator
        # is "model" (full attention square), "hardware" adds what the device really runs
        "flops": parts | {"per_device_hardware": parts["hardware"] / exp.plan.n_devices},
        "collectives": fp.collectives,
        "compile_s": compile_s,
        "target": est,
    }
    if mem is not None:
        from dxrun.capacity.memory_model import disagreement

        report["memory_model"] = mem.to_json() | {
            "xla_cpu_total_bytes": fp.total_bytes, "precision": cfg.train.precision,
            "disagreement": disagreement(mem.total_bytes, fp.total_bytes)}
    ck, nbytes, write = cfg.checkpoint, state_bytes(state), cfg.plan.write_gb_per_s * GB
    every, minutes = save_cadence(ck.every, ck.every_minutes,
                                  plan_platform(cfg.plan.target, exp.plan.platform), nbytes, write)
    report["checkpoint"] = checkpoint_cost(nbytes, write, every, minutes, est.get("step_time_s"))
    report["warnings"] = [warning] if warning else []
    if not est["fits"] and suggest:
        report["suggestion"] = first_that_fits(
            cfg, usable_bytes(target), exp.plan,
            need=None if mem is None else lambda e: accelerator_memory(e, target).total_bytes)
    return report


def plan_table(report: dict[str, Any]) -> str:
    t = report["target"]
    rows = [("params", f"{report['n_params']:,}"), *memory_rows(report)]
    rows += [
        ("model FLOPs", f"{report['model_flops_per_step']:.3e} per step" + _flops_parts(report)),
        ("collectives", ", ".join(f"{k} x{int(v['count'])} ({_gb(v['bytes'])}/step)"
                                  for k, v in sorted(report["collectives"].items())) or "none"),
        ("target", f"{t['target']}: {t['memory_per_device_gb']:.1f} GB per device, usable "
                   f"{100 * t['usable_fraction']:.0f}% = {t['usable_per_device_gb']:.1f} GB "
                   f"({t['usable_source']})"),
        ("fits", f"{'yes' if t['fits'] else 'NO'}: needs {t['needs_per_device_gb']:.2f} GB, "
                 f"headroom {t['headroom_gb']:.2f} GB"),
    ]
    if "timing" in t:
        g = t["timing"]
        rows.append(("estimate", t["estimate"]))
        rows.append(("step", f"{t['step_time_s'] * 1e3:.1f} ms ({t['bound']}-bound: matmuls "
                             f"{g['matmul_s'] * 1e3:.1f} ms, attention {g['attention_s'] * 1e3:.1f}"
                             f" ms ({'fused' if g['fused_attention'] else 'XLA'}), elementwise "
                             f"{g['elementwise_s'] * 1e3:.1f} ms, collectives "
                             f"{(g['tensor_collective_s'] + g['data_collective_s']) * 1e3:.1f} ms"
                             f" of which exposed {g['exposed_collective_s'] * 1e3:.1f} ms), "
                             f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.0f}%"
                             f" ({t['precision']}, peak {t['peak_tflops']:g} TFLOP/s)"))
    elif "step_time_s" in t:
        rows.append(("estimate", f"step {t['step_time_s'] * 1e3:.1f} ms ({t['bound']}-bound: "
                                 f"compute {t['compute_s'] * 1e3:.1f} ms, memory "
                                 f"{t['memory_s'] * 1e3:.1f} ms, collectives "
                                 f"{t['collective_s'] * 1e3:.1f} ms), "
                                 f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.0f}%"
                                 f" ({t['precision']}, peak {t['peak_tflops']:g} TFLOP/s)"))
    if "checkpoint" in report:
        rows.append(("checkpoint", checkpoint_line(report["checkpoint"])))
    if not t["fits"]:
        s = report.get("suggestion")
        rows.append(("suggestion", " ".join(s) if s else "no candidate fits; a larger mesh"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _flops_parts(report: dict[str, Any]) -> str:
    f = report.get("flops")
    if not f:
        return ""
    return (f" (matmuls {f['block_matmuls']:.2e}, attention {f['attention_full']:.2e} full / "
            f"{f['attention_causal']:.2e} causal, output layer {f['output_layer']:.2e}); "
            f"hardware {f['per_device_hardware']:.3e} per device with recomputation")


MEMORY_AGREEMENT = 0.10  # beyond it (fp32) the table shows the CPU compile's figure as well


def memory_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's per-device memory: XLA's compile on a CPU target; on an accelerator the
    memory model's breakdown, and the CPU compile's figure beside it when the two disagree by
    more than 10% in fp32 (in bf16 the CPU program is not the accelerator's, so never)."""
    pd, mm = report["per_device"], report.get("memory_model")
    opt = _gb(pd["opt_state_bytes"] if mm is None else mm["opt_state_bytes"])
    if report.get("shard_optimizer"):
        opt += f" (split over data; {_gb(report.get('opt_state_unsplit_bytes', 0.0))} not)"
    xla = (f"params {_gb(pd['params_bytes'])}, optimizer {opt}, "
           f"gradients {_gb(pd['grads_bytes'])}, activations+temps "
           f"{_gb(pd['activations_bytes'])}; total {_gb(pd['total_bytes'])}")
    if mm is None:
        return [("per device", xla)]
    gathers = f", FSDP gathers {_gb(mm['gathers_bytes'])}" if mm["gathers_bytes"] else ""
    chunk = (f" (in chunks of {report['loss_chunk']} positions)" if report.get("loss_chunk")
             else "")
    rows = [("per device",
             f"params {_gb(mm['params_bytes'])}, optimizer {opt}, "
             f"gradients {_gb(mm['grads_bytes'])}, activations {_gb(mm['activations_bytes'])} "
             f"+ one layer's backward {_gb(mm['working_bytes'])} + logits "
             f"{_gb(mm['head_bytes'])}{chunk}{gathers}; total {_gb(mm['total_bytes'])} "
             f"({mm['basis']})")]
    if mm["precision"] == "fp32" and mm["disagreement"] > MEMORY_AGREEMENT:
        rows.append(("XLA:CPU", f"{xla} ({100 * mm['disagreement']:.0f}% from the model)"))
    return rows


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.01 * GB else f"{nbytes / 2**20:.1f} MiB"


def run_plan(cfg: Any, run_dir: Any, plan: Any) -> dict[str, Any]:
    """``run.mode=plan``: compile for the mesh, print the table, write plan.json; train nothing."""
    from dxrun.experiment import Experiment
    from dxrun.runtime import write_json

    exp = Experiment.build(cfg, plan, data=_NoData())
    report = plan_report(cfg, exp)
    write_json(run_dir / "plan.json", {**plan.to_json(), "plan_mode": report})
    log.info("mesh plan\n%s\n%s", plan.table(), plan_table(report))
    if plan.layout_search:
        from dxrun.capacity.layout_search import table

        log.info("parallelism=auto\n%s", table(plan.layout_search, run=False))
    for warning in report.get("warnings", []):
        log.warning("%s", warning)
    if report["checkpoint"]["too_costly"]:
        log.warning("checkpoints: %s", checkpoint_line(report["checkpoint"]))
    return report


def plan_platform(target: str | None, backend: str) -> str:
    """The platform a plan is for: ``plan.target``'s (a named GPU or TPU, or cpu), else the
    backend this process runs on. What ``data.seq_len=null`` resolves by."""
    if target is None:
        return backend
    kind = TARGETS[target].device_kind
    return "cpu" if kind == "cpu" else "gpu" if kind.startswith("NVIDIA") else "tpu"


def planned(cfg: Any, backend: str) -> tuple[Any, Any]:
    """(the config plan mode follows, its mesh plan). The config is a copy, ``cfg`` is read,
    never rewritten: ``data.seq_len=null`` resolved for the target (``with_plan_seq_len``); for
    ``parallelism=auto`` the batch held fixed and the layout ranked first by the estimate alone
    for ``plan.target`` (the plan carries the ranking)."""
    from dataclasses import replace

    from dxrun.capacity import layout_search
    from dxrun.experiment import visible_devices
    from dxrun.plan import make_plan

    plan_cfg, searched = with_plan_seq_len(cfg, backend), None
    if layout_search.searches(plan_cfg):
        plan_cfg = layout_search.fixed_batch(plan_cfg, visible_devices())
        searched = layout_search.search(plan_cfg, plan_mode=True)
        plan_cfg = layout_search.with_layout(plan_cfg, layout_search.chosen_layout(searched))
    return plan_cfg, replace(make_plan(plan_cfg, *visible_devices()), layout_search=searched)


def with_plan_seq_len(cfg: Any, backend: str) -> Any:
    """A copy of ``cfg`` whose ``data.seq_len=null`` is resolved as a run on plan mode's target
    would (the model's context on an accelerator), not as this host would; ``cfg`` itself is
    read, never rewritten."""
    import copy

    from dxrun.batch import default_seq_len

    out = copy.deepcopy(cfg)
    out.data.seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len,
                                       plan_platform(cfg.plan.target, backend))
    return out
