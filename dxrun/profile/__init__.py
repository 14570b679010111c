"""Read a run's profiler trace: the top operations by device time, and compute vs collective vs
idle per step.

The trace is read with the profiler's own reader, ``jax.profiler.ProfileData`` (the XSpace
protobuf JAX writes, parsed by jaxlib itself): no extra dependency and no hand-written protobuf
parser. A device's operations are the events of its ``XLA Ops`` line (GPU/TPU planes
``/device:*``) or, on CPU, the host events that carry an ``hlo_op`` stat; one execution of the
train step is one ``run_id`` (CPU) or one event of the ``XLA Modules`` line (GPU/TPU). An op's
kind (matmul, attention, a collective, elementwise fusion) comes from the compiled step's HLO
saved beside the trace, falling back on its name; on TPU from the compiler's own category of the
op, its JAX op and source line, which the trace carries (``xspace``). ``python -m
dxrun.profile`` prints ``main``'s table (``__main__.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dxrun.profile import xspace
from dxrun.tracking import HLO_FILE

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "send", "recv")
COMPUTE, COLLECTIVE = "compute", "collective"
# Ops whose event encloses their body's ops (a scan over layers is a while loop): counted through
# the ops inside them, never themselves.
CONTAINERS = ("while", "conditional", "call")
IDLE = "idle"
MOVES = "copy / data formatting"  # ops that move or lay out bytes, without arithmetic
ATTENTION = re.compile(r"flash|splash|fmha|attention|\bmha\b", re.I)


@dataclass(frozen=True)
class Op:
    name: str
    device: str
    step: int  # the execution it belongs to (0, 1, ... in trace order)
    start_ns: float
    dur_ns: float
    kind: str = ""  # from the trace itself (TPU); "" reads it from the HLO or the name
    source: str = ""  # the JAX op that made it, from the trace itself (TPU)


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


# --- op kinds on TPU, from the trace -------------------------------------------------------------

_EVENT = re.compile(r"^%?([\w.\-]+) = .*? ([\w\-]+)\(", re.S)  # "%fusion.4 = f32[8] fusion(..."
_COLLECTIVE = re.compile(r"(?<![\w-])(" + "|".join(COLLECTIVES) + r")(?![\w])")
_MOVES = ("data formatting", "copy", "copy-start", "copy-done", "async-start", "async-done",
          "dynamic-slice", "dynamic-update-slice", "broadcast", "slice", "concatenate", "pad",
          "transpose", "reshape", "bitcast")


def instruction(text: str) -> tuple[str, str]:
    """``(name, opcode)`` of an op's event name that is its HLO instruction's text (TPU, GPU:
    ``%fusion.4 = f32[8]{0} fusion(...), kind=kLoop, ...``); other names as they are, no opcode."""
    m = _EVENT.match(text)
    return (m.group(1), m.group(2)) if m else (text, "")


def tpu_kind(text: str, stats: dict) -> str:
    """An op's kind on TPU from its instruction's text and its metadata's stats: the compiler's
    category (``hlo_category``), the JAX op (``tf_op``) and the source line that made it. Attention
    is what attention's own code computes (its matmuls and softmax in XLA's fusions, or one
    kernel: a Pallas ``tpu_custom_call`` such as splash attention); loops are ``while``."""
    _, opcode = instruction(text)
    cat = str(stats.get("hlo_category") or "")
    base = opcode.removesuffix("-start").removesuffix("-done")
    if opcode in CONTAINERS or cat in CONTAINERS:
        return opcode if opcode in CONTAINERS else cat
    if base in COLLECTIVES:
        return base
    if m := _COLLECTIVE.search(cat) or (base == "async" and _COLLECTIVE.search(text)):
        return m.group(1)
    if cat in _MOVES or (not cat and opcode in _MOVES):
        return MOVES
    source_file = str(stats.get("source") or "").rpartition("/")[2]  # a file, not its folders
    made_by = f"{stats.get('tf_op') or ''} {source_file}"
    kernel = opcode == "custom-call" and "tpu_custom_call" in text
    if ATTENTION.search(made_by) or (kernel and ATTENTION.search(text)):
        return "attention"
    if "convolution" in cat or opcode in ("dot", "convolution"):
        return "matmul"
    if kernel:
        return "pallas kernel"
    if cat == "non-fusion elementwise":
        return "elementwise"
    if (cat.endswith("fusion") and cat != "custom fusion") or (not cat and opcode == "fusion"):
        return "elementwise fusion"
    return cat or opcode


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
    tpu: dict[str, dict[str, dict]] | None = None
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            if plane.name.startswith("/device:TPU") and tpu is None:
                tpu = xspace.op_stats(xplane, "/device:TPU", ("hlo_category", "tf_op", "source"))
            meta = (tpu or {}).get(plane.name)
            lines = {line.name: list(line.events) for line in plane.lines}
            modules = [e for e in lines.get("XLA Modules", [])
                       if module is None or e.name.split("(")[0].strip() == module]
            for e in lines.get("XLA Ops", []):
                owner = next((i for i, m in enumerate(modules)
                              if m.start_ns <= e.start_ns <= m.end_ns), None)
                if owner is not None or not modules:
                    name, _ = instruction(e.name)
                    kind = source = ""
                    if meta is not None:
                        stats = meta.get(e.name, {})
                        kind = tpu_kind(e.name, stats)
                        source = str(stats.get("tf_op") or "").removesuffix(":")
                    ops.append(Op(name, plane.name, owner or 0, e.start_ns, e.duration_ns,
                                  kind, source))
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
    kinds: list[tuple[str, float]]  # (kind, ms per step), most first; then idle, if serial


def summarize(ops: list[Op], kinds: dict[str, str], top: int = 15) -> Summary:
    """Per step and device, then averaged: its span, the time under compute ops, under
    collectives only, and neither (idle); the ops with the most device time, and the time by
    kind. Where no two ops of a step overlap (a TPU core runs one at a time) the kinds end with
    idle, so that they add up to the step."""
    kind_of = {o.name: o.kind or kinds.get(o.name) or name_kind(o.name) for o in ops}
    ops = [o for o in ops if kind_of[o.name] not in CONTAINERS]
    by_step: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for op in ops:
        by_step[(op.device, op.step)].append(op)
    n = max(len(by_step), 1)
    span = comp = coll = overlap = 0.0
    for group in by_step.values():
        start = min(o.start_ns for o in group)
        end = max(o.start_ns + o.dur_ns for o in group)
        spans = {c: [(o.start_ns, o.start_ns + o.dur_ns) for o in group
                     if category(kind_of[o.name]) == c]
                 for c in (COMPUTE, COLLECTIVE)}
        busy = _union_ns(spans[COMPUTE] + spans[COLLECTIVE])
        c = _union_ns(spans[COMPUTE])
        span, comp, coll = span + end - start, comp + c, coll + busy - c
        overlap += sum(o.dur_ns for o in group) - busy
    per_op: dict[str, list[float]] = defaultdict(list)
    for op in ops:
        per_op[op.name].append(op.dur_ns)
    step_ns = span / n
    rows = [(name, kind_of[name], sum(d) / n / 1e6,
             sum(d) / n / step_ns if step_ns else 0.0, round(len(d) / n))
            for name, d in per_op.items()]
    rows.sort(key=lambda r: -r[2])
    by_kind: dict[str, float] = defaultdict(float)
    for _, kind, ms, _, _ in rows:
        by_kind[kind] += ms
    steps = len({op.step for op in ops})
    devices = len({op.device for op in ops})
    idle_ms = (span - comp - coll) / n / 1e6
    serial = [(IDLE, idle_ms)] if ops and overlap <= 1e-6 * span else []
    return Summary(steps, devices, step_ns / 1e6, comp / n / 1e6, coll / n / 1e6, idle_ms,
                   rows[:top], sorted(by_kind.items(), key=lambda kv: -kv[1]) + serial)


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
        parsed = hlo_ops(text)
        kinds = {k: v[0] for k, v in parsed.items()}
        ops = read_ops(pb, module_name(text))
        sources = ({o.name: o.source for o in ops if o.source}
                   | {k: v[1] for k, v in parsed.items() if v[1]})
        out.append((pb, summarize(ops, kinds, top), sources))
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

