"""The sweep report: one row per job of a multirun, read back from the job dirs alone, its layouts
ranked by measured tokens/s in the format ``parallelism=auto`` shares, written as ``report.md``
and ``report.csv`` with PNG plots, and uploaded to the sweep's W&B group. Each section's own
account follows, in that order: the ranking, the jobs collected, the plots, the upload, the
report written, and the Hydra callback that writes it at the end of every multirun.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dxrun.config import AXES, EXIT_CODES, EXIT_CRASHED, EXIT_REFUSED, ConfigError, fail
from dxrun.plan import Layout, Sizes
from dxrun.run import STATUS, SWEEP_EXITS, is_main, sweep_group
from dxrun.tracking.logger import read_metrics

# ------------------------------------------------------------------------------------------------
# Layouts ranked by measured tokens/s, with their spread: the one ranking format of the sweep
# report and of ``parallelism=auto`` (a sweep over every layout is the check of auto's choice).
# Pure functions of numbers: no JAX, no files.
#
# A layout's speed is the median of its timing windows (tokens/s, all devices, one value per
# post-compile log window) and its spread the interquartile range of those windows. Two layouts
# are told apart only when the faster's lower quartile is above the slower's upper quartile; a
# layout with fewer than ``MIN_WINDOWS`` windows has no spread, so it is never told apart from
# another. From ``STEADY_WINDOWS`` windows on, the quartiles are robust to one window slowed by
# something else on the host.

# One window has no spread: a layout needs two to be told apart from another.
MIN_WINDOWS = 2
# The quartiles sit at positions 0.25 (n - 1) and 0.75 (n - 1) of the sorted windows; from
# five windows on they are inner windows, so one stray window (the slowest or the fastest)
# moves neither past its neighbour. With four or fewer it drags a quartile part of its way.
STEADY_WINDOWS = 5


@dataclass(frozen=True)
class LayoutRun:
    """One candidate layout and what was measured of it. A sweep fills ``layout``, ``windows``,
    ``devices`` and ``mem_bytes_per_device`` from a job; ``parallelism=auto`` can fill the same
    from its timed steps (``windows`` = tokens per step / each step's seconds) and add its
    roofline estimate (``estimated_ms``) and, for a candidate it did not time, why
    (``excluded``: "does not fit: <need> of <have> GiB")."""

    layout: str  # dp4_tp2, as the parallelism presets are named (plus remat/accum if they vary)
    windows: tuple[float, ...] = ()  # tokens/s of each post-compile window; () = not measured
    devices: int | None = None
    mem_bytes_per_device: float | None = None
    estimated_ms: float | None = None
    excluded: str = ""


@dataclass(frozen=True)
class Ranked:
    run: LayoutRun
    rank: int | None  # 1 = fastest; None = not measured (excluded)
    median: float | None
    q1: float | None
    q3: float | None
    vs_best: float | None  # best median / this median (1.0 for the fastest)
    why: str  # the fastest: "fastest"; the others: why they lost, or that they could not be told apart

    @property
    def layout(self) -> str:
        return self.run.layout


def quartiles(xs: list[float] | tuple[float, ...]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile), linear between the sorted values (numpy's
    default); one value is its own three quartiles."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0], s[0], s[0]

    def at(q: float) -> float:
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return at(0.25), statistics.median(s), at(0.75)


def beyond_spread(fast: Ranked, slow: Ranked) -> bool:
    """``fast`` is faster than ``slow`` beyond both spreads: its lower quartile is above the
    other's upper one, and each has more than one window (one window has no spread)."""
    return (len(fast.run.windows) >= MIN_WINDOWS and len(slow.run.windows) >= MIN_WINDOWS
            and fast.q1 > slow.q3)


def rank_layouts(runs: list[LayoutRun]) -> list[Ranked]:
    """The measured layouts fastest first (by median tokens/s), then the unmeasured ones by
    their estimate (those without one last, in the order given). Each row says how it compares
    with the fastest, or why it was not measured."""
    measured = [r for r in runs if r.windows]
    stats = {id(r): quartiles(r.windows) for r in measured}
    order = sorted(measured, key=lambda r: -stats[id(r)][1])
    out: list[Ranked] = []
    for i, r in enumerate(order):
        q1, med, q3 = stats[id(r)]
        out.append(Ranked(r, i + 1, med, q1, q3, None, ""))
    if out:
        best = out[0]
        rows = []
        for i, row in enumerate(out):
            ratio = best.median / row.median if row.median else None
            if i == 0:
                why = "fastest"
            elif beyond_spread(best, row):
                why = f"slower: {ratio:.2f}× behind {best.layout}, beyond the spread"
            else:
                why = f"within the spread of {best.layout} ({ratio:.2f}×)"
            rows.append(Ranked(row.run, row.rank, row.median, row.q1, row.q3, ratio, why))
        out = rows
    # Unmeasured: by their estimate where they have one (auto's model-only ranking), else as given.
    rest = sorted((r for r in runs if not r.windows),
                  key=lambda r: (r.estimated_ms is None, r.estimated_ms or 0.0))
    out += [Ranked(r, None, None, None, None, None, r.excluded or "not measured") for r in rest]
    return out


def verdict(ranked: list[Ranked], where: str) -> str:
    """One sentence on a ranking: ``fastest at batch 64: dp4_tp2, <ratio>× dp8, beyond the
    spread``, or ``at batch 64: not distinguishable: dp4_tp2 <ratio>× dp8, spreads overlap``
    (``where``: "at batch 64")."""
    measured = [r for r in ranked if r.rank is not None]
    if not measured:
        return f"{where}: no layout measured"
    best = measured[0]
    if len(measured) == 1:
        return f"{where}: only {best.layout} measured"
    second = measured[1]
    ratio = best.median / second.median
    if beyond_spread(best, second):
        return f"fastest {where}: {best.layout}, {ratio:.2f}× {second.layout}, beyond the spread"
    one = [r.layout for r in (best, second) if len(r.run.windows) < MIN_WINDOWS]
    cause = (f"{' and '.join(one)} timed in one window only" if one else "spreads overlap")
    return (f"{where}: not distinguishable: {best.layout} {ratio:.2f}× {second.layout}, "
            f"{cause}")


def _ms(tokens_per_step: float | None, tokens_per_s: float | None) -> str:
    if not (tokens_per_step and tokens_per_s):
        return "–"
    return f"{1e3 * tokens_per_step / tokens_per_s:,.1f}"


def ranking_table(ranked: list[Ranked], tokens_per_step: float | None = None) -> list[str]:
    """The ranking as Markdown table lines. Columns that no row fills (devices, memory,
    estimate, measured ms without ``tokens_per_step``) are left out."""
    runs = [r.run for r in ranked]
    cols: list[tuple[str, object]] = [("rank", lambda r: "–" if r.rank is None else str(r.rank)),
                                      ("layout", lambda r: f"`{r.layout}`")]
    if any(x.devices for x in runs):
        cols.append(("devices", lambda r: str(r.run.devices or "–")))
    if any(x.mem_bytes_per_device for x in runs):
        cols.append(("memory/device", lambda r: "–" if not r.run.mem_bytes_per_device
                     else f"{r.run.mem_bytes_per_device / 2**20:,.1f} MiB"))
    if any(x.estimated_ms for x in runs):
        cols.append(("estimated ms", lambda r: "–" if not r.run.estimated_ms
                     else f"{r.run.estimated_ms:,.1f}"))
    cols.append(("median tokens/s", lambda r: "–" if r.median is None else f"{r.median:,.0f}"))
    cols.append(("spread (IQR)", lambda r: "–" if r.median is None
                 else f"{r.q1:,.0f}–{r.q3:,.0f}"))
    cols.append(("windows", lambda r: str(len(r.run.windows))))
    if tokens_per_step:
        cols.append(("measured ms", lambda r: _ms(tokens_per_step, r.median)))
    cols.append(("× best", lambda r: "–" if r.vs_best is None else f"{r.vs_best:.2f}"))
    cols.append(("", lambda r: "✓" if r.rank == 1 else ""))
    cols.append(("why", lambda r: r.why))
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r).replace("|", "\\|") for _, f in cols) + " |"
              for r in ranked]
    return lines


