"""Read a run's profiler trace: the top operations by device time, and compute vs collective vs
idle per step.

The trace is read with the profiler's own reader, ``jax.profiler.ProfileData`` (the XSpace
protobuf JAX writes, parsed by jaxlib itself): no extra dependency and no hand-written protobuf
parser. A device's operations are the events of its ``XLA Ops`` line (GPU/TPU planes
``/device:*``) or, on CPU, the host events that carry an ``hlo_op`` stat; one execution of the
train step is one ``run_id`` (CPU) or one event of the ``XLA Modules`` line (GPU/TPU). An op's
kind (matmul, attention, a collective, elementwise fusion) comes from the compiled step's HLO
saved beside the trace, falling back on its name.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dxrun.trace import HLO_FILE

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "send", "recv")
COMPUTE, COLLECTIVE = "compute", "collective"
# Ops whose event encloses their body's ops (a scan over layers is a while loop): counted through
# the ops inside them, never themselves.
CONTAINERS = ("while", "conditional", "call")


@dataclass(frozen=True)
class Op:
    name: str
    device: str
    step: int  # the execution it belongs to (0, 1, ... in trace order)
    start_ns: float
    dur_ns: float


# --- op kinds from the compiled HLO --------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")


def hlo_kinds(hlo_text: str) -> dict[str, str]:
    """Instruction name -> kind, for every instruction of the HLO module's text."""
    return {name: kind for name, (kind, _) in hlo_ops(hlo_text).items()}


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (kind, the JAX op that made it: its ``op_name`` metadata)."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if m := _COMP.match(line):
            current = m.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    kinds: dict[str, tuple[str, str]] = {}
    for lines in bodies.values():
        for line in lines:
            if m := _INSTR.match(line):
                name, opcode, rest = m.groups()
                called = re.findall(r"calls=%?([\w.\-]+)", rest)
                inner = "\n".join(" ".join(bodies.get(c, [])) for c in called)
                source = re.search(r'op_name="([^"]+)"', rest)
                kinds[name] = (_kind(opcode, rest + inner), source.group(1) if source else "")
    return kinds


def _kind(opcode: str, text: str) -> str:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return base
    if re.search(r"fmha|flash|attention", text, re.I) and opcode in ("custom-call", "fusion"):
        return "attention"
    if opcode in ("dot", "convolution") or re.search(r" (dot|convolution)\(|gemm|matmul", text):
        return "matmul"
    if opcode == "fusion":
        return "elementwise fusion"
    return opcode


def name_kind(name: str) -> str:
    """An op's kind from its name alone (no HLO saved): collectives and matmuls by name."""
    base = re.sub(r"[.\d]+$", "", name).removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return base
    if base.startswith("wrapped_"):
        return "elementwise fusion"
    if re.search(r"dot|gemm|matmul|convolution|cublas", name):
        return "matmul"
    if re.search(r"fmha|flash|attention", name, re.I):
        return "attention"
    return "elementwise fusion" if "fusion" in name else base


def category(kind: str) -> str:
    return COLLECTIVE if kind in COLLECTIVES else COMPUTE


# --- the trace ---------------------------------------------------------------------------------

def trace_files(run_dir: Path) -> list[Path]:
    """The newest trace of each process under ``<run dir>/profile/`` (``*.xplane.pb``)."""
    root = run_dir / "profile" if (run_dir / "profile").is_dir() else run_dir
    newest: dict[Path, Path] = {}
    for pb in sorted(root.rglob("*.xplane.pb")):
        owner = pb.parents[3] if len(pb.parents) > 3 else root  # <dir>/plugins/profile/<time>/
        if owner not in newest or pb.parent.name > newest[owner].parent.name:
            newest[owner] = pb
    return sorted(newest.values())


def _stats(event: object) -> dict:
    try:
        return dict(event.stats)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return {}


