"""A Hugging Face checkpoint read into a run's sharded parameters (``model.init_from=hf:<dir>``).

Each dxrun parameter is made in the run's shardings one shard at a time: a shard reads the HF
tensors it needs one at a time (one per layer of a stacked weight), turns each into dxrun's
layout (``layout.to_dxrun``) and keeps its slice, padding the vocabulary with zero rows to the
mesh's ``padded_vocab``; it is on its devices before the next is read. So the host holds one HF
tensor and one shard beyond the shards placed so far, never the whole model, and each process
reads only the shards of its own devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dxrun.hf.config import hf_dir, read_config
from dxrun.hf.files import HFWeights
from dxrun.hf.layout import Weight, dims, to_dxrun, weights

if TYPE_CHECKING:
    from dxrun.experiment import Experiment


def _table(exp: Experiment, d: Path) -> list[Weight]:
    m = exp.cfg.model
    return weights(read_config(d)["model_type"], m.tie_embeddings)


def check_hf_weights(exp: Experiment) -> None:
    """Refuse (ConfigError, one line) a directory whose tensors do not make this model:
    headers only, before anything is written."""
    d = hf_dir(exp.cfg.model.init_from)
    with HFWeights(d) as files:
        files.check(_table(exp, d), exp.cfg.model)


def _leaves(tree: dict) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(str(getattr(k, "key", k)) for k in p): x for p, x in flat}


def pad_slice(x: np.ndarray, index: tuple, axis: int | None, padded: int) -> np.ndarray:
    """``x`` padded with zeros to ``padded`` along ``axis`` (None: no padding), then
    ``x[index]``, without making the padded copy."""
    if axis is None:
        return x[index]
    real = x.shape[axis]
    start, stop, _ = index[axis].indices(padded)
    idx = list(index)
    idx[axis] = slice(min(start, real), min(stop, real))
    part = x[tuple(idx)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, (stop - start) - part.shape[axis])
    return np.pad(part, pad) if pad[axis][1] else part


def import_params(exp: Experiment, spec: dict | None = None) -> dict:
    """The parameters of ``exp.cfg.model.init_from``'s directory, laid out in ``exp``'s
    shardings (``exp.param_shardings``), as a params tree ``exp.init_state`` takes. ``spec``:
    ``exp.abstract_state().params`` when the caller has it."""
    d = hf_dir(exp.cfg.model.init_from)
    m, table = exp.cfg.model, _table(exp, d)
    spec = spec or exp.abstract_state().params
    specs, axes = _leaves(spec), _leaves(exp.axes)
    if set(specs) != {w.dxrun for w in table}:
        raise AssertionError(f"dxrun.hf.layout misses {set(specs) ^ {w.dxrun for w in table}}")
    real_v = dims(m)["V"]
    built: dict[str, jax.Array] = {}
    with HFWeights(d) as files:
        files.check(table, m)
        for w in table:
            s, names = specs[w.dxrun], list(axes[w.dxrun])
            if w.per_layer:
                names = names[1:]
            vocab = names.index("vocab") if "vocab" in names else None
            one = s.shape[1:] if w.per_layer else s.shape
            real = tuple(real_v if i == vocab else n for i, n in enumerate(one))

            def shard(index: tuple, w: Weight = w, one: tuple = one, real: tuple = real,
                      vocab: int | None = vocab, dtype: Any = s.dtype) -> np.ndarray:
                rest = index[1:] if w.per_layer else index
                pad = one[vocab] if vocab is not None else 0
                if not w.per_layer:
                    x = to_dxrun(w, files.read(files.name_for(w, None)), real)
                    return np.array(pad_slice(x, rest, vocab, pad), dtype=dtype)
                layers = range(m.n_layers)[index[0]]
                out = None
                for k, layer in enumerate(layers):  # one layer's tensor alive at a time
                    x = to_dxrun(w, files.read(files.name_for(w, layer)), real)
                    piece = pad_slice(x, rest, vocab, pad)
                    if out is None:
                        out = np.empty((len(layers), *piece.shape), dtype)
                    out[k] = piece
                    del x, piece
                return out

            built[w.dxrun] = _place(s.shape, s.sharding, shard)
    return _nest(built)


def _place(shape: tuple[int, ...], sharding: Any, shard: Any) -> jax.Array:
    """``jax.make_array_from_callback``, one shard at a time: each is read once (replicas of
    it on other devices share the read) and is on its devices before the next is read, so
    the host holds one shard (and one tensor) at a time."""
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(tuple((s.start, s.stop, s.step) for s in index), []).append(
            (device, index))
    placed = {}
    for group in by_index.values():
        first = jax.device_put(shard(group[0][1]), group[0][0])
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