# ------------------------------------------------------------------------------------------------
# Read a sweep back from its job dirs: ``.hydra/`` (overrides, config), ``status.json``,
# ``plan.json``, ``summary.json`` and ``metrics.jsonl``. Nothing else, so a sweep copied back from
# a cluster reads the same. No JAX here.

log = logging.getLogger("dxrun")

# Overrides that choose the devices or the mesh: jobs that differ only in these are the same
# workload on a different number of devices (the scaling-efficiency comparison).
DEVICE_KEYS = ("parallelism", "runtime.cpu_devices")
# The axes every plan.json names (one that -1 can infer; the context axis came later: 1 there).
MESH_KEYS = tuple(a.key for a in AXES if a.inferable)


@dataclass
class JobRecord:
    dir: Path
    num: int | None
    overrides: list[str]
    status: str  # ok | stopped (by a signal, resumable) | failed
    kind: str | None = None  # failed: refused | crashed | unfinished; stopped: the signal
    reason: str | None = None
    log: str | None = None
    started: float | None = None
    finished: float | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    _rows: list[dict[str, float]] | None = field(default=None, repr=False, compare=False)
    # metrics.jsonl's lines that are not rows (cut short by a kill, or damaged): left out
    skipped_lines: int = field(default=0, compare=False)

    @property
    def label_num(self) -> str:
        return str(self.num) if self.num is not None else self.dir.name

    @property
    def n_devices(self) -> int | None:
        return self.plan.get("n_devices")

    @property
    def batch_size(self) -> int | None:
        return self.plan.get("global_batch") or self.config.get("data", {}).get("batch_size")

    @property
    def per_device_batch(self) -> int | None:
        """Examples per data replica and micro-batch (``data.per_device_batch_size``)."""
        plan = self.plan
        if "per_device_batch_size" in plan:
            return plan["per_device_batch_size"]
        if plan.get("global_batch") and plan.get("dp"):  # a plan.json from before the key
            return plan["global_batch"] // (plan["dp"] * plan["fsdp"] * plan.get("grad_accum", 1))
        return None

    @property
    def mesh(self) -> str:
        """``dp4_tp2``-style name of the job's mesh, as the parallelism presets are named."""
        if not self.plan:
            return ""
        return Layout(Sizes({a.key: self.plan[a.key] for a in AXES if a.key in self.plan})).mesh

    @property
    def workload(self) -> tuple[str, ...]:
        """The job's overrides minus the device and mesh choices."""
        return tuple(sorted(o for o in self.overrides
                            if o.lstrip("+~").partition("=")[0].split(".")[0] != "parallelism"
                            and not o.startswith("runtime.cpu_devices")))

    def metrics(self) -> list[dict[str, float]]:
        """The rows of the job's metrics.jsonl, read once (the table and every plot use them)."""
        if self._rows is None:
            path = self.dir / "metrics.jsonl"
            rows, torn = read_metrics(path)
            if torn:  # a job killed mid-write: its complete rows still make its curve
                log.warning("%s: skipped %d line(s) cut short or damaged (a killed job?): %s",
                            path, len(torn), torn[-1][:60])
            self._rows, self.skipped_lines = rows, len(torn)
        return self._rows

    @cached_property
    def throughput(self) -> Throughput | None:
        """The job's throughput statistic (``job_throughput`` of its metrics.jsonl rows, else
        of its summary's last window); None: it timed no window."""
        return job_throughput(self.metrics() or [self.summary])

    def windows(self) -> tuple[float, ...]:
        """Tokens/s (all devices) of the timing windows its throughput counts."""
        return self.throughput.windows if self.throughput else ()


@dataclass(frozen=True)
class Throughput:
    """A job's tokens/s as every figure of the sweep report reads it: the ranking, the table's
    tokens_per_s, tokens_per_s_per_device and mfu, the scaling efficiencies and the plots."""

    windows: tuple[float, ...]  # tokens/s (all devices) of each window counted, in step order
    median: float  # of ``windows``: what the ranking sorts by
    per_device: float | None  # median perf/tokens_per_s_per_device of the same windows
    mfu: float | None  # median perf/mfu of the same windows; None: no known peak


SAVE = "perf/checkpoint_block_s"


