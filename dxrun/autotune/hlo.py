"""Read what XLA made of a jitted function: which collectives the compiled HLO contains.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from dxrun.fit import HLO_DTYPE_BYTES

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# An HLO instruction line: `%name = f32[...]{...} all-reduce(...)` (or the -start async form).
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo_text: str) -> Counter:
    """Count collective ops by kind in compiled HLO text (async start/done pairs count once)."""
    return Counter(m.group(1) for line in hlo_text.splitlines() if (m := _OP.search(line)))


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _OP.search(line)) and m.group(1) == kind]


_SHAPE = re.compile(r"\b(" + "|".join(HLO_DTYPE_BYTES) + r")\[([\d,]*)\]")
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
    return sum(HLO_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
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
