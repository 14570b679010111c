"""A run's parameters written as a Hugging Face directory (``save_hf``, ``python -m dxrun.export``;
``dxrun.hf``'s face re-exports it). No JAX.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dxrun.config import config_json, model_type_of
from dxrun.hf.layout import Weight, dims, hf_name, output_axis, shape_of, to_hf, weights
from dxrun.hf.reader import INDEX, SINGLE

# A run's parameters written as a Hugging Face directory (``python -m dxrun.export``).
#
# ``config.json`` from the model section (``dxrun.config.hf_model.config_json``), the tensors
# under the names ``save_pretrained`` writes (``transformer.`` / ``model.`` prefixed) in
# safetensors files of at most ``max_shard_bytes`` (``model.safetensors``, or
# ``model-0000N-of-0000M.safetensors`` and their index), the vocabulary cut back to the model's
# (the mesh's padding rows dropped), and the run's ``tokenizer.json`` when it has one. Each HF
# tensor is gathered from the parameters' shards on its own (a stacked weight layer by layer),
# and a file's tensors are written together, so the host holds one file's worth at most.
# Everything is written into a new dir beside the target, renamed into place at the end: a
# failure leaves nothing.

MAX_SHARD_BYTES = 5 * 10**9  # the hub's default


def _leaf(params: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        params = params[p]
    return params


def hf_tensors(params: dict, axes: dict, m: Any) -> list[tuple[str, Any]]:
    """(HF name, a function that gathers that tensor to the host as numpy), in the table's
    order: nothing is gathered until called."""
    table = weights(model_type_of(m), m)
    d = dims(m)
    groups: dict[str, list[tuple[Weight, tuple[int, ...]]]] = {}
    for w in table:
        for layer, expert, at in w.instances(m):
            groups.setdefault(hf_name(w, layer, expert=expert), []).append((w, at))

    def gather(w: Weight, at: tuple[int, ...]) -> np.ndarray:
        x, names = _leaf(params, w.path), list(_leaf(axes, w.path))
        if at:  # a layer (and an expert) of a stacked weight
            x, names = x[at], names[len(at):]
        x = np.asarray(x, dtype=np.float32)  # gathered from its shards (a jax.Array)
        if "vocab" in names:  # the mesh's padding rows dropped
            x = np.take(x, np.arange(m.vocab_size), axis=names.index("vocab"))
        return to_hf(w, x, shape_of(w.hf_shape, d), d)

    def tensor(name: str) -> np.ndarray:
        parts = sorted(groups[name], key=lambda wa: wa[0].part or (0, ()))
        pieces = [gather(w, at) for w, at in parts]
        return (pieces[0] if len(pieces) == 1
                else np.concatenate(pieces, axis=output_axis(parts[0][0])))

    return [(name, lambda name=name: tensor(name)) for name in groups]


def plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The tensors' files, in order, each at most ``max_bytes`` (a larger tensor alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if files[-1] and used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += n
    return files


def save_hf(params: dict, axes: dict, m: Any, to: Path, tokenizer: Path | None = None,
            extra_config: dict | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the HF directory ``to`` (new, or empty) of ``params`` (model section ``m``)."""
    from safetensors.numpy import save_file

    tensors = hf_tensors(params, axes, m)  # refuses a model with no HF equivalent first
    d = dims(m)
    table = {hf_name(w, i, expert=j): w for w in weights(model_type_of(m), m)
             for i, j, _ in w.instances(m)}
    sizes = [(n, 4 * int(np.prod(shape_of(table[n].hf_shape, d)))) for n, _ in tensors]
    files = plan_files(sizes, max_shard_bytes)
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", dir=to.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_json(m, extra_config), indent=2))
        get = dict(tensors)
        names = [SINGLE] if len(files) == 1 else [
            f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
        for file, members in zip(names, files, strict=True):
            save_file({n: get[n]() for n in members}, str(tmp / file), metadata={"format": "pt"})
        if len(files) > 1:
            (tmp / INDEX).write_text(json.dumps({
                "metadata": {"total_size": sum(n for _, n in sizes)},
                "weight_map": {n: f for f, ms in zip(names, files, strict=True) for n in ms}},
                indent=2))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if to.exists():
            to.rmdir()  # empty (the caller checked)
        tmp.rename(to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to
