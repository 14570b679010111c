"""The sweep report, what the rest may use: one row per job of a multirun, read back from the
job dirs alone, written as ``report.md`` / ``report.csv`` with PNG plots, uploaded to the sweep's
W&B group, its layouts ranked by measured tokens/s in the format ``parallelism=auto`` shares;
written by a Hydra callback at the end of every multirun (``SweepReport``, built in a multirun
only: a single run loads nothing of this package) or by ``python -m dxrun.report <sweep dir>``.

- ``ranking.py``: layouts ranked by tokens/s with their spread (pure numbers).
- ``collect.py``: the jobs read back from their dirs.
- ``plots.py``: the PNG plots.
- ``write.py``: report.md, report.csv, the W&B upload, the callback and the sweep's exit code.
"""

from dxrun.report.collect import JobRecord, find_jobs, job_throughput, scaling_efficiency, tally
from dxrun.report.ranking import LayoutRun, Ranked, rank_layouts, ranking_table, verdict
from dxrun.report.write import SweepReport, exit_for_failed_jobs, write_report

__all__ = ["JobRecord", "LayoutRun", "Ranked", "SweepReport", "exit_for_failed_jobs",
           "find_jobs", "job_throughput", "rank_layouts", "ranking_table", "scaling_efficiency",
           "tally", "verdict", "write_report"]
