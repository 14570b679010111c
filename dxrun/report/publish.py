"""The report's plots and table into the sweep's W&B group, as one extra run of job type
``sweep-report`` beside the jobs. Never fatal: the files in the sweep dir are the report."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

from dxrun.report.collect import JobRecord
from dxrun.run.runtime import sweep_group

log = logging.getLogger("dxrun")


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
