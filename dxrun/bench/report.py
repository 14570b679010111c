"""The suite's results: one ``Figure`` per measured ratio, written as a section of
BENCHMARKS.md (between markers, the rest of the file kept) and as JSON beside it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def markers(key: str) -> tuple[str, str]:
    """The comments around one generated section (``suite``; ``gpu``, ``auto``, ``torch`` for
    ``--gpu``, ``--auto``, ``--torch``)."""
    return f"<!-- dxrun.bench {key}: begin -->", f"<!-- dxrun.bench {key}: end -->"


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
             "torch": "One CPU device: dxrun vs PyTorch eager"}[report.key]
    lines = [begin, f"## {title}: `{report.command}`", "",
             f"`{report.command}` on {m['device_count']} × {m['device_kind']} "
             f"({m['cpu_cores']} cores), JAX {m['jax']}, {m['date']}; load average "
             f"{m['load_before']} before, {m['load_after']} after. Ratios are side by side in "
             "this one run (variants interleaved, median of per-repetition medians); raw times "
             "beside them. Goal met: ✓, not met: ✗ (the reason is in the note).", ""]
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
    elif m := re.search(r"^(## |<!-- dxrun\.bench \w+: begin -->)", text, re.M):
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
