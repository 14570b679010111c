"""``python -m dxrun.data.prepare``: streaming output equal to the in-memory split, and every
refusal through the real CLI (exit 2, one line, no traceback, nothing touched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dxrun.data import Tokenizer, encode_files, split, text_files
from dxrun.data import prepare as prep

ROOT = Path(__file__).resolve().parents[1]


def _docs(root: Path) -> Path:
    docs = root / "docs"
    docs.mkdir(parents=True)
    for i, n in enumerate((3000, 0, 1700, 4100)):  # one empty document
        (docs / f"doc{i}.txt").write_text("".join(chr(97 + (i * 7 + j) % 26) for j in range(n)))
    (docs / "sub").mkdir()
    (docs / "sub" / "más.txt").write_text("ünïcode " * 50)
    return docs


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dxrun.data.prepare", *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("val_fraction", [0.1, 0.0])
def test_streaming_equals_the_in_memory_split(tmp_path, monkeypatch, val_fraction):
    docs = _docs(tmp_path)
    monkeypatch.setattr(prep, "COPY_CHUNK", 1000)  # the tail moves in several chunks
    meta = prep.prepare(str(docs), str(tmp_path / "out"), val_fraction=val_fraction)
    ids = encode_files(text_files(str(docs)), Tokenizer(None))
    train, val = split(ids, val_fraction)
    got_train = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
    got_val = np.fromfile(tmp_path / "out" / "val.bin", np.uint16)
    np.testing.assert_array_equal(got_train, train)
    np.testing.assert_array_equal(got_val, val)
    # 3000, 1700, 4100 letters and 50 x 10 UTF-8 bytes, each document + EOT (the empty one: none)
    assert len(got_val) == int(9304 * val_fraction) and len(got_train) + len(got_val) == 9304
    on_disk = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert on_disk == meta and meta["max_id"] == int(ids.max()) > 127
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "meta.json", "train.bin", "val.bin"]  # no temporary files left


def test_cli_refusals(tmp_path):
    docs = _docs(tmp_path)
    out = tmp_path / "out"
    assert _cli(docs, out).returncode == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    cases = [
        ((docs, out), "out already has train.bin, val.bin, meta.json; pass --overwrite"),
        ((docs, out, "--val-fraction", "1"), "--val-fraction=1.0 must be in [0, 1)"),
        ((docs, tmp_path / "new", "--val-fraction", "-0.1"), "--val-fraction=-0.1 must be in"),
        ((docs, docs / "tok"), "is inside the text path"),
        ((f"{tmp_path}/**", tmp_path / "deep" / "tok"), "is inside the text path"),
        ((docs / "doc0.txt", tmp_path / "bad", "--tokenizer", docs / "doc0.txt"),
         "cannot read it as a tokenizer.json"),
        ((tmp_path / "nothing", tmp_path / "new"), "no such file"),
    ]
    for args, needle in cases:
        proc = _cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("dxrun.data.prepare: error: "), lines
        assert needle in lines[0], (needle, lines[0])
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    assert after == before
    assert not any((tmp_path / name).exists() for name in ("new", "deep", "bad"))
    assert not (docs / "tok").exists()


def test_cli_overwrite_replaces_and_a_failed_run_keeps_the_old_outputs(tmp_path):
    docs = _docs(tmp_path)
    out = tmp_path / "out"
    assert _cli(docs, out).returncode == 0
    old = (out / "train.bin").read_bytes()
    old_meta = json.loads((out / "meta.json").read_text())
    (docs / "latin1.txt").write_bytes(b"caf\xe9")  # not UTF-8: fails after some documents
    proc = _cli(docs, out, "--overwrite")
    assert proc.returncode == 2 and "is not UTF-8 text" in proc.stderr, proc.stderr
    assert (out / "train.bin").read_bytes() == old
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    (docs / "latin1.txt").unlink()
    (docs / "doc1.txt").write_text("new text")
    proc = _cli(docs, out, "--overwrite", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    assert (out / "val.bin").stat().st_size == 0
    meta = json.loads((out / "meta.json").read_text())
    total = old_meta["train_tokens"] + old_meta["val_tokens"]
    assert (meta["train_tokens"], meta["val_tokens"]) == (total + 9, 0)  # 8 bytes + EOT


def test_help_is_whole_with_an_example_and_the_run_command_is_the_shortest(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prep.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    description = " ".join(prep.__doc__.strip().split("\n\n")[1].split())
    assert description in help_text and description.endswith("data.path=<out dir>``.")
    assert "example: python -m dxrun.data.prepare corpus/ data/mycorpus" in help_text
    docs, out = _docs(tmp_path), tmp_path / "mycorpus"
    prep.main([str(docs), str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"train with: python -m dxrun data=tokens data.path={out}"
