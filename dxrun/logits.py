"""``python -m dxrun.logits <run dir | checkpoints dir | step dir | HF dir> tokens=1,2,3
[out=logits.npy] [step=N | --best] [overrides]``: a model's fp32 next-token logits for token ids
(separated by commas or spaces: ``tokens="1 2 3"`` is three ids, as ``dxrun.sample``'s prompt).

In Python, ``from dxrun.logits import load_model``: ``load_model(path, *overrides)`` is the
newest checkpoint (``step=N``: that one; ``best=True``: keep_best's; on the command line
``step=N`` and ``--best``), or a Hugging Face directory, placed on the mesh of the run's
``parallelism`` or the overrides' (``"parallelism=tp2"``), as a callable: token ids
``[B, L]`` (or ``[L]``) in, logits ``[B, L, model.vocab_size]`` out (numpy fp32, the mesh's
padding rows cut). The command prints the last position's top five and saves the whole array
with ``out=`` (``numpy.save``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dxrun.config import ConfigError, RunConfig
from dxrun.tools.checkpoint import BEST, Loaded, load, main, split_args, token_ids

__all__ = ["Model", "load_model"]

# step: the checkpoint of that step (0: the newest; --best: keep_best's)
OPTIONS: dict[str, Any] = {"tokens": "", "out": "", "step": 0}


@dataclass
class Model:
    """A loaded model as a function of token ids; ``loaded`` holds its config (``.cfg``), step
    and mesh (``.exp.mesh``)."""

    loaded: Loaded
    _forward: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._forward = self.loaded.exp.forward()

    def __call__(self, tokens: Any) -> np.ndarray:
        ids = np.asarray(tokens)
        ids = ids[None] if ids.ndim == 1 else ids
        m = self.loaded.cfg.model
        if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"tokens: give integer ids of shape [batch, length] (got "
                              f"{ids.dtype} {list(ids.shape)})")
        if ids.min() < 0 or ids.max() >= m.vocab_size or ids.shape[1] > m.max_seq_len:
            raise ConfigError(f"tokens: ids must lie in [0, {m.vocab_size}) and be at most "
                              f"model.max_seq_len={m.max_seq_len} long (got ids "
                              f"{ids.min()}..{ids.max()}, length {ids.shape[1]})")
        out = self._forward(self.loaded.params, ids.astype(np.int32))
        return np.asarray(out, np.float32)[..., :m.vocab_size]


def load_model(path: str | Path, *overrides: str, step: int | None = None,
               best: bool = False) -> Model:
    """The model of a run dir, checkpoints dir, step dir or HF dir, on the mesh of its
    ``parallelism`` or the overrides', as a ``Model``; bad input is a ConfigError."""
    given = [*overrides, *([BEST] if best else [])]
    return Model(load(Path(path), given, key="path", with_data=False, step=step,
                      adjust=_fits_the_model))


def _fits_the_model(cfg: RunConfig) -> None:
    """No data is read: the default window is cut to the model's context where it is longer
    (a small HF model's max_position_embeddings), as its plan and checks require."""
    if cfg.data.seq_len is not None and cfg.data.seq_len > cfg.model.max_seq_len:
        cfg.data.seq_len = cfg.model.max_seq_len


def run(argv: list[str]) -> None:
    path, o, overrides = split_args("logits", argv, OPTIONS)
    try:
        ids = token_ids(o["tokens"])
    except ValueError:
        raise ConfigError(f"tokens={o['tokens']}: give token ids, e.g. tokens=1,2,3") from None
    if o["step"] < 0:
        raise ConfigError(f"step={o['step']} is no checkpoint's step; give one (or leave step= "
                          "out for the newest)")
    if o["step"] and BEST in overrides:
        raise ConfigError(f"step={o['step']} and --best name two checkpoints; give one")
    model = load_model(path, *overrides, step=o["step"] or None)
    out = model(np.array([ids]))
    if o["out"]:
        np.save(o["out"], out)
        print(f"wrote {o['out']}: logits {list(out.shape)} (batch, position, vocab), fp32")
    last = out[0, -1]
    top = np.argsort(-last)[:5]
    print(f"step {model.loaded.step}  last position's top 5: "
          + "  ".join(f"{i}: {last[i]:.4f}" for i in top))


if __name__ == "__main__":
    main("logits", run)
