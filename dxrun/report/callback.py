"""The Hydra callback that writes the sweep report at the end of every multirun (registered
in conf/config.yaml under hydra.callbacks). Light to import: every run instantiates it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("dxrun")


# Sweep dirs of the multiruns started in this process: after Hydra returns, the launcher
# (dxrun.__main__.cli) reads the jobs' status.json there for its exit code. Hydra keeps no
# handle on the sweep dir once the multirun is over, and with submitit the jobs ran elsewhere.
SWEEP_DIRS: list[Path] = []


def _main_process() -> bool:
    if "jax" not in sys.modules:  # no job ran JAX: a single process
        return True
    import jax

    return not jax.distributed.is_initialized() or jax.process_index() == 0


class SweepReport(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SWEEP_DIRS.append(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not _main_process():
            return  # process 0 of a multi-process sweep writes the one report
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            from dxrun.report.table import write_report

            jobs = write_report(sweep_dir, upload=True)
            n_ok = sum(j.status == "ok" for j in jobs)
            log.info("sweep report (%d ok, %d failed): %s", n_ok, len(jobs) - n_ok,
                     sweep_dir / "report.md")
        except Exception as e:  # noqa: BLE001 - a report problem must not fail the sweep
            log.warning("sweep report not written (%s); retry with: python -m dxrun.report %s",
                        e, sweep_dir)