def job_throughput(rows: list[dict[str, Any]]) -> Throughput | None:
    """The median tokens/s over a job's post-compile timing windows: its metrics rows
    that carry ``perf/tokens_per_s`` (the compiling step is never in a window), less those a
    checkpoint save held (``perf/checkpoint_block_s``: the saves inside the row's own window),
    unless that is all of them. Per-device tokens/s and MFU are medians over the same windows
    (within a job both are proportional to tokens/s). None: no row with tokens/s."""
    timed = [r for r in rows if r.get("perf/tokens_per_s")]
    clean = [r for r in timed if not r.get(SAVE)]
    counted = clean or timed
    if not counted:
        return None

    def median_of(key: str) -> float | None:
        got = [r[key] for r in counted if r.get(key) is not None]
        return statistics.median(got) if len(got) == len(counted) else None

    windows = tuple(r["perf/tokens_per_s"] for r in counted)
    return Throughput(windows, statistics.median(windows),
                      median_of("perf/tokens_per_s_per_device"), median_of("perf/mfu"))


def layout_run(job: JobRecord) -> LayoutRun:
    """A finished job as a row of the layout ranking (the format ``parallelism=auto`` shares):
    its counted windows, so the ranking's median is its throughput statistic's."""
    return LayoutRun(layout=job.mesh, windows=job.windows(), devices=job.n_devices,
                     mem_bytes_per_device=job.summary.get("mem/step_bytes_per_device"))


def statistic_sentence(jobs: list[JobRecord]) -> str | None:
    """The one sentence of report.md that says what every throughput figure in it is; None
    when no job timed a window."""
    counts = sorted({len(j.windows()) for j in jobs if j.windows()})
    if not counts:
        return None
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return ("Every throughput figure in this report (the ranking, tokens_per_s, "
            "tokens_per_s_per_device, mfu, the scaling efficiencies and the plots) is the job's "
            f"median over its post-compile timing windows ({n} a job: tokens_per_s_windows; one "
            "every train.log_every steps), leaving out the windows a checkpoint save held "
            "(perf/checkpoint_block_s).")


def tally(jobs: list[JobRecord]) -> str:
    """``6 jobs: 3 ok, 1 stopped, 2 failed`` (stopped only when some job was)."""
    n = {s: sum(j.status == s for j in jobs) for s in ("ok", "stopped", "failed")}
    return (f"{len(jobs)} job{'s' * (len(jobs) != 1)}: "
            + ", ".join(f"{v} {s}" for s, v in n.items() if v or s != "stopped"))


class Unreadable(Exception):
    """A job file that is not what a job writes (a disk error, a copy cut short, a hand edit):
    the report lists the job as unreadable and reports the others. ``file``: its path in the
    job dir."""

    def __init__(self, file: str, what: str):
        super().__init__(f"{file}: {what}")
        self.file, self.what = file, what


NUMBER = (int, float)
# What the report reads of each file, and the type it must have (or null). summary.json: the
# figures of the table and, for a job without metrics rows, of its throughput.
STATUS_FIELDS: dict[str, type | tuple[type, ...]] = {
    "status": str, "job": int, "started": NUMBER, "finished": NUMBER, "overrides": list,
    "step": int, "signal": str, "kind": str, "reason": str, "log": str, "relaunch": str,
    "checkpoint": str}
PLAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "dp": int, "fsdp": int, "tp": int, "n_devices": int, "global_batch": int,
    "per_device_batch_size": int, "grad_accum": int, "platform": str}
SUMMARY_FIELDS: dict[str, type | tuple[type, ...]] = {k: NUMBER for k in (
    "train/loss", "eval/loss", "perf/tokens_per_s", "perf/tokens_per_s_per_device", "perf/mfu",
    "perf/checkpoint_block_s", "mem/step_bytes_per_device", "mem/peak_bytes_per_device",
    "compile_time_s", "goodput")}


