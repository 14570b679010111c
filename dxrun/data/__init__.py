"""Data sources, chosen by ``data.name``: ``markov`` (synthetic), ``text`` and ``tokens``; or
your own, ``data._target_`` (``dxrun.data``).

Each gives this process's rows of any step's global batch ([rows, seq_len + 1] int32) by random
access (``local_batch``), and a prefetching iterator with a JSON-able state for training
(``train_iterator``). Both are pure functions of (seed, step): the mesh and the number of
processes only decide which rows a process reads.

``has_eval`` says whether there is held-out data: a corpus whose validation split is shorter
than one window has none, and evaluation is then off (with one warning), never run on the
training split.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dxrun.config import ConfigError, checked_factory, first_line
from dxrun.plan import default_seq_len

if TYPE_CHECKING:
    from dxrun.config import DataConfig, ModelConfig, RunConfig


# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# A learnable synthetic language with an exactly known loss floor.
#
# A random sparse Markov chain of order ``k`` over ``S`` symbols: each context (the previous k
# tokens) has ``branching`` possible successors with random probabilities. Sequences start from the
# chain's stationary distribution, so every position is distributed alike and the best achievable
# mean cross-entropy over a window is known exactly (``entropy_floor``). With k >= 2 a model needs
# attention to do better than bigram statistics.
#
# The global batch of step ``n`` depends only on (seed, stream, n): never on the mesh or the number
# of processes, so every parallelism trains on identical data.

TRAIN, EVAL = 0, 1  # independent streams of the same chain
MAX_TABLE_BYTES = 2 * 2**30  # refuse chains whose tables need more (validation.validate)


def table_bytes(symbols: int, order: int, branching: int) -> int:
    """Peak memory of building the chain: per context, a row of ``symbols`` random float64 and
    its int64 argsort (alive together), then successors, probabilities, cumulative
    probabilities and the stationary solve's edge lists (a few ``branching``-long rows)."""
    return symbols**order * (16 * symbols + 48 * branching + 24)


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


