"""A run fitted to its devices. The run's decision (``decide``), taken once for a run and for plan
mode alike, and the layout search it makes for ``parallelism=auto``: the fastest layout (mesh,
remat, gradient accumulation) that fits, ranked by the estimate and timed for real on the run's
own data, with its budget rule and the decision's cache. Under it, what a compiled step needs
and how fast it goes: its footprint and estimate (XLA's memory and cost analyses, the memory and
time models for an accelerator target), the nearest setting that fits a memory budget, and the
memory preflight of every real run, which refuses a step that will not fit and writes where its
memory goes; with them, this host's own measured figures (memory, matmul peak, bandwidth: a CPU
target's numbers) and the collectives read from the compiled HLO. Over it, plan mode
(``run.mode=plan``): the decision reported for a target, training nothing, with its advice for a
plan that does not fit. Each section's own account follows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import OmegaConf

from dxrun.config import AXES, ConfigError, disk_error
from dxrun.experiment import (
    Experiment,
    adopt,
    analysis_is_full,
    process_data,
    step_bytes,
    visible_devices,
)
from dxrun.model.sharding import replicated_bytes_over
from dxrun.model.user_model import plan_line
from dxrun.plan import cost
from dxrun.plan.cost import (
    GB,
    TARGETS,
    USABLE_CPU,
    Footprint,
    GiB,
    StepEstimate,
    Target,
    checkpoint_cost,
    checkpoint_line,
    disagreement,
    estimate,
    gb_text,
    plan_platform,
    save_cadence,
    shape_warning,
    target_key,
    usable_bytes,
)
from dxrun.plan.run_plan import (
    LOGICAL_RULES,
    MEASURE_ROUNDS,
    MEASURE_STEPS,
    PRUNE,
    REMATS,
    SEARCHES,
    AttentionTarget,
    Layout,
    MeshPlan,
    Row,
    RunPlan,
    TooLarge,
    _gib,
    _ms,
    _s,
    candidates,
    chosen_layout,
    default_seq_len,
    held_batch,
    kind_target,
    layout_of,
    make_plan,
    measure_rule,
    measure_stage,
    meshes,
    model_choice,
    model_stage,
    named,
    padded_vocab,
    precision_of,
    recorded,
    resolved_config,
    resumed_layout,
    rows_of,
    saved_config,
    search_cost,
    searches,
    survivors,
    table,
    table_rows,
    to_measure,
    train_through,
    unused_axes,
)
from dxrun.run.runtime import (
    agree,
    faults_from_env,
    gather,
    is_main,
    local_processes,
    release_freed_memory,
    user_cache_dir,
    write_json,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig, RuntimeConfig, TrainConfig
    from dxrun.plan.run_plan import Resume


# ------------------------------------------------------------------------------------------------
# What a compiled step needs and how fast it goes: its footprint and estimate (XLA's memory and
# cost analyses, the memory and time models for an accelerator target), the nearest setting that
# fits a memory budget, and the memory preflight of every real run, which refuses a step that will
# not fit and writes where its memory goes. With them, this host's own measured figures (memory,
# matmul peak, bandwidth: a CPU target's numbers) and the collectives read from the compiled HLO.
# Each section's own account follows.

# ------------------------------------------------------------------------------------------------
# Read what XLA made of a jitted function: which collectives the compiled HLO contains.

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction line: `%name = f32[...]{...} all-reduce(...)` (or the -start async form).
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> Counter:
    """Count collective ops by kind in compiled HLO text (async start/done pairs count once)."""
    return Counter(m.group(1) for line in hlo_text.splitlines() if (m := _OP.search(line)))


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _OP.search(line)) and m.group(1) == kind]


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
                "c64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*body=%([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")


# XLA's named-axes spelling, e.g. mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, optionally with the
# mesh's device order as an iota tile between them: device_ids=([4,2]T(1,0))
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))?\s*\{([^}]*)\}")


def _group_size(line: str, n_devices: int) -> int:
    """Devices in one replica group, from any of XLA's three spellings."""
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", line):  # iota: [groups, size]
        return int(m.group(1).split(",")[-1])
    if m := _MESH_GROUPS.search(line):  # named axes
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(3)))
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):  # explicit lists
        return len(m.group(1).split(","))
    return n_devices  # no groups: all devices


def _result_bytes(line: str, kind: str) -> int:
    head = line.split("=", 1)[1].split(f" {kind}", 1)[0]  # the result shape(s), tuple or not
    return sum(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in _SHAPE.findall(head))


def _loops(hlo_text: str) -> tuple[dict[str, list[str]], dict[str, int]]:
    """Each computation's lines, and how many times per step each one runs: a while body
    ``known_trip_count`` times its parent's count (nested loops multiply), the rest once."""
    trips: dict[str, tuple[str, int]] = {}
    current = ""
    lines_of: dict[str, list[str]] = defaultdict(list)
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            continue
        lines_of[current].append(line)
        if m := _WHILE.search(line):
            trips[m.group(1)] = (current, int(m.group(2)))

    def repeats(comp: str, depth: int = 0) -> int:
        if comp not in trips or depth > 16:
            return 1
        parent, n = trips[comp]
        return n * repeats(parent, depth + 1)

    return lines_of, {comp: repeats(comp) for comp in lines_of}


def _sent(line: str, kind: str, n_devices: int) -> tuple[int, float]:
    """(devices in the group, bytes each device sends) of one collective. Ring algorithms over
    a group of n: all-reduce sends 2(n-1)/n of the buffer, all-gather and all-to-all (n-1)/n of
    the result, reduce-scatter (n-1) x the result, a permute the buffer."""
    size, n = _result_bytes(line, kind), _group_size(line, n_devices)
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
              "all-to-all": (n - 1) / n, "reduce-scatter": n - 1,
              "collective-permute": 1.0}[kind]
    return n, factor * size


def collective_traffic(hlo_text: str, n_devices: int) -> dict[str, dict[str, float]]:
    """Per collective kind: executions per step and bytes each device sends per step (see
    ``_sent``). Collectives inside a loop body (the layer scan, accumulation) count once per
    iteration (XLA's known_trip_count)."""
    lines_of, runs = _loops(hlo_text)
    out: dict[str, dict[str, float]] = {}
    for comp, lines in lines_of.items():
        for line in lines:
            if not (m := _OP.search(line)):
                continue
            kind, k = m.group(1), runs[comp]
            entry = out.setdefault(kind, {"count": 0, "bytes": 0.0})
            entry["count"] += k
            entry["bytes"] += k * _sent(line, kind, n_devices)[1]
    return out


def per_iteration(hlo_text: str, trips: int, n_devices: int) -> dict[tuple[str, int], dict]:
    """The collectives of one iteration of the loops that run ``trips`` times per step (the
    layer scan's forward and backward bodies: per layer), by (kind, devices in a group): their
    count and the bytes each device sends."""
    lines_of, runs = _loops(hlo_text)
    out: dict[tuple[str, int], dict] = {}
    for comp, lines in lines_of.items():
        for line in lines:
            if runs[comp] == trips and (m := _OP.search(line)):
                n, sent = _sent(line, m.group(1), n_devices)
                entry = out.setdefault((m.group(1), n), {"count": 0, "bytes": 0.0})
                entry["count"] += 1
                entry["bytes"] += sent
    return out


def instances(hlo_text: str, kind: str, n_devices: int) -> list[tuple[int, int, int]]:
    """Each ``kind`` collective as (times it runs per step: more than 1 inside a loop body,
    devices in its group, bytes of its result)."""
    lines_of, runs = _loops(hlo_text)
    return [(runs[comp], _group_size(line, n_devices), _result_bytes(line, kind))
            for comp, lines in lines_of.items() for line in lines
            if (m := _OP.search(line)) and m.group(1) == kind]


def partitioned(lowered: Any) -> str:
    """The HLO of ``lowered`` (a ``jax.jit(...).lower(...)``) right after XLA's SPMD
    partitioner: where the collectives are inserted, in the dtypes the program computes them
    in. XLA:CPU later widens bf16 arithmetic (all-reduces included) to f32, so only this dump,
    the same pass on every platform, shows what a GPU will communicate."""
    with tempfile.TemporaryDirectory() as tmp:
        # The executable is never run: LLVM's optimisations (most of a CPU compile) are off.
        lowered.compile(compiler_options={"xla_dump_to": tmp,
                                          "xla_dump_hlo_pass_re": "spmd-partitioning",
                                          "xla_backend_optimization_level": 0,
                                          "xla_llvm_disable_expensive_passes": True})
        dumps = sorted(Path(tmp).glob("*.after_spmd-partitioning.*.txt"))
        if not dumps:
            raise RuntimeError(f"XLA wrote no post-partitioner dump to {tmp}")
        return dumps[-1].read_text()


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[")


def dots(hlo_text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """Each ``dot`` as (the op_name JAX gave it, its result dtype, its operands' dtypes)."""
    dtype_of = {m.group(1): m.group(2) for line in hlo_text.splitlines()
                if (m := _DEF.match(line))}
    out = []
    for line in hlo_text.splitlines():
        if (m := _DEF.match(line)) and (d := re.search(r"\sdot\(([^)]*)\)", line)):
            operands = tuple(dtype_of[o] for o in re.findall(r"%([\w.\-]+)", d.group(1)))
            name = re.search(r'op_name="([^"]*)"', line)
            out.append((name.group(1) if name else "", m.group(2), operands))
    return out


def replica_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of one collective (partition ids, which plan mode's meshes number as
    the devices, row-major over data, fsdp, tensor), from any of XLA's three spellings."""
    import numpy as np

    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(-1, shape[-1]).tolist()
    if m := _MESH_GROUPS.search(line):
        named = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in named], [int(s) for _, s in named]
        inner = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
        outer = [i for i in range(len(names)) if i not in inner]
        ids = np.arange(math.prod(sizes))
        if m.group(2):  # the mesh's devices in the order of an iota tile: [dims]T(perm)
            tile = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2))
            ids = ids.reshape([int(x) for x in tile.group(1).split(",")])
            if tile.group(2):
                ids = ids.transpose([int(x) for x in tile.group(2).split(",")])
        ids = ids.reshape(sizes).transpose(outer + inner)
        return ids.reshape(-1, math.prod(sizes[i] for i in inner) if inner else 1).tolist()
    if m := re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                         m.group(1))]
    return [list(range(n_devices))]


def collective_list(hlo_text: str, n_devices: int) -> list[dict[str, Any]]:
    """Every collective of the compiled step: its kind, executions per step (loop trip counts
    multiplied in), device groups, result dtypes and the bytes each device sends per execution
    (ring algorithms, see ``_sent``). What the accelerator time model prices link by link."""
    lines_of, runs = _loops(hlo_text)
    out = []
    for comp, lines in lines_of.items():
        for line in lines:
            if m := _OP.search(line):
                kind = m.group(1)
                head = line.split("=", 1)[1].split(f" {kind}", 1)[0]
                out.append({"kind": kind, "runs": runs[comp],
                            "groups": replica_groups(line, n_devices),
                            "dtypes": sorted({t for t, _ in _SHAPE.findall(head)}),
                            "bytes": _sent(line, kind, n_devices)[1]})
    return out


