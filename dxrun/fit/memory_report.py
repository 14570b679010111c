"""Where a compiled step's memory goes: written beside a memory refusal or an out-of-memory crash.

The parts are XLA's memory analysis of the compiled step split by what the arguments are:
parameters, optimizer state, the rest of the train state, the batch (the arguments), outputs not
aliased to a donated input, and temporaries (gradients and activations live there). They add up
to the step's total (``experiment.step_bytes``) exactly. Beside them: the largest arguments by tree
path, and the largest temporaries of the optimized HLO with the JAX op that made them (layer
names where the model's scopes give them); XLA reuses temporary buffers, so those do not add up
to the temporaries' total. On an accelerator a device memory profile (pprof) is saved too.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from dxrun.config import disk_error
from dxrun.cost import (
    GiB,
)

# Bytes of each of XLA's element types, as its HLO text names them.
HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
               "c64": 8}

BREAKDOWN_FILE = "memory_breakdown.txt"
PPROF = "memory.prof"
_ANY_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape (a tuple: its elements summed)."""
    return sum(HLO_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
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


def write_breakdown(run_dir: Path, compiled: Any, state: Any, platform: str) -> Path:
    """The breakdown as ``<run dir>/memory_breakdown.txt`` (and ``memory.prof`` on an
    accelerator); returns the text file's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / BREAKDOWN_FILE
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
