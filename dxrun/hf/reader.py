"""A Hugging Face directory's weights, read lazily by ``dxrun.hf.layout``'s table (``HFWeights``;
``dxrun.hf``'s face re-exports it). No JAX.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from dxrun.config import ConfigError
from dxrun.hf.layout import BUFFERS, Weight, dims, hf_name, shape_of

# A Hugging Face directory's weights, read lazily: ``model.safetensors``, or the shards
# ``model-0000N-of-0000M.safetensors`` its ``model.safetensors.index.json`` lists, as PyTorch's
# classes save them or as the Flax classes do (``kernel``: the weight transposed, ``embedding``,
# ``scale``): a Flax tensor is read under its PyTorch name, in PyTorch's layout.
#
# Opening reads the headers only (names, shapes, dtypes); ``HFWeights.read`` reads one tensor,
# through safetensors' memory-mapped reader, and nothing else stays in memory. ``check`` compares
# the headers with what the model section expects (``dxrun.hf``): a missing, extra or
# misshapen tensor, a truncated or unreadable file is a ConfigError naming the file. No JAX.

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# The files of layouts dxrun does not read, and how to get one it does.
OTHER_LAYOUTS = {"flax_model.msgpack": "Flax's msgpack", "pytorch_model.bin": "PyTorch's pickle",
                 "tf_model.h5": "TensorFlow's h5"}
# A Flax name's last part, for PyTorch's "weight": whether the tensor is transposed.
FLAX = {".kernel": True, ".embedding": False, ".scale": False}


def weight_files(d: Path) -> dict[str, Path]:
    """Each tensor's file: from the index when there is one, else ``model.safetensors``'s."""
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
            return {name: d / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{d / INDEX}: not a safetensors index ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no weight_map'})") from None
    if (d / SINGLE).is_file():
        return {}
    found = next((f"{f} ({kind} layout)" for f, kind in OTHER_LAYOUTS.items()
                  if (d / f).is_file()), None)
    if found:
        raise ConfigError(f"{d}: holds {found}, not {SINGLE} (safetensors); save it with "
                          "save_pretrained(dir, safe_serialization=True), which dxrun reads")
    raise ConfigError(f"{d}: no {SINGLE} or {INDEX}; a Hugging Face directory holds its "
                      "weights as safetensors")


class HFWeights:
    """The tensors of a HF directory, by name; a context manager (the files stay open)."""

    def __init__(self, d: Path):
        self.dir = d
        self._stack = ExitStack()
        self._files: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        listed = weight_files(d)
        for path in sorted(set(listed.values())) or [d / SINGLE]:
            handle = self._open(path)
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                self.file_of[name] = path
        missing = {n: p for n, p in listed.items() if n not in self.file_of}
        if missing:
            name, path = next(iter(missing.items()))
            raise ConfigError(f"{path}: holds no tensor {name} ({d / INDEX} lists it there)")
        # PyTorch's name -> (Flax's, transposed), for a directory the Flax classes saved
        self.flax: dict[str, tuple[str, bool]] = {}
        if any(n.endswith((".kernel", ".embedding")) for n in self.file_of):
            for name in list(self.file_of):
                end = next((e for e in FLAX if name.endswith(e)), None)
                if end is not None:
                    torch = name.removesuffix(end) + ".weight"
                    self.flax[torch] = (name, FLAX[end])
                    self.file_of[torch] = self.file_of.pop(name)
        self.layout = "Flax" if self.flax else "PyTorch"

    def _open(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._files:
            if not path.is_file():
                raise ConfigError(f"{path}: no such file ({INDEX} names it)")
            try:
                self._files[path] = self._stack.enter_context(safe_open(str(path), "numpy"))
            except Exception as e:  # noqa: BLE001 - safetensors' own errors: one line
                raise ConfigError(f"{path}: not a readable safetensors file (truncated or "
                                  f"damaged: {first(e)})") from None
        return self._files[path]

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def shape(self, name: str) -> tuple[int, ...]:
        stored, transposed = self.flax.get(name, (name, False))
        shape = tuple(self._open(self.file_of[name]).get_slice(stored).get_shape())
        return shape[::-1] if transposed else shape

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or its ``region`` (only those bytes are read), as float32 (bf16 and
        fp16 checkpoints widen exactly)."""
        path = self.file_of[name]
        stored, transposed = self.flax.get(name, (name, False))
        try:
            handle = self._open(path)
            if region is None:
                x = handle.get_tensor(stored)
            else:
                x = handle.get_slice(stored)[region[::-1] if transposed else region]
            return np.asarray(x.T if transposed else x, dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors: one line
            raise ConfigError(f"{path}: tensor {name} is unreadable ({first(e)})") from None

    def name_for(self, w: Weight, layer: int | None, expert: int | None = None) -> str:
        """The name ``w`` has in this directory: GPT-2 checkpoints from the hub leave out the
        ``transformer.`` prefix that ``save_pretrained`` writes."""
        name = hf_name(w, layer, expert=expert)
        bare = hf_name(w, layer, prefixed=False, expert=expert)
        return bare if name not in self.file_of and w.hf.startswith("transformer.") and (
            bare in self.file_of) else name

    def check(self, table: list[Weight], m: Any) -> None:
        """Every tensor the table expects for the model section ``m``, at its shape; no other
        (buffers aside)."""
        d, expected = dims(m), set()
        for w in table:
            for layer, expert, _ in w.instances(m):
                name = self.name_for(w, layer, expert)
                expected.add(name)
                if name not in self.file_of and not any(
                        self.name_for(v, i, j) in self.file_of for v in table
                        for i, j, _ in v.instances(m)):
                    first = sorted(self.file_of)[0] if self.file_of else "none"
                    raise ConfigError(
                        f"{self.dir}: no tensor is named as transformers saves this model "
                        f"(e.g. {name}, in PyTorch's layout, or Flax's: kernel, embedding, "
                        f"scale); its tensors are named like {first}")
                if name not in self.file_of:
                    raise ConfigError(f"{self.dir}: tensor {name} is missing ({len(expected)} "
                                      f"found of the model's, {self.layout} layout); it holds "
                                      f"dxrun's {w.dxrun}")
                want, have = shape_of(w.hf_shape, d), self.shape(name)
                if have != want:
                    raise ConfigError(
                        f"{self.file_of[name]}: tensor {name} has shape {list(have)}, but "
                        f"config.json makes it {list(want)} ({', '.join(w.hf_shape)})")
        extra = sorted(n for n in self.file_of if n not in expected
                       and not n.endswith(BUFFERS) and not (n == "lm_head.weight" and m.tie_embeddings))
        if extra:
            raise ConfigError(f"{self.file_of[extra[0]]}: tensor {extra[0]} is not one of the "
                              f"model's ({len(extra)} such); config.json describes another model")


def first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