class MarkovSource:
    def __init__(self, symbols: int, order: int, branching: int, seed: int,
                 batch_size: int, seq_len: int, max_iter: int = 100_000):
        self.S, self.k, self.batch_size, self.seq_len, self.seed = (
            symbols, order, batch_size, seq_len, seed)
        n_ctx = symbols**order
        rng = np.random.default_rng([seed, 0xC4A1])
        # Successors of each context and their probabilities (Dirichlet(1): varied entropies).
        # (a copy: the full argsort is n_ctx x symbols and must not outlive this line)
        self.succ = np.argsort(rng.random((n_ctx, symbols)), axis=1)[:, :branching].copy()
        self.prob = rng.dirichlet(np.ones(branching), size=n_ctx)
        self.cum = np.cumsum(self.prob, axis=1)
        self.cum[:, -1] = 1.0
        self.pi = self._stationary(max_iter)
        self.entropy_rate = float((self.pi * np.array([_entropy(p) for p in self.prob])).sum())
        self.entropy_floor = self._window_floor()

    def _next_ctx(self, ctx: np.ndarray, token: np.ndarray) -> np.ndarray:
        return (ctx * self.S + token) % (self.S**self.k)

    def _stationary(self, max_iter: int) -> np.ndarray:
        """Stationary distribution by power iteration of the lazy chain (P+I)/2, which has the
        same stationary distributions as P and converges even where P is periodic. A chain that
        mixes too slowly is refused: its entropy floor would be a wrong number."""
        n_ctx = self.S**self.k
        src = np.repeat(np.arange(n_ctx), self.succ.shape[1])
        dst = self._next_ctx(src, self.succ.reshape(-1))
        w = self.prob.reshape(-1)
        pi = np.full(n_ctx, 1.0 / n_ctx)
        for _ in range(max_iter):
            new = 0.5 * pi + 0.5 * np.bincount(dst, weights=pi[src] * w, minlength=n_ctx)
            change, pi = np.abs(new - pi).sum(), new
            if change < 1e-13:
                return pi / pi.sum()
        raise ConfigError(
            f"data.symbols={self.S}, data.order={self.k}, data.seed={self.seed}: the chain's "
            f"stationary distribution did not converge in {max_iter:,} iterations (last change "
            f"{change:.1e}), so its entropy floor is unknown; try another data.seed or a "
            "larger data.branching")

    def _window_floor(self) -> float:
        """Best mean loss over the seq_len targets of one window: target j (predicted from the
        j tokens before it) costs H(X_j | X_<j), which is the entropy rate once j >= order."""
        joint = self.pi.reshape((self.S,) * self.k)  # law of k consecutive tokens
        cond = []
        for j in range(1, self.k):
            h_j = _entropy(joint.sum(axis=tuple(range(j + 1, self.k))).ravel())
            h_prev = _entropy(joint.sum(axis=tuple(range(j, self.k))).ravel())
            cond.append(h_j - h_prev)
        full = max(0, self.seq_len - len(cond))
        return (sum(cond[: self.seq_len]) + full * self.entropy_rate) / self.seq_len

    def window_entropy(self) -> float:
        """The entropy of seq_len consecutive tokens, per token: the floor of a model of a
        window's joint law (``model.objective=mdlm``, whose bound lies above it). As
        ``entropy_floor`` but the first token costs its own entropy, H(X_0), and the window
        ends a token earlier (seq_len > order: that token costs the entropy rate)."""
        joint = self.pi.reshape((self.S,) * self.k)
        first = _entropy(joint.sum(axis=tuple(range(1, self.k))).ravel())
        return self.entropy_floor + (first - self.entropy_rate) / self.seq_len

    def batch(self, step: int, stream: int = TRAIN) -> np.ndarray:
        """Tokens [batch_size, seq_len + 1] (int32) of global step ``step``."""
        rng = np.random.default_rng([self.seed, stream, step])
        B, T = self.batch_size, self.seq_len + 1
        ctx = rng.choice(self.pi.size, size=B, p=self.pi)
        out = np.empty((B, T), np.int32)
        for i in range(self.k):  # the first k tokens are the digits of the starting context
            out[:, i] = (ctx // self.S ** (self.k - 1 - i)) % self.S
        u = rng.random((B, T))
        for t in range(self.k, T):
            idx = np.minimum((self.cum[ctx] < u[:, t:t + 1]).sum(axis=1), self.succ.shape[1] - 1)
            out[:, t] = self.succ[ctx, idx]
            ctx = self._next_ctx(ctx, out[:, t])
        return out


# ------------------------------------------------------------------------------------------------
# Token corpora: text files tokenized at start, or pre-tokenized ``.bin`` memmaps.
#
# Every failure a user can cause (missing path, empty corpus, unreadable tokenizer, dtype
# disagreement, token ids beyond the model's vocabulary) is a ConfigError before anything compiles.
#
# Token files are ``TokenFile``s, not memmaps: a memmap pickles as a full copy of its data, and
# Grain sends the source to every worker process; a ``TokenFile`` pickles as (path, dtype, range).

BYTE_VOCAB = 256
BYTE_EOT = 0  # NUL never occurs in UTF-8 text, so it can separate documents
EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SCAN_CHUNK = 1 << 24  # tokens per read when scanning a token file (32-64 MB)

log = logging.getLogger("dxrun")


class TokenFile:
    """Tokens ``[start, stop)`` of a flat binary token file, read through a memmap that is opened
    lazily and never pickled: a Grain worker reopens the file instead of receiving a copy.

    Slicing with a step-1 slice gives another ``TokenFile`` (a view, as ``corpus.split`` needs);
    ``np.asarray`` reads the tokens.
    """

    def __init__(self, path: str | Path, dtype: Any, start: int = 0, stop: int | None = None):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        size = self.path.stat().st_size // self.dtype.itemsize
        self.start, self.stop = start, size if stop is None else stop
        self._mm: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def _array(self) -> np.ndarray:
        if len(self) == 0:
            return np.zeros(0, self.dtype)  # np.memmap refuses an empty file
        if self._mm is None:
            self._mm = np.memmap(self.path, self.dtype, mode="r")
        return self._mm[self.start:self.stop]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice) and key.step in (None, 1):
            a, b, _ = key.indices(len(self))
            return TokenFile(self.path, self.dtype, self.start + a, self.start + max(a, b))
        return self._array()[key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self._array(), dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mm": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.dtype.name}, {self.start}, {self.stop})"


def max_id(tokens: Any, name: str = "tokens") -> int:
    """The largest id (-1 if empty), read in chunks so a large file never sits in memory whole;
    big files say what they are doing, since this can take a while."""
    n, top = len(tokens), -1
    chunks = range(0, n, SCAN_CHUNK)
    loud = len(chunks) > 4
    if loud:
        log.info("scanning %s (%s tokens) for its largest token id", name, f"{n:,}")
    for k, start in enumerate(chunks):
        top = max(top, int(np.asarray(tokens[start:start + SCAN_CHUNK]).max()))
        if loud and (k + 1) % 16 == 0:
            log.info("  %s: %d%%", name, min(100, 100 * (start + SCAN_CHUNK) // n))
    return top


@dataclass
class Corpus:
    train: Any  # 1-D token ids: an in-memory array (text) or a TokenFile (tokens)
    val: Any
    vocab_size: int  # ids are < vocab_size
    description: str
    max_id: int  # the largest id in train and val
    max_id_in: str = ""  # the token file holding it (empty: text, tokenized here)


class Tokenizer:
    """Byte-level (no file, vocab 256) or a local HF ``tokenizer.json``."""

    def __init__(self, path: str | None):
        self.path = path
        if path is None:
            self.vocab_size, self.eot, self._hf = BYTE_VOCAB, BYTE_EOT, None
            return
        try:
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"data.tokenizer={path}: cannot read it as a tokenizer.json "
                              f"({first}); give a HF tokenizers JSON file") from None
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        ids = [self._hf.token_to_id(name) for name in EOT_NAMES]
        self.eot = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        if self._hf is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint32)
        # No BOS/CLS/SEP from the tokenizer's post-processor: documents are separated by our
        # one end-of-text token (iter_documents), the same whatever the tokenizer's template.
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, np.uint32)

    def unencodable(self, text: str) -> list[str]:
        """Characters of ``text`` this tokenizer cannot represent: dropped by it or mapped to
        its unknown token (bytes: only lone surrogates, which have no UTF-8)."""
        if self._hf is None:
            return [c for c in text if 0xD800 <= ord(c) <= 0xDFFF]
        enc = self._hf.encode(text, add_special_tokens=False)
        unk = getattr(self._hf.model, "unk_token", None)
        covered = {i for tok, (a, b) in zip(enc.tokens, enc.offsets, strict=True) if tok != unk
                   for i in range(a, b)}
        return [c for i, c in enumerate(text) if i not in covered and not c.isspace()]

    def decode(self, ids: Any) -> str:
        if self._hf is None:
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return self._hf.decode([int(i) for i in ids])


