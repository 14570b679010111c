"""``python -m dxrun.data.prepare <text path> <out dir> [--tokenizer tokenizer.json]``

Tokenizes a text corpus (a file, a directory or a glob; bytes by default) into ``train.bin`` and
``val.bin`` (nanoGPT's layout: flat uint16/uint32 token ids) and ``meta.json`` (vocab size, dtype,
token counts), ready for ``python -m dxrun data=tokens data.path=<out dir>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dxrun.data.corpus import Tokenizer, encode_files, split, text_files
from dxrun.errors import ConfigError


def prepare(text: str, out_dir: str, tokenizer: str | None = None,
            val_fraction: float = 0.05) -> dict:
    tok = Tokenizer(tokenizer)
    ids = encode_files(text_files(text, key="text path"), tok, key="text path")
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    train, val = split(ids, val_fraction)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train.astype(dtype).tofile(out / "train.bin")
    val.astype(dtype).tofile(out / "val.bin")
    meta = {"vocab_size": int(tok.vocab_size), "dtype": dtype, "train_tokens": int(len(train)),
            "val_tokens": int(len(val)), "eot": tok.eot,
            "tokenizer": str(Path(tokenizer).resolve()) if tokenizer else "bytes"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dxrun.data.prepare",
                                     description=__doc__.strip().splitlines()[2])
    parser.add_argument("text", help="a text file, a directory or a glob")
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", default=None, help="a local HF tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.text, args.out_dir, args.tokenizer, args.val_fraction)
    except ConfigError as e:
        print(f"dxrun.data.prepare: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.out_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
          f"tokens, vocab {meta['vocab_size']}, {meta['dtype']}")
    print(f"train with: python -m dxrun data=tokens data.path={args.out_dir} "
          f"data.dtype={meta['dtype']} data.vocab_size={meta['vocab_size']}")


if __name__ == "__main__":
    main()
