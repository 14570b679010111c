"""The config family: what a run is asked to do, and its refusal in one line. Every key of
the run config written once (``schema``, the parallelism and distributed sections in
``schema_parallel``; a key's facts in ``key``), registered with Hydra with its resolvers and
presets (``registry``), every metric's name (``metric_names``), a Hugging Face checkpoint's
``config.json`` read as the model section and written back (``hf_model``), your own factories
behind ``_target_`` (``target``), and how a run ends: its outcomes, status and exit codes
(``errors``). The command line and the composed values are checked by ``dxrun.checks``.

No JAX import: the device count is decided from the composed config before JAX starts.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The family's face: what the rest of dxrun imports (``from dxrun.config import ConfigError,
# RunConfig``), each name still in its module. The registry sits apart: it imports Hydra.
from dxrun.config.errors import (
    DISK_ERRNOS, EXIT_CODES, EXIT_CRASHED, EXIT_REFUSED, FAILED, OK, RUNNING, STOPPED, UNFINISHED,
    CheckpointGone, CheckpointReadError, ConfigError, DiskError, Interrupted, NonFiniteError,
    NothingToTrain, Stopped, disk_error, fail, first_line, named_line)
from dxrun.config.key import (
    BATCH, FRACTION, INT32, NON_NEGATIVE, POSITIVE, Choices, Range, key, ranges_table, section,
    walk)
from dxrun.config.schema import (
    BACKENDS, DATA_SOURCE_KEYS, FIELDS, GLOBAL, NULLABLE, PER_DEVICE, RANGES, UNRANGED,
    CheckpointConfig, DataConfig, EarlyStopConfig, EvalConfig, LoggerConfig, ModelConfig,
    MoEConfig, OptimizerConfig, PlanConfig, ProfileConfig, RunConfig, RunSection, RuntimeConfig,
    TrainConfig, choices_of, expert_d_ff, head_dim_of, moe_layers, null_is_a_value,
    ranges_markdown)
from dxrun.config.schema_parallel import (
    AXES, FILLS, INSIDE, SPANS, Axis, DistributedConfig, ParallelismConfig, axis_sizes)
from dxrun.config.target import (
    PASSES, call_refusal, check_targets, checked_factory, locate)

import importlib
from typing import Any

# A Hugging Face config.json's names, imported from ``hf_model`` when first asked for: the
# model package, which imports this face, loads none of the families' tables.
_HF = ("ARCHITECTURES", "HF_PREFIX", "HF_TYPES", "LLAMA_LIKE", "apply_hf_model",
       "check_rope_scaling", "config_json", "hf_dir", "model_type_of", "read_config")


def __getattr__(name: str) -> Any:
    if name not in _HF:
        raise AttributeError(f"module 'dxrun.config' has no attribute {name!r}")
    return getattr(importlib.import_module("dxrun.config.hf_model"), name)