def _read(job_dir: Path, file: str, parse: Any) -> Any:
    """``file`` of ``job_dir`` parsed; None when the job has none. Unreadable: a dir where the
    file should be, an empty file (JSON and YAML files are never written empty: the JSON ones
    atomically), a byte that is not UTF-8, a parse error."""
    path = job_dir / file
    if not path.exists():
        return None
    if not path.is_file():
        raise Unreadable(file, "a directory, not a file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unreadable(file, f"not UTF-8 text (byte {e.start})") from e
    except OSError as e:
        raise Unreadable(file, e.strerror or str(e)) from e
    if not text.strip():
        raise Unreadable(file, "empty")
    try:
        return parse(text)
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise Unreadable(file, f"not valid {'JSON' if parse is json.loads else 'YAML'} "
                               f"({str(e).splitlines()[0]})") from e


def _typed(file: str, value: Any, want: type, fields: dict[str, Any] | None = None) -> Any:
    """``value`` when it is a ``want`` whose ``fields`` are of their types (or null)."""
    if value is None:
        return None
    if not isinstance(value, want):
        raise Unreadable(file, f"a {type(value).__name__}, not a {want.__name__}")
    for key, kind in (fields or {}).items():
        got = value.get(key)
        if got is not None and (not isinstance(got, kind) or isinstance(got, bool)):
            raise Unreadable(file, f"{key} is {json.dumps(got)[:40]}, not a "
                                   f"{'number' if kind is NUMBER else kind.__name__}")
    return value


def _strings(file: str, value: Any) -> list[str]:
    if value is not None and not all(isinstance(o, str) for o in value):
        raise Unreadable(file, "a list of overrides holds something that is not a string")
    return list(value or [])


def read_job(job_dir: Path) -> JobRecord:
    """The job as its files say; a file that is not what a job writes makes it an unreadable
    failed job (kind ``unreadable``, the file and what is wrong as its reason)."""
    try:
        return _read_job(job_dir)
    except Unreadable as e:
        record = JobRecord(dir=job_dir, num=int(job_dir.name) if job_dir.name.isdigit() else None,
                           overrides=[], status="failed", kind="unreadable",
                           reason=f"{e.file} unreadable: {e.what}; the job is left out")
        record._rows = []  # its rows are not to be trusted either
        return record


def _read_job(job_dir: Path) -> JobRecord:
    status = _typed(STATUS, _read(job_dir, STATUS, json.loads), dict, STATUS_FIELDS) or {}
    summary = _typed("summary.json", _read(job_dir, "summary.json", json.loads), dict,
                     SUMMARY_FIELDS) or {}
    plan = _typed("plan.json", _read(job_dir, "plan.json", json.loads), dict, PLAN_FIELDS) or {}
    if plan and not all(isinstance(plan.get(axis), int) for axis in MESH_KEYS):
        raise Unreadable("plan.json", f"no {', '.join(MESH_KEYS[:-1])} and {MESH_KEYS[-1]} "
                         "(the mesh)")
    hydra_file, config_file = ".hydra/hydra.yaml", ".hydra/config.yaml"
    hydra = _typed(hydra_file, _read(job_dir, hydra_file, yaml.safe_load), dict) or {}
    hydra = _typed(hydra_file, hydra.get("hydra"), dict) or {}
    job = _typed(hydra_file, hydra.get("job"), dict) or {}
    hydra_num = job.get("num")  # a single run's is Hydra's "???": no job number
    hydra_num = hydra_num if isinstance(hydra_num, int) else None
    config = _typed(config_file, _read(job_dir, config_file, yaml.safe_load), dict) or {}
    _typed(config_file, config.get("data"), dict, {"batch_size": int})
    _typed(config_file, config.get("logger"), dict)
    overrides = _strings(STATUS, status.get("overrides")) or _strings(
        ".hydra/overrides.yaml", _typed(".hydra/overrides.yaml", _read(
            job_dir, ".hydra/overrides.yaml", yaml.safe_load), list))
    if (job_dir / "metrics.jsonl").exists() and not (job_dir / "metrics.jsonl").is_file():
        raise Unreadable("metrics.jsonl", "a directory, not a file")
    num = status.get("job", hydra_num)
    record = JobRecord(dir=job_dir, num=num, overrides=overrides, status="ok",
                       summary=summary, plan=plan, config=config,
                       started=status.get("started"), finished=status.get("finished"))
    state = status.get("status")
    if state == "stopped":
        record.status, record.kind = "stopped", status.get("signal")
        record.reason = (f"stopped by {status.get('signal')} at step {status.get('step')}, "
                         f"checkpoint {status.get('checkpoint')} committed; resume with: "
                         f"{status.get('relaunch')}")
    elif state == "failed":
        record.status, record.kind = "failed", status.get("kind", "crashed")
        record.reason, record.log = status.get("reason"), status.get("log")
    elif state == "running" or (state is None and not summary):
        # dxrun.0.log: process 0's log of a multi-process job
        log = next((p for p in (job_dir / "dxrun.log", job_dir / "dxrun.0.log") if p.is_file()),
                   job_dir / "dxrun.log")
        record.status, record.kind = "failed", "unfinished"
        record.reason = ("did not finish (killed, timed out, or still running)" if state
                         else "no summary.json: the job never finished")
        record.log = str(log) if log.is_file() else None
    return record


def find_jobs(sweep_dir: Path) -> list[JobRecord]:
    """Every job under ``sweep_dir``: a dir holding ``.hydra/`` (what a run claims first), in
    job order. Also works on a single run dir or a dir of single runs."""
    sweep_dir = Path(sweep_dir)
    dirs = {p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir()}
    jobs = [read_job(d) for d in dirs]
    return sorted(jobs, key=lambda j: (j.num is None, j.num if j.num is not None else 0,
                                       str(j.dir)))


def varying(jobs: list[JobRecord]) -> set[str]:
    """The overrides that are not the same for every job: what the sweep varied."""
    every = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    return {o for j in jobs for o in j.overrides} - every


def layout_groups(jobs: list[JobRecord]) -> list[tuple[str, list[JobRecord]]]:
    """Finished jobs of the same workload and global batch on more than one mesh, each with
    where it stands (``at batch 64``, plus any other override the sweep varied): the groups
    whose layouts the report ranks."""
    ok = [j for j in jobs if j.status == "ok" and j.mesh and j.windows()]
    vary = varying(jobs)
    out = []
    for key in sorted({(j.batch_size or 0, j.workload) for j in ok}):
        same = [j for j in ok if (j.batch_size or 0, j.workload) == key]
        if len({j.mesh for j in same}) < 2:
            continue
        rest = [o for o in key[1] if o in vary and not o.startswith("data.batch_size=")]
        out.append((" ".join([f"at batch {key[0]}", *rest]), same))
    return out


WEAK, STRONG = "weak", "strong"


def scaling_groups(jobs: list[JobRecord]) -> list[tuple[str, list[JobRecord]]]:
    """Finished jobs of the same workload (same overrides but the mesh) on more than one device
    count, with what the group held fixed: the global batch (strong scaling) or, with a global
    batch that grows, the per-device batch (weak scaling). A group that held neither is left
    out: its jobs differ in more than the devices."""
    ok = [j for j in jobs if j.status == "ok" and j.n_devices
          and j.throughput and j.throughput.per_device]
    out = []
    for key in sorted({j.workload for j in ok}):
        same = [j for j in ok if j.workload == key]
        if len({j.n_devices for j in same}) < 2:
            continue
        if len({j.batch_size for j in same}) == 1:
            out.append((STRONG, same))
        elif len({j.per_device_batch for j in same}) == 1:
            out.append((WEAK, same))
    return out


def scaling_efficiency(jobs: list[JobRecord]) -> dict[Path, tuple[str, float]]:
    """(kind, efficiency) of each job of a scaling group, against the group's fewest devices
    (with several meshes at that count, the fastest is the base), from each job's throughput
    statistic (``job_throughput``). Weak: tokens/s per device at
    n ÷ at the fewest. Strong: speed-up ÷ device ratio, (T_n / T_0) / (n / n_0), which is the
    same quotient of tokens/s per device; the kinds differ in what was held fixed."""
    out: dict[Path, tuple[str, float]] = {}
    for kind, same in scaling_groups(jobs):
        fewest = min(j.n_devices for j in same)
        base = max(j.throughput.per_device for j in same if j.n_devices == fewest)
        for j in same:
            out[j.dir] = (kind, j.throughput.per_device / base)
    return out


def overlapping(jobs: list[JobRecord]) -> list[tuple[JobRecord, JobRecord]]:
    """Pairs of finished jobs whose run times overlapped (a launcher running jobs side by
    side): their throughputs shared the machine and are not comparable."""
    timed = [j for j in jobs if j.started and j.finished and j.kind != "refused"]
    return [(a, b) for i, a in enumerate(timed) for b in timed[i + 1:]
            if a.started < b.finished and b.started < a.finished]


# ------------------------------------------------------------------------------------------------
# The sweep's PNG plots (matplotlib, no display), each drawn only when the sweep varied what
# it is plotted against: throughput by layout (mesh or devices varied), loss curves (one entry per
# workload), final loss vs each scalar varied (lr...), MFU vs batch size, weak/strong scaling.
# Each ``*_figure`` returns the matplotlib figure (or None), so a test reads its labels.

def _figure(panels: int = 1, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, height), dpi=100, squeeze=False)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, axes[0][0] if panels == 1 else list(axes[0])


