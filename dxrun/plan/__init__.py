"""The pure plan, below the experiment: values in, values out, no JAX and nothing compiled. Every
decision a run takes from its validated config, made once and carried: the mesh's axis sizes
and the ``Layout`` (``axes``), how a mesh spreads over hosts (``hosts``), the global batch, its
learning rate and the loss's chunk (``batch``), the attention kernels' table and the rule that
picks a run's (``kernels``), the context axis's zig-zag split (``context``), the mesh plan
(``mesh``: ``make_plan``, ``LOGICAL_RULES``, the vocabulary's rows) and the ``RunPlan`` that
carries them with the save cadence and the search's record (``run_plan``).
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.plan.axes import (
    Layout, Sizes, layout_of, named, replicas_of, resolve_axes, shrink)
from dxrun.plan.batch import (
    AUTO_ON_BYTES, check_batch_keys, default_seq_len, resolve_loss_chunk, scaled_lr)
from dxrun.plan.context import (
    BLOCK, LONG_SEQ, kv_gather_bytes, zigzag_order)
from dxrun.plan.hosts import (
    split_over_hosts)
from dxrun.plan.kernels import (
    AUTO, CAPABILITY, KERNELS, RESIDUALS, AttentionTarget, Inputs, attention_target, check_remat,
    choose, compiled_kernel, kind_target, run_inputs)
from dxrun.plan.mesh import (
    BATCH_AXES, LOGICAL_RULES, MESH_AXES, OPTIMIZER_DATA_AXES, MeshPlan, compute_dtype, make_plan,
    padded_vocab, precision_of, table_rows)
from dxrun.plan.run_plan import (
    Resume, RunPlan, own_s, recorded, resolved_config, saved_config)