# ------------------------------------------------------------------------------------------------
# Where a compiled step's memory goes: written beside a memory refusal or an out-of-memory crash.
#
# The parts are XLA's memory analysis of the compiled step split by what the arguments are:
# parameters, optimizer state, the rest of the train state, the batch (the arguments), outputs not
# aliased to a donated input, and temporaries (gradients and activations live there). They add up
# to the step's total (``experiment.step_bytes``) exactly. Beside them: the largest arguments by tree
# path, and the largest temporaries of the optimized HLO with the JAX op that made them (layer
# names where the model's scopes give them); XLA reuses temporary buffers, so those do not add up
# to the temporaries' total. On an accelerator a device memory profile (pprof) is saved too.

FILE = "memory_breakdown.txt"
PPROF = "memory.prof"
_ANY_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape (a tuple: its elements summed)."""
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _ANY_SHAPE.findall(shape_text))


def leaf_bytes(x: Any) -> int:
    """Per-device bytes of an abstract array: its shard's shape where it has a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    return math.prod(shape) * x.dtype.itemsize


def _path(p: tuple) -> str:
    import jax

    return jax.tree_util.keystr(p, simple=True, separator=".")


def breakdown(compiled: Any, state: Any) -> dict[str, Any]:
    """``parts`` (name -> bytes per device, adding up to ``total``), ``largest_args`` and
    ``largest_temps`` ((name, bytes, what) each), for the step compiled for ``state``."""
    import jax

    m = compiled.memory_analysis()
    by_field = {name: sum(leaf_bytes(x) for x in jax.tree.leaves(getattr(state, name)))
                for name in state._fields}
    other_state = sum(v for k, v in by_field.items() if k not in ("params", "opt_state"))
    parts = {
        "parameters": by_field["params"],
        "optimizer state": by_field["opt_state"],
        "other train state": other_state,
        "batch and other arguments": m.argument_size_in_bytes - sum(by_field.values()),
        "outputs not aliased to inputs": m.output_size_in_bytes - m.alias_size_in_bytes,
        "temporaries (gradients, activations)": m.temp_size_in_bytes,
    }
    args = [(_path(p), leaf_bytes(x), f"{x.dtype}{list(x.shape)}")
            for p, x in jax.tree_util.tree_leaves_with_path(state)]
    return {"total": float(sum(parts.values())), "parts": parts,
            "largest_args": sorted(args, key=lambda a: -a[1])[:10],
            "largest_temps": largest_temps(compiled.as_text())}


def largest_temps(hlo_text: str, n: int = 10) -> list[tuple[str, int, str]]:
    """The largest values the entry computation makes (not its parameters), with their JAX op."""
    entry = hlo_text[hlo_text.find("\nENTRY "):] if "\nENTRY " in hlo_text else ""
    out = []
    for line in entry.splitlines()[1:]:
        m = _LINE.match(line)
        if not m or m.group(3) in ("parameter", "constant", "get-tuple-element", "tuple",
                                   "bitcast"):
            continue
        op = re.search(r'op_name="([^"]+)"', line)
        out.append((m.group(1), shape_bytes(m.group(2)), op.group(1) if op else m.group(3)))
    return sorted(out, key=lambda t: -t[1])[:n]


def render(b: dict[str, Any]) -> str:
    def gib(x: float) -> str:
        return f"{x / GiB:.3f} GiB" if x >= GiB / 100 else f"{x / 2**20:.3f} MiB"

    total = b["total"]
    out = [f"train step: {int(total)} bytes = {gib(total)} per device (XLA's memory analysis of "
           "the compiled step)", "", "| part | bytes per device | | share |", "|---|---:|---:|---:|"]
    out += [f"| {k} | {int(v)} | {gib(v)} | {v / total:.1%} |" if total else f"| {k} | 0 | | |"
            for k, v in b["parts"].items()]
    out += ["", "largest arguments (bytes per device; the global shape):"]
    out += [f"  {gib(size)}  {name}  {what}" for name, size, what in b["largest_args"]]
    out += ["", "largest temporaries (XLA reuses their buffers: these overlap in time):"]
    out += [f"  {gib(size)}  {name}  {what}" for name, size, what in b["largest_temps"]]
    return "\n".join(out) + "\n"


def refusal_dir() -> Path:
    """A new dir for a refused run's breakdown (a refusal writes nothing into outputs/)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="dxrun-memory-"))


def accelerator_profile(platform: str) -> bool:
    """A device memory profile exists only on accelerators (CPU keeps no allocator stats)."""
    return platform in ("gpu", "tpu", "cuda", "rocm")


def write(run_dir: Path, compiled: Any, state: Any, platform: str) -> Path:
    """The breakdown as ``<run dir>/memory_breakdown.txt`` (and ``memory.prof`` on an
    accelerator); returns the text file's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / FILE
    path.write_text(render(breakdown(compiled, state)))
    if accelerator_profile(platform):
        import jax

        try:
            jax.profiler.save_device_memory_profile(str(run_dir / PPROF))
        except Exception:  # noqa: BLE001, S110 - the text breakdown is what matters
            pass
    return path


def is_out_of_memory(e: BaseException) -> bool:
    """XLA's out-of-memory errors (RESOURCE_EXHAUSTED on every backend); not a full disk,
    which tensorstore (Orbax's writer) reports as RESOURCE_EXHAUSTED too."""
    text = str(e)
    return disk_error(e) is None and (
        "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text)


def xla_need(e: BaseException) -> float | None:
    """GiB per device that XLA's out-of-memory refusal says the program needs ("HLO temporaries
    (23.62G) exceeds available HBM (15.75G)": binary units), or None where it names none."""
    m = re.search(r"\(([\d.]+)([KMG])\) exceeds", str(e)) or re.search(
        r"[Uu]sed ([\d.]+)([KMG]) of", str(e))
    if m is None:
        return None
    return float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)] / GiB


class OutOfMemory(RuntimeError):
    """A step ran out of device memory; the message names the breakdown's file."""


# ------------------------------------------------------------------------------------------------
# This host's own figures, measured once per machine and kept in dxrun's cache dir: its
# memory, its matmul peak and its memory bandwidth (a CPU target's numbers).

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
    return target, cost.peak_tflops(target.device_kind, precision_of(
        cfg.train.precision, cost.normalize_kind(target.device_kind)))


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
    kind = cost.normalize_kind(device_kind)
    peak = cost.peak_tflops(device_kind, precision_of(train.precision, kind))
    if peak is None and kind != "cpu":
        log.warning("no peak TFLOP/s known for device kind %r: perf/mfu is not logged; set "
                    "runtime.peak_tflops=<TFLOP/s> or runtime.peak_tflops=measure", device_kind)
    return peak


# ------------------------------------------------------------------------------------------------
# A compiled step's footprint and estimate (XLA's memory and cost analyses, the memory and
# time models for an accelerator target), and the nearest setting that fits a memory budget.

def _shard_bytes(tree: Any) -> float:
    total = 0.0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += x.dtype.itemsize * float(math.prod(shape))
    return total


def footprint(exp: Any, compiled: Any, xla_cost: bool = True) -> Footprint:
    """``xla_cost=False``: skip XLA's FLOPs and bytes (two more compiles of a scanned model;
    an accelerator target's time model counts its own from the shapes): reported as 0."""
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


def target_vocab(cfg: RunConfig, plan: MeshPlan, target: Target) -> int:
    """The rows the vocabulary tables of ``cfg``'s model have in a run on ``target``
    (128-aligned on a GPU or TPU; the plan's own padding is for the devices it was made on:
    this CPU in plan mode), unless ``parallelism.vocab_align`` names another alignment."""
    platform = plan_platform(target_key(target), plan.platform)
    return padded_vocab(table_rows(cfg.model), plan.tp, platform, cfg.parallelism.vocab_align)


def target_plan(cfg: RunConfig, plan: MeshPlan, *, device: AttentionTarget | None = None,
                vocab: int | None = None) -> MeshPlan:
    """``plan`` made again by ``make_plan`` (every decision taken from the final inputs), its
    layout, batch, sequence length and ZeRO-1 kept, for ``device``'s attention facts or with
    ``vocab`` rows (a target's, ``target_vocab``)."""
    return make_plan(cfg, plan.n_visible, plan.platform, plan.processes,
                     plan.process_hosts or None, device or plan.attention_device,
                     layout=plan.layout, batch=plan.global_batch, seq_len=plan.seq_len,
                     vocab=vocab, zero=plan.shard_optimizer)


def kernel_on(cfg: RunConfig, plan: MeshPlan, device_kind: str) -> str:
    """The kernel a run of ``cfg`` laid out as ``plan`` runs on ``device_kind``: the plan's own
    choice where the plan was made for that device's platform, else that of the plan made for
    it (plan mode's and the layout search's estimates of another target)."""
    device = kind_target(device_kind)
    if device.platform == plan.attention_device.platform:
        return plan.attention
    return target_plan(cfg, plan, device=device).attention


def accelerator_memory(exp: Any, target: Target) -> Any:
    """The memory model's per-device estimate (``plan.cost``) of ``exp``'s step on
    ``target``: the state's shards read from the abstract state's shardings (of the model
    with the target's vocabulary padding), activations from the shapes, with the attention
    kernel a run on that target would use."""
    cfg, plan = exp.cfg, exp.plan
    vocab = target_vocab(cfg, plan, target)
    if vocab != exp.padded_vocab:  # shapes only: the same model with the target's rows
        exp = Experiment.build(cfg, target_plan(cfg, plan, vocab=vocab), data=NoData())
    state = exp.abstract_state()
    kernel = kernel_on(cfg, plan, target.device_kind)
    zero_dp = plan.dp if plan.shard_optimizer else 1
    mem = cost.estimate_memory(
        cost.shapes(cfg.model, plan, kernel, vocab),
        _shard_bytes(state.params), _shard_bytes(state.opt_state),
        _shard_bytes(exp.abstract_batch()), plan.fsdp, zero_dp)
    return replace(mem, padded_vocab=vocab)


def _cost(compiled: Any) -> tuple[float, float]:
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def cost_per_device(exp: Any) -> tuple[float, float]:
    """FLOPs and bytes accessed per device for one step. XLA's cost analysis counts a loop body
    once, so a scanned model is measured as the unrolled 1- and 2-layer steps of the same
    config and extrapolated in depth (every layer is the same): cost(n) = c1 + (n-1)(c2 - c1)."""
    cfg = exp.cfg
    if not cfg.model.scan_layers or cfg.model._target_:  # a user model: its own layers
        return _cost(exp.compile_step())
    costs = []
    for n in (1, 2):
        small = OmegaConf.merge(cfg, {"model": {"n_layers": n, "scan_layers": False}})
        costs.append(_cost(Experiment.build(small, exp.plan, data=NoData()).analyse_step()))
    (f1, b1), (f2, b2) = costs
    n = cfg.model.n_layers
    return f1 + (n - 1) * (f2 - f1), b1 + (n - 1) * (b2 - b1)


