"""``dxrun.tools.load``: the arguments of ``dxrun.evaluate`` / ``dxrun.sample`` (a run dir whose
name holds ``=`` is still the path) and a crash's traceback file (never a planted link)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from dxrun.tools.load import main, split_args
from dxrun.tools.sample import OPTIONS


def test_a_run_dir_named_with_equals_signs_is_the_path(tmp_path, monkeypatch):
    # Hydra's override_dirname names runs like this.
    run = tmp_path / "multirun" / "optimizer.lr=0.1,train.steps=2"
    run.mkdir(parents=True)
    path, options, overrides = split_args(
        "sample", [str(run), "prompt=a=b", "n=2", "parallelism=tp2", "+data.x=1"], OPTIONS)
    assert path == run and (options["prompt"], options["n"]) == ("a=b", 2)
    assert overrides == ["parallelism=tp2", "+data.x=1"]
    # Relative and existing; or not a key=value at all (the refusal then names the path).
    monkeypatch.chdir(run.parent)
    assert split_args("evaluate", [run.name, "eval.batches=2"], {})[::2] == (
        Path(run.name), ["eval.batches=2"])
    assert split_args("evaluate", ["gone/lr=0.1"], {})[0] == Path("gone/lr=0.1")


def test_a_crash_traceback_never_follows_a_planted_link(tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    # What another user of a shared /tmp could plant at the old, predictable name.
    planted = Path(tempfile.gettempdir()) / f"dxrun.sample.{os.getpid()}.log"
    planted.symlink_to(victim)

    def crash(argv: list[str]) -> None:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(sys, "argv", ["dxrun.sample"])
    try:
        with pytest.raises(SystemExit) as stop:
            main("sample", crash)
    finally:
        planted.unlink()
    assert stop.value.code == 1 and victim.read_text() == "keep me"
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dxrun.sample: error: RuntimeError: the device fell over")
    log = Path(re.search(r"full traceback: (.+)\)$", line)[1])
    try:
        assert log != planted and not log.is_symlink()
        assert "RuntimeError: the device fell over" in log.read_text()
        assert log.stat().st_mode & 0o077 == 0  # this user's alone
    finally:
        log.unlink()