def text_files(path: str, key: str = "data.path") -> list[Path]:
    """A file, a directory (all files below it) or a glob, sorted."""
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise ConfigError(f"{key}={path}: no such file, directory or glob match; "
                              "give the path of your text corpus")
    return files


def iter_documents(files: list[Path], tokenizer: Tokenizer,
                   key: str = "data.path") -> Iterator[np.ndarray]:
    """Each non-empty file's ids followed by the end-of-text token, one file at a time."""
    eot = np.asarray([] if tokenizer.eot is None else [tokenizer.eot], np.uint32)
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{key}: {f} is not UTF-8 text; convert it or leave it out") from None
        if text:
            yield np.concatenate([tokenizer.encode(text), eot])


def empty_corpus(files: list[Path], key: str) -> ConfigError:
    return ConfigError(f"{key}: the corpus ({len(files)} file(s)) is empty; "
                       f"point {key} at files with text in them")


def encode_files(files: list[Path], tokenizer: Tokenizer, key: str = "data.path") -> np.ndarray:
    """All documents (files), each followed by the end-of-text token, as one id array."""
    parts = list(iter_documents(files, tokenizer, key))
    if not parts:
        raise empty_corpus(files, key)
    return np.concatenate(parts)


def n_val_tokens(n: int, val_fraction: float) -> int:
    """The held-out tail: the last ``val_fraction`` of ``n`` tokens (data=text and prepare)."""
    return int(n * val_fraction)


