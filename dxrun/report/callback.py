"""The Hydra callback that writes the sweep report at the end of every multirun (registered
in conf/config.yaml under hydra.callbacks), and the sweep's exit code the launcher takes from
its jobs (``exit_for_failed_jobs``). Light to import: every run instantiates it."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dxrun.config import EXIT_CODES, EXIT_CRASHED, EXIT_REFUSED, fail
from dxrun.report.sweep import find_jobs, tally, write_report
from dxrun.run.runtime import SWEEP_EXITS, is_main

log = logging.getLogger("dxrun")


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
