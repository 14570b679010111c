"""A mixture of experts' auxiliary losses, from its layers to the train step: the MoE layers
(``dxrun.model.moe``) ``record`` their router statistics into the ``router_statistics`` the train
step opens around its loss; ``with_router_losses`` adds the penalties to the loss it
differentiates and the statistics to its metrics; ``move_router_bias`` moves DeepSeek-V3's
balancing biases after the update.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

# The metrics' entry that carries each MoE layer's balancing-bias step to the train step, which
# takes it out of the metrics and adds it to the biases after the update (``move_router_bias``).
BIAS_STEP = "moe:bias_step"  # not a metric: taken out before the row
PENALTY = "moe:penalty"  # not a metric: the penalties in the loss, taken out of train/loss


# The statistics of the MoE layers traced so far, innermost ``router_statistics`` first.
_FOUND: contextvars.ContextVar[list | None] = contextvars.ContextVar("dxrun_moe", default=None)


@contextlib.contextmanager
def router_statistics() -> Iterator[list]:
    """The list the MoE layers traced inside this context ``record`` their statistics into."""
    found: list = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def record(stats: dict[str, jax.Array]) -> None:
    """Hand ``stats`` to the innermost ``router_statistics``; dropped outside one (decoding,
    logits)."""
    found = _FOUND.get()
    if found is not None:
        found.append(stats)


def with_router_losses(loss: jax.Array, metrics: dict[str, jax.Array], found: list
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``loss`` plus the MoE layers' penalties (``found``: what ``router_statistics`` gathered
    around the forward pass; model.moe.aux_loss x the load-balancing loss + model.moe.z_loss x the
    z-loss, a mean over the layers), and ``metrics`` with ``moe/aux_loss``, ``moe/z_loss``
    (those means, before their coefficients), ``moe/load_max`` and ``moe/load_min`` (each
    layer's most and least loaded expert's tokens over the mean, the extremes over the
    layers) and ``moe/dropped`` (the share of routed assignments the capacity dropped).
    ``found`` empty: both unchanged."""
    if not found:
        return loss, metrics
    stats = jax.tree.map(lambda *a: jnp.concatenate([jnp.atleast_1d(x) for x in a]), *found)
    aux, z = stats["aux_loss"].mean(), stats["z_loss"].mean()
    load_LxN = stats["load_N"].reshape(-1, stats["load_N"].shape[-1])
    over_mean_LxN = load_LxN / jnp.maximum(load_LxN.mean(-1, keepdims=True), 1e-9)
    out = dict(metrics)
    if BIAS_STEP in stats:  # (layers x N): the step moves the biases by it
        out[BIAS_STEP] = stats[BIAS_STEP].reshape(load_LxN.shape)
    penalty = stats["penalty"].mean()
    out.update({"moe/aux_loss": aux, "moe/z_loss": z, "moe/dropped": stats["dropped"].mean(),
                "moe/load_max": over_mean_LxN.max(), "moe/load_min": over_mean_LxN.min(),
                PENALTY: penalty})
    return loss + penalty, out


def move_router_bias(params: dict, metrics: dict) -> tuple[dict, dict]:
    """(``params`` with the sigmoid router's balancing biases moved by the step's
    ``BIAS_STEP``, ``metrics`` without it): DeepSeek-V3's auxiliary-loss-free balancing, a
    rule outside the gradient. Unchanged without one."""
    if BIAS_STEP not in metrics:
        return params, metrics
    rest = {k: v for k, v in metrics.items() if k != BIAS_STEP}
    mlp = params["moe_blocks"]["mlp"]
    moved = {**mlp, "bias": mlp["bias"] + metrics[BIAS_STEP].astype(mlp["bias"].dtype)}
    return {**params, "moe_blocks": {**params["moe_blocks"], "mlp": moved}}, rest


def vmappable(params: dict) -> bool:
    """Whether the model of ``params`` (any tree shaped as its parameters) can run under
    ``jax.vmap``: not with MoE layers, whose grouped matmuls (``jax.lax.ragged_dot``) have no
    batching rule over another axis. (The train step's micro-batches then reduce their
    gradients over the data replicas each, not once a step.)"""
    return "moe_blocks" not in params
