"""The sweep report: one row per job of a multirun, read back from the job dirs alone
(``collect``), written as ``report.md`` / ``report.csv`` (``table``) with PNG plots (``plots``),
uploaded to the sweep's W&B group (``publish``), its layouts ranked by measured tokens/s in the
format ``parallelism=auto`` shares (``ranking``); run by a Hydra callback at the end of every
multirun (``callback``) or by ``python -m dxrun.report <sweep dir>``."""

from dxrun.report.collect import JobRecord, find_jobs
from dxrun.report.ranking import LayoutRun, Ranked, rank_layouts, ranking_table, verdict
from dxrun.report.table import write_report

__all__ = ["JobRecord", "LayoutRun", "Ranked", "find_jobs", "rank_layouts", "ranking_table",
           "verdict", "write_report"]
