"""The suite's results: one ``Figure`` per measured ratio, written as a section of
BENCHMARKS.md (between markers, the rest of the file kept) and as JSON beside it."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def markers(key: str) -> tuple[str, str]:
    """The comments around one generated section (``suite``; ``gpu``, ``auto``, ``torch`` for
    ``--gpu``, ``--auto``, ``--torch``)."""
    return f"<!-- benchmarks {key}: begin -->", f"<!-- benchmarks {key}: end -->"


@dataclass
class Figure:
    section: str
    name: str
    ratio: float | None  # what the goal is about; None for a figure that only reports
    raw: dict[str, Any]  # the measurements behind the ratio (ms, bytes, counts)
    goal: str = ""  # e.g. ">= 1.0"
    met: bool | None = None
    note: str = ""  # the measured reason where a goal is not met, or what the ratio is
    command: str = ""  # set where it is not the suite's own command


def meets(ratio: float, goal: str) -> bool:
    op, bound = goal.split()
    return ratio >= float(bound) if op == ">=" else ratio <= float(bound)


def figure(section: str, name: str, ratio: float | None, raw: dict, goal: str = "",
           note: str = "", command: str = "") -> Figure:
    met = meets(ratio, goal) if goal and ratio is not None else None
    return Figure(section, name, ratio, raw, goal, met, note, command)


@dataclass
class Report:
    command: str
    machine: dict[str, Any]
    figures: list[Figure] = field(default_factory=list)
    key: str = "suite"  # which generated section of BENCHMARKS.md this run replaces

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "machine": self.machine,
                "figures": [asdict(f) for f in self.figures]}


def _raw(raw: dict[str, Any]) -> str:
    def short(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items()) + "}"
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return "; ".join(f"{k} {short(v)}" for k, v in raw.items()).replace("|", "/")


def markdown(report: Report) -> str:
    m = report.machine
    begin, end = markers(report.key)
    title = {"suite": "The suite", "gpu": "GPU figures",
             "auto": "parallelism=auto vs the best layout",
             "torch": "One CPU device: dxrun vs PyTorch eager",
             "onedev": "One device: dxrun vs hand-written jax.jit steps"}[report.key]
    lines = [begin, f"## {title}: `{report.command}`", "",
             f"`{report.command}` on {m['device_count']} × {m['device_kind']} "
             f"({m['cpu_cores']} cores), JAX {m['jax']}, {m['date']}; load average "
             f"{m['load_before']} before, {m['load_after']} after{_others(m)}. Ratios are side "
             "by side in this one run (variants interleaved, median of per-repetition "
             "medians); raw times beside them. Goal met: ✓, not met: ✗ (the reason is in the note).", ""]
    section = None
    for f in report.figures:
        if f.section != section:
            section = f.section
            lines += ["", f"### {section}", "", "| figure | ratio | goal | | raw | note |",
                      "|---|---|---|---|---|---|"]
        ratio = "" if f.ratio is None else f"{f.ratio:.3f}"
        mark = {True: "✓", False: "✗", None: ""}[f.met]
        note = f.note + (f" (`{f.command}`)" if f.command else "")
        lines.append(f"| {f.name} | {ratio} | {f.goal} | {mark} | {_raw(f.raw)} | {note} |")
    return "\n".join([*lines, "", end])


def replace_section(md_path: Path, key: str, section: str) -> None:
    """Put ``section`` (its markers included) in place of ``key``'s section of ``md_path`` (or
    before the first ``##`` or generated section, whichever comes first), keeping everything
    else."""
    text = md_path.read_text() if md_path.is_file() else "# Benchmarks\n"
    begin, end = markers(key)
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text,
                      flags=re.S)
    elif m := re.search(r"^(## |<!-- benchmarks \w+: begin -->)", text, re.M):
        # never between another section's begin marker and its heading
        text = f"{text[:m.start()]}{section}\n\n{text[m.start():]}"
    else:
        text = f"{text.rstrip()}\n\n{section}\n"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)


def write(report: Report, md_path: Path) -> Path:
    """Replace this run's section of ``md_path`` (or add it before the first ``##``), keeping
    everything else; the JSON (``BENCHMARKS.json``, ``BENCHMARKS.gpu.json``) goes beside it.
    Returns the JSON's path."""
    replace_section(md_path, report.key, markdown(report))
    json_path = md_path.with_suffix(".json" if report.key == "suite" else f".{report.key}.json")
    json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return json_path


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _others(m: dict[str, Any]) -> str:
    share = m.get("others_cpu_share")
    return "" if share is None else (
        f"; other processes used {100 * share:.1f}% of the {m['cpu_cores']} cores meanwhile")


class OtherLoad:
    """The CPU time other processes took while the bench ran, as a share of the cores: the
    machine's busy time (``/proc/stat``) less this process's and its children's. The load
    average cannot say it: the bench itself keeps both cores busy, so its 1-minute average
    reads about 2 after any run, quiet or not. None where ``/proc/stat`` is missing."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        import resource

        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
        own = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))
        return busy, own, time.monotonic()

    def share(self) -> float | None:
        """Other processes' CPU seconds / (cores x wall seconds) since construction."""
        now = self._now()
        if self.start is None or now is None:
            return None
        busy, own, t = (b - a for a, b in zip(self.start, now, strict=True))
        return max(0.0, busy - own) / ((os.cpu_count() or 1) * t)
