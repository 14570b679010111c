"""Hugging Face checkpoints in and out (``model.init_from=hf:<dir>``, ``python -m dxrun.export``):
the one table of which HF tensor becomes which dxrun weight, and how (import, export and the
guide read it: ``docs/guide/huggingface.md`` prints ``TABLES``), a HF directory's weights read
lazily by it, and a run's parameters written as a HF directory. The ``config.json`` side is the
config family's (``dxrun.config.hf_model``); the weights placed into a run's shards are the
experiment's (``dxrun.experiment.import_params``). No JAX: numpy in, numpy out, so the export
command imports it before JAX starts. The table and its conversions are ``layout``, the reader
``reader``, the writer ``writer``; this face re-exports what the rest of dxrun uses.
"""

from __future__ import annotations

from dxrun.hf.layout import (
    BUFFERS,
    NORM_NAMES,
    SAME,
    TABLES,
    TRANSPOSED,
    Weight,
    dims,
    dxrun_block,
    hf_name,
    output_axis,
    shape_of,
    to_dxrun,
    to_hf,
    weights,
)
from dxrun.hf.reader import FLAX, INDEX, OTHER_LAYOUTS, SINGLE, HFWeights, first, weight_files
from dxrun.hf.writer import MAX_SHARD_BYTES, hf_tensors, plan_files, save_hf

__all__ = ["BUFFERS", "FLAX", "INDEX", "MAX_SHARD_BYTES", "NORM_NAMES", "OTHER_LAYOUTS", "SAME",
           "SINGLE", "TABLES", "TRANSPOSED", "HFWeights", "Weight", "dims", "dxrun_block",
           "first", "hf_name", "hf_tensors", "output_axis", "plan_files", "save_hf",
           "shape_of", "to_dxrun", "to_hf", "weight_files", "weights"]