def _save(fig: Any | None, path: Path) -> Path | None:
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _label(job: JobRecord, vary: set[str]) -> str:
    return " ".join(o for o in job.overrides if o in vary) or f"job {job.label_num}"


def _workload_label(job: JobRecord, vary: set[str]) -> str:
    """What a workload (a job's overrides but the mesh) varied: ``data.batch_size=64``."""
    return " ".join(o for o in job.workload if o in vary)


def varied_layouts(jobs: list[JobRecord]) -> bool:
    """The sweep ran finished jobs on more than one mesh or device count."""
    ok = [j for j in jobs if j.status == "ok" and j.mesh]
    return len({(j.mesh, j.n_devices) for j in ok}) > 1


def throughput_figure(jobs: list[JobRecord]) -> Any | None:
    """The layouts of each batch (and workload), fastest on top: a bar at the median tokens/s
    of the job's timing windows, its interquartile range as the error bar and every window a
    dot; each bar is labelled by its mesh on the y axis (one label a bar, so none overlap), and
    the legend names the batches. Drawn when the sweep varied the mesh or the devices."""
    if not varied_layouts(jobs):
        return None
    ok = [j for j in jobs if j.status == "ok" and j.mesh and j.windows()]
    if not ok:
        return None
    vary = varying(jobs)
    groups: dict[tuple, list[JobRecord]] = defaultdict(list)
    for j in ok:
        groups[(j.batch_size or 0, j.workload)].append(j)
    n_rows = len(ok) + len(groups) - 1  # a blank row between groups
    fig, ax = _figure(height=max(4.2, 0.28 * n_rows + 1.4))
    y, ticks, names = 0, [], []
    for i, (key, same) in enumerate(sorted(groups.items(), key=lambda kv: kv[0][0])):
        color = f"C{i % 10}"
        by_layout = {j.mesh: j for j in same}
        ranked = rank_layouts([layout_run(j) for j in same])
        rest = [o for o in key[1] if o in vary and not o.startswith("data.batch_size=")]
        label = " ".join([f"batch {key[0]}", *rest])
        for k, r in enumerate(ranked):
            ax.barh(y, r.median, xerr=[[r.median - r.q1], [r.q3 - r.median]], color=color,
                    alpha=0.75, capsize=3, label=label if k == 0 else None)
            ax.scatter(r.run.windows, [y] * len(r.run.windows), color="black", s=6, zorder=3)
            ticks.append(y)
            names.append(f"{r.layout} ({by_layout[r.layout].n_devices} dev)")
            y += 1
        y += 1
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()  # the first batch's fastest layout on top
    ax.set_xlabel("tokens/s (all devices): median of the timing windows, IQR bars, windows dots")
    ax.set_title("Throughput by layout, fastest first")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def loss_figure(jobs: list[JobRecord]) -> Any | None:
    """Train loss against tokens seen, one colour and one legend entry per workload: the jobs
    that differ only in their mesh draw the same curve (mesh equivalence), so the entry names
    their meshes instead of repeating the line."""
    curves = [(j, [r for r in j.metrics() if "train/loss" in r and "data/tokens_seen" in r])
              for j in jobs if j.status == "ok"]
    curves = [(j, rows) for j, rows in curves if rows]
    if not curves:
        return None
    fig, ax = _figure()
    vary = varying(jobs)
    groups: dict[tuple, list[tuple[JobRecord, list]]] = defaultdict(list)
    for j, rows in curves:
        groups[j.workload].append((j, rows))
    for i, (_, same) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0][0].batch_size
                                         or 0)):
        meshes = list(dict.fromkeys(j.mesh for j, _ in same if j.mesh))  # in job order
        label = _workload_label(same[0][0], vary) if len(same) > 1 or len(groups) > 1 else ""
        if len(same) > 1:
            shared = f"{len(same)} jobs" + (f": {', '.join(meshes)}" if meshes else "")
            label = f"{label} ({shared})" if label else shared
        label = label or _label(same[0][0], vary)
        for k, (_, rows) in enumerate(same):
            ax.plot([r["data/tokens_seen"] for r in rows], [r["train/loss"] for r in rows],
                    color=f"C{i % 10}", lw=1.2, label=label if k == 0 else None)
    floors = {r["data/entropy_floor"] for _, rows in curves for r in rows
              if "data/entropy_floor" in r}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="black", ls=":", lw=1, label="entropy floor")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7, ncol=2 if len(groups) > 8 else 1)
    return fig


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def scalar_keys(jobs: list[JobRecord]) -> list[str]:
    """The number-valued override keys the sweep varied (``optimizer.lr``), not the mesh or the
    devices, nor the batch size of a sweep that varied layouts (its question is throughput)."""
    ok = [j for j in jobs if j.status == "ok"]
    values: dict[str, set[float]] = defaultdict(set)
    for j in ok:
        for o in j.overrides:
            key, _, v = o.lstrip("+~").partition("=")
            if _number(v) is not None:
                values[key].add(_number(v))
    skip = {"runtime.cpu_devices"} | ({"data.batch_size", "data.per_device_batch_size"}
                                      if varied_layouts(jobs) else set())
    return [k for k in sorted(values) if len(values[k]) > 1 and k not in skip
            and k.split(".")[0] != "parallelism"]


def final_loss_figure(jobs: list[JobRecord]) -> Any | None:
    """Final loss (held-out where every job has one, else train) against each scalar the sweep
    varied, one panel a key (at most 3), the lowest marked."""
    keys = scalar_keys(jobs)[:3]
    ok = [j for j in jobs if j.status == "ok"]
    if not keys or not ok:
        return None
    metric = "eval/loss" if all(j.summary.get("eval/loss") is not None for j in ok) else "train/loss"
    ok = [j for j in ok if j.summary.get(metric) is not None]
    if not ok:
        return None
    fig, axes = _figure(len(keys))
    axes = [axes] if len(keys) == 1 else axes
    best = min(ok, key=lambda j: j.summary[metric])
    for ax, key in zip(axes, keys, strict=True):
        pts = []
        for j in ok:
            v = next((_number(o.partition("=")[2]) for o in j.overrides
                      if o.lstrip("+~").partition("=")[0] == key), None)
            if v is not None:
                pts.append((v, j.summary[metric], j is best))
        xs = [p[0] for p in pts]
        ax.scatter(xs, [p[1] for p in pts], color="C0", s=24, zorder=3)
        ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], marker="*",
                   s=160, color="C3", zorder=4, label=f"lowest: {_label(best, varying(jobs))}")
        if min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"final {metric}")
        ax.set_title(f"Final {metric} vs {key}")
        ax.legend(fontsize=7)
    return fig


