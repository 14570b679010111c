"""An example of your own data for dxrun: ``data._target_=custom_block.CountingData``, written
against dxrun's batch-source protocol (``dxrun/data/__init__.py``): built with the run's global
batch, window, vocabulary and seed, it gives any step's whole batch of either split by random
access, so dxrun's train iterator resumes it from a checkpoint's step.

Each row counts up from a random start by a random stride (1 to ``max_stride``) modulo the
vocabulary: after two tokens the rest of the row is determined.
"""

from __future__ import annotations

import numpy as np

SPLITS = ("train", "eval")


class CountingData:
    has_eval = True
    entropy_floor = None  # not worked out: dxrun then reports no floor

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                 max_stride: int = 3):
        self.shape, self.vocab_size, self.seed = (batch_size, seq_len + 1), vocab_size, seed
        self.max_stride = max_stride
        self.description = f"counting rows, strides 1 to {max_stride}, mod {vocab_size}"

    def batch(self, step: int, split: str) -> np.ndarray:
        rng = np.random.default_rng([self.seed, SPLITS.index(split), step])
        B, T = self.shape
        start_Bx1 = rng.integers(0, self.vocab_size, (B, 1))
        stride_Bx1 = rng.integers(1, self.max_stride + 1, (B, 1))
        return ((start_Bx1 + stride_Bx1 * np.arange(T)) % self.vocab_size).astype(np.int32)
