"""The model family: what the train step computes, and what the rest may use of it.

- ``layers``: the building blocks (parameters with logical axes, the weight matmul, norms, the
  MLP, its activations with their lean custom VJPs); ``attention``: causal multi-head /
  grouped-query attention, rotary positions, the kernel dispatch; its kernels beside it
  (``splash_attention``, the context axis's blockwise one in ``context_parallel``).
- ``transformer``: the block and the model that stacks them; ``moe``: the mixture of experts'
  layer and model, ``router_losses`` its statistics' way to the train step's loss.
- ``losses``: the next token's cross-entropy in chunks; ``objectives``: masked diffusion.
- ``user_model``: your own model; ``sharding``: the logical-axis rules and constraints that
  place it on the mesh, ZeRO-1's padding with them; ``reductions``: metric reductions.

Imports nothing of dxrun outside itself, the config (``dxrun.config``) and the plan
(``dxrun.plan``).
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.model.attention import (
    Attention, reference_attention, window_mask)
from dxrun.model.context_parallel import (
    in_context_order)
from dxrun.model.losses import (
    chunked_cross_entropy)
from dxrun.model.objectives import (
    MaskedDiffusion, mask_rate, objective_of)
from dxrun.model.router_losses import (
    PENALTY, move_router_bias, router_statistics, vmappable, with_router_losses)
from dxrun.model.sharding import (
    batch_sharding, check_process_rows, in_mesh_context, mesh_from_plan, optimizer_param_shardings,
    pad, param_axes, param_shardings, refit, replicated, replicated_bytes_over, spread_shardings,
    unpad, without_mesh_axis, zero_pads)
from dxrun.model.transformer import (
    Transformer, count_params, resize_vocab)
from dxrun.model.user_model import (
    build_model, logits_of, plan_line)

__all__ = ["PENALTY", "Attention", "MaskedDiffusion", "Transformer", "batch_sharding", "build_model",
           "check_process_rows", "chunked_cross_entropy", "count_params", "in_context_order",
           "in_mesh_context", "logits_of", "mask_rate", "mesh_from_plan", "move_router_bias",
           "objective_of", "optimizer_param_shardings", "pad", "param_axes", "param_shardings",
           "plan_line", "reference_attention", "refit", "replicated", "replicated_bytes_over",
           "resize_vocab", "router_statistics", "spread_shardings", "unpad", "vmappable",
           "window_mask", "with_router_losses", "without_mesh_axis", "zero_pads"]