def efficiency_figure(jobs: list[JobRecord]) -> Any | None:
    """MFU against batch size, one line per mesh; tokens/s per device where a job has no MFU
    (no known peak, e.g. CPUs); both the jobs' throughput statistic. Drawn when the sweep ran
    more than one batch size."""
    ok = [j for j in jobs if j.status == "ok" and j.batch_size
          and j.throughput and j.throughput.per_device]
    if len({j.batch_size for j in ok}) < 2:
        return None
    use_mfu = all(j.throughput.mfu is not None for j in ok)

    def value(j: JobRecord) -> float:
        return j.throughput.mfu if use_mfu else j.throughput.per_device

    fig, ax = _figure()
    meshes: dict[str, list[JobRecord]] = defaultdict(list)
    for j in ok:
        meshes[f"{j.mesh} ({j.n_devices} dev)"].append(j)
    for label, same in sorted(meshes.items(), key=lambda kv: (kv[1][0].n_devices, kv[0])):
        same = sorted(same, key=lambda j: j.batch_size)
        ax.plot([j.batch_size for j in same], [value(j) for j in same], "-o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({j.batch_size for j in ok})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("global batch size")
    ax.set_ylabel("MFU" if use_mfu else "tokens/s per device")
    ax.set_title("MFU vs batch size" if use_mfu else "Tokens/s per device vs batch size")
    ax.legend(fontsize=8)
    return fig


# What each kind plots against devices, its ideal (from the fewest devices, n0) and its title.
_SCALING = {
    WEAK: ("tokens/s per device", lambda y0, n0, n: y0, "ideal: the same tokens/s per device",
           "Weak scaling (per-device batch fixed)"),
    STRONG: ("speed-up over the fewest devices", lambda y0, n0, n: n / n0,
             "ideal: speed-up = device ratio", "Strong scaling (global batch fixed)"),
}


def scaling_figure(jobs: list[JobRecord]) -> Any | None:
    """One panel per kind of scaling group in the sweep (weak, strong): each group's best mesh
    at each device count (the jobs' throughput statistic, as the efficiency columns), and the
    dashed ideal of that kind from its fewest devices."""
    groups = scaling_groups(jobs)
    kinds = [k for k in (WEAK, STRONG) if any(kind == k for kind, _ in groups)]
    if not kinds:
        return None
    fig, axes = _figure(len(kinds))
    axes = [axes] if len(kinds) == 1 else axes
    vary = varying(jobs)
    for ax, kind in zip(axes, kinds, strict=True):
        ylabel, ideal, ideal_label, title = _SCALING[kind]
        mine = [same for k, same in groups if k == kind]
        for i, same in enumerate(mine):
            best: dict[int, float] = {}
            for j in same:
                best[j.n_devices] = max(best.get(j.n_devices, 0.0), j.throughput.per_device)
            xs = sorted(best)
            n0 = xs[0]
            # tokens/s per device (weak); speed-up T_n / T_0 = (t_n * n) / (t_0 * n0) (strong)
            ys = [best[n] if kind == WEAK else best[n] * n / (best[n0] * n0) for n in xs]
            held = (f"per-device batch {same[0].per_device_batch}" if kind == WEAK
                    else f"global batch {same[0].batch_size}")
            rest = [o for o in same[0].workload if o in vary and "batch_size=" not in o]
            ax.plot(xs, ys, "-o", color=f"C{i % 10}", label=" ".join([held, *rest]))
            ax.plot(xs, [ideal(ys[0], n0, n) for n in xs], "--", color=f"C{i % 10}", alpha=0.5)
        ax.plot([], [], "--", color="gray", label=ideal_label)
        ax.set_xscale("log", base=2)
        ticks = sorted({j.n_devices for same in mine for j in same})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    return fig


# (file stem, figure function) in report order; each draws only when the sweep varied what
# it plots against.
FIGURES = [("throughput", throughput_figure), ("loss", loss_figure),
           ("final_loss", final_loss_figure), ("efficiency", efficiency_figure),
           ("scaling", scaling_figure)]


def write_plots(sweep_dir: Path, jobs: list[JobRecord]) -> list[Path]:
    made = [_save(draw(jobs), sweep_dir / f"{name}.png") for name, draw in FIGURES]
    return [p for p in made if p is not None]


# ------------------------------------------------------------------------------------------------
# The report's plots and table into the sweep's W&B group, as one extra run of job type
# ``sweep-report`` beside the jobs. Never fatal: the files in the sweep dir are the report.

def wandb_target(sweep_dir: Path, jobs: list[JobRecord]) -> dict[str, Any] | None:
    """Project, entity, group and mode the jobs logged to (their saved configs); None when
    they did not log to W&B."""
    loggers = [j.config.get("logger", {}) for j in jobs if j.config]
    loggers = [lc for lc in loggers if lc.get("name") == "wandb"]
    if not loggers:
        return None
    groups = Counter(lc.get("group") for lc in loggers if lc.get("group"))
    lc = loggers[0]
    mode = lc.get("mode") or os.environ.get("WANDB_MODE") or "offline"
    if mode == "disabled":
        return None
    return {"project": lc.get("project"), "entity": lc.get("entity"), "mode": mode,
            "group": groups.most_common(1)[0][0] if groups else sweep_group(sweep_dir)}


def upload_report(sweep_dir: Path, jobs: list[JobRecord], table: list[dict[str, Any]],
                  pngs: list[Path]) -> str | None:
    """Log the plots (as images) and the table to a ``report-<group>`` run; returns the
    group, or None when W&B was off or the upload failed (one warning)."""
    target = wandb_target(sweep_dir, jobs)
    if target is None:
        return None
    try:
        import wandb

        run = wandb.init(project=target["project"], entity=target["entity"],
                         group=target["group"], job_type="sweep-report",
                         name=f"report-{target['group']}", dir=str(sweep_dir),
                         mode=target["mode"], reinit="finish_previous",
                         config={"sweep_dir": str(sweep_dir), "n_jobs": len(jobs)})
        try:
            columns = list(table[0]) if table else []
            data = [[None if v is None else (v if isinstance(v, (int, float)) else str(v))
                     for v in row.values()] for row in table]
            run.log({**{f"report/{p.stem}": wandb.Image(str(p)) for p in pngs},
                     "report/jobs": wandb.Table(columns=columns, data=data)})
        finally:
            run.finish()
        log.info("sweep report uploaded to W&B group %s (%s)", target["group"], target["mode"])
        return target["group"]
    except Exception as e:  # noqa: BLE001 - the report on disk is what counts
        log.warning("W&B upload of the sweep report failed (%s); the report is in %s", e,
                    sweep_dir)
        return None


# ------------------------------------------------------------------------------------------------
# ``report.md`` and ``report.csv``: one row per job. The CSV holds the numbers unrounded (the
# jobs' ``summary.json`` figures, and their throughput statistic: ``collect.job_throughput``); the
# Markdown rounds them for reading.

def _summary(key: str) -> Callable[[JobRecord], Any]:
    return lambda j: j.summary.get(key)


def _throughput(field: str) -> Callable[[JobRecord], Any]:
    return lambda j: getattr(j.throughput, field) if j.throughput else None


# (column, value of a job, Markdown format) in report order.
COLUMNS: list[tuple[str, Callable[[JobRecord], Any], Callable[[Any], str]]] = [
    ("job", lambda j: j.label_num, str),
    ("status", lambda j: j.status if j.status == "ok" else f"{j.status} ({j.kind})", str),
    ("overrides", lambda j: " ".join(j.overrides), lambda v: f"`{v}`" if v else ""),
    ("mesh", lambda j: j.mesh, str),
    ("devices", lambda j: j.n_devices, str),
    ("batch_size", lambda j: j.batch_size, str),
    ("per_device_batch", lambda j: j.per_device_batch, str),
    ("train_loss", _summary("train/loss"), "{:.4f}".format),
    ("eval_loss", _summary("eval/loss"), "{:.4f}".format),
    # The job's throughput statistic (collect.job_throughput), the number the ranking sorts by;
    # never the last window alone, which is the one the final checkpoint save is recorded in.
    ("tokens_per_s", _throughput("median"), "{:,.0f}".format),
    ("tokens_per_s_windows", lambda j: len(j.windows()) or None, str),
    ("tokens_per_s_per_device", _throughput("per_device"), "{:,.0f}".format),
    ("mfu", _throughput("mfu"), "{:.2%}".format),
    # Filled in from the whole sweep: each job's group held one of the two batches fixed.
    (f"{WEAK}_scaling_efficiency", None, "{:.2f}".format),
    (f"{STRONG}_scaling_efficiency", None, "{:.2f}".format),
    # What the job's compiled step needs per device (every backend), and the allocator's
    # high-water mark where the backend keeps one (GPU/TPU) and it rose during the job.
    ("step_mem_bytes_per_device", _summary("mem/step_bytes_per_device"),
     lambda v: f"{v / 2**20:,.1f} MiB"),
    ("peak_mem_bytes_per_device", _summary("mem/peak_bytes_per_device"),
     lambda v: f"{v / 2**20:,.1f} MiB"),
    ("compile_time_s", _summary("compile_time_s"), "{:.2f}".format),
    ("goodput", _summary("goodput"), "{:.1%}".format),  # productive step time / wall time
    ("reason", lambda j: j.reason, str),
    ("log", lambda j: j.log, str),
]


def rows(jobs: list[JobRecord]) -> list[dict[str, Any]]:
    scaling = scaling_efficiency(jobs)
    out = []
    for j in jobs:
        kind, eff = scaling.get(j.dir, (None, None))
        row = {name: (eff if name == f"{kind}_scaling_efficiency" else None) if get is None
               else get(j) for name, get, _ in COLUMNS}
        out.append(row)
    return out


def rankings(jobs: list[JobRecord]) -> list[tuple[str, list[Ranked]]]:
    """Each group of jobs that differ only in their mesh (``at batch 64``) with its layouts
    ranked."""
    return [(where, rank_layouts([layout_run(j) for j in same]))
            for where, same in layout_groups(jobs)]


def headline(jobs: list[JobRecord], ranked: list[tuple[str, list[Ranked]]]) -> str | None:
    """The answer to the sweep's question, for the report's first line: the fastest layout
    at each batch (or that the fastest two cannot be told apart); else, for a sweep of other
    settings, the job with the lowest final loss. None when neither applies."""
    if ranked:
        return "; ".join(verdict(r, where) for where, r in ranked)
    ok = [j for j in jobs if j.status == "ok"]
    metric = "eval/loss" if ok and all(j.summary.get("eval/loss") is not None for j in ok) \
        else "train/loss"
    ok = [j for j in ok if j.summary.get(metric) is not None]
    vary = varying(jobs)
    if len(ok) < 2 or not vary:
        return None
    best = min(ok, key=lambda j: j.summary[metric])
    named = " ".join(o for o in best.overrides if o in vary)
    return f"lowest final {metric}: {named} ({best.summary[metric]:.4f})"


def write_csv(path: Path, table: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c, _, _ in COLUMNS])
        w.writeheader()
        for row in table:
            w.writerow({k: "" if v is None else v for k, v in row.items()})


