"""Hugging Face checkpoints in and out (``model.init_from=hf:<dir>``, ``python -m dxrun.export``):
the one table of which HF tensor becomes which dxrun weight, and how (import, export and the
guide read it: ``docs/guide/huggingface.md`` prints ``TABLES``), a HF directory's weights read
lazily by it, and a run's parameters written as a HF directory. The ``config.json`` side is the
config family's (``dxrun.config.hf_model``); the weights placed into a run's shards are the
experiment's (``dxrun.experiment.import_params``). No JAX: numpy in, numpy out, so the export
command imports it before JAX starts. The table and its conversions are ``layout``, the reader
``reader``, the writer ``writer``; this face hands out their names, each imported from its
module when first asked for: a run that reads no checkpoint loads this face alone.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "layout": ("BUFFERS", "NORM_NAMES", "SAME", "TABLES", "TRANSPOSED", "Weight", "dims",
               "dxrun_block", "hf_name", "output_axis", "shape_of", "to_dxrun", "to_hf",
               "weights"),
    "reader": ("FLAX", "INDEX", "OTHER_LAYOUTS", "SINGLE", "HFWeights", "first", "weight_files"),
    "writer": ("MAX_SHARD_BYTES", "hf_tensors", "plan_files", "save_hf"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module 'dxrun.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dxrun.hf.{_MODULE[name]}"), name)
