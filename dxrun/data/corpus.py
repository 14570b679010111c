"""Token corpora: text files tokenized at start, or pre-tokenized ``.bin`` memmaps.

Every failure a user can cause (missing path, empty corpus, unreadable tokenizer, dtype
disagreement, token ids beyond the model's vocabulary) is a ConfigError before anything compiles.

Token files are ``TokenFile``s, not memmaps: a memmap pickles as a full copy of its data, and
Grain sends the source to every worker process; a ``TokenFile`` pickles as (path, dtype, range).
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dxrun.config import ConfigError, first_line

if TYPE_CHECKING:
    from dxrun.config import DataConfig, ModelConfig



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
