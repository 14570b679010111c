"""``dxrun.tools.load``: the arguments of ``dxrun.evaluate`` / ``dxrun.sample`` (a run dir whose
name holds ``=`` is still the path), the checkpoint's config read as data (never interpolated),
the run dir taken from the path given (never from the checkpoint), and a crash's traceback file
(never a planted link)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import MARKOV_STEPS

from dxrun.tools.load import as_data, given_run_dir, load, main, split_args
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


TRICKY = ["${oc.env:HOME}", "${data_meta:/etc,vocab_size,7}", "a\\${x}", "\\\\${x}", "${x:${y}}",
          "${", "ends with \\", "$${x}", "plain"]


def test_stored_strings_come_back_as_written():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"s": [as_data(t) for t in TRICKY], "x": 1, "y": 2})
    assert list(cfg.s) == OmegaConf.to_container(cfg, resolve=True)["s"] == TRICKY
    assert as_data({"a": [1, None, 2.5, True]}) == {"a": [1, None, 2.5, True]}


def _meta_file(step_dir: Path) -> Path:
    (path,) = [p for p in (step_dir / "meta").iterdir()
               if p.is_file() and p.read_bytes().startswith(b"{") and b'"config"' in p.read_bytes()]
    return path


@pytest.mark.e2e  # reads the session's trained markov run
def test_a_checkpoints_config_is_read_as_data(markov_run, tmp_path):
    """A ``${...}`` stored in a checkpoint's meta (as a literal string: the saved config was
    resolved when it was written) is never resolved when a tool composes the config: no
    environment variable or file is read through it."""
    run = tmp_path / "run"
    shutil.copytree(markov_run / "checkpoints", run / "checkpoints")
    path = _meta_file(run / "checkpoints" / str(MARKOV_STEPS))
    meta = json.loads(path.read_text())
    meta["config"]["logger"]["project"] = "${oc.env:HOME}"
    meta["config"]["logger"]["tags"] = TRICKY
    meta["config"]["train"]["objective"] = "${model.name}"
    path.write_text(json.dumps(meta))
    loaded = load(run, ["parallelism=dp1"], "path", with_data=False)
    assert loaded.cfg.logger.project == "${oc.env:HOME}"
    assert list(loaded.cfg.logger.tags) == TRICKY
    assert loaded.cfg.train.objective == "${model.name}"
    assert loaded.run_dir == run


def test_the_run_dir_is_the_path_given_never_the_recorded_one(tmp_path):
    run = tmp_path / "copy"
    (run / "checkpoints" / "300").mkdir(parents=True)
    for given in (run, run / "checkpoints", run / "checkpoints" / "300"):
        assert given_run_dir(given, run / "checkpoints") == run
    shared = tmp_path / "shared" / "run-1a2b"  # checkpoint.dir=<shared>: outside any run dir
    (shared / "300").mkdir(parents=True)
    assert given_run_dir(shared / "300", shared) is None
    elsewhere = tmp_path / "mine"  # a run dir whose checkpoints.txt leads to the shared dir
    elsewhere.mkdir()
    (elsewhere / "checkpoints.txt").write_text(f"{shared}\n")
    assert given_run_dir(elsewhere, shared) == elsewhere
