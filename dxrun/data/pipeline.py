"""The Grain pipeline over a token corpus: windows -> global shuffle -> this process's rows ->
batches -> prefetch.

The order is defined globally: a seeded shuffle of all windows, reshuffled each epoch
(Grain combines the seed with the epoch). Global batch ``k`` is windows ``[k*B, (k+1)*B)`` of that
order, and process ``p`` of ``P`` reads rows ``[p*B/P, (p+1)*B/P)`` of it and nothing else. So
what a step sees depends on (seed, step) only: not on the mesh and not on the number of
processes. The iterator state is Grain's small JSON-able dict, for an exact mid-epoch resume.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np


class Windows:
    """Random-access source: window ``i`` is tokens ``[i*L, i*L + L + 1)`` (inputs + targets).

    ``tokens`` is an array or a ``corpus.TokenFile``; Grain pickles this source into each worker
    process, and a TokenFile travels as its path, not its data."""

    def __init__(self, tokens: Any, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], np.int32)


class ProcessRows(grain.MapDataset):
    """Row ``j`` of process ``p``: global row ``(j // b) * B + p * b + j % b``, ``b = B / P``."""

    def __init__(self, rows: grain.MapDataset, batch_size: int, index: int, count: int):
        super().__init__(rows)
        self._rows, self._B, self._b, self._p = rows, batch_size, batch_size // count, index

    def __len__(self) -> int:
        return len(self._rows) // self._B * self._b

    def __getitem__(self, j):  # noqa: ANN001 - Grain passes ints or slices
        if isinstance(j, slice):
            return self.slice(j)
        return self._rows[(j // self._b) * self._B + self._p * self._b + j % self._b]

    def __str__(self) -> str:
        return f"ProcessRows(p={self._p}, b={self._b}, B={self._B})"


def local_batches(tokens: Any, seq_len: int, batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Random access to this process's batch of every step: ``ds[k]`` is step k's rows."""
    rows = grain.MapDataset.source(Windows(tokens, seq_len)).shuffle(seed=seed).repeat()
    mine = ProcessRows(rows, batch_size, process_index, process_count)
    return mine.batch(batch_size // process_count, drop_remainder=True)


class GrainBatches:
    """The training iterator: prefetching threads (and ``workers`` processes) over the batches,
    with a JSON-able state."""

    def __init__(self, batches: grain.MapDataset, workers: int, prefetch: int = 4):
        ds = batches.to_iter_dataset(grain.ReadOptions(num_threads=max(1, min(4, prefetch)),
                                                       prefetch_buffer_size=prefetch))
        if workers > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we have no main
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        self._it = iter(ds)

    def __iter__(self) -> GrainBatches:
        return self

    def __next__(self) -> np.ndarray:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return self._it.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._it.set_state(state)