def _cell(value: Any, fmt: Callable[[Any], str]) -> str:
    return "–" if value is None or value == "" else fmt(value).replace("|", "\\|")


def markdown(sweep_dir: Path, jobs: list[JobRecord], table: list[dict[str, Any]],
             plots: list[Path], extra: list[str],
             ranked: list[tuple[str, list[Ranked]]] | None = None) -> str:
    first = headline(jobs, ranked or [])
    lines = ([f"# {first}", "", f"Sweep report: `{sweep_dir}`"] if first
             else [f"# Sweep report: `{sweep_dir}`"])
    lines += ["", f"{tally(jobs)}.", ""]
    statistic = statistic_sentence(jobs)
    lines += [statistic, ""] if statistic else []
    lines += extra
    for where, r in ranked or []:
        lines += [f"## Layouts ranked {where}", "", verdict(r, where) + ".", ""]
        lines += ranking_table(r)
        lines += [""]
    if ranked:
        lines += ["Spread: the interquartile range of a job's timing windows. A layout is faster "
                  "beyond the spread when its lower quartile is above the other's upper one.",
                  "", "## Jobs", ""]
    shown = [(c, f) for c, _, f in COLUMNS if c not in ("reason", "log")]
    lines += ["| " + " | ".join(c for c, _ in shown) + " |",
              "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_cell(row[c], f) for c, f in shown) + " |" for row in table]
    stopped = [j for j in jobs if j.status == "stopped"]
    if stopped:  # not failures: each continues from its checkpoint
        lines += ["", "## Stopped jobs (resumable)", ""]
        lines += [f"- job {j.label_num}: {j.reason}" for j in stopped]
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- job {j.label_num} ({j.kind}): {j.reason}" + (f" — log: `{j.log}`"
                                                                   if j.log else "")
                  for j in failed]
    skipped = [j for j in jobs if j.metrics() is not None and j.skipped_lines]
    if skipped:  # the job is reported from its other rows
        lines += ["", "## Lines left out", ""]
        lines += [f"- job {j.label_num}: {j.skipped_lines} line(s) of metrics.jsonl cut short or "
                  "damaged (a killed job?); its other rows are reported" for j in skipped]
    lines += ["", "Columns: losses are the final train / held-out loss (nats/token); tokens_per_s "
              "counts all devices together; per_device_batch is what one data "
              "replica computes at once (global = per-device x dp x fsdp x train.grad_accum). "
              "Jobs with the same overrides but the mesh form a scaling group: weak scaling "
              "when they share the per-device batch (the global batch grows with the devices), "
              "efficiency = tokens/s per device at n devices / at the fewest; strong scaling "
              "when they share the global batch, efficiency = speed-up / device ratio. Peak "
              "memory and compile time are the job's own compiled step."]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(sweep_dir: Path, upload: bool = False) -> list[JobRecord]:
    """Write report.md, report.csv and the plots into ``sweep_dir``; with ``upload`` also to
    the sweep's W&B group when its jobs logged to W&B. Raises ConfigError for a dir that
    holds no jobs."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError(f"{sweep_dir} is not a directory; give a multirun dir, e.g. "
                          "multirun/<date>/<time>")
    jobs = find_jobs(sweep_dir)
    if not jobs:
        raise ConfigError(f"{sweep_dir} holds no jobs (no job dir with .hydra/ below it); give a "
                          "multirun dir, e.g. multirun/<date>/<time>")
    for j in jobs:
        if j.kind == "unreadable":  # its files are not a job's: the others are reported
            log.warning("%s: %s", j.dir, j.reason)
    table = rows(jobs)
    write_csv(sweep_dir / "report.csv", table)
    pngs = write_plots(sweep_dir, jobs)
    extra = []
    if scaling_efficiency(jobs) and any(j.plan.get("platform") == "cpu" for j in jobs):
        extra += ["**Note:** these jobs ran on simulated CPU devices, which share this host's "
                  "cores: the scaling efficiencies measure the partitioning overhead (XLA's "
                  "sharded program and its collectives), not how hardware scales.", ""]
    pairs = overlapping(jobs)
    if pairs:
        extra += [f"**Warning:** {len(pairs)} pair(s) of jobs ran at the same time (e.g. jobs "
                  f"{pairs[0][0].label_num} and {pairs[0][1].label_num}): their tokens/s shared "
                  "the machine and are not comparable; run a throughput sweep one job at a "
                  "time (the default launcher).", ""]
    results = sweep_dir / "optimization_results.yaml"
    if results.is_file():
        import yaml

        best = yaml.safe_load(results.read_text()) or {}
        params = " ".join(f"{k}={v}" for k, v in (best.get("best_params") or {}).items())
        extra += [f"Optuna best: {best.get('best_value')} with `{params}` "
                  "(optimization_results.yaml)", ""]
    (sweep_dir / "report.md").write_text(markdown(sweep_dir, jobs, table, pngs, extra,
                                                  rankings(jobs)))
    if upload:
        upload_report(sweep_dir, jobs, table, pngs)
    return jobs


# ------------------------------------------------------------------------------------------------
# The Hydra callback that writes the sweep report at the end of every multirun (registered
# in conf/config.yaml under hydra.callbacks), and the sweep's exit code the launcher takes from
# its jobs (``exit_for_failed_jobs``). Light to import: every run instantiates it.

class SweepReport(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # the sweep's exit code, read from its jobs once Hydra returns (``runtime.SWEEP_EXITS``)
        SWEEP_EXITS.append(functools.partial(exit_for_failed_jobs, Path(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_main():
            return  # process 0 of a multi-process sweep writes the one report
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            jobs = write_report(sweep_dir, upload=True)
            log.info("sweep report (%s): %s", tally(jobs), sweep_dir / "report.md")
        except Exception as e:  # noqa: BLE001 - a report problem must not fail the sweep
            log.warning("sweep report not written (%s); retry with: python -m dxrun.report %s",
                        e, sweep_dir)


def exit_for_failed_jobs(sweep_dir: Path) -> None:
    """Exit non-zero naming the failed jobs, read from their status.json like the report
    does: this also covers jobs that ran in other processes (submitit) or were killed.

    A job stopped by a signal after committing its checkpoint did not fail: it is named with
    its resume command, and with no failed job the sweep exits as a stopped single run does,
    0 for SIGTERM (a scheduler's requeue point) and 130 once any job was stopped by SIGINT."""
    jobs = find_jobs(sweep_dir)
    stopped = [j for j in jobs if j.status == "stopped"]
    for j in stopped:
        print(f"dxrun: job #{j.label_num} {j.reason}", file=sys.stderr)
    failed = [j for j in jobs if j.status == "failed"]
    if failed:
        names = "; ".join(f"#{j.label_num} ({' '.join(j.overrides)})" for j in failed)
        fail(f"{len(failed)} sweep job(s) failed: {names} (details: {sweep_dir}/report.md)",
              code=EXIT_REFUSED if all(j.kind == "refused" for j in failed) else EXIT_CRASHED)
    if any(j.kind == "SIGINT" for j in stopped):
        sys.exit(EXIT_CODES["SIGINT"])
