"""ZeRO-1 at any data-parallel size: the optimizer state of a parameter none of whose axes the
data axis divides is padded, with zeros at the end of one axis, up to a multiple of it, and split.

An uneven split is not an option: jit's in/out shardings must divide every axis they split (JAX
raises ``IndivisibleError``). The padding starts at zero and stays zero: the step pads the
gradients and parameters alike (``dxrun.step``), and every optimizer dxrun builds updates
elementwise (Adam's, Lion's and SGD's moments of a zero gradient are zero, and so is their
update; a global norm counts no zeros), so the real rows' update is the unsplit one. The
parameters themselves are never padded: the step slices them back before gathering them.
A checkpoint holds the padded state; a mesh of another data size reads its real rows and pads
with zeros (``dxrun.checkpointing.vocab_padding``), so checkpoints move between meshes as before.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dxrun.model.sharding import data_sharded_spec, logical_to_spec
from dxrun.plan.mesh import OPTIMIZER_DATA_AXES

Pad = tuple[int, int, int] | None  # (array axis, its size, padded size); None: not padded


def _held(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def zero_pad(names: Any, shape: tuple[int, ...], mesh: Mesh, rules: dict[str, Any],
             axis: str = "data") -> Pad:
    """How ZeRO-1 pads a tensor of logical ``names`` and ``shape``: None when its layout splits
    over ``axis`` already (``data_sharded_spec``) or nothing can; else the axis (in
    ``OPTIMIZER_DATA_AXES``, not split by any other mesh axis, so the padded state's shards
    line up with the parameter's) whose padding to a multiple of ``axis``'s size adds least,
    the first in that order on a tie."""
    n = mesh.shape[axis]
    if names is None or n == 1 or any(
            axis in _held(e) for e in data_sharded_spec(names, shape, mesh, rules)):
        return None
    spec = logical_to_spec(names, rules)
    best: Pad = None
    for name in OPTIMIZER_DATA_AXES:
        if name not in names:
            continue
        i = list(names).index(name)
        if math.prod(mesh.shape[a] for a in _held(spec[i])) > 1:  # split over tensor or fsdp
            continue
        padded = math.ceil(shape[i] / n) * n
        if best is None or padded * best[1] < best[2] * shape[i]:
            best = (i, shape[i], padded)
    return best


def zero_pads(axes: dict, shapes: dict, mesh: Mesh, rules: dict[str, Any]) -> dict:
    """``zero_pad`` of every parameter: a tree of ``Pad`` shaped like the parameters."""
    return jax.tree.map(lambda names, x: zero_pad(names, x.shape, mesh, rules), axes, shapes,
                        is_leaf=lambda x: isinstance(x, tuple) or x is None)


def _each(f: Any, tree: Any, pads: dict | None) -> Any:
    if pads is None:
        return tree
    flat, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([x if p is None else f(x, *p) for x, p in zip(
        flat, treedef.flatten_up_to(pads), strict=True)])


def pad(tree: Any, pads: dict | None) -> Any:
    """Each array of ``tree`` (shaped like the parameters) padded with zeros as ``pads`` says."""
    def one(x: Any, axis: int, size: int, padded: int) -> Any:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, padded - size)
        return jnp.pad(x, widths)
    return _each(one, tree, pads)


def unpad(tree: Any, pads: dict | None) -> Any:
    """``pad`` undone: each padded array cut back to its parameter's size."""
    return _each(lambda x, axis, size, _: jax.lax.slice_in_dim(x, 0, size, axis=axis), tree,
                 pads)


def refit(x: Any, shape: tuple[int, ...]) -> Any:
    """An optimizer-state array of one layout's padding brought to another's ``shape``: each
    axis cut or padded with zeros at its end. Exact: both hold the real rows first and zeros
    after them."""
    if tuple(x.shape) == tuple(shape):
        return x
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape, strict=True))]
    return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, shape, strict=True)])
