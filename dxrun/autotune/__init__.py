"""The autotune wing, entered for ``parallelism=auto``'s layout search and ``run.mode=plan`` alone:
the search (``search``: the fastest layout that fits, with its budget rule), its timed turns
(``timing``) and its cache (``cache``); a compiled step's footprint and estimate (``footprint``)
with the collectives read from its HLO (``hlo``); and plan mode (``plan_mode``: the decision
reported for a target, training nothing) with its advice for a plan that does not fit
(``advice``). The pure rules they apply live in ``dxrun.cost`` and ``dxrun.plan``.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.autotune.advice import (
    GROWTH, Setting, StateShapes, advice_text, fastest_that_fits, price, settings)
from dxrun.autotune.cache import (
    CACHE_SCHEMA, cache_key, cache_path, read_cache, write_cache)
from dxrun.autotune.footprint import (
    accelerator_memory, cost_per_device, footprint, kernel_on)
from dxrun.autotune.hlo import (
    collective_lines, collective_list, collective_traffic, collectives, dots, instances,
    partitioned, per_iteration, replica_groups)
from dxrun.autotune.plan_mode import (
    memory_rows, plan_report, plan_table, planned, run_plan)
from dxrun.autotune.search import (
    search, start_layout, worth_it)
from dxrun.autotune.timing import (
    time_layouts)
