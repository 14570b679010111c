"""Metric reductions on global (sharded) arrays, and their collective forms for ``shard_map``.

Inside ``jit`` a global array's reduction is an ordinary ``jnp`` reduction: XLA inserts the
cross-device collective. Inside ``shard_map`` code sees only its shard and must name the mesh
axes to reduce over; those forms default to the batch axes (``data``, ``fsdp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dxrun.plan import BATCH_AXES

__all__ = ["REDUCTIONS", "AxisNames", "all_gather", "collect_from_devices", "reduce_custom",
           "reduce_max", "reduce_mean", "reduce_mean_collective", "reduce_min", "reduce_sum",
           "reduce_sum_collective"]

AxisNames = str | Sequence[str]


def reduce_mean(x: jax.Array) -> jax.Array:
    return jnp.mean(x)


def reduce_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(x)


def reduce_max(x: jax.Array) -> jax.Array:
    return jnp.max(x)


def reduce_min(x: jax.Array) -> jax.Array:
    return jnp.min(x)


REDUCTIONS = {"mean": reduce_mean, "sum": reduce_sum, "max": reduce_max, "min": reduce_min}


def reduce_custom(metrics: Mapping[str, jax.Array], ops: Mapping[str, str],
                  default: str | None = "mean") -> dict[str, jax.Array]:
    """Reduce each metric to a scalar by its named op (``{"loss": "mean", "step": "max"}``).

    Metrics not named in ``ops`` use ``default`` (None makes them an error). An unknown op name,
    or an op for a metric that is not there, raises ValueError: nothing is silently skipped.
    """
    unknown = {k: v for k, v in ops.items() if v not in REDUCTIONS}
    if unknown:
        raise ValueError(f"reduce_custom: unknown op(s) {unknown}; valid ops: "
                         f"{', '.join(REDUCTIONS)}")
    missing = sorted(set(ops) - set(metrics))
    if missing:
        raise ValueError(f"reduce_custom: ops given for absent metrics {missing}")
    out = {}
    for name, value in metrics.items():
        op = ops.get(name, default)
        if op is None:
            raise ValueError(f"reduce_custom: no op for metric {name!r} and no default")
        if op not in REDUCTIONS:
            raise ValueError(f"reduce_custom: unknown default op {op!r}")
        out[name] = REDUCTIONS[op](value)
    return out


def collect_from_devices(x: jax.Array) -> list[np.ndarray]:
    """Each addressable device's shard of ``x`` as host arrays, ordered by device id."""
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return [np.asarray(s.data) for s in shards]


def _axes(axis_name: AxisNames | None) -> AxisNames:
    return tuple(BATCH_AXES) if axis_name is None else axis_name


def reduce_mean_collective(x: jax.Array, axis_name: AxisNames | None = None) -> jax.Array:
    """Mean over the devices of ``axis_name`` (inside ``shard_map``); default: batch axes."""
    return jax.lax.pmean(x, _axes(axis_name))


def reduce_sum_collective(x: jax.Array, axis_name: AxisNames | None = None) -> jax.Array:
    return jax.lax.psum(x, _axes(axis_name))


def all_gather(x: jax.Array, axis_name: AxisNames | None = None, tiled: bool = True) -> jax.Array:
    """Concatenate (``tiled``) or stack every device's ``x`` along a new leading axis."""
    return jax.lax.all_gather(x, _axes(axis_name), tiled=tiled)

