"""What a plan costs on an accelerator, and the choices priced by it (pure: values in, values out,
no JAX): the targets and the share of their memory a run gets (``targets``), model FLOPs, peaks
and MFU (``flops``), one step's time (``time_model``) and per-device memory (``memory_model``)
on a GPU or TPU target, the fit and speed of a step (``estimate``), what plan mode says beside
its figures (``plan_notes``), the save cadence (``cadence``), ``parallelism=auto``'s layouts and
the rules that rank them (``layouts``) and the search's record as the log reads it
(``search_record``).
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.cost.cadence import (
    MAX_CHECKPOINT_OVERHEAD, cadence_text, checkpoint_cost, checkpoint_line, minutes_for_overhead,
    save_cadence)
from dxrun.cost.estimate import (
    Footprint, StepEstimate, estimate, overrides_to_try, shape_warning)
from dxrun.cost.flops import (
    PEAK_TFLOPS, attention_flops, flops_per_token, is_causal, matmul_params, mfu, normalize_kind,
    peak_tflops, step_flops)
from dxrun.cost.layouts import (
    MEASURE_ROUNDS, MEASURE_STEPS, PRUNE, REMATS, SEARCHES, Row, TooLarge, candidates,
    chosen_layout, fit_variants, gib_text, held_batch, measure_rule, measure_stage, meshes,
    model_choice, model_stage, ms_text, resumed_layout, rows_of, s_text, search_cost, searches,
    survivors, time_every, to_measure, train_budget, train_through)
from dxrun.cost.memory_model import (
    REMAT, MemoryEstimate, Shapes, disagreement, estimate_memory, gather_bytes, head_bytes,
    layer_none, layer_saved, shapes, working_set)
from dxrun.cost.plan_notes import (
    exposed_warning, fit_warning, kv_heads_warning, preset_note, shape_line, tflops_per_device,
    unsplit_warning)
from dxrun.cost.search_record import (
    markdown, table)
from dxrun.cost.targets import (
    GB, TARGETS, TPU_USABLE, USABLE, USABLE_CPU, GiB, Target, Usable, gb_text, gpu_memory_fraction,
    plan_platform, target_key, usable_bytes, usable_share)
from dxrun.cost.time_model import (
    COST, ESTIMATE_BASIS, Workload, collective_time, step_time, workload)
