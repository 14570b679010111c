"""Token corpora: text files tokenized at start, or pre-tokenized ``.bin`` memmaps.

Every failure a user can cause (missing path, empty corpus, unreadable tokenizer, dtype
disagreement, token ids beyond the model's vocabulary) is a ConfigError before anything compiles.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dxrun.errors import ConfigError

BYTE_VOCAB = 256
BYTE_EOT = 0  # NUL never occurs in UTF-8 text, so it can separate documents
EOT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids (possibly a read-only memmap)
    val: np.ndarray
    vocab_size: int  # ids are < vocab_size
    description: str


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
        return np.asarray(self._hf.encode(text).ids, np.uint32)

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


def encode_files(files: list[Path], tokenizer: Tokenizer, key: str = "data.path") -> np.ndarray:
    """All documents (files), each followed by the end-of-text token, as one id array."""
    parts = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{key}: {f} is not UTF-8 text; convert it or leave it out") from None
        if not text:
            continue
        parts.append(tokenizer.encode(text))
        if tokenizer.eot is not None:
            parts.append(np.asarray([tokenizer.eot], np.uint32))
    if not parts:
        raise ConfigError(f"{key}: the corpus ({len(files)} file(s)) is empty; "
                          "point data.path at files with text in them")
    return np.concatenate(parts)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def load_text(d: Any) -> Corpus:
    tokenizer = Tokenizer(d.tokenizer)
    tokens = encode_files(text_files(d.path), tokenizer)
    train, val = split(tokens, d.val_fraction)
    kind = "bytes" if d.tokenizer is None else Path(d.tokenizer).name
    return Corpus(train, val, tokenizer.vocab_size, f"{len(tokens):,} tokens ({kind})")


def load_tokens(d: Any) -> Corpus:
    """``train.bin`` / ``val.bin`` in ``data.path`` (nanoGPT layout), ``meta.json`` optional."""
    root = Path(d.path).expanduser()
    if not (root / "train.bin").is_file():
        raise ConfigError(f"data.path={d.path}: no train.bin there; give the folder that "
                          "`python -m dxrun.data.prepare` wrote (train.bin, val.bin)")
    meta_path = root / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("dtype", d.dtype) != d.dtype:
        raise ConfigError(f"data.dtype={d.dtype} but {meta_path} says dtype={meta['dtype']}; "
                          f"set data.dtype={meta['dtype']}")
    dtype = DTYPES[d.dtype]
    arrays = []
    for name in ("train.bin", "val.bin"):
        f = root / name
        if not f.is_file() or f.stat().st_size == 0:
            arrays.append(np.zeros(0, dtype))
            continue
        if f.stat().st_size % np.dtype(dtype).itemsize:
            raise ConfigError(f"data.dtype={d.dtype}: {f} is {f.stat().st_size} bytes, not a "
                              f"whole number of {d.dtype} values; check data.dtype")
        arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    train, val = arrays
    if len(train) == 0:
        raise ConfigError(f"data.path={d.path}: train.bin is empty; prepare a corpus with text")
    vocab = int(meta.get("vocab_size", 0)) or int(max(train.max(), val.max(initial=0))) + 1
    # (check_fits scans the ids themselves too: a meta.json can be wrong)
    return Corpus(train, val, vocab, f"{len(train):,} train + {len(val):,} val tokens ({d.dtype})")


def check_fits(corpus: Corpus, cfg: Any) -> None:
    """Vocabulary and window checks against the model, before anything compiles."""
    d, m = cfg.data, cfg.model
    top = max(int(a.max()) for a in (corpus.train, corpus.val) if len(a))
    if top >= m.vocab_size:
        raise ConfigError(f"data.path={d.path}: token id {top} >= model.vocab_size="
                          f"{m.vocab_size}; set data.vocab_size (or model.vocab_size) to "
                          f"{max(top + 1, corpus.vocab_size)} or more")
    if corpus.vocab_size > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary "
                          f"({corpus.vocab_size}); set data.vocab_size (or model.vocab_size) to "
                          f"{corpus.vocab_size} or more")
    if len(corpus.train) < d.seq_len + 1:
        raise ConfigError(f"data.path={d.path}: the corpus has {len(corpus.train)} training "
                          f"tokens, shorter than one window of data.seq_len+1={d.seq_len + 1}; "
                          "add text or lower data.seq_len")
