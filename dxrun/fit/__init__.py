"""A run fitted to its devices, on every run's path beside the trainer: the run's decision
(``decide``: the layout, the batch, the save cadence, the resume, carried in ``Decided``), the
memory preflight that refuses a step which will not fit (``preflight``), where a compiled step's
memory goes, written beside a refusal or an out-of-memory crash (``memory_report``), and this
host's own figures: its memory, its matmul peak, its bandwidth (``host``). The layout search and
plan mode, which build on these, are ``dxrun.autotune``'s; a fixed layout loads none of it.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.fit.decide import (
    Decided, Handover, decide)
from dxrun.fit.host import (
    HOST_FILE, cpu_device_budget, device_budget, host_figure, matmul_probe, measure_peak_tflops,
    resolve_peak, resolve_target)
from dxrun.fit.memory_report import (
    BREAKDOWN_FILE, HLO_DTYPE_BYTES, OutOfMemory, breakdown, is_out_of_memory, shape_bytes,
    write_breakdown, xla_need)
from dxrun.fit.preflight import (
    NoData, compile_checked, first_that_fits, memory_preflight, overrides_to_try, state_bytes)
