"""Data sources, chosen by ``data.name``: ``markov`` (synthetic), ``text`` and ``tokens``; or
your own, ``data._target_`` (``dxrun.data.user``).

Each gives this process's rows of any step's global batch ([rows, seq_len + 1] int32) by random
access (``local_batch``), and a prefetching iterator with a JSON-able state for training
(``train_iterator``). Both are pure functions of (seed, step): the mesh and the number of
processes only decide which rows a process reads.

``has_eval`` says whether there is held-out data: a corpus whose validation split is shorter
than one window has none, and evaluation is then off (with one warning), never run on the
training split.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dxrun.data import user
from dxrun.data.markov import EVAL, TRAIN, MarkovSource
from dxrun.plan.batch import default_seq_len

if TYPE_CHECKING:
    from dxrun.config.schema import RunConfig

__all__ = ["EVAL", "TRAIN", "Data", "BatchIterator", "build_data"]

log = logging.getLogger("dxrun")


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
        if getattr(d, "_target_", None):  # your own source (dxrun.data.user)
            self.kind, self.vocab_size = "target", cfg.model.vocab_size
            self.source = user.build_source(d._target_, dict(d.kwargs), batch_size, seq_len,
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
        from dxrun.data import corpus, pipeline  # grain: for corpora only

        loaded = corpus.load_text(d) if d.name == "text" else corpus.load_tokens(d)
        corpus.check_fits(loaded, d, cfg.model, seq_len)
        if warning := corpus.vocab_warning(loaded, cfg.model):
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
                self._splits[stream] = pipeline.local_batches(
                    tokens, seq_len, batch_size, d.seed + stream, process_index,
                    process_count)

    def _more_held_out(self) -> str:
        d = self.cfg.data
        return (f"raise data.val_fraction (now {d.val_fraction}) or add text" if d.name == "text"
                else f"put a longer val.bin in data.path={d.path}")

    def eval_batches(self, asked: int) -> tuple[int, str | None]:
        """The held-out batches an evaluation of ``eval.batches=asked`` reads, and a warning
        where that is not ``asked``: a corpus's split gives at most its full batches, so that
        no window is read twice, and one batch (its windows repeated) when it holds fewer
        windows than a batch. An endless stream (markov, your own source) gives ``asked``."""
        w, b = self.eval_windows, self.batch_size
        if w is None or asked * b <= w:
            return asked, None
        held = f"the held-out split holds {w} windows of data.seq_len={self.seq_len}"
        if w < b:
            return 1, (f"eval.batches={asked}: {held}, fewer than one batch of {b}: each "
                       f"evaluation reads 1 batch, in which windows repeat; eval/* is over "
                       f"those {w} windows; {self._more_held_out()}, or lower data.batch_size")
        return w // b, (f"eval.batches={asked}: {held}, {w // b} batch"
                        f"{'es' if w // b > 1 else ''} of {b}: each evaluation reads those, no "
                        f"window twice; lower eval.batches to {w // b} to silence this")

    def local_batch(self, step: int, stream: int = TRAIN) -> np.ndarray:
        """This process's rows of global batch ``step``."""
        if self.kind in ("markov", "target"):
            rows = (self.markov.batch(step, stream) if self.kind == "markov" else
                    user.checked_batch(self.cfg.data._target_, self.source, step, stream,
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
        from dxrun.data.pipeline import GrainBatches  # grain: for corpora only

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
