"""A Hugging Face checkpoint read into a run's sharded parameters (``model.init_from=hf:<dir>``).

Each dxrun parameter is made with ``jax.make_array_from_callback`` in the run's shardings: the
callback of a device's shard reads the HF tensors it needs one at a time (one per layer of a
stacked weight), turns each into dxrun's layout (``layout.to_dxrun``) and keeps the shard's
slice of it, padding the vocabulary with zero rows to the mesh's ``padded_vocab``. So the host
holds one HF tensor beyond the shards built so far, never the whole model, and each process
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


def import_params(exp: Experiment) -> dict:
    """The parameters of ``exp.cfg.model.init_from``'s directory, laid out in ``exp``'s
    shardings (``exp.param_shardings``), as a params tree ``exp.init_state`` takes."""
    d = hf_dir(exp.cfg.model.init_from)
    m, table = exp.cfg.model, _table(exp, d)
    spec = exp.abstract_state().params
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
                layers = range(m.n_layers)[index[0]] if w.per_layer else [None]
                rest = index[1:] if w.per_layer else index
                pieces = []
                for layer in layers:
                    x = files.read(files.name_for(w, layer))
                    pieces.append(pad_slice(to_dxrun(w, x, real), rest, vocab, one[vocab]
                                            if vocab is not None else 0))
                    del x
                out = np.stack(pieces) if w.per_layer else pieces[0]
                return out.astype(dtype, copy=False)

            built[w.dxrun] = jax.make_array_from_callback(s.shape, s.sharding, shard)
    return _nest(built)


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out
