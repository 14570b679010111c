"""``python -m dxrun.data.prepare <text path> <out dir> [--tokenizer tokenizer.json]``

Tokenizes a text corpus (a file, a directory or a glob; bytes by default) into ``train.bin`` and
``val.bin`` (nanoGPT's layout: flat uint16/uint32 token ids) and ``meta.json`` (vocab size, dtype,
token counts, largest id), ready for ``python -m dxrun data=tokens data.path=<out dir>``.

Streaming: one file (document) at a time is tokenized and appended to a temporary file in the
out dir, so memory holds one document, never the corpus. The held-out split is the last
``--val-fraction`` of all tokens, as ``data=text`` holds out: once the total is known, that tail
is copied to ``val.bin`` and cut off the end of the temporary file, which becomes ``train.bin``.
The outputs appear only when everything succeeded; a failure leaves the out dir as it was.

Each document is the tokenizer's ids *without* its special tokens (HF ``add_special_tokens=False``:
no BOS/CLS/SEP) followed by one end-of-text token (``<|endoftext|>``/``</s>``/...; byte 0 for bytes).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from pathlib import Path

import numpy as np

from dxrun.config import ConfigError
from dxrun.data.corpus import (
    BYTES,
    Tokenizer,
    empty_corpus,
    iter_documents,
    n_val_tokens,
    text_files,
)

OUTPUTS = ("train.bin", "val.bin", "meta.json")
COPY_CHUNK = 1 << 26  # bytes per read when moving the held-out tail to val.bin


def _inside_input(text: str, out: Path) -> bool:
    """Would a rerun with the same text path read this run's outputs back as text?"""
    given = Path(text).expanduser()
    outputs = [Path(os.path.abspath(out / name)) for name in OUTPUTS]
    if given.is_dir():
        return Path(os.path.abspath(out)).resolve().is_relative_to(given.resolve())
    if given.is_file():
        return any(o.resolve() == given.resolve() for o in outputs)
    pattern = os.path.abspath(given)  # a glob ('*' here also crosses '/', as '**' does)
    return any(fnmatch.fnmatch(str(o), pattern) for o in outputs)


def check_args(text: str, out: Path, val_fraction: float, overwrite: bool) -> None:
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction} must be in [0, 1); "
                          "e.g. --val-fraction 0.05 (0 = no held-out split)")
    if _inside_input(text, out):
        raise ConfigError(f"out dir {out} is inside the text path {text}: a rerun would read "
                          "train.bin/val.bin back as text; write somewhere outside it")
    existing = [name for name in OUTPUTS if (out / name).exists()]
    if existing and not overwrite:
        raise ConfigError(f"{out} already has {', '.join(existing)}; pass --overwrite to "
                          "replace them or choose another out dir")


def _move_tail(src: Path, dst: Path, start_byte: int) -> None:
    """Copy bytes ``[start_byte, end)`` of ``src`` to ``dst`` in chunks, then cut them off."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        f.seek(start_byte)
        while chunk := f.read(COPY_CHUNK):
            g.write(chunk)
    os.truncate(src, start_byte)


def prepare(text: str, out_dir: str, tokenizer: str | None = None,
            val_fraction: float = 0.05, overwrite: bool = False) -> dict:
    out = Path(out_dir).expanduser()
    check_args(text, out, val_fraction, overwrite)
    tok = Tokenizer(tokenizer)
    files = text_files(text, key="text path")
    dtype = np.dtype("uint16" if tok.vocab_size <= 2**16 else "uint32")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.tmp" for name in OUTPUTS}
    done = False
    try:
        n, top = 0, -1
        with open(tmp["train.bin"], "wb") as f:
            for ids in iter_documents(files, tok, key="text path"):
                ids.astype(dtype).tofile(f)
                n, top = n + len(ids), max(top, int(ids.max(initial=0)))
        if n == 0:
            raise empty_corpus(files, "text path")
        n_val = n_val_tokens(n, val_fraction)
        _move_tail(tmp["train.bin"], tmp["val.bin"], (n - n_val) * dtype.itemsize)
        meta = {"vocab_size": int(tok.vocab_size), "dtype": dtype.name, "train_tokens": n - n_val,
                "val_tokens": n_val, "max_id": top, "eot": tok.eot,
                "tokenizer": str(Path(tokenizer).resolve()) if tokenizer else BYTES}
        tmp["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        for name in OUTPUTS:  # meta.json last: it vouches for the .bin files beside it
            tmp[name].replace(out / name)
        done = True
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        if created and not done and not any(out.iterdir()):
            out.rmdir()  # a refused corpus leaves no trace
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dxrun.data.prepare",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the example's lines
        description=__doc__.strip().split("\n\n")[1],
        epilog="Files are tokenized one at a time and streamed to disk; val.bin is the last\n"
               "--val-fraction of all tokens. Each file (document) is encoded without the\n"
               "tokenizer's own special tokens (add_special_tokens=False) and followed by one\n"
               "end-of-text token.\n\n"
               "example:\n"
               "  python -m dxrun.data.prepare corpus/ data/mycorpus --tokenizer tokenizer.json\n"
               "  python -m dxrun data=tokens data.path=data/mycorpus   # vocab, dtype: meta.json")
    parser.add_argument("text", help="a text file, a directory or a glob")
    parser.add_argument("out_dir", help="where train.bin, val.bin and meta.json go "
                                        "(not inside the text path)")
    parser.add_argument("--tokenizer", default=None, help="a local HF tokenizer.json "
                                                          "(default: bytes, vocab 256)")
    parser.add_argument("--val-fraction", type=float, default=0.05,
                        help="the last fraction of the tokens held out as val.bin, in [0, 1)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace train.bin/val.bin/meta.json already in out_dir")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.text, args.out_dir, args.tokenizer, args.val_fraction,
                       args.overwrite)
    except ConfigError as e:
        print(f"dxrun.data.prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
          f"tokens, vocab {meta['vocab_size']}, {meta['dtype']}")
    # The run takes the vocabulary and dtype from meta.json: the path is all it needs.
    print(f"train with: python -m dxrun data=tokens data.path={args.out_dir}")


if __name__ == "__main__":
    main()
