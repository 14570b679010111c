"""Sharding: one mechanism, logical axis names -> mesh axes through the plan's rules table.

Every parameter carries logical axis names (``axes=`` metadata on its ``nnx.Param``). This module
turns those names into ``NamedSharding``s on the plan's mesh; XLA (GSPMD) inserts every collective.
The low-level helpers users of the reference systems know (``make_mesh``, ``apply_tp_sharding``, ...)
are thin wrappers over the same plan, rules and functions, not a second mechanism.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.plan import (
    BATCH_AXES,
    LOGICAL_RULES,
    MESH_AXES,
    OPTIMIZER_DATA_AXES,
    MeshPlan,
    Sizes,
    replicas_of,
    resolve_axes,
)

# (mesh, rules) active while a step is traced; model code calls ``constrain`` with logical names.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, dict[str, Any]] | None] = contextvars.ContextVar(
    "dxrun_mesh", default=None
)


def host_grid(plan: MeshPlan, process_of: Sequence[int]) -> np.ndarray:
    """Indices into the devices (``process_of``: each device's process) laid out as the
    plan's mesh: each host's devices, its processes in process order, fill the local part of
    every axis (``plan.local``, row-major), and the hosts, in order, the outer part
    (``plan.dcn``), as JAX's ``create_hybrid_device_mesh`` does with processes as granules,
    except that a granule is a host, which may run several processes. Over ``plan.shape``."""
    order = sorted(range(len(process_of)),
                   key=lambda i: (plan.host_of(process_of[i]), process_of[i]))
    per_host = plan.n_devices // plan.hosts
    grid = np.empty(plan.shape, dtype=np.int64)
    local = tuple(plan.local.values())
    for h in range(plan.hosts):
        at = np.unravel_index(h, tuple(plan.dcn.values()))
        grid[tuple(slice(i * w, (i + 1) * w) for i, w in zip(at, local, strict=True))] = (
            np.reshape(order[h * per_host:(h + 1) * per_host], local))
    return grid


def mesh_from_plan(plan: MeshPlan) -> Mesh:
    if plan.processes > 1:
        devices = jax.devices()
        grid = np.array(devices, dtype=object)[
            host_grid(plan, [d.process_index for d in devices])]
    else:
        devices = jax.devices()
        grid = np.array([devices[i] for i in plan.device_ids]).reshape(plan.shape)
    # Auto axes: sharding is annotation-driven (GSPMD), not JAX 0.10's default Explicit mode.
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(names: Sequence[str | None] | None, rules: dict[str, Any]) -> P:
    if names is None:
        return P()
    return P(*(rules.get(n) if n is not None else None for n in names))


def param_axes(state: nnx.State) -> dict:
    """Pure dict of each parameter's logical axis names, same structure as its pure params."""
    axes = jax.tree.map(
        lambda v: v.get_metadata().get("axes"), state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes


def param_shardings(axes: dict, mesh: Mesh, rules: dict[str, Any]) -> dict:
    return jax.tree.map(
        lambda names: NamedSharding(mesh, logical_to_spec(names, rules)), axes,
        is_leaf=lambda x: isinstance(x, tuple) or x is None,
    )


def _mesh_axes_of(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def data_sharded_spec(names: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                      rules: dict[str, Any], axis: str = "data") -> P:
    """The rules' spec of a tensor with logical ``names`` and ``shape``, also split over mesh
    axis ``axis`` along its first logical axis (in ``OPTIMIZER_DATA_AXES`` order) whose
    per-shard size ``axis`` divides: ZeRO-1's layout of an optimizer-state tensor. The rules'
    spec unchanged when no axis divides (``dxrun.model.sharding`` pads such a tensor so one does)."""
    spec = list(logical_to_spec(names, rules))
    n = mesh.shape[axis]
    if names is None or n == 1:
        return P(*spec)
    for name in OPTIMIZER_DATA_AXES:
        if name not in names:
            continue
        i = list(names).index(name)
        held = _mesh_axes_of(spec[i])
        if axis in held:
            return P(*spec)
        split = math.prod(mesh.shape[a] for a in held)
        if shape[i] % (split * n) == 0:
            spec[i] = (*held, axis)
            return P(*spec)
    return P(*spec)


def optimizer_param_shardings(axes: dict, shapes: dict, mesh: Mesh, rules: dict[str, Any],
                              shard_over_data: bool) -> dict:
    """The sharding each parameter's optimizer state (moments, momentum) takes: its
    parameter's, and with ``shard_over_data`` (``parallelism.shard_optimizer``) split over the
    ``data`` replicas as well (``data_sharded_spec``)."""
    if not shard_over_data:
        return param_shardings(axes, mesh, rules)
    return jax.tree.map(
        lambda names, x: NamedSharding(mesh, data_sharded_spec(names, x.shape, mesh, rules)),
        axes, shapes, is_leaf=lambda x: isinstance(x, tuple) or x is None)


def replicated_bytes_over(tree: Any, axis: str = "data") -> float:
    """Bytes per device of the (abstract or real) arrays of ``tree`` that mesh axis ``axis``
    does not split: what ZeRO-1 leaves replicated over the data replicas."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        s = x.sharding
        if isinstance(s, NamedSharding) and s.mesh.shape.get(axis, 1) > 1 and not any(
                axis in _mesh_axes_of(e) for e in s.spec):
            total += x.dtype.itemsize * math.prod(s.shard_shape(x.shape))
    return total


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def check_process_rows(sharding: NamedSharding, plan: MeshPlan, batch_size: int) -> None:
    """This process's devices hold exactly the row block its data reader reads
    (``plan.data_shard``); anything else would train on misplaced rows, so it is checked."""
    index = sharding.addressable_devices_indices_map((batch_size, 1))
    rows = {(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
            for s in index.values()}
    per = batch_size // plan.data_shards
    block = plan.data_shard(jax.process_index())
    held = (min(a for a, _ in rows), max(b for _, b in rows))
    if held != (block * per, (block + 1) * per):
        raise RuntimeError(f"process {jax.process_index()} holds rows {held} of the batch but "
                           f"reads rows {(block * per, (block + 1) * per)}: the mesh's process "
                           "order is not the plan's")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def spread_shardings(shapes: Any, mesh: Mesh, shardings: Any) -> Any:
    """Each array split over every device of ``mesh``: where its init is computed with the
    least work per device, whatever layout it is used in. Its own sharding in ``shardings``,
    with the mesh axes it is replicated over added to the first axis of the array that takes
    them too: laying it out in its own sharding is then a gather within groups of devices.
    (Spread along some other axis, XLA's partitioner replicates the whole array first and warns
    "Involuntary full rematerialization".) Its own sharding where no axis takes them."""
    def spread(x: Any, own: NamedSharding) -> NamedSharding:
        used = {a for e in own.spec for a in _mesh_axes_of(e)}
        rest = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
        if not rest:
            return own  # already split over every device
        k = math.prod(mesh.shape[a] for a in rest)
        spec = [*own.spec, *[None] * (len(x.shape) - len(own.spec))]
        for i, e in enumerate(spec):
            held = _mesh_axes_of(e)
            if x.shape[i] % (math.prod(mesh.shape[a] for a in held) * k) == 0:
                spec[i] = (*held, *rest)
                return NamedSharding(mesh, P(*spec))
        return own
    return jax.tree.map(spread, shapes, shardings)


@contextlib.contextmanager
def in_mesh_context(mesh: Mesh, rules: dict[str, Any] | None = None) -> Iterator[Mesh]:
    """Activate ``mesh`` (and the rules table) for tracing: activation constraints apply."""
    token = _ACTIVE.set((mesh, dict(LOGICAL_RULES if rules is None else rules)))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def without_mesh_axis(axis: str) -> Iterator[None]:
    """While tracing under ``in_mesh_context``: activation constraints leave out mesh axis
    ``axis``, e.g. for a function ``jax.vmap``-ed with ``spmd_axis_name=axis``, whose mapped
    axis takes it (see ``dxrun.experiment.accumulated_grads``)."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    mesh, rules = active

    def drop(target: Any) -> Any:
        if isinstance(target, tuple):
            kept = tuple(a for a in target if a != axis)
            return kept or None
        return None if target == axis else target

    token = _ACTIVE.set((mesh, {name: drop(t) for name, t in rules.items()}))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_axes(name: str) -> dict[str, int]:
    """The mesh axes of more than one device that the active rules (``in_mesh_context``, less
    any ``without_mesh_axis``) map logical axis ``name`` to, in order, with their sizes; empty
    outside ``in_mesh_context``."""
    active = _ACTIVE.get()
    if active is None:
        return {}
    mesh, rules = active
    return {a: mesh.shape[a] for a in _mesh_axes_of(rules.get(name)) if mesh.shape[a] > 1}


def active_spec(names: Sequence[str | None]) -> P:
    """The spec of logical ``names`` under the active rules (``in_mesh_context``, less any
    ``without_mesh_axis``): what a ``jax.shard_map`` inside the traced step maps over."""
    active = _ACTIVE.get()
    return P() if active is None else logical_to_spec(names, active[1])


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside ``in_mesh_context``."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def gathered_backward(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """``x`` unchanged; its gradient pinned to the layout of logical ``names`` (``constrain``).
    Sequence parallelism: a block's output gradient gathered along the sequence before the
    block's backward, which is then tensor parallelism's (no weight moves)."""
    return x


def _gathered_fwd(x: jax.Array, names: tuple[str | None, ...]) -> tuple[jax.Array, None]:
    return x, None


def _gathered_bwd(names: tuple[str | None, ...], _: None, g: jax.Array) -> tuple[jax.Array]:
    return (constrain(g, names),)


gathered_backward.defvjp(_gathered_fwd, _gathered_bwd)


# ---- the low-level API of the reference systems, on the same plan and rules -----------------


def num_devices() -> int:
    return jax.device_count()


def make_mesh(n_devices: int = 0, **sizes: int) -> Mesh:
    """A mesh over the first ``n_devices`` (0 = all), each axis's size by key (``dp=2,
    tp=4``; an axis not given 1, dp -1); one size but cp may be -1 (inferred)."""
    n = n_devices or jax.device_count()
    sizes = Sizes(resolve_axes(dict(Sizes({"dp": -1} | sizes)), n))
    if sizes.n != n:
        raise ValueError(f"{'*'.join(sizes)} = {'*'.join(map(str, sizes.values()))} = "
                         f"{sizes.n} != {n} devices")
    plan = MeshPlan(sizes=sizes, device_ids=tuple(range(n)), n_visible=n,
                    platform=jax.default_backend(), global_batch=replicas_of(sizes),
                    seq_len=0, rules=dict(LOGICAL_RULES))
    return mesh_from_plan(plan)


def make_tp_mesh(tp: int) -> Mesh:
    """Tensor parallel over ``tp`` devices, data parallel over the rest."""
    return make_mesh(dp=-1, tp=tp)


def replicate(tree: Any, mesh: Mesh) -> Any:
    return jax.device_put(tree, replicated(mesh))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place a global batch (leading axis = examples) sharded over the data and fsdp axes."""
    return jax.device_put(batch, batch_sharding(mesh))


def apply_tp_sharding(model: nnx.Module, mesh: Mesh, rules: dict[str, Any] | None = None):
    """Shard a model's parameters in place by their logical axes (Megatron TP + FSDP rules)."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(param_axes(state), mesh, LOGICAL_RULES if rules is None else rules)
    params = jax.device_put(nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds of a tree of (sharded) arrays."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + math.prod(
                shard.data.shape) * shard.data.dtype.itemsize
    return out


# ------------------------------------------------------------------------------------------------
# ZeRO-1 at any data-parallel size: the optimizer state of a parameter none of whose axes the
# data axis divides is padded, with zeros at the end of one axis, up to a multiple of it, and split.
#
# An uneven split is not an option: jit's in/out shardings must divide every axis they split (JAX
# raises ``IndivisibleError``). The padding starts at zero and stays zero: the step pads the
# gradients and parameters alike (``dxrun.experiment``), and every optimizer dxrun builds updates
# elementwise (Adam's, Lion's and SGD's moments of a zero gradient are zero, and so is their
# update; a global norm counts no zeros), so the real rows' update is the unsplit one. The
# parameters themselves are never padded: the step slices them back before gathering them.
# A checkpoint holds the padded state; a mesh of another data size reads its real rows and pads
# with zeros (``dxrun.checkpointing.store``), so checkpoints move between meshes as before.

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