def first_that_fits(base: Any, budget_bytes: float, plan: MeshPlan,
                    max_tries: int = 8, time_budget_s: float = 40.0,
                    need: Any = None) -> list[str] | None:
    """Compile the candidates (``plan.cost.candidates``) in order (shapes only), each
    merged into ``base`` (the run's config as its files record it, ``resolved_config``: its
    layout, batch and sequence length as keys) and laid out over ``plan``'s devices,
    processes and hosts, and return the first whose per-device need is within
    ``budget_bytes``; None if none does within ``time_budget_s`` (a refused run must answer
    within a minute, whatever the model). ``need(exp)``: the per-device bytes of a candidate
    when not its compiled step's (an accelerator target's memory model: nothing compiled)."""
    deadline = time.perf_counter() + time_budget_s
    cfg = base
    for overrides in cost.candidates(cfg)[:max_tries]:
        if time.perf_counter() > deadline:
            return None
        trial = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        try:
            # Over the run's processes too: a trial planned for one process would put this
            # process's devices at other rows of the batch than its plan reads (refused).
            exp = Experiment.build(trial, make_plan(
                trial, plan.n_visible, plan.platform, plan.processes,
                plan.process_hosts or None, plan.attention_device), data=NoData())
        except ConfigError:
            continue
        try:
            needs = step_bytes(exp.analyse_step()) if need is None else need(exp)
        except Exception as e:  # a TPU's compile refuses what does not fit its chip
            if not is_out_of_memory(e):
                raise
            continue
        if needs is not None and needs <= budget_bytes:
            return overrides
    return None


class NoData:
    """Plan mode and suggestions compile the step only; they never read data."""


def step_estimate(cfg: RunConfig, exp: Any, compiled: Any, target: Target,
                  peak: float | None, xla_cost: bool = True) -> StepEstimate:
    """Fit and speed of ``exp``'s compiled step on ``target`` (plan mode, and the layout
    search's ranking): the accelerator time model on a GPU/TPU target, else the roofline of
    XLA's counts. ``xla_cost=False`` (the layout search: one compile per candidate, not three):
    on a CPU target the FLOPs are counted from the shapes and the bytes are the compile's own
    count (a scanned layer loop counted once)."""
    key = target_key(target)
    # A user model (model._target_): XLA's counts of its compile; the memory and time models
    # know dxrun's own block only.
    own = not cfg.model._target_
    accelerator = key in cost.COST and own
    fp = footprint(exp, compiled, xla_cost=xla_cost and not accelerator)
    state = exp.abstract_state()
    n_params = exp.count_params(state.params)  # the real vocabulary, without padding
    plan = exp.plan  # the layout, batch and sequence length: the run plan's, not the config's
    tokens = plan.global_batch * plan.seq_len
    model_flops = cost.flops_per_token(cfg.model, n_params, plan.seq_len) * tokens
    timing = None
    if accelerator and peak:
        w = cost.workload(cfg, exp.plan, n_params, fp.params_bytes / 4,
                              target_vocab(cfg, plan, target),
                              kernel_on(cfg, plan, target.device_kind))
        t = TARGETS[key]
        timing = cost.step_time(w, cost.COST[key], peak, t.hbm_bytes_per_s,
                                    t.link_bytes_per_s,
                                    collective_list(compiled.as_text(), exp.plan.n_devices))
        parts = cost.step_flops(cfg.model, tokens, plan.seq_len, w.vocab, plan.remat,
                                 timing["fused_attention"])
    else:
        parts = cost.step_flops(cfg.model, tokens, plan.seq_len, plan.padded_vocab,
                                 plan.remat)
        if cfg.model._target_:  # a user model: no block of dxrun's to count by parts
            parts = {"model": model_flops, "hardware": model_flops}
        if not xla_cost:
            # The bytes: the compile's own count (free). A scanned model's layer loop is
            # counted once, on every candidate alike: a ranking of layouts more than a time
            # (on simulated devices the bytes decide it).
            fp = replace(fp, flops=parts["hardware"] / exp.plan.n_devices,
                         bytes_accessed=_cost(compiled)[1])
    # An accelerator's need comes from the memory model: XLA:CPU's temporaries describe a CPU
    # program (bf16 through fp32 temporaries); the compile's figure is kept beside it.
    mem = accelerator_memory(exp, target) if target.device_kind != "cpu" and own else None
    est = estimate(fp, target, peak, model_flops, tokens, exp.plan.n_devices,
                   plan.precision, timing, None if mem is None else mem.total_bytes)
    if mem is not None:  # plan.json: the rows a run there has, beside the plan's (this CPU's)
        est["padded_vocab"] = mem.padded_vocab
    return StepEstimate(fp, mem, est, parts, model_flops, n_params)


def state_bytes(state: Any) -> float:
    """Bytes of the whole train state (every array once, as a checkpoint holds it; its
    shapes alone do)."""
    return float(sum(x.dtype.itemsize * math.prod(x.shape) for x in jax.tree.leaves(state)))


# ------------------------------------------------------------------------------------------------
# The memory preflight of every real run: before any weight is allocated, the train step
# compiled from shapes alone must fit what this host or device gives one device; a refusal names
# the nearest setting that fits (plan mode's suggestion search) and writes where the memory goes.

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


def check_memory(cfg: RunConfig, exp: Any, compiled: Any, plan: RunPlan | None = None) -> str | None:
    """This process's refusal of a run whose compiled step will not fit what its host gives a
    device, in one line with the nearest setting that fits (tried from ``plan``'s layout,
    batch and sequence length; None: ``exp``'s config as it is); None when it fits."""
    if cfg.runtime.skip_memory_check or (exp.plan.platform == "tpu"
                                         and cfg.runtime.memory_gb is None):
        return None  # XLA's TPU compile is the check (``compile_checked``); it passed
    need = step_bytes(compiled)
    if need is None:
        return None
    budget, shared, source = device_budget(cfg.runtime)
    if need <= budget:
        return None
    # No suggestion changes the model: sharded over every visible device, its weights and
    # optimizer state alone are the least any of them needs. Below that, a search of compiles
    # would only make the refusal slow.
    floor = state_bytes(exp.abstract_state()) / exp.plan.n_visible
    if floor > budget:
        fix_text = (f"the weights and optimizer state alone need {floor / GiB:.4f} GiB per "
                    f"device on all {exp.plan.n_visible}: try a larger mesh or a smaller model")
    else:
        base = cfg if plan is None else resolved_config(cfg, plan)
        fix = first_that_fits(base, budget, exp.plan)
        fix_text = f"try {' '.join(fix)}" if fix else "try a larger mesh or a smaller model"
    # Three significant figures: a tiny budget reads "0.004 GiB", not "0.0 GiB".
    return (f"the train step needs {need / GiB:.3g} GiB per device x {shared} device(s) = "
            f"{need * shared / GiB:.3g} GiB, but {source} gives {budget * shared / GiB:.3g} GiB; "
            f"{fix_text} (or runtime.skip_memory_check=true to run anyway)")


def compile_checked(cfg: RunConfig, exp: Experiment, plan: RunPlan | None = None) -> Any:
    """The run's step compiled for the preflight (and the run). On a TPU, XLA's compile is the
    memory check: it assigns every buffer of the program, donated inputs reused, and refuses
    one that exceeds the chip (RESOURCE_EXHAUSTED) before anything runs, where arguments plus
    temporaries (``step_bytes``) count buffers that share memory. Its refusal becomes the
    preflight's one line, with the nearest setting that compiles."""
    try:
        return exp.compile_step()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        base = cfg if plan is None else resolved_config(cfg, plan)
        fix = first_that_fits(base, float("inf"), exp.plan)  # fits: its compile passes
        why = str(e).split(":", 1)[-1].strip().splitlines()[0]
        raise ConfigError(f"the train step does not fit one {jax.devices()[0].device_kind} "
                          f"chip: XLA says {why}; try "
                          f"{' '.join(fix) if fix else 'a larger mesh or a smaller model'}"
                          ) from None


def memory_preflight(cfg: RunConfig, exp: Experiment, compiled: Any, out: Path | None = None,
                     plan: RunPlan | None = None) -> None:
    """Raise ConfigError, before any weight is allocated, when the compiled step will not fit
    (``check_memory``); the refusal writes where the memory goes and its one line names the
    file. Bad input leaves no run dir behind, so the file goes to ``out``, by default a new dir
    under the system's temp dir (``refusal_dir``).

    The processes of a run decide together: each checks its own host, and one refusing alone
    would leave the others waiting for it in their first collective. The first process that
    refuses says why (its line, its file) and every process raises that one line. ``plan``:
    the run plan ``exp`` was built for (``check_memory``)."""
    lines = gather("memory_preflight", check_memory(cfg, exp, compiled, plan) or "")
    if not any(lines):
        return
    first = next(i for i, line in enumerate(lines) if line)
    path = ""
    if jax.process_index() == first:
        path = str(write(out or refusal_dir(), compiled,
                                       exp.abstract_state(), exp.plan.platform))
    path = gather("memory_preflight/report", path)[first]
    raise ConfigError(f"{lines[first]}; where the memory goes: {path}")


# ------------------------------------------------------------------------------------------------
# The run's decision (``decide``), taken once for a run and for plan mode alike, and the layout
# search it makes for ``parallelism=auto``: the fastest layout (mesh, remat, gradient
# accumulation) that fits, ranked by the estimate and timed for real on the run's own data, with
# its budget rule and the decision's cache. Each section's own account follows.

# ------------------------------------------------------------------------------------------------
# The decision cache: a layout search's record kept in the user's cache dir under what
# decides its answer, checked before it is taken.

def cache_key(cfg: RunConfig, held: tuple[int, int], n_devices: int, device_kind: str,
              jax_version: str, processes: int) -> str:
    """What decides the answer: the model's shape, the batch and sequence length held
    (``held``), precision, optimizer, devices and their kind, JAX's version, and whether it
    was measured."""
    key = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "batch": held[0], "seq_len": held[1],
           "precision": precision_of(cfg.train.precision, cost.normalize_kind(device_kind)),
           "optimizer": cfg.optimizer.name,
           "devices": n_devices, "processes": processes, "device_kind": device_kind,
           "jax": jax_version, "measured": cfg.parallelism.search != "model",
           "top": cfg.parallelism.search_top, "target": cfg.plan.target,
           "memory_gb": cfg.runtime.memory_gb}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return Path(user_cache_dir()) / "layouts"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


# The entries' layout: an entry written under another (by an older or newer dxrun) is decided
# again rather than read by guesswork. Raise it when a field's meaning changes.
CACHE_SCHEMA = 1


# Each axis's size: one that -1 could infer is in every row; one that cannot (context) came
# later and may be absent (1: ``layout_of``), and is checked where present.
_ROW_FIELDS = {**{a.key: int for a in AXES if a.inferable}, "remat": str, "grad_accum": int,
               "chosen": bool, "fits": bool, "why": str}


_ROW_NUMBERS = ("need_gb", "est_ms", "measured_ms")  # each a number or null