def read_ops(xplane: Path, module: str | None) -> list[Op]:
    """The device operations of the train step's executions in one trace file."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    ops: list[Op] = []
    runs: dict[object, int] = {}
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            lines = {line.name: list(line.events) for line in plane.lines}
            modules = [e for e in lines.get("XLA Modules", [])
                       if module is None or e.name.split("(")[0].strip() == module]
            for e in lines.get("XLA Ops", []):
                owner = next((i for i, m in enumerate(modules)
                              if m.start_ns <= e.start_ns <= m.end_ns), None)
                if owner is not None or not modules:
                    ops.append(Op(e.name, plane.name, owner or 0, e.start_ns, e.duration_ns))
        elif plane.name == "/host:CPU":
            for line in plane.lines:
                for e in line.events:
                    s = _stats(e)
                    if "hlo_op" not in s or (module and s.get("hlo_module") != module):
                        continue
                    run = runs.setdefault(s.get("run_id"), len(runs))
                    ops.append(Op(s["hlo_op"], f"cpu:{s.get('device_ordinal', line.name)}", run,
                                  e.start_ns, e.duration_ns))
    return ops


def _union_ns(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class Summary:
    steps: int
    devices: int
    step_ms: float  # mean over steps and devices: first op start to last op end
    compute_ms: float
    collective_ms: float  # not overlapped by compute
    idle_ms: float
    top: list[tuple[str, str, float, float, int]]  # (op, kind, ms per step, share, count/step)
    kinds: list[tuple[str, float]]  # (kind, ms per step), most first


def summarize(ops: list[Op], kinds: dict[str, str], top: int = 15) -> Summary:
    """Per step and device, then averaged: its span, the time under compute ops, under
    collectives only, and neither (idle); the ops with the most device time, and the time by
    kind."""
    ops = [o for o in ops if (kinds.get(o.name) or name_kind(o.name)) not in CONTAINERS]
    by_step: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for op in ops:
        by_step[(op.device, op.step)].append(op)
    n = max(len(by_step), 1)
    span = comp = coll = 0.0
    for group in by_step.values():
        start = min(o.start_ns for o in group)
        end = max(o.start_ns + o.dur_ns for o in group)
        spans = {c: [(o.start_ns, o.start_ns + o.dur_ns) for o in group
                     if category(kinds.get(o.name) or name_kind(o.name)) == c]
                 for c in (COMPUTE, COLLECTIVE)}
        busy = _union_ns(spans[COMPUTE] + spans[COLLECTIVE])
        c = _union_ns(spans[COMPUTE])
        span, comp, coll = span + end - start, comp + c, coll + busy - c
    per_op: dict[str, list[float]] = defaultdict(list)
    for op in ops:
        per_op[op.name].append(op.dur_ns)
    step_ns = span / n
    rows = [(name, kinds.get(name) or name_kind(name), sum(d) / n / 1e6,
             sum(d) / n / step_ns if step_ns else 0.0, round(len(d) / n))
            for name, d in per_op.items()]
    rows.sort(key=lambda r: -r[2])
    by_kind: dict[str, float] = defaultdict(float)
    for _, kind, ms, _, _ in rows:
        by_kind[kind] += ms
    steps = len({op.step for op in ops})
    devices = len({op.device for op in ops})
    return Summary(steps, devices, step_ns / 1e6, comp / n / 1e6, coll / n / 1e6,
                   (span - comp - coll) / n / 1e6, rows[:top],
                   sorted(by_kind.items(), key=lambda kv: -kv[1]))


def _short(source: str, width: int = 70) -> str:
    """A JAX op path, its end kept: ``jit(step)/.../transpose(jvp(Block))/attn/dot_general``."""
    return source if len(source) <= width else "…" + source[-(width - 1):]


def table(s: Summary, sources: dict[str, str] | None = None) -> str:
    """The Markdown table ``python -m dxrun.profile`` prints."""
    pct = (lambda x: f"{x / s.step_ms:.1%}") if s.step_ms else (lambda x: "-")
    out = [f"{s.steps} traced step(s) x {s.devices} device(s); per step and device: "
           f"{s.step_ms:.2f} ms = compute {s.compute_ms:.2f} ms ({pct(s.compute_ms)}) + "
           f"collective {s.collective_ms:.2f} ms ({pct(s.collective_ms)}) + idle "
           f"{s.idle_ms:.2f} ms ({pct(s.idle_ms)})", "",
           "| kind | ms/step | share of step |", "|---|---:|---:|"]
    out += [f"| {kind} | {ms:.3f} | {pct(ms)} |" for kind, ms in s.kinds]
    out += ["", "| op | kind | ms/step | share of step | count/step | JAX op |",
            "|---|---|---:|---:|---:|---|"]
    out += [f"| `{name}` | {kind} | {ms:.3f} | {share:.1%} | {count} | "
            f"{_short((sources or {}).get(name, '')).replace('|', '/')} |"
            for name, kind, ms, share, count in s.top]
    return "\n".join(out)


def module_name(hlo_text: str) -> str | None:
    m = re.match(r"HloModule ([\w.\-]+)", hlo_text)
    return m.group(1) if m else None


def read_run(run_dir: Path, top: int = 15) -> list[tuple[Path, Summary, dict[str, str]]]:
    """Each process's trace under ``run_dir`` summarized (see ``summarize``), with each op's
    JAX op."""
    out = []
    for pb in trace_files(run_dir):
        hlo = next((p / HLO_FILE for p in pb.parents if (p / HLO_FILE).is_file()), None)
        text = hlo.read_text() if hlo else ""
        ops = hlo_ops(text)
        kinds = {k: v[0] for k, v in ops.items()}
        sources = {k: v[1] for k, v in ops.items()}
        out.append((pb, summarize(read_ops(pb, module_name(text)), kinds, top), sources))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dxrun.profile",
        description="The top operations by device time and compute vs collective vs idle per "
                    "step, read from the trace a run took with train.profile.start=<step> "
                    "train.profile.steps=<n> (under <run dir>/profile/).")
    parser.add_argument("run_dir", type=Path, help="the run dir (or its profile/ dir)")
    parser.add_argument("--top", type=int, default=15, help="how many ops to list (default 15)")
    args = parser.parse_args(argv)
    results = read_run(args.run_dir, args.top)
    if not results:
        print(f"dxrun.profile: no trace under {args.run_dir}; take one with "
              "train.profile.start=<step> train.profile.steps=<n>", file=sys.stderr)
        return 2
    for pb, s, sources in results:
        print(f"{pb}\n\n{table(s, sources)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
