"""What a plan costs, and the choices priced by it (pure: values in, values out, no JAX): the
targets a plan is made for and the share of their memory a run gets (``targets``), model FLOPs,
peaks and MFU (``flops``), the save cadence and what a save costs (``cadence``),
``parallelism=auto``'s layouts and the rules that rank them (``layouts``) and the search's
record as the log reads it (``search_record``). The accelerator models that estimate one step
on a target are ``dxrun.estimates``', read by the layout search and plan mode alone.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.cost.cadence import (
    MAX_CHECKPOINT_OVERHEAD, cadence_text, checkpoint_cost, checkpoint_line, minutes_for_overhead,
    save_cadence)
from dxrun.cost.flops import (
    GATED, PEAK_TFLOPS, RECOMPUTE_MATMULS, active_d_ff, active_params, attention_flops,
    block_matmul_flops, flops_per_token, is_causal, matmul_params, mfu, normalize_kind,
    peak_tflops, step_flops)
from dxrun.cost.layouts import (
    MEASURE_ROUNDS, MEASURE_STEPS, PRUNE, REMATS, SEARCHES, Row, TooLarge, candidates,
    chosen_layout, fit_variants, gib_text, held_batch, measure_rule, measure_stage, meshes,
    model_choice, model_stage, ms_text, resumed_layout, rows_of, s_text, search_cost, searches,
    survivors, time_every, to_measure, train_budget, train_through, unused_axes)
from dxrun.cost.search_record import (
    markdown, table)
from dxrun.cost.targets import (
    GB, TARGETS, TPU_USABLE, USABLE, USABLE_CPU, GiB, Target, Usable, gb_text, gpu_memory_fraction,
    plan_platform, target_key, usable_bytes, usable_share)