def read_cache(key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the decision cached under ``key``, None); (None, None) when there is none; (None, why)
    when the entry is in doubt (``entry_doubt``): the run decides again."""
    path = cache_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        record = json.loads(text)
    except ValueError:
        return None, "is not JSON"
    why = entry_doubt(record)
    return (None, why) if why else (record, None)


def entry_doubt(record: Any) -> str | None:
    """Why a cache entry cannot be taken as written (pure): another schema, a ranking row
    missing a field or holding the wrong type, a layout of no devices, or not exactly one
    chosen row that fits; None when every field the run and its ranking read is sound."""
    if not isinstance(record, dict):
        return "is not a decision"
    if record.get("schema") != CACHE_SCHEMA:
        return (f"was written under schema {record.get('schema')} (this dxrun reads "
                f"{CACHE_SCHEMA})")
    if record.get("search") not in SEARCHES or not isinstance(record.get("rows"), list):
        return "lacks its mode or its ranking"
    for r in record["rows"]:
        if not isinstance(r, dict):
            return "has a ranking row that is not one"
        for name, kind in {**{a.key: int for a in AXES if a.key in r}, **_ROW_FIELDS}.items():
            # bool is an int to isinstance: a size of true is as wrong as one of "2"
            if not isinstance(r.get(name), kind) or (kind is int and isinstance(r[name], bool)):
                return f"has a ranking row whose {name} is {r.get(name)!r}"
        sizes = layout_of(r).sizes
        if min(*sizes.values(), r["grad_accum"]) < 1 or r["remat"] not in REMATS:
            mesh = "x".join(str(v) for _, v in named(sizes))
            return (f"has a ranking row of no layout ({mesh}, "
                    f"remat={r['remat']}, grad_accum={r['grad_accum']})")
        for name in _ROW_NUMBERS:
            v = r.get(name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                return f"has a ranking row whose {name} is {v!r}"
        spread = r.get("spread_ms")
        if spread is not None and not (isinstance(spread, list) and len(spread) == 2 and all(
                isinstance(x, (int, float)) for x in spread)):
            return f"has a ranking row whose spread_ms is {spread!r}"
    chosen = [r for r in record["rows"] if r["chosen"]]
    if len(chosen) != 1 or not chosen[0]["fits"]:
        return f"has {len(chosen)} chosen layouts that fit, not one"
    return None


def write_cache(key: str, record: dict[str, Any]) -> None:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "schema": CACHE_SCHEMA}, indent=1))
    tmp.replace(path)  # concurrent sweep jobs: the last writer wins, never a torn file


# ------------------------------------------------------------------------------------------------
# Timing layouts for real: each takes turns of a few steps on the run's own data, in rounds
# whose order alternates; every decision read off a clock is process 0's. What the turns make
# that the run can take over (the seeded init, or the state after the steps they trained) is
# left in a ``Handover``.



@dataclass
class Handover:
    """What a run's layout search made that the run takes over instead of making it again;
    each part is taken (set back to None) once the run has it, so its copy is freed."""

    exp: Experiment | None = None  # the chosen layout's compile: the run's step
    params: Any = None  # the seeded init the timing drew (host arrays, the same on any layout)
    init_s: float | None = None  # its seconds
    state: Any = None  # the run's state after the first ``step`` steps the turns trained
    step: int = 0
    trained_s: float = 0.0  # those steps' seconds


def time_layouts(cfg: RunConfig, layouts: list[Layout], devices: tuple,
                 built: dict[Layout, Any] | None = None, rounds: int = MEASURE_ROUNDS,
                 prune: float | None = PRUNE, tag: str = "layout_search",
                 keep: Handover | None = None, with_turns: bool = False,
                 train_cap: int = 0, held: tuple[int, int] | None = None) -> dict[Layout, Any]:
    """Seconds per step of each layout (the median of its turns; ``with_turns``: the list of
    its turns' medians, for the ranking's spread): ``rounds`` rounds in which each layout takes
    a turn (``_turn``: up to ``MEASURE_STEPS`` timed steps) on the run's own data at the
    ``held`` batch and sequence length (None: ``held_batch``), the order reversed every other
    round so that drift on a shared host falls on all alike. With ``prune``, after each round
    only ``survivors`` go on. ``built``: Experiments already compiled (the model stage's).
    One seeded init is copied into each layout's shardings at its turn and freed after it (one
    layout's state alive at a time); ``keep.params`` gets it, for the run to start from.
    ``train_cap`` (``train_through``; needs ``keep``): the turns train the run's first steps
    instead, each at most ``train_cap`` timed steps: one state carried from layout to layout
    on the run's batches in order, left in ``keep.state`` after ``keep.step`` steps. Every
    decision read off a clock (when a turn stops, who survives a round) is process 0's, agreed
    under keys beginning ``tag``: each process's own clock would stop its turn at another step
    and leave the others waiting in a collective for ever."""
    held = held or held_batch(cfg, *devices)
    exps = {}
    for layout in layouts:
        exps[layout] = (built or {}).get(layout) or Experiment.build(cfg, make_plan(
            cfg, *devices, layout=layout, batch=held[0], seq_len=held[1]))
    # Drawn spread over every device, then copied whole to every process's host: each layout
    # re-shards it at its turn. One process reads its own shards (process_allgather would
    # first replicate them over every simulated device in host memory).
    t0 = time.perf_counter()
    init = exps[layouts[0]].seeded.spread_params()
    params = (jax.device_get(init) if jax.process_count() == 1
              else multihost_utils.process_allgather(init, tiled=True))
    del init
    if keep is not None:  # the run's own init, drawn here: its time is the run's startup
        keep.init_s = time.perf_counter() - t0
        if not train_cap:
            keep.params = params
    turns: dict[Layout, list[float]] = {layout: [] for layout in layouts}
    live = list(layouts)
    turn_s = float(cfg.parallelism.search_turn_s)
    for k in range(rounds):
        for layout in live if k % 2 == 0 else live[::-1]:
            at = f"{tag}/{k}/{layouts.index(layout)}"
            times = _turn(exps[layout], params,
                          lambda t, at=at: agreed(f"{at}/{len(t)}", sum(t) >= turn_s),
                          keep if train_cap else None, train_cap or MEASURE_STEPS)
            if train_cap:
                params = None  # in the run's state now
            turns[layout].append(statistics.median(times))
            release_freed_memory()  # the next layout's buffers have other shapes
            log.info("layout search: %s %s ms per step (%d timed, round %d of at most %d)",
                     layout.label, _ms(1e3 * turns[layout][-1]), len(times), k + 1, rounds)
        if prune:
            kept = survivors({x: statistics.median(turns[x]) for x in live}, prune)
            live = [layouts[i] for i in agreed(f"{tag}/{k}/live",
                                               [layouts.index(x) for x in kept])]
        if len(live) == 1:
            break
    if with_turns:
        return {layout: list(t) for layout, t in turns.items()}
    return {layout: statistics.median(t) for layout, t in turns.items()}


def agreed(key: str, value: Any) -> Any:
    """Process 0's ``value`` (JSON) on every process; one process: ``value``."""
    return json.loads(agree(key, json.dumps(value)))


def _turn(exp: Any, params: Any, done: Callable[[list[float]], bool],
          run: Handover | None = None, cap: int = MEASURE_STEPS) -> list[float]:
    """One layout's turn: one untimed step (the first after a switch pays for it: page faults,
    after ``release_freed_memory``; the first of all, one-off costs), then up to ``cap``
    timed steps (their seconds, returned), stopping once ``done(times)``. Its state is made
    from ``params`` and dropped after it, its steps on the first two batches; or with ``run``
    (``train_cap``) the run's own: ``run.state`` moved onto this layout (the first turn makes
    it from ``params``), trained on the run's next batches and left in ``run`` with the steps
    done and their seconds."""
    if run is None:
        state, first = exp.init_state(params=params), 0
    else:
        state = exp.init_state(params=params) if run.state is None else adopt(exp, run.state)
        run.state, first = None, run.step
    times: list[float] = []
    for i in range(1 + cap):
        # A fresh state's steps alternate the first two batches; the run's take its next ones.
        tokens = exp.global_batch(exp.data.local_batch(i % 2 if run is None else first + i))
        t0 = time.perf_counter()
        state, metrics = exp.step(state, tokens)
        jax.block_until_ready((state, metrics))
        took = time.perf_counter() - t0
        if run is not None:
            run.step, run.trained_s = run.step + 1, run.trained_s + took
        if i > 0:
            times.append(took)
            if done(times):
                break
    if run is not None:
        run.state = state
    del state
    return times


# ------------------------------------------------------------------------------------------------
# ``parallelism=auto``: the fastest layout (mesh, remat, gradient accumulation) that fits.
#
# The candidates are the meshes the plan accepts (``plan.run_plan.candidates``); the **model**
# stage compiles each from shapes (nothing allocated) and ranks the variants that fit by the
# estimate (``autotune.fit.step_estimate``) for the visible hardware or ``plan.target``; the
# **measure** stage (``parallelism.search=measure|fresh``) times the few the rules pick, in
# rounds (``autotune.search``), and the fastest wins. Before them the budget rule
# (``worth_it``) keeps a run on its start when a search would not pay. The global batch
# and sequence length are held fixed throughout (``plan.run_plan.held_batch``). The decision is
# cached (``autotune.search``) and checked before it is taken; every process takes process 0's.
# The config is read, never rewritten: each candidate is a mesh plan made for its layout.

_SEARCHES = [0]  # searches made in this process: each agrees on its own keys
Timer = Callable[[Any, list[Layout]], dict[Layout, Any]]


# Is a search worth it (``parallelism.search_budget``)? The starting layout (the preset's own: all
# devices data-parallel) is compiled first, as the run would compile it, and a search predicted
# (``plan.run_plan.search_cost``) to cost more than that fraction of the run's steps is not
# made: the run keeps its start, and the log says why.
Score = Callable[..., tuple[float, float | None]]  # (layout, say=True) -> (GiB, est. s or None)


def start_layout(cfg: RunConfig, devices: tuple, held: tuple[int, int]) -> Layout | None:
    """The layout the run would take unsearched: the preset's own (``parallelism=auto``: every
    device data-parallel) at the ``held`` batch and sequence length; None where the plan
    refuses it (the batch does not divide...)."""
    try:
        plan = make_plan(cfg, *devices, batch=held[0], seq_len=held[1])
    except ConfigError:
        return None
    return Layout(plan.sizes, cfg.model.remat, cfg.train.grad_accum)


def say_score(layout: Layout, need_gb: float, est_s: float | None) -> None:
    """A candidate's score in the log as the model stage takes it (a compile takes seconds)."""
    log.info("layout search: %s needs %.3f GiB per device, est. %s ms", layout.label, need_gb,
             _ms(None if est_s is None else 1e3 * est_s))


def worth_it(cfg: RunConfig, layouts: list[Layout], score: Score, budget: float,
             budget_gb: float | None, devices: tuple, tag: str, target: str,
             held: tuple[int, int]) -> tuple[Score, Row | None, str]:
    """(the scorer, with the starting layout's score kept for the model stage; the starting
    layout's row, chosen, its ``why`` the reason, when a search would cost more than ``budget``
    of the run (``search_cost``), else None; what the start is: "all devices data-parallel").
    The start is scored first: its compile is the run's own either way, and its time is what
    each other layout's compile is predicted to take. ``target``: the estimate's, named in the
    reason. Process 0's verdict on every process."""
    start, verdict = start_layout(cfg, devices, held), None
    what = "all devices data-parallel"
    if start not in layouts and layouts:  # e.g. a batch the devices do not divide
        start, what = layouts[0], "the first layout the plan accepts"
    if len(layouts) > 1:
        t = time.perf_counter()
        try:
            need, est = kept_score = score(start, say=False)
        except TooLarge as e:  # the start does not fit the chip: a search it is
            need, est, kept_score = None, None, e
        compile_s = time.perf_counter() - t
        kept = {start: kept_score}
        score = (lambda layout, say=True, inner=score: _taken(kept.pop(layout)) if layout in kept
                 else inner(layout, say=say))
        if est is not None and (budget_gb is None or need <= budget_gb):
            row = Row(start, need, 1e3 * est, fits=True)
            cost, steps, run_s = search_cost(cfg, row, len(layouts), compile_s,
                                             devices[1] == "cpu")
            if cost > budget * run_s:
                turns = f", {steps} steps of turns" if steps else ""
                more = len(layouts) - 1
                verdict = (f"a search of {len(layouts)} layouts ({more} more "
                           f"compile{'s' * (more != 1)} of {compile_s:.1f} s{turns}) would take "
                           f"est. {_s(cost)} s, more than parallelism.search_budget={budget:g} "
                           f"of the run's est. {_s(run_s)} s ({cfg.train.steps} steps at "
                           f"{_ms(1e3 * est)} ms on {target}); parallelism.search=fresh "
                           "searches anyway")
    verdict = agreed(f"{tag}/budget", verdict)
    if verdict is None:
        if len(layouts) > 1 and need is not None:
            say_score(start, need, est)  # the model stage's first
        return score, None, what
    return score, Row(start, need, 1e3 * est, chosen=True, fits=True, why=verdict), what


def _taken(score: tuple[float, float | None] | TooLarge) -> tuple[float, float | None]:
    """A kept score as the scorer gave it: its figures, or its refusal raised again."""
    if isinstance(score, TooLarge):
        raise score
    return score


@dataclass(frozen=True)
class Searched:
    """A layout search's outcome: the layout the run takes and the ranking's record (what
    plan.json and the log show)."""

    layout: Layout
    record: dict[str, Any]


@dataclass
class _Search:
    """What one search reads throughout: the config, the devices, the batch and sequence
    length held fixed, and the estimate's target and memory budget."""

    cfg: RunConfig
    devices: tuple
    held: tuple[int, int]
    plan_mode: bool
    mode: str  # plan mode: "model"
    fresh: bool  # a search asked for: no cached decision, whatever the budget
    tag: str  # this search's keys in the processes' agreement
    key: str
    target: Target
    peak: float | None
    budget_gb: float | None

    def plan(self, layout: Layout | None = None) -> MeshPlan:
        return make_plan(self.cfg, *self.devices, layout=layout, batch=self.held[0],
                         seq_len=self.held[1])


def search(cfg: Any, plan_mode: bool = False, timer: Timer | None = None,
           resumed: Layout | None = None, handover: Handover | None = None,
           held: tuple[int, int] | None = None) -> Searched | None:
    """Choose the layout (``parallelism.search``; plan mode: from the estimate alone); None:
    no search. ``timer(cfg, layouts)``: seconds per step of each layout, or its turns'
    (default ``time_layouts``'s). ``resumed``: the layout of the checkpoint a run resumes, kept
    where the plan accepts it here. ``handover``: filled with what the run takes over.
    ``held``: the batch and sequence length (None: ``held_batch`` on these devices)."""
    if cfg.parallelism.search == "none":
        return None
    t0, devices = time.perf_counter(), visible_devices(cfg.plan.target if plan_mode else None)
    if resumed is not None and (kept := _resumed(cfg, resumed, devices, t0)) is not None:
        return kept
    s = _setup(cfg, devices, plan_mode, held or held_batch(cfg, *devices))
    if (cached := _from_cache(s, handover, t0)) is not None:
        return cached
    layouts, refused = candidates(cfg, *devices, batch=s.held[0], seq_len=s.held[1])
    if not layouts:  # the plan refuses every layout (more devices than there are...): its words
        s.plan()
    if not plan_mode:  # a state no mesh can hold: said before a compile is spent on it
        state_floor(s, layouts[0])
    # A search that measures keeps each candidate's full compile for its timing; so does a
    # run's on an accelerator, whose analysis compile is the full one: the chosen layout's is
    # then the run's step, not a second compile of the same program.
    keep = s.mode in ("measure", "fresh") or (not plan_mode and analysis_is_full(devices[1]))
    built: dict[Layout, Any] | None = {} if keep else None
    score = _scorer(s, built)
    budget = None if s.fresh else cfg.parallelism.get("search_budget")
    unsearched, start = None, ""
    if budget is not None:  # would the run's search pay? (plan mode: the planned run's)
        score, unsearched, start = worth_it(cfg, layouts, score, budget, s.budget_gb, devices,
                                            s.tag, s.target.name, s.held)
    if unsearched is not None:  # the start, chosen; the others never compiled
        verdict, unsearched.why, top = unsearched.why, "", 0
        rows = [unsearched] + [Row(x, why="not searched") for x in layouts
                               if x != unsearched.layout]
    else:
        verdict, top = None, cfg.parallelism.search_top
        rows = _ranked(s, layouts, score, built, handover, timer)
    chosen = next(r.layout for r in rows if r.chosen)
    if handover is not None and built and chosen in built:  # its compile: the run's step
        handover.exp = built.pop(chosen)
    if built:
        built.clear()
    rows += [Row(layout, why=why) for layout, why in refused]
    return Searched(chosen, _record(s, rows, top, verdict, start, handover, t0))


def _resumed(cfg: RunConfig, resumed: Layout, devices: tuple, t0: float) -> Searched | None:
    """The checkpoint's layout, kept where the plan accepts it on these devices; else None
    (chosen again as a new run would, the checkpoint resharded onto the choice)."""
    n, size = cfg.parallelism.n_devices or devices[0], resumed.sizes.n
    why = (f"its {size} devices are not this run's {n}" if size != n
           else _refused(lambda: make_plan(cfg, *devices, layout=resumed)))
    if why is None:
        row = Row(resumed, chosen=True, fits=True, why="")
        return Searched(resumed, {
            "search": "resume", "target": "the checkpoint's layout", "top": 0,
            "rows": [row.to_json()], "searched": False, "cached": False, "search_s": 0.0,
            "decide_s": time.perf_counter() - t0})
    log.info("parallelism=auto: the checkpoint's layout %s does not fit this run (%s); "
             "choosing again as a new run would, the checkpoint resharded onto the choice",
             resumed.label, why)
    return None


def _setup(cfg: RunConfig, devices: tuple, plan_mode: bool, held: tuple[int, int]) -> _Search:
    _SEARCHES[0] += 1
    n = cfg.parallelism.n_devices or devices[0]
    key = cache_key(cfg, held, n, jax.devices()[0].device_kind, jax.__version__, devices[2])
    target, peak = resolve_target(cfg, n)
    if plan_mode:  # the target's usable memory, as plan mode's fit
        budget_gb = usable_bytes(target) / GiB if target.memory_bytes else None
    elif devices[1] == "tpu" and cfg.runtime.memory_gb is None:
        budget_gb = None  # XLA's compile is the check (``compile_checked``): it fits or raises
    else:  # the memory preflight's budget
        budget_gb = device_budget(cfg.runtime)[0] / GiB
    mode = cfg.parallelism.search
    return _Search(cfg, devices, held, plan_mode, "model" if plan_mode else mode,
                   mode == "fresh", f"layout_search/{_SEARCHES[0]}", key, target, peak,
                   budget_gb)


def _from_cache(s: _Search, handover: Handover | None, t0: float) -> Searched | None:
    """An earlier run's decision, planned and (for a run) fitted before it is taken; None:
    none, or in doubt (one warning: deciding again as if there were none)."""
    cached, doubt = read_cache(s.key) if not s.fresh and is_main() else (None, None)
    checked: dict[Layout, Any] = {}  # the cached layout's compile, the run's step if taken
    if cached is not None:
        scorer = None if s.plan_mode else _scorer(s, checked)
        doubt = _cached_doubt(s, chosen_layout(cached), scorer)
    cached, doubt = agreed(f"{s.tag}/cache", [cached, doubt])
    if doubt:
        log.warning("parallelism=auto: the cached decision %s %s; deciding again as if there "
                    "were none (parallelism.search=fresh searches again and replaces it)",
                    cache_path(s.key), doubt)
        return None
    if cached is None:
        return None
    chosen = chosen_layout(cached)
    if handover is not None and chosen in checked:  # its compile: the run's step
        handover.exp = checked.pop(chosen)
    return Searched(chosen, {
        **cached, "search": s.mode, "decided_by": cached["search"], "cached": True,
        "searched": False, "search_s": 0.0, "decide_s": time.perf_counter() - t0,
        "init_s": None, "trained_steps": 0, "trained_s": 0.0, "compile_s": 0.0})


def _ranked(s: _Search, layouts: list[Layout], score: Score, built: dict[Layout, Any] | None,
            handover: Handover | None, timer: Timer | None) -> list[Row]:
    """The model stage's ranking and, unless plan mode, the measure stage's choice: process
    0's rows on every process (memory readings differ per process), so that every process
    measures the same candidates in the same order."""
    cfg, top = s.cfg, s.cfg.parallelism.search_top
    rows = _agreed_rows(f"{s.tag}/rows", model_stage(layouts, s.budget_gb, score))
    if not s.plan_mode and not any(r.fits for r in rows):
        raise ConfigError(agreed(f"{s.tag}/none", nothing_fits(s, rows)))
    if s.mode == "model":
        model_choice(rows, top=0)
        return rows
    fitting = {r.layout for r in rows if r.fits}
    for layout in [x for x in built if x not in fitting]:  # their compiles freed before timing
        del built[layout]
    turn_s = cfg.parallelism.search_turn_s
    every, prune = measure_rule(rows, turn_s, s.devices[1] == "cpu")
    cap = 0
    if handover is not None and s.devices[2] == 1:  # the run's own search: train through?
        timed = to_measure(rows, top, every, turn_s)
        # One padding of the vocabulary: the state moves between layouts as it is.
        if len({built[r.layout].padded_vocab for r in timed if r.layout in built}) == 1:
            cap = train_through(cfg, timed, s.budget_gb)
    timer = timer or (lambda c, ls: time_layouts(c, ls, s.devices, built, prune=prune,
                                                 tag=s.tag, keep=handover, with_turns=True,
                                                 train_cap=cap, held=s.held))
    measure_stage(rows, top, lambda ls: timer(cfg, ls), every, turn_s)
    return _agreed_rows(f"{s.tag}/chosen", rows)


def state_floor(s: _Search, layout: Layout) -> None:
    """Raise ConfigError when the weights and optimizer state alone, sharded over every device,
    exceed what the run's devices give one (the least any layout needs: shapes only, nothing
    compiled): a search would compile every variant of every mesh to learn that."""
    budget, _, source = device_budget(s.cfg.runtime)
    n = s.cfg.parallelism.n_devices or s.devices[0]
    floor = state_bytes(Experiment.build(s.cfg, s.plan(layout), data=NoData()).abstract_state()
                        ) / n
    if floor > budget:
        raise ConfigError(
            f"parallelism=auto: the weights and optimizer state alone need "
            f"{_gib(floor / GiB)} per device sharded over all {n} {s.devices[1]} devices, more "
            f"than {source} gives one ({_gib(budget / GiB)}); try a smaller model or more "
            "devices")


SMALLER = (2, 4)  # the global batch divided by these, tried when no layout fits


def nothing_fits(s: _Search, rows: list[Row]) -> str:
    """The search's refusal when no layout fits, in one line: the nearest row (the least
    memory, at its most recomputation and micro-batches), and the largest smaller batch at
    which that mesh fits so (compiled: a chip's compile is the check), which a run given it
    searches again from."""
    near = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb,
               default=rows[0] if rows else None)
    batch, seq_len = s.held
    budget, _, source = device_budget(s.cfg.runtime)
    what = f"; the nearest, {near.layout.label}, {near.why}" if near and near.why else ""
    fix = "a smaller model or more devices"
    if near is not None:
        fix = next((f"data.batch_size={b}" for b in (batch // k for k in SMALLER)
                    if _fits_at(s, near.layout, b)), fix)
    n = s.cfg.parallelism.n_devices or s.devices[0]
    return (f"parallelism=auto: none of the {len(rows)} layouts of {n} {s.devices[1]} "
            f"devices fits at data.batch_size={batch}, data.seq_len={seq_len} "
            f"({source}: {_gib(budget / GiB)} per device{what}); try {fix}")


def _fits_at(s: _Search, layout: Layout, batch: int) -> bool:
    """Does ``layout``'s mesh fit at the global ``batch``, with its recomputation and as many
    micro-batches as divide the batch (the most memory a search could save there)?"""
    for accum in sorted(ACCUMS, reverse=True):
        try:
            plan = make_plan(s.cfg, *s.devices, layout=replace(layout, grad_accum=accum),
                             batch=batch, seq_len=s.held[1])
        except ConfigError:  # the accumulation does not divide the batch
            continue
        try:
            need = step_bytes(Experiment.build(s.cfg, plan, data=NoData()).analyse_step())
        except Exception as e:  # a chip's compile refuses what does not fit it
            if not is_out_of_memory(e):
                raise
            return False
        return s.budget_gb is None or need is None or need <= s.budget_gb * GiB
    return False


def _record(s: _Search, rows: list[Row], top: int, verdict: str | None, start: str,
            handover: Handover | None, t0: float) -> dict[str, Any]:
    """The ranking's record, cached for later runs when a run searched."""
    h = handover or Handover()
    record = {"search": s.mode, "target": s.target.name, "key": s.key, "top": top,
              "rows": [r.to_json() for r in rows], "searched": verdict is None,
              "search_s": time.perf_counter() - t0, "decided_at": time.strftime("%Y-%m-%d %H:%M"),
              "init_s": h.init_s, "cached": False, "trained_steps": h.step,
              "trained_s": h.trained_s,
              "compile_s": h.exp.step.compile_time_s if h.exp is not None else 0.0}
    if verdict is not None:  # no search: the time went to deciding (startup) and to the
        # starting layout's compile (the run's own: compile)
        record.update(unsearched=verdict, start=start, search_s=0.0,
                      decide_s=record["search_s"] - record["compile_s"])
    elif is_main() and not s.plan_mode:  # a run's length is not in the key: no verdict cached
        write_cache(s.key, record)
    return record


def _refused(make: Callable[[], Any]) -> str | None:
    """The plan's refusal (``make()`` raising ConfigError), its first clause; None: accepted."""
    try:
        make()
    except ConfigError as e:
        return str(e).split(";")[0]
    return None


def _cached_doubt(s: _Search, layout: Layout, score: Score | None) -> str | None:
    """Why a cached layout cannot be this run's: the plan refuses it here (a model or a mesh
    rule changed since it was cached), or, with ``score`` (a run's: the step compiled as the
    run's own), its step no longer fits the memory preflight's budget. Plan mode passes no
    ``score``: it reports the fit itself. None: take it."""
    if (why := _refused(lambda: s.plan(layout))) is not None:
        return f"chose {layout.label}, which this run's plan refuses: {why}"
    if score is None:
        return None
    try:
        need, _ = score(layout, say=False)
    except ConfigError as e:
        return f"chose {layout.label}, which this run cannot build: {str(e).split(';')[0]}"
    except TooLarge as e:
        return f"chose {layout.label}, which no longer fits: {str(e).removeprefix('does not fit: ')}"
    if s.budget_gb is not None and need > s.budget_gb:
        return f"chose {layout.label}, which no longer fits: {_gib(need)} of {_gib(s.budget_gb)}"
    return None


def _scorer(s: _Search, built: dict[Layout, Any] | None = None) -> Score:
    """``score(layout)``: (GiB per device, est. seconds or None). ``built`` None: the cheaper
    analysis compile, not kept; else the run's own compile, kept in ``built`` with its
    Experiment for the measure stage or, chosen, the run."""
    def score(layout: Layout, say: bool = True) -> tuple[float, float | None]:
        plan = s.plan(layout)
        try:
            if built is None:
                exp = Experiment.build(s.cfg, plan, data=NoData())
                compiled = exp.analyse_step()  # its memory and cost figures are the run's
            else:
                exp = Experiment.build(s.cfg, plan)
                compiled = exp.compile_step()
                built[layout] = exp
        except Exception as e:  # a chip's compile refuses a program over its memory: a row
            if not is_out_of_memory(e):
                raise
            if say:
                log.info("layout search: %s does not fit: XLA refuses it (needs %s)",
                         layout.label, _gib(xla_need(e)))
            raise TooLarge(xla_need(e)) from None
        est = step_estimate(s.cfg, exp, compiled, s.target, s.peak, xla_cost=False)
        need = (est.mem.total_bytes if est.mem is not None and s.plan_mode
                else step_bytes(compiled) or est.fp.total_bytes)
        step_s = est.est.get("step_time_s")
        if say:
            say_score(layout, need / GiB, step_s)
        return need / GiB, step_s

    return score


def _agreed_rows(key: str, rows: list[Row]) -> list[Row]:
    """Process 0's rows on every process."""
    return rows_of({"rows": agreed(key, [r.to_json() for r in rows])})


# ------------------------------------------------------------------------------------------------
# The run's decision, taken once by one function for a run and for plan mode alike: the
# layout (searched for ``parallelism=auto``), the global batch and sequence length, the save
# cadence, and the checkpoint a run resumes. The validated config is read, never rewritten:
# what is derived travels in the ``RunPlan``.

# A resume's finder: the run's config as its files will record it -> the checkpoint or None.
FindResume = Callable[[dict[str, Any]], "Resume | None"]


@dataclass
class Decided:
    """``decide``'s answer, the one carrier from the decision to the loop (``prepare`` returns
    it once the resume is planned and the memory preflight passed): the plan, the experiment
    built for it (the search's compile where it made the run's), what else the search made
    that the run takes over, and the resume."""

    plan: RunPlan  # every number derived from the config: layout, batch, cadence, search
    exp: Experiment  # the built experiment, its mesh plan and data inside; exp.cfg is cfg
    # What parallelism=auto's search made that the run takes over (the seeded init its timing
    # drew, or the state after the first steps its turns trained), each part taken once.
    handover: Handover | None = None
    resume: Resume | None = None  # the checkpoint a run resumes; None: a fresh start


def decide(cfg: Any, *, plan_mode: bool = False, find_resume: FindResume | None = None
           ) -> Decided:
    """Decide the run of ``cfg`` on the devices it sees (``experiment.visible_devices``). Plan
    mode plans for ``plan.target``'s platform (``data.seq_len=null`` as a run there resolves
    it; its devices' attention kernel) and compiles nothing it would train. ``find_resume``: a
    run's resume finder, asked before a search (the checkpoint's layout is kept where it fits)."""
    devices = visible_devices(cfg.plan.target if plan_mode else None)
    platform = plan_platform(cfg.plan.target, devices[1]) if plan_mode else devices[1]
    seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    handover, searched, resume = (None if plan_mode else Handover()), None, None
    if not searches(cfg.parallelism):
        mesh = make_plan(cfg, *devices, seq_len=seq_len)  # the batch, whichever key gave it
        if find_resume is not None:
            resume = find_resume(saved_config(cfg, RunPlan(mesh)))
    else:  # parallelism=auto: the batch held fixed; a resume keeps its own layout
        held = held_batch(cfg, *devices, seq_len=seq_len)
        if cfg.data.per_device_batch_size is not None:
            log.info("parallelism=auto: the global batch is held at %d (data.per_device_"
                     "batch_size on the starting layout) while the layouts change", held[0])
        if find_resume is not None:
            resume = find_resume(OmegaConf.to_container(recorded(cfg, *held), resolve=True))
        searched = search(cfg, plan_mode=plan_mode, resumed=resumed_layout(resume),
                          handover=handover, held=held)
        mesh = make_plan(cfg, *devices, layout=searched.layout, batch=held[0],
                         seq_len=held[1])
    if handover is not None and handover.exp is not None:  # the search compiled the run's step
        exp, handover.exp = replace(handover.exp, plan=mesh), None
    else:
        exp = Experiment.build(cfg, mesh, NoData() if plan_mode else process_data(cfg, mesh))
    ck = cfg.checkpoint  # checkpoint.every=null: by platform, on an accelerator by the state
    cadence = save_cadence(ck.every, ck.every_minutes, platform,
                           state_bytes(exp.abstract_state()), cfg.plan.write_gb_per_s * GB)
    plan = RunPlan(mesh, cadence, searched.record if searched is not None else None)
    return Decided(plan, exp, handover, resume)


# ------------------------------------------------------------------------------------------------
# Plan mode (``run.mode=plan``): the run's decision reported for a target, training nothing,
# and its advice for a plan that does not fit (the fastest setting that fits, by the estimate).
# Each section's own account follows.

# ------------------------------------------------------------------------------------------------
# Plan mode's advice for a plan that does not fit: the fastest setting that fits, by the estimate.
#
# The candidates are the ways to lay the same update out on the same devices: every mesh
# (dp x fsdp x tp) the mesh plan accepts, each ``model.remat``, ``train.grad_accum`` and ZeRO-1
# (``parallelism.shard_optimizer``). Each is first priced from the shapes alone (values in,
# values out): the memory model's need, with the state's shards counted from the parameters'
# logical axes, and the time model's step without its collectives, which the step can only
# exceed. Those that may fit are then built and compiled from shapes (plan mode's own need and
# estimate) in the order of that bound, until the bound of the next cannot beat the runners-up
# found, or the compile budget ends. When none fits, the same pricing finds the smallest multiple
# of the devices on which a layout would (an accelerator target: each device brings its memory).

ACCUMS = (1, 2, 4, 8, 16)
RUNNERS_UP = 3  # settings listed after the suggestion
GROWTH = (2, 4, 8, 16, 32, 64)  # the device counts (x the plan's) tried when none fits
MAX_COMPILES = 10
# On a CPU target the bound (FLOPs at the peak) leaves out the memory traffic a CPU step is
# bound by, so it rarely stops the compiles early: fewer of them, nearest first among equals.
MAX_COMPILES_CPU = 3
TIME_BUDGET_S = 120.0  # the compile stage stops here, keeping what it found
SLACK = 1.02  # a pure need this close over the budget is still compiled (rounding, padding)
CPU_SLACK = 1.25


@dataclass(frozen=True)
class Setting:
    """One candidate: a layout (mesh, remat, accumulation) and whether ZeRO-1 is on.
    ``keyed``: ZeRO-1 set against what the config's ``parallelism.shard_optimizer`` gives on
    this layout (its plan's decision), so the key is one of the candidate's overrides."""

    layout: Layout
    zero: bool
    keyed: bool = field(default=False, compare=False)


@dataclass
class Priced:
    setting: Setting
    overrides: list[str]
    need_bytes: float | None  # the memory model's (pure) or plan mode's (built)
    step_s: float | None  # a lower bound (pure) or the estimate (compiled)
    changes: int = 0
    compiled: bool = False

    def to_json(self, asked_s: float | None) -> dict[str, Any]:
        return {"overrides": self.overrides, "step_time_s": self.step_s,
                "speed": asked_s / self.step_s if asked_s and self.step_s else None,
                "needs_gb": None if self.need_bytes is None else self.need_bytes / GB}


@dataclass(frozen=True)
class StateShapes:
    """What the state's shards are counted from: each parameter's shape, itemsize and
    logical axes, the optimizer's bytes per parameter byte, the global batch's bytes."""

    leaves: tuple[tuple[tuple[int, ...], int, tuple | None], ...]
    opt_per_param: float
    batch_bytes: float

    @classmethod
    def of(cls, exp: Any, state: Any) -> StateShapes:
        leaves: list[tuple[tuple[int, ...], int, tuple | None]] = []
        jax.tree.map(lambda names, x: leaves.append((tuple(x.shape), x.dtype.itemsize, names)),
                     exp.axes, state.params,
                     is_leaf=lambda x: isinstance(x, tuple) or x is None)
        params = sum(itemsize * math.prod(shape) for shape, itemsize, _ in leaves)
        opt = sum(x.dtype.itemsize * x.size for x in jax.tree.leaves(state.opt_state))
        batch = exp.abstract_batch()
        return cls(tuple(leaves), opt / params, batch.dtype.itemsize * math.prod(batch.shape))

    def per_device(self, s: Setting) -> tuple[float, float, float]:
        """(params, optimizer state, batch) bytes per device: a tensor axis split where its
        mesh axes divide it (the vocabulary always: it is padded to tp), the optimizer state as
        its parameter's, over the data replicas too under ZeRO-1."""
        sizes = s.layout.mesh_sizes
        params = 0.0
        for shape, itemsize, names in self.leaves:
            n = float(itemsize)
            for dim, name in zip(shape, names or (None,) * len(shape), strict=True):
                rule = LOGICAL_RULES.get(name) if name else None
                k = math.prod(sizes[a] for a in ((rule,) if isinstance(rule, str) else
                                                 rule or ()))
                n *= -(-dim // k) if dim % k == 0 or name == "vocab" else dim
            params += n
        opt = self.opt_per_param * params / (s.layout.dp if s.zero else 1)
        return params, opt, self.batch_bytes / s.layout.replicas


def settings(cfg: RunConfig, n: int, platform: str, batch: int, seq_len: int,
             processes: int = 1, hosts: tuple[int, ...] | None = None, device: Any = None
             ) -> list[tuple[Setting, MeshPlan]]:
    """Every (setting, its mesh plan) on ``n`` devices that the mesh plan accepts at the
    global ``batch`` and ``seq_len`` held fixed: ZeRO-1 off, and on too with data replicas."""
    out = []
    for sizes in meshes(n, seq_len, unused_axes(cfg)):
        for remat in REMATS:
            for accum in ACCUMS:
                layout = Layout(sizes, remat, accum)
                try:
                    own = make_plan(cfg, n, platform, processes, hosts, device, layout=layout,
                                    batch=batch, seq_len=seq_len)
                except ConfigError:
                    continue
                for z in (False, True) if sizes["dp"] > 1 else (False,):
                    plan = own if z == own.shard_optimizer else make_plan(
                        cfg, n, platform, processes, hosts, device, layout=layout,
                        batch=batch, seq_len=seq_len, zero=z)
                    out.append((Setting(layout, z, keyed=plan is not own), plan))
    return out


def overrides(cfg: RunConfig, s: Setting, asked: Setting, batch: int) -> list[str]:
    """The keys that turn the asked setting into ``s`` (the batch of one update kept)."""
    a, b = asked.layout, s.layout
    out = []
    if a.sizes != b.sizes:  # every axis -1 could infer, and one that cannot where it changes
        out += [f"parallelism.{x.key}={b.sizes[x.key]}" for x in sorted(
            AXES, key=lambda x: not x.inferable)
            if (x.inferable and not x.only_with) or a.sizes[x.key] != b.sizes[x.key]]
    if a.remat != b.remat:
        out.append(f"model.remat={b.remat}")
    if a.grad_accum != b.grad_accum:
        out.append(f"train.grad_accum={b.grad_accum}")
    if s.keyed:
        out.append(f"parallelism.shard_optimizer={str(s.zero).lower()}")
    per_device = batch // (b.replicas * b.grad_accum)
    if cfg.data.per_device_batch_size is not None and per_device != cfg.data.per_device_batch_size:
        out.append(f"data.per_device_batch_size={per_device}")
    return out


def _model_need(cfg: RunConfig, plan: MeshPlan, target: Target, state: tuple[float, float, float]
                ) -> float:
    """The memory model's need (``plan.cost``) of ``plan`` with the state's shards
    ``state``: what ``fit.accelerator_memory`` counts, before anything is built (the logits
    of the target's vocabulary padding, as there)."""
    m = cfg.model
    kernel = kernel_on(cfg, plan, target.device_kind)
    vocab = target_vocab(cfg, plan, target)
    x = cost.shapes(m, plan, kernel, vocab)
    return cost.estimate_memory(x, *state, plan.fsdp).total_bytes


def _step_bound(cfg: RunConfig, plan: MeshPlan, target: Target, peak: float | None,
                n_params: int, params_bytes: float) -> float | None:
    """A lower bound of the estimated step: the accelerator time model's without collectives
    (they only add to it), or on a CPU target the recomputed FLOPs at the peak."""
    key = target_key(target)
    if not peak:
        return None
    if key in cost.COST:
        w = cost.workload(cfg, plan, n_params, params_bytes / 4,
                              kernel=kernel_on(cfg, plan, target.device_kind))
        t = TARGETS[key]
        return cost.step_time(w, cost.COST[key], peak, t.hbm_bytes_per_s,
                                  t.link_bytes_per_s, [])["step_time_s"]
    parts = cost.step_flops(cfg.model, plan.global_batch * plan.seq_len, plan.seq_len,
                             plan.padded_vocab, plan.remat)
    return parts["hardware"] / plan.n_devices / (peak * 1e12)


def price(cfg: RunConfig, shapes: StateShapes, target: Target, peak: float | None, n_params: int,
          candidates: list[tuple[Setting, MeshPlan]], asked: Setting, batch: int
          ) -> list[Priced]:
    """Each candidate priced from the shapes: the memory model's need and the step's lower
    bound."""
    out = []
    for s, plan in candidates:
        state = shapes.per_device(s)
        need = _model_need(cfg, plan, target, state)
        o = overrides(cfg, s, asked, batch)
        out.append(Priced(s, o, need, _step_bound(cfg, plan, target, peak, n_params, state[0]),
                          changes=len(o)))
    return out


def _order(p: Priced) -> tuple[float, int, float]:
    return (p.step_s if p.step_s is not None else 0.0, p.changes, p.need_bytes or 0.0)


def _compile(cfg: RunConfig, p: Priced, asked_plan: MeshPlan, target: Target, peak: float | None,
             budget: float) -> Priced:
    """``p`` built and compiled from shapes as plan mode plans a run: its need and estimate
    (not compiled when the built state already does not fit an accelerator)."""
    lay = p.setting.layout
    keys = {"parallelism": {**lay.sizes, "shard_optimizer": p.setting.zero},
            "model": {"remat": lay.remat}, "train": {"grad_accum": lay.grad_accum}}
    trial = OmegaConf.merge(cfg, keys)
    plan = make_plan(trial, asked_plan.n_visible, asked_plan.platform, asked_plan.processes,
                     asked_plan.process_hosts or None, asked_plan.attention_device,
                     batch=asked_plan.global_batch, seq_len=asked_plan.seq_len)
    exp = Experiment.build(trial, plan, data=NoData())
    if target.device_kind != "cpu":
        need = accelerator_memory(exp, target).total_bytes
        if need > budget:
            return replace(p, need_bytes=need, step_s=None, compiled=True)
    s = step_estimate(trial, exp, exp.analyse_step(), target, peak, xla_cost=False)
    need = s.est["needs_per_device_gb"] * GB
    return replace(p, need_bytes=need, step_s=step_of(s.est, lay.grad_accum) if s.est["fits"]
                   else None, compiled=True)


def step_of(est: dict[str, Any], grad_accum: int) -> float | None:
    """The estimate's step, the same for every candidate. On a CPU target (the roofline of
    the compile's bytes) XLA counts a loop's body once, the micro-batch loop's too: its bytes
    are counted ``grad_accum`` times here, or accumulation would look free."""
    if "timing" in est or "memory_s" not in est:
        return est.get("step_time_s")
    return max(est["compute_s"], est["memory_s"] * grad_accum) + est["collective_s"]


def fastest_that_fits(cfg: RunConfig, exp: Any, state: Any, target: Target, peak: float | None,
                      asked: dict[str, Any], n_params: int, *, runners_up: int = RUNNERS_UP,
                      max_compiles: int | None = None, time_budget_s: float = TIME_BUDGET_S
                      ) -> dict[str, Any]:
    """Plan mode's advice for ``exp``'s plan (which does not fit ``target``): the fastest
    setting that fits, with its estimated step and speed against the asked one's (``asked``:
    its estimate, priced as the candidates are: ``step_estimate(..., xla_cost=False)``), and
    up to ``runners_up`` more; or, when none fits on these devices, how many would do.
    ``cfg``: the run's config as its files record it (``run_plan.resolved_config``)."""
    t0 = time.perf_counter()
    plan, budget = exp.plan, usable_bytes(target)
    asked_s = step_of(asked, plan.grad_accum)
    if max_compiles is None:
        max_compiles = MAX_COMPILES if target.device_kind != "cpu" else MAX_COMPILES_CPU
    start = Setting(plan.layout, plan.shard_optimizer)
    shapes = StateShapes.of(exp, state)
    batch, seq = plan.global_batch, plan.seq_len
    candidates = [c for c in settings(cfg, plan.n_devices, plan.platform, batch, seq,
                                      plan.processes, plan.process_hosts or None,
                                      plan.attention_device)
                  if c[0] != start]
    priced = price(cfg, shapes, target, peak, n_params, candidates, start, batch)
    # A CPU target's program is not the one the memory model counts (XLA:CPU keeps more): there
    # it only rules out what is far over, and the compile decides.
    slack = SLACK if target.device_kind != "cpu" else CPU_SLACK
    maybe = sorted((p for p in priced if p.need_bytes <= budget * slack), key=_order)
    fits: list[Priced] = []
    compiled = 0
    for p in maybe:
        keep = fits[:runners_up + 1]
        if (len(keep) > runners_up and p.step_s is not None and keep[-1].step_s is not None
                and p.step_s >= keep[-1].step_s):
            break  # no candidate left can beat the ones kept
        if compiled >= max_compiles or time.perf_counter() - t0 > time_budget_s:
            break
        done = _compile(cfg, p, plan, target, peak, budget)
        compiled += 1
        if done.need_bytes is not None and done.need_bytes <= budget:
            fits = sorted([*fits, done], key=_order)
    out: dict[str, Any] = {"candidates": len(priced), "fit_by_model": len(maybe),
                           "compiled": compiled, "asked_step_time_s": asked_s}
    if fits:
        best, *rest = _distinct(fits)
        out |= {"suggestion": best.to_json(asked_s),
                "runners_up": [r.to_json(asked_s) for r in rest[:runners_up]]}
    elif target.device_kind != "cpu":
        out["larger_mesh"] = larger_mesh(cfg, shapes, target, peak, n_params, start, plan)
    out["search_s"] = time.perf_counter() - t0
    return out


def _distinct(ranked: list[Priced]) -> list[Priced]:
    """``ranked`` less each setting estimated as fast as one before it on the same mesh (a
    remat or ZeRO-1 that only moves memory): the list names different choices."""
    out: list[Priced] = []
    for p in ranked:
        mesh = p.setting.layout.mesh
        if not any(q.setting.layout.mesh == mesh and q.step_s is not None and p.step_s is not None
                   and abs(p.step_s - q.step_s) <= 1e-3 * q.step_s for q in out):
            out.append(p)
    return out


def larger_mesh(cfg: RunConfig, shapes: StateShapes, target: Target, peak: float | None,
                n_params: int, asked: Setting, plan: MeshPlan) -> dict[str, Any] | None:
    """The smallest multiple of the plan's devices (``GROWTH``) on which a setting fits by the
    memory model, and its fastest setting there by the step's lower bound (nothing compiled:
    plan it with ``plan.devices``); None when none up to the last multiple does."""
    base = OmegaConf.merge(cfg, {"parallelism": {"n_devices": 0}})
    for k in GROWTH:
        n = plan.n_devices * k
        candidates = settings(base, n, plan.platform, plan.global_batch, plan.seq_len,
                              device=plan.attention_device)
        priced = price(base, shapes, target, peak, n_params, candidates, asked,
                       plan.global_batch)
        fits = sorted((p for p in priced if p.need_bytes <= usable_bytes(target)), key=_order)
        if fits:
            best = fits[0]
            extra = [f"parallelism.n_devices={n}"] if cfg.parallelism.n_devices else []
            return {"devices": n, "overrides": [f"plan.devices={n}", *extra, *best.overrides],
                    "needs_gb": best.need_bytes / GB, "step_time_bound_s": best.step_s}
    return None


def advice_text(advice: dict[str, Any], n_devices: int, short: bool = False) -> str:
    """The table's suggestion row (``short``: without the runners-up)."""
    s = advice.get("suggestion")
    if s is not None:
        text = f"fastest that fits: {' '.join(s['overrides'])} ({_setting_text(s)})"
        if short:
            return text
        rest = "; ".join(f"{' '.join(r['overrides'])} ({_setting_text(r)})"
                         for r in advice.get("runners_up", []))
        return (text + (f"; runners-up: {rest}" if rest else "") +
                f" [ranked by the estimate: {advice['compiled']} of {advice['candidates']} "
                f"settings compiled, {advice['fit_by_model']} fit by the memory model]")
    larger = advice.get("larger_mesh")
    if larger:
        return (f"no layout of {n_devices} devices fits; {larger['devices']} would: "
                f"{' '.join(larger['overrides'])} (memory model: "
                f"{gb_text(larger['needs_gb'] * GB)} per device; not compiled)")
    if advice.get("fit_by_model") == 0:
        return (f"no layout of {n_devices} to {n_devices * GROWTH[-1]} devices fits at this "
                "batch and sequence length")
    return (f"none of the {advice['compiled']} settings compiled fits "
            f"({advice['candidates']} candidates)")


def _setting_text(p: dict[str, Any]) -> str:
    need = f"needs {gb_text(p['needs_gb'] * GB)}"
    if p["step_time_s"] is None:
        return need
    speed = f", {p['speed']:.2f}x the asked speed" if p["speed"] else ""
    return f"est. {p['step_time_s'] * 1e3:.1f} ms a step{speed}, {need}"


# ------------------------------------------------------------------------------------------------
# Plan mode (``run.mode=plan``): the run's decision (``autotune.search``) reported for a
# target, training nothing. The train step is compiled for the planned mesh from shapes alone
# and XLA's analyses of it give the per-device memory, FLOPs, bytes and collectives; from those
# the table says whether it **fits** the target's memory (and when not, the fastest setting
# that does: ``autotune.plan_mode``) and how fast it would go (an estimate: the accelerator time
# model on a GPU/TPU target, a roofline of XLA's counts on ``plan.target=cpu``), with the
# model's shape, the TFLOP/s per device and the warnings (``plan.cost``).



def plan_report(cfg: Any, exp: Any, suggest: bool = True,
                plan: RunPlan | None = None) -> dict[str, Any]:
    """Everything plan mode prints and writes into plan.json (beside the mesh plan) for
    ``exp``'s step. ``plan``: the run plan it was built for (its save cadence, and the layout
    a refusal's settings start from); None: ``exp.plan`` as given, its cadence as a run's.
    ``suggest=False``: no search for a setting that fits (the published-runs benchmark)."""
    target, peak = resolve_target(cfg, exp.plan.n_devices)
    t0 = time.perf_counter()
    compiled = exp.compile_step()
    compile_s = time.perf_counter() - t0
    s = step_estimate(cfg, exp, compiled, target, peak)
    fp, mem, est, parts, model_flops = s.fp, s.mem, s.est, s.parts, s.model_flops
    state = exp.abstract_state()
    platform = plan_platform(cfg.plan.target, exp.plan.platform)
    nbytes, write = state_bytes(state), cfg.plan.write_gb_per_s * GB
    if plan is None:
        ck = cfg.checkpoint
        plan = RunPlan(exp.plan, save_cadence(ck.every, ck.every_minutes, platform, nbytes,
                                              write))
    tokens = exp.plan.global_batch * exp.plan.seq_len
    warning = shape_warning(platform, exp.plan.seq_len, cfg.model.max_seq_len, tokens)
    zero = exp.plan.shard_optimizer
    report: dict[str, Any] = {
        "n_params": s.n_params,
        "n_devices": exp.plan.n_devices,
        "per_device": {k: v for k, v in asdict(fp).items() if k != "collectives"}
        | {"activations_bytes": fp.activations_bytes},
        "shard_optimizer": zero,
        # ZeRO-1 (parallelism.shard_optimizer): per device, the optimizer state no axis of
        # which the data replicas divide, held whole by every replica (counters at least)
        "opt_state_unsplit_bytes": replicated_bytes_over(state.opt_state) if zero else 0.0,
        "loss_chunk": exp.plan.loss_chunk,
        "model_flops_per_step": model_flops,
        # counted from the shapes (flops.step_flops): per step, all devices; MFU's numerator
        # is "model" (full attention square), "hardware" adds what the device really runs
        "flops": parts | {"per_device_hardware": parts["hardware"] / exp.plan.n_devices},
        "collectives": fp.collectives,
        "compile_s": compile_s,
        "target": est,
    }
    if mem is not None:
        report["memory_model"] = mem.to_json() | {
            "xla_cpu_total_bytes": fp.total_bytes, "precision": exp.plan.precision,
            "disagreement": disagreement(mem.total_bytes, fp.total_bytes)}
    report["checkpoint"] = checkpoint_cost(nbytes, write, *plan.cadence, est.get("step_time_s"))
    report["model"] = (plan_line(cfg.model, s.n_params) if cfg.model._target_
                       else cost.shape_line(cfg.model, s.n_params))
    report["tflops_per_device"] = cost.tflops_per_device(model_flops, exp.plan.n_devices,
                                                        est.get("step_time_s"))
    report["preset"] = cost.preset_note(cfg.parallelism.name, exp.plan.shape)
    if not est["fits"] and suggest:
        # The asked step priced as the candidates are: on a CPU target from the shapes' FLOPs
        # and this compile's bytes, not the two more compiles of XLA's own count.
        asked = est if mem is not None else step_estimate(cfg, exp, compiled, target, peak,
                                                         xla_cost=False).est
        report["advice"] = fastest_that_fits(
            resolved_config(cfg, plan), exp, state, target, peak, asked, s.n_params)
        best = report["advice"].get("suggestion")
        report["suggestion"] = best["overrides"] if best else None
    unsplit = report["opt_state_unsplit_bytes"]
    opt = mem.opt_state_bytes if mem is not None else fp.opt_state_bytes
    found = report.get("advice")
    report["warnings"] = [w for w in (
        cost.fit_warning(est, found and advice_text(found, exp.plan.n_devices, short=True)),
        cost.kv_heads_warning(cfg.model), warning,
        cost.unsplit_warning(zero, opt, unsplit, exp.plan.dp),
        cost.exposed_warning(est)) if w]
    return report


def plan_table(report: dict[str, Any]) -> str:
    t = report["target"]
    rows = [*([("preset", report["preset"])] if report.get("preset") else []),
            ("model", report.get("model") or f"{report['n_params']:,} parameters"),
            *memory_rows(report)]
    rows += [
        ("model FLOPs", f"{report['model_flops_per_step']:.3e} per step" + _flops_parts(report)),
        ("collectives", ", ".join(f"{k} x{int(v['count'])} ({gb_text(v['bytes'])}/step)"
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
    if report.get("tflops_per_device"):
        rows.append(("TFLOP/s", f"{report['tflops_per_device']:.1f} per device (model FLOPs per "
                                "device / the estimated step)"))
    if "checkpoint" in report:
        rows.append(("checkpoint", checkpoint_line(report["checkpoint"])))
    if "advice" in report:
        rows.append(("suggestion", advice_text(report["advice"], report["n_devices"])))
    rows += [("warning", w) for w in report.get("warnings", [])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _flops_parts(report: dict[str, Any]) -> str:
    f = report.get("flops")
    if not f or "block_matmuls" not in f:  # a user model's: counted whole
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
    opt = gb_text(pd["opt_state_bytes"] if mm is None else mm["opt_state_bytes"])
    if report.get("shard_optimizer"):
        opt += f" (split over data; {gb_text(report.get('opt_state_unsplit_bytes', 0.0))} not)"
    xla = (f"params {gb_text(pd['params_bytes'])}, optimizer {opt}, "
           f"gradients {gb_text(pd['grads_bytes'])}, activations+temps "
           f"{gb_text(pd['activations_bytes'])}; total {gb_text(pd['total_bytes'])}")
    if mm is None:
        return [("per device", xla)]
    gathers = f", FSDP gathers {gb_text(mm['gathers_bytes'])}" if mm["gathers_bytes"] else ""
    chunk = (f" (in chunks of {report['loss_chunk']} positions)" if report.get("loss_chunk")
             else "")
    rows = [("per device",
             f"params {gb_text(mm['params_bytes'])}, optimizer {opt}, "
             f"gradients {gb_text(mm['grads_bytes'])}, activations {gb_text(mm['activations_bytes'])} "
             f"+ one layer's backward {gb_text(mm['working_bytes'])} + logits "
             f"{gb_text(mm['head_bytes'])}{chunk}{gathers}; total {gb_text(mm['total_bytes'])} "
             f"({mm['basis']})")]
    rows += [("memory note", note) for note in mm.get("notes", [])]
    if mm["precision"] == "fp32" and mm["disagreement"] > MEMORY_AGREEMENT:
        rows.append(("XLA:CPU", f"{xla} ({100 * mm['disagreement']:.0f}% from the model)"))
    return rows


def planned(cfg: Any) -> Decided:
    """The run plan mode reports: ``decide`` for ``plan.target`` on the visible devices (for
    ``parallelism=auto`` the layout ranked first by the estimate alone)."""
    return decide(cfg, plan_mode=True)


def run_plan(cfg: Any, run_dir: Any, decided: Decided) -> dict[str, Any]:
    """``run.mode=plan``: compile for the mesh, print the table, write plan.json; train nothing."""
    plan = decided.plan
    report = plan_report(cfg, decided.exp, plan=plan)
    write_json(run_dir / "plan.json", {**plan.to_json(), "plan_mode": report})
    log.info("mesh plan\n%s\n%s", plan.mesh.table(), plan_table(report))
    if plan.search:
        log.info("parallelism=auto\n%s", table(plan.search, run=False))
    if report["warnings"]:  # each is a row of the table above
        n = len(report["warnings"])
        log.warning("plan mode: %d warning%s (the table's warning rows)", n, "s" * (n > 1))
    if report["checkpoint"]["too_costly"]:
        log.warning("checkpoints: %s", checkpoint_line(report["checkpoint"]))
    return report
