"""A checkpoint restored where the vocabulary, or ZeRO-1's optimizer state, is padded differently.

The vocab axis of ``wte`` / ``lm_head`` (and of their optimizer moments) has
``plan.padded_vocab`` rows: a multiple of tp and of the platform's alignment (128 on GPU/TPU).
So a checkpoint of vocab 65 has 65 rows under dp1 on CPU, 66 under tp2 and 128 on a GPU. Its
arrays are read at the target's padding: the rows both have, read straight into the target's
shards, zeros beyond (Orbax's non-strict read). That is exact: padding rows start at zero, their
logits are masked and their gradients are zero, so every padding row of a checkpoint is zero,
and the real rows always come first.

ZeRO-1's padding of the optimizer state to a multiple of the data axis (``dxrun.model.sharding``)
is read the same way: zeros after the real rows. Only those differences are read this way; the
callers have already refused a checkpoint of another model shape or vocabulary
(``check_compatible``, ``load``), and any other difference fails as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

Shapes = dict[tuple[str, ...], tuple[int, ...]]


def leaf_key(path: tuple) -> tuple[str, ...]:
    """A leaf's path by names and indices alone: the target's optimizer states are named
    tuples (attributes), the checkpoint's metadata holds them as dicts and lists."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
        else:
            out.append(str(k))
    return tuple(out)


def shapes(tree: Any) -> Shapes:
    """Every array leaf's shape, by its path (``leaf_key``)."""
    return {leaf_key(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(x, "shape")}


def stored_shapes(state_dir: Path) -> Shapes:
    """The shapes a checkpoint's ``state`` item was written with (its metadata alone)."""
    return shapes(ocp.StandardCheckpointHandler().metadata(state_dir).tree)


def padding_differs(stored: Shapes, target: Shapes, partial: bool = False) -> bool:
    """True when the two differ only by one padding: the same leaves, and every leaf that
    differs does so in one axis with the same (stored, target) sizes as every other
    (``partial``: the target may leave stored leaves out)."""
    if not (target.keys() <= stored.keys() if partial else target.keys() == stored.keys()):
        return False
    pairs = set()
    for key, want in target.items():
        have = stored[key]
        if have == want:
            continue
        axes = [i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b]
        if len(have) != len(want) or len(axes) != 1:
            return False
        pairs.add((have[axes[0]], want[axes[0]]))
    return len(pairs) == 1


def without_zero_padding(tree_shapes: Shapes) -> Shapes:
    """``tree_shapes`` (a train state's) with each optimizer-state leaf that is larger than its
    parameter (the ``params`` leaf of the same trailing path) in some axes given the
    parameter's shape: ZeRO-1 pads the state it splits (``dxrun.model.sharding``), never the
    parameters, and every optimizer dxrun builds keeps a parameter-shaped state otherwise."""
    out = dict(tree_shapes)
    for key, shape in tree_shapes.items():
        if key[0] == "params":
            continue
        param = next((tree_shapes[("params", *key[i:])] for i in range(1, len(key))
                      if ("params", *key[i:]) in tree_shapes), None)
        if (param is not None and len(param) == len(shape)
                and all(a >= b for a, b in zip(shape, param, strict=True))):
            out[key] = param
    return out


def restore_args(state_dir: Path, target: dict[str, Any], partial: bool = False
                 ) -> ocp.args.CheckpointArgs:
    """How to read ``state_dir`` (a step dir's ``state`` item) into ``target`` (abstract arrays
    with this mesh's shardings): strictly, or re-padded when only the vocab padding or ZeRO-1's
    padding of the optimizer state (another data-parallel size) differs; ``partial``: only the
    target's leaves (a fresh optimizer state is not read)."""
    stored, want = stored_shapes(state_dir), shapes(target)
    real_stored, real_want = without_zero_padding(stored), without_zero_padding(want)
    only_zero = (want.keys() <= stored.keys() and want != {k: stored[k] for k in want}
                 and all(real_stored[k] == real_want[k] for k in want)
                 and (partial or want.keys() == stored.keys()))
    repad = only_zero or padding_differs(real_stored, real_want, partial)
    if not partial:
        return ocp.args.StandardRestore(target, strict=not repad)
    return ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(
                                      target, strict=not repad))
