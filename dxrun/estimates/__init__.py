"""One train step estimated on a GPU or TPU target from the model's shapes and the plan (pure:
values in, values out, no JAX): its time (``time_model``: ``COST``, calibrated per accelerator),
its per-device memory (``memory_model``), its fit and speed from the figures counted
(``step_fit``), and what plan mode says beside them (``plan_notes``). Read by the layout search
and plan mode (``dxrun.autotune``); a run that neither searches nor plans loads none of it.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.estimates.memory_model import (
    REMAT, MemoryEstimate, Shapes, disagreement, estimate_memory, gather_bytes, head_bytes,
    layer_none, layer_saved, shapes, working_set)
from dxrun.estimates.plan_notes import (
    exposed_warning, fit_warning, kv_heads_warning, preset_note, shape_line, tflops_per_device,
    unsplit_warning)
from dxrun.estimates.step_fit import (
    Footprint, StepEstimate, estimate, shape_warning)
from dxrun.estimates.time_model import (
    COST, ESTIMATE_BASIS, Workload, collective_time, step_time, workload)
