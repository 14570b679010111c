"""The batches a run reads: ``Data`` (a source's rows of any step's global batch, and the train
iterator with its JSON-able state), the Grain pipeline over a token corpus (windows -> global
shuffle -> this process's rows -> batches -> prefetch) and the protocol of your own source
(``data._target_``). Grain is imported where a corpus is read, not with this module: its import
is heavy, and a markov run or your own source never needs it.

The order is defined globally: a seeded shuffle of all windows, reshuffled each epoch
(Grain combines the seed with the epoch). Global batch ``k`` is windows ``[k*B, (k+1)*B)`` of
that order, and process ``p`` of ``P`` reads rows ``[p*B/P, (p+1)*B/P)`` of it and nothing
else. So what a step sees depends on (seed, step) only: not on the mesh and not on the number
of processes. The iterator state is the number of batches read (``{"next_index": k}``), for
an exact mid-epoch resume with any number of worker processes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dxrun.config import ConfigError, checked_factory
from dxrun.data.corpus import check_fits, load_text, load_tokens, vocab_warning
from dxrun.data.markov import EVAL, TRAIN, MarkovSource
from dxrun.plan import default_seq_len

if TYPE_CHECKING:
    from dxrun.config import RunConfig



log = logging.getLogger("dxrun")


# Your own data through ``data._target_``: the protocol a batch source follows for dxrun to
# train, resume and evaluate on it.
#
# * Built once per process as ``Target(**data.kwargs, batch_size=<the global batch>,
#   seq_len=<the window>, vocab_size=model.vocab_size, seed=data.seed)``.
# * ``source.batch(step, split) -> [batch_size, seq_len + 1]`` integer token ids in
#   ``[0, vocab_size)``, the whole global batch, a pure function of ``(step, split)`` with
#   ``split`` "train" or "eval" (each process keeps its own rows of it).
# * Optional: ``has_eval`` (default True: there is an "eval" split), ``entropy_floor`` (the
#   data's loss floor in nats per token, or None), ``description`` (one line for the log).
# dxrun's train iterator reads ``batch(0, "train")``, ``batch(1, "train")``, ... and its state is
# the next step: a checkpoint's data position, so a resumed run reads what the uninterrupted one
# would have.

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


class ProcessRows:
    """Random-access source over the shuffled rows: row ``j`` of process ``p`` is global row
    ``(j // b) * B + p * b + j % b``, ``b = B / P``."""

    def __init__(self, rows: Any, batch_size: int, index: int, count: int):
        self._rows, self._B, self._b, self._p = rows, batch_size, batch_size // count, index

    def __len__(self) -> int:
        return len(self._rows) // self._B * self._b

    def __getitem__(self, j: int) -> np.ndarray:
        return self._rows[(j // self._b) * self._B + self._p * self._b + j % self._b]

    def __str__(self) -> str:
        return f"ProcessRows(p={self._p}, b={self._b}, B={self._B})"


def local_batches(tokens: Any, seq_len: int, batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1) -> Any:
    """Random access to this process's batch of every step (a ``grain.MapDataset``): ``ds[k]``
    is step k's rows."""
    import grain  # heavy: for corpora only (this section's note)

    rows = grain.MapDataset.source(Windows(tokens, seq_len)).shuffle(seed=seed).repeat()
    mine = grain.MapDataset.source(ProcessRows(rows, batch_size, process_index, process_count))
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

    def __init__(self, batches: Any, workers: int, prefetch: int = 4):
        self._batches, self._workers, self._prefetch = batches, workers, prefetch
        self._start, self._read = 0, 0
        self._it: Any = None  # opened at the first batch: no worker starts before it is needed

    def _open(self) -> Any:
        import grain  # heavy: for corpora only (this section's note)

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


__all__ = ["EVAL", "TRAIN", "Data", "BatchIterator", "build_data"]



class BatchIterator(Protocol):
    def __next__(self) -> np.ndarray: ...
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


class _StepIterator:
    def __init__(self, data: Data, stream: int):
        self.data, self.stream, self.step = data, stream, 0

    def __iter__(self) -> _StepIterator:
        return self

    def __next__(self) -> np.ndarray:
        out = self.data.local_batch(self.step, self.stream)
        self.step += 1
        return out

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Data:
    """One data source for one process: ``process_index`` of ``process_count`` reads its rows."""

    def __init__(self, cfg: RunConfig, process_index: int = 0, process_count: int = 1,
                 batch_size: int | None = None, seq_len: int | None = None):
        """``batch_size`` and ``seq_len``: the run's global batch and window (``plan.global_batch``,
        ``plan.seq_len``); None: ``data.batch_size``, and ``data.seq_len`` or for null this
        backend's default (a config no mesh plan resolved). The config is only read."""
        d = cfg.data
        if seq_len is None:  # no plan: data.seq_len, or for null this backend's default
            import jax

            seq_len = default_seq_len(d.seq_len, cfg.model.max_seq_len, jax.default_backend())
        batch_size = d.batch_size if batch_size is None else batch_size
        self.cfg, self.index, self.count = cfg, process_index, process_count
        self.batch_size, self.seq_len, self.workers = batch_size, seq_len, d.workers
        self.rows = batch_size // process_count
        self.kind = d.name
        self.entropy_floor: float | None = None
        self.has_eval = True  # the markov source's eval stream is an independent one
        self.eval_windows: int | None = None  # held-out windows; None: an endless stream
        if getattr(d, "_target_", None):  # your own source (dxrun.data)
            self.kind, self.vocab_size = "target", cfg.model.vocab_size
            self.source = build_source(d._target_, dict(d.kwargs), batch_size, seq_len,
                                            self.vocab_size, d.seed)
            self.has_eval = bool(getattr(self.source, "has_eval", True))
            self.entropy_floor = getattr(self.source, "entropy_floor", None)
            self.description = getattr(self.source, "description", f"data._target_={d._target_}")
            return
        if d.name == "markov":
            self.markov = MarkovSource(symbols=d.symbols or cfg.model.vocab_size, order=d.order,
                                       branching=d.branching, seed=d.seed,
                                       batch_size=batch_size, seq_len=seq_len)
            # masked diffusion models the whole window: its floor is the window's entropy
            self.entropy_floor = (self.markov.window_entropy() if cfg.model.objective == "mdlm"
                                  else self.markov.entropy_floor)
            self.vocab_size = self.markov.S
            self.description = (f"order {d.order}, {self.markov.S} symbols "
                                f"(entropy floor {self.entropy_floor:.4f} nats/token)")
            return
        loaded = load_text(d) if d.name == "text" else load_tokens(d)
        check_fits(loaded, d, cfg.model, seq_len)
        if warning := vocab_warning(loaded, cfg.model):
            log.warning(warning)
        self.vocab_size, self.description = loaded.vocab_size, loaded.description
        self.has_eval = len(loaded.val) >= seq_len + 1
        self.eval_windows = max(0, len(loaded.val) - 1) // seq_len
        if not self.has_eval and cfg.train.eval_every > 0:
            log.warning("no evaluation: the held-out split has %d tokens, fewer than one window "
                        "(data.seq_len+1=%d); %s, or set train.eval_every=0 to silence this",
                        len(loaded.val), seq_len + 1, self._more_held_out())
        self._splits = {}
        for stream, tokens in ((TRAIN, loaded.train), (EVAL, loaded.val)):
            if stream == TRAIN or self.has_eval:
                self._splits[stream] = local_batches(
                    tokens, seq_len, batch_size, d.seed + stream, process_index,
                    process_count)

    def _more_held_out(self) -> str:
        d = self.cfg.data
        return (f"raise data.val_fraction (now {d.val_fraction}) or add text" if d.name == "text"
                else f"put a longer val.bin in data.path={d.path}")

    def eval_batches(self, asked: int, given: str | None = None) -> tuple[int, str | None]:
        """The held-out batches an evaluation of ``eval.batches=asked`` reads, and a warning
        where that is not ``asked``: a corpus's split gives at most its full batches, so that
        no window is read twice, and one batch (its windows repeated) when it holds fewer
        windows than a batch. An endless stream (markov, your own source) gives ``asked``.
        ``given``: the setting as the warning names it (``eval.batches=all``)."""
        w, b = self.eval_windows, self.batch_size
        if w is None or asked * b <= w:
            return asked, None
        given = given or f"eval.batches={asked}"
        windows = f"{w} window{'s' if w != 1 else ''}"
        held = f"the held-out split holds {windows} of data.seq_len={self.seq_len}"
        if w < b:
            return 1, (f"{given}: {held}, fewer than one batch of {b}: each evaluation reads "
                       f"1 batch, in which windows repeat; eval/* is over "
                       f"{'that' if w == 1 else 'those'} {windows}; "
                       f"{self._more_held_out()}, or lower data.batch_size")
        return w // b, (f"{given}: {held}, {w // b} batch"
                        f"{'es' if w // b > 1 else ''} of {b}: each evaluation reads those, no "
                        f"window twice; lower eval.batches to {w // b} to silence this")

    def local_batch(self, step: int, stream: int = TRAIN) -> np.ndarray:
        """This process's rows of global batch ``step``."""
        if self.kind in ("markov", "target"):
            rows = (self.markov.batch(step, stream) if self.kind == "markov" else
                    checked_batch(self.cfg.data._target_, self.source, step, stream,
                                       self.batch_size, self.seq_len, self.vocab_size))
            return rows[self.index * self.rows:(self.index + 1) * self.rows]
        if stream not in self._splits:
            raise ValueError("no held-out data (Data.has_eval is False): nothing to evaluate on")
        return self._splits[stream][step]

    def train_iterator(self, overfit_batches: int = 0) -> BatchIterator:
        """The training batches; ``overfit_batches`` (debug=overfit): the same few, over and
        over (``Repeated``)."""
        if overfit_batches:
            return Repeated(self.train_iterator(), overfit_batches)
        if self.kind in ("markov", "target"):  # random access: the state is the next step
            return _StepIterator(self, TRAIN)
        return GrainBatches(self._splits[TRAIN], self.workers)


def build_data(cfg: RunConfig, process_index: int = 0, process_count: int = 1,
               batch_size: int | None = None, seq_len: int | None = None) -> Data:
    return Data(cfg, process_index, process_count, batch_size, seq_len)


class Repeated:
    """``train.overfit_batches`` (debug=overfit): the first few batches of a train iterator,
    given over and over. A model that cannot drive its loss down on them has a bug, whatever the
    data. The position it reports and restores is its source's (the batches it read), so a
    checkpoint's data position stays one the iterator without it understands."""

    def __init__(self, source: Any, n: int):
        self.source, self.n = source, n
        self.kept: list[Any] = []
        self.i = 0

    def __iter__(self) -> Repeated:
        return self

    def __next__(self) -> Any:
        if len(self.kept) < self.n:
            self.kept.append(next(self.source))
        batch = self.kept[self.i % self.n]
        self.i += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return self.source.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.source.set_state(state)

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()