def split(tokens: Any, val_fraction: float) -> tuple[Any, Any]:
    n_val = n_val_tokens(len(tokens), val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def load_text(d: DataConfig) -> Corpus:
    tokenizer = Tokenizer(d.tokenizer)
    tokens = encode_files(text_files(d.path), tokenizer)
    train, val = split(tokens, d.val_fraction)
    kind = "bytes" if d.tokenizer is None else Path(d.tokenizer).name
    return Corpus(train, val, tokenizer.vocab_size, f"{len(tokens):,} tokens ({kind})",
                  int(tokens.max()))


def read_meta(meta_path: Path, path: Any) -> dict[str, Any]:
    """``meta.json`` of a token dir (``data.path={path}``), {} when there is none. Refuses, in
    one line, a file that is not a JSON object (hand-edited, or cut short)."""
    if not meta_path.is_file():
        return {}
    fix = ("write it again with `python -m dxrun.data.prepare`, or delete it (the token files "
           "are then scanned)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.path={path}: {meta_path} is not valid JSON ({first_line(e)});"
                          f" {fix}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"data.path={path}: {meta_path} holds a JSON "
                          f"{type(meta).__name__}, not an object of keys; {fix}")
    return meta


BYTES = "bytes"  # meta.json's "tokenizer" for byte-level tokens (prepare without --tokenizer)


def recorded_tokenizer(d: DataConfig) -> tuple[bool, str | None]:
    """The tokenizer a token dir's ``meta.json`` names, as ``data.tokenizer`` would give it:
    (True, None) for bytes, (True, path) for a tokenizer.json still there, (False, None) when the
    dir records none (files written by other tools), the file is gone, or it names bytes for a
    vocabulary beyond a byte's 256 ids (a byte cannot decode them): ids only then."""
    try:
        meta = read_meta(Path(d.path).expanduser() / "meta.json", d.path)
    except ConfigError:
        return False, None
    name = meta.get("tokenizer")
    if name == BYTES:
        vocab = max(int(getattr(d, "vocab_size", None) or 0), int(meta.get("vocab_size") or 0))
        return (True, None) if vocab <= 256 else (False, None)
    if isinstance(name, str) and Path(name).is_file():
        return True, name
    return False, None


def load_tokens(d: DataConfig) -> Corpus:
    """``train.bin`` / ``val.bin`` in ``data.path`` (nanoGPT layout), read as ``data.dtype``
    (meta.json's, required: ``config.no_token_dtype``). The vocabulary comes from
    ``meta.json``; the largest id from a scan of the files, never from meta.json's ``max_id``:
    an id it understates would pass the vocabulary check and reach the embedding lookup and
    the loss's gather out of range, as a NaN loss."""
    root = Path(d.path).expanduser()
    if not (root / "train.bin").is_file():
        raise ConfigError(f"data.path={d.path}: no train.bin there; give the folder that "
                          "`python -m dxrun.data.prepare` wrote (train.bin, val.bin)")
    meta_path = root / "meta.json"
    meta = read_meta(meta_path, d.path)
    if meta.get("dtype", d.dtype) != d.dtype:
        raise ConfigError(f"data.dtype={d.dtype} but {meta_path} says dtype={meta['dtype']}; "
                          f"set data.dtype={meta['dtype']}")
    dtype = DTYPES[d.dtype]
    arrays = []
    for name in ("train.bin", "val.bin"):
        f = root / name
        if not f.is_file():
            arrays.append(np.zeros(0, dtype))
            continue
        if f.stat().st_size % np.dtype(dtype).itemsize:
            raise ConfigError(f"data.dtype={d.dtype}: {f} is {f.stat().st_size} bytes, not a "
                              f"whole number of {d.dtype} values; check data.dtype")
        arrays.append(TokenFile(f, dtype))
    train, val = arrays
    if len(train) == 0:
        raise ConfigError(f"data.path={d.path}: train.bin is empty; prepare a corpus with text")
    if (meta.get("train_tokens"), meta.get("val_tokens")) not in ((None, None),
                                                               (len(train), len(val))):
        log.warning("%s does not match train.bin/val.bin (token counts differ): its vocab_size "
                    "and dtype may be another corpus's", meta_path)
    top, where = -1, ""
    for name, tokens in (("train.bin", train), ("val.bin", val)):
        if (t := max_id(tokens, name)) > top:
            top, where = t, name
    vocab = int(meta.get("vocab_size", 0)) or top + 1
    return Corpus(train, val, vocab,
                  f"{len(train):,} train + {len(val):,} val tokens ({d.dtype})", top, where)


def vocab_warning(corpus: Corpus, m: ModelConfig) -> str | None:
    """A model vocabulary far beyond the data's (more than twice and more than 1,024 over)
    runs, but spends its output layer on ids that never occur: say so once."""
    v = corpus.vocab_size
    if not (m.vocab_size > 2 * v and m.vocab_size > v + 1024):
        return None
    unused = (m.vocab_size - v) * m.d_model * (1 if m.tie_embeddings else 2)
    return (f"model.vocab_size={m.vocab_size} is far above the data's vocabulary ({v}): "
            f"{unused:,} parameters for ids that never occur; set data.vocab_size={v} "
            f"(or model.vocab_size={v}) to train the model the data needs")


def check_fits(corpus: Corpus, d: DataConfig, m: ModelConfig, seq_len: int) -> None:
    """Vocabulary and window (``seq_len``: the run's) checks of the data ``d`` against the model
    ``m``, before anything compiles."""
    top = corpus.max_id
    if top >= m.vocab_size:
        where = f" {corpus.max_id_in} holds" if corpus.max_id_in else ""
        raise ConfigError(f"data.path={d.path}:{where} token id {top} >= model.vocab_size="
                          f"{m.vocab_size}; set data.vocab_size (or model.vocab_size) to "
                          f"{max(top + 1, corpus.vocab_size)} or more")
    if d.vocab_size <= top:  # the model may not follow it (model=small), but it is wrong
        raise ConfigError(f"data.vocab_size={d.vocab_size} is not above the data's largest "
                          f"token id {top}; set data.vocab_size={max(top + 1, corpus.vocab_size)}"
                          " or leave it out (data=tokens takes meta.json's)")
    if corpus.vocab_size > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary "
                          f"({corpus.vocab_size}); set data.vocab_size (or model.vocab_size) to "
                          f"{corpus.vocab_size} or more")
    if len(corpus.train) < seq_len + 1:
        raise ConfigError(f"data.path={d.path}: the corpus has {len(corpus.train)} training "
                          f"tokens, shorter than one window of data.seq_len+1={seq_len + 1}; "
                          "add text or lower data.seq_len")


# ------------------------------------------------------------------------------------------------
# The Grain pipeline over a token corpus: windows -> global shuffle -> this process's rows ->
# batches -> prefetch. Grain is imported where a corpus is read, not with this module: its
# import is heavy, and a markov run or your own source never needs it.
#
# The order is defined globally: a seeded shuffle of all windows, reshuffled each epoch
# (Grain combines the seed with the epoch). Global batch ``k`` is windows ``[k*B, (k+1)*B)`` of
# that order, and process ``p`` of ``P`` reads rows ``[p*B/P, (p+1)*B/P)`` of it and nothing
# else. So what a step sees depends on (seed, step) only: not on the mesh and not on the number
# of processes. The iterator state is the number of batches read (``{"next_index": k}``), for
# an exact mid-epoch resume with any number of worker processes.


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
