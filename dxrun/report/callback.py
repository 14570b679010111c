"""The Hydra callback that writes the sweep report at the end of every multirun (registered
in conf/config.yaml under hydra.callbacks). Light to import: every run instantiates it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dxrun.multihost.distributed import is_main
from dxrun.report.collect import tally
from dxrun.report.table import write_report

log = logging.getLogger("dxrun")


# Sweep dirs of the multiruns started in this process: after Hydra returns, the launcher
# (dxrun.__main__.cli) reads the jobs' status.json there for its exit code. Hydra keeps no
# handle on the sweep dir once the multirun is over, and with submitit the jobs ran elsewhere.
SWEEP_DIRS: list[Path] = []


class SweepReport(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SWEEP_DIRS.append(Path(config.hydra.sweep.dir))

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
