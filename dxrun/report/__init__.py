"""The sweep report (``sweep``): one row per job of a multirun, read back from the job dirs
alone, written as ``report.md`` / ``report.csv`` with PNG plots, uploaded to the sweep's W&B
group, its layouts ranked by measured tokens/s in the format ``parallelism=auto`` shares; run
by a Hydra callback at the end of every multirun (``sweep.SweepReport``) or by ``python -m dxrun.report
<sweep dir>``."""

from dxrun.report.sweep import (
    JobRecord,
    LayoutRun,
    Ranked,
    find_jobs,
    rank_layouts,
    ranking_table,
    verdict,
    write_report,
)

__all__ = ["JobRecord", "LayoutRun", "Ranked", "find_jobs", "rank_layouts", "ranking_table",
           "verdict", "write_report"]
