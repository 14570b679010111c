"""The Grain pipeline over a token corpus: windows -> global shuffle -> this process's rows ->
batches -> prefetch.

The order is defined globally: a seeded shuffle of all windows, reshuffled each epoch
(Grain combines the seed with the epoch). Global batch ``k`` is windows ``[k*B, (k+1)*B)`` of that
order, and process ``p`` of ``P`` reads rows ``[p*B/P, (p+1)*B/P)`` of it and nothing else. So
what a step sees depends on (seed, step) only: not on the mesh and not on the number of
processes. The iterator state is the number of batches read (``{"next_index": k}``), for an
exact mid-epoch resume with any number of worker processes.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import numpy as np


class Windows:
    """Random-access source: window ``i`` is tokens ``[i*L, i*L + L + 1)`` (inputs + targets).

    ``tokens`` is an array or a ``data.TokenFile``; Grain pickles this source into each worker
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


def position(state: dict[str, Any]) -> int:
    """The batches read, from a Grain iterator state: ``{"next_index": k}`` (no workers), or the
    nested state that ``mp_prefetch`` saved in older checkpoints (worker ``i`` of ``w`` reads
    batches ``i, i+w, ...``: together they have read the sum of their positions)."""
    if "next_index" in state:
        return int(state["next_index"])
    if "iterators_in_use_states" in state:
        return sum(position(s) for s in state["iterators_in_use_states"])
    raise ValueError(f"not a Grain iterator state: {state}")


def _end_with_parent(index: int, count: int) -> None:
    """In each worker process: die with the training process, even when it is SIGKILLed
    (Linux's parent-death signal; elsewhere the workers end when they find their parent gone)."""
    import ctypes
    import multiprocessing
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


class GrainBatches:
    """The training iterator: prefetching threads (and ``workers`` processes) over the batches.
    Its state is the number of batches read, ``{"next_index": k}``, whatever the workers: a
    resume starts the pipeline at batch k (random access), so ``data.workers`` may change."""

    def __init__(self, batches: grain.MapDataset, workers: int, prefetch: int = 4):
        self._batches, self._workers, self._prefetch = batches, workers, prefetch
        self._start, self._read = 0, 0
        self._it: Any = None  # opened at the first batch: no worker starts before it is needed

    def _open(self) -> Any:
        ds = self._batches[self._start:] if self._start else self._batches
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=max(1, min(4, self._prefetch)),
                                                  prefetch_buffer_size=self._prefetch))
        if self._workers > 0:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we have no main
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers),
                                worker_init_fn=_end_with_parent)
        return iter(ds)

    def __iter__(self) -> GrainBatches:
        return self

    def __next__(self) -> np.ndarray:
        if self._it is None:
            self._it = self._open()
        out = next(self._it)
        self._read += 1
        return out

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._start + self._read}

    def set_state(self, state: dict[str, Any]) -> None:
        self.close()
        self._start, self._read = position(state), 0

    def close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None
