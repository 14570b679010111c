"""The report written: ``report.md`` and ``report.csv`` (one row per job) with the plots, uploaded
to the sweep's W&B group; and the Hydra callback that writes it at the end of every multirun
(``SweepReport``, built in a multirun only) with the sweep's exit code taken from its jobs.
"""

from __future__ import annotations

import csv
import functools
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dxrun.config import EXIT_CODES, EXIT_CRASHED, EXIT_REFUSED, ConfigError, fail
from dxrun.report.collect import (
    STRONG,
    WEAK,
    JobRecord,
    find_jobs,
    layout_groups,
    layout_run,
    overlapping,
    scaling_efficiency,
    statistic_sentence,
    tally,
    varying,
)
from dxrun.report.plots import write_plots
from dxrun.report.ranking import Ranked, rank_layouts, ranking_table, verdict
from dxrun.run import SWEEP_EXITS, is_main, sweep_group

log = logging.getLogger("dxrun")


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
