"""A Hugging Face checkpoint read into a run's sharded parameters (``model.init_from=hf:<dir>``).

Each dxrun parameter is made in the run's shardings one shard at a time: for each layer of a
stacked weight in turn, a shard reads only its region of the HF tensor (safetensors' lazy
slices; ``dxrun.hf.dxrun_block`` maps dxrun's index to the HF tensor's), in dxrun's layout, into
the shard; rows past the real vocabulary are the mesh's padding, zeros. A shard is on its
devices before the next is read, and replicas share one read. So the host holds one shard
beyond the shards placed so far, never the whole model, and each process reads only the
shards of its own devices.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dxrun import hf  # its face: the table, the reader loaded when a run reads a checkpoint
from dxrun.config import hf_dir, read_config

if TYPE_CHECKING:
    from dxrun.config import ModelConfig
    from dxrun.hf import Weight


def _table(m: ModelConfig, d: Path) -> list[Weight]:
    return hf.weights(read_config(d)["model_type"], m)


def check_hf_weights(m: ModelConfig) -> None:
    """Refuse (ConfigError, one line) a directory whose tensors do not make this model:
    headers only, before anything is written."""
    d = hf_dir(m.init_from)
    with hf.HFWeights(d) as files:
        files.check(_table(m, d), m)


def _leaves(tree: dict) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(str(getattr(k, "key", k)) for k in p): x for p, x in flat}


def import_params(m: ModelConfig, spec: dict, axes: dict) -> dict:
    """The parameters of ``m.init_from``'s directory, laid out as ``spec`` (the run's abstract
    params: their shapes and shardings; ``axes``: their logical axes), as a params tree
    ``Experiment.init_state`` takes."""
    d = hf_dir(m.init_from)
    table = _table(m, d)
    specs, axes = _leaves(spec), _leaves(axes)
    if set(specs) != {w.dxrun for w in table}:
        raise AssertionError(f"dxrun.hf misses {set(specs) ^ {w.dxrun for w in table}}")
    dim = hf.dims(m)
    real_v = dim["V"]
    built: dict[str, jax.Array] = {}
    with hf.HFWeights(d) as files:
        files.check(table, m)
        for w in table:
            s, names = specs[w.dxrun], list(axes[w.dxrun])
            lead = (1 if w.per_layer else 0) + (1 if w.per_expert else 0)  # stacked axes
            names = names[lead:]
            vocab = names.index("vocab") if "vocab" in names else None
            one = s.shape[lead:]
            real = tuple(real_v if i == vocab else n for i, n in enumerate(one))
            stack = {at: (layer, expert) for layer, expert, at in w.instances(m)}

            def shard(index: tuple, w: Weight = w, one: tuple = one, real: tuple = real,
                      dtype: Any = s.dtype, lead: int = lead, stack: dict = stack,
                      shape: tuple = s.shape) -> np.ndarray:
                # (start, stop) per axis of one layer (and expert), within the real
                # vocabulary; the rows past it are the mesh's padding, zeros
                wanted = [i.indices(n)[:2] for i, n in zip(index[lead:], one, strict=True)]
                within = tuple((min(a, r), min(b, r)) for (a, b), r in zip(wanted, real,
                                                                           strict=True))
                spans = [range(n)[i] for i, n in zip(index[:lead], shape[:lead], strict=True)]
                lens = tuple(len(r) for r in spans)
                out = np.zeros((*lens, *(b - a for a, b in wanted)), dtype)
                fill = tuple(slice(0, b - a) for a, b in within)
                hf_shape = hf.shape_of(w.hf_shape, dim)
                if any(a == b for a, b in within):  # all padding (or empty): zeros
                    return out
                for at in itertools.product(*spans):  # one layer's (expert's) block at a time
                    name = files.name_for(w, *stack[at])
                    here = tuple(a - r.start for a, r in zip(at, spans, strict=True))
                    out[(*here, *fill)] = hf.dxrun_block(
                        w, real, within, hf_shape, lambda sl, name=name: files.read(name, sl),
                        dim)
                return out

            built[w.dxrun] = _place(s.shape, s.sharding, shard)
    return _nest(built)


def _place(shape: tuple[int, ...], sharding: Any, shard: Any) -> jax.Array:
    """``jax.make_array_from_callback``, one shard at a time: each is read once (replicas of
    it on other devices share the read) and is on its devices before the next is read, so
    the host holds one shard at a time."""
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(tuple((s.start, s.stop, s.step) for s in index), []).append(
            (device, index))
    placed = {}
    for group in by_index.values():
        # Ready before the next is read: an asynchronous copy keeps its host buffer alive, and
        # several in flight would hold several shards
        first = jax.block_until_ready(jax.device_put(shard(group[0][1]), group[0][0]))
        # replicas copied from device to device: no two share the host's buffer
        placed |= {device: jax.device_put(first, device) for device, _ in group[1:]}
        placed[group[0][0]] = first
    arrays = [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out
