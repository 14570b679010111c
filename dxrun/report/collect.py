"""A sweep read back from its job dirs: ``.hydra/`` (overrides, config), ``status.json``,
``plan.json``, ``summary.json`` and ``metrics.jsonl``. Nothing else, so a sweep copied back from
a cluster reads the same. No JAX here.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from dxrun.config import AXES
from dxrun.plan import Layout, Sizes
from dxrun.report.ranking import LayoutRun
from dxrun.run import STATUS
from dxrun.tracking import read_metrics

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
    # an axis a plan.json from before it does not name is of size 1 (the expert axis)
    if plan and not all(isinstance(plan.get(axis, 1), int) for axis in MESH_KEYS) or (
            plan and not any(axis in plan for axis in MESH_KEYS)):
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
