"""Your own data through ``data._target_``: the protocol a batch source follows for dxrun to
train, resume and evaluate on it.

* Built once per process as ``Target(**data.kwargs, batch_size=<the global batch>,
  seq_len=<the window>, vocab_size=model.vocab_size, seed=data.seed)``.
* ``source.batch(step, split) -> [batch_size, seq_len + 1]`` integer token ids in
  ``[0, vocab_size)``, the whole global batch, a pure function of ``(step, split)`` with
  ``split`` "train" or "eval" (each process keeps its own rows of it).
* Optional: ``has_eval`` (default True: there is an "eval" split), ``entropy_floor`` (the
  data's loss floor in nats per token, or None), ``description`` (one line for the log).
dxrun's train iterator reads ``batch(0, "train")``, ``batch(1, "train")``, ... and its state is
the next step: a checkpoint's data position, so a resumed run reads what the uninterrupted one
would have.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dxrun.config.errors import ConfigError
from dxrun.config.target import checked_factory

SPLITS = ("train", "eval")  # by stream: dxrun.data.TRAIN (0), EVAL (1)


def build_source(target: str, kwargs: dict[str, Any], batch_size: int, seq_len: int,
                 vocab_size: int, seed: int) -> Any:
    factory = checked_factory("data", target, kwargs)
    source = factory(**kwargs, batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size,
                     seed=seed)
    if not callable(getattr(source, "batch", None)):
        raise ConfigError(f"data._target_={target} returned a {type(source).__name__} with no "
                          "batch(step, split) method")
    return source


def checked_batch(target: str, source: Any, step: int, stream: int, batch_size: int,
                  seq_len: int, vocab_size: int) -> np.ndarray:
    """``source.batch(step, split)`` as int32, refused in one line when it is not a global
    batch of token ids in the vocabulary."""
    rows = np.asarray(source.batch(step, SPLITS[stream]))
    want = (batch_size, seq_len + 1)
    if rows.shape != want or not np.issubdtype(rows.dtype, np.integer):
        raise ConfigError(f"data._target_={target}: batch({step}, {SPLITS[stream]!r}) gave a "
                          f"{rows.dtype} array of shape {rows.shape}, not integers of shape "
                          f"{want} (batch_size, seq_len + 1)")
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        raise ConfigError(f"data._target_={target}: batch({step}, {SPLITS[stream]!r}) has ids "
                          f"in [{rows.min()}, {rows.max()}], outside model.vocab_size="
                          f"{vocab_size}")
    return rows.astype(np.int32)
