"""``dxrun.tools.checkpoint``: the arguments of ``dxrun.evaluate`` / ``dxrun.sample`` (a run dir whose
name holds ``=`` is still the path), the checkpoint's config read as data (never interpolated),
the run dir taken from the path given (never from the checkpoint), a crash's traceback file
(never a planted link), and the newest checkpoint of a run still training read every time."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import pytest
from conftest import MARKOV_STEPS, Output, subprocess_env

from dxrun.checkpointing import committed_steps
from dxrun.export import run as export_run
from dxrun.sample import OPTIONS
from dxrun.tools.checkpoint import as_data, given_run_dir, load, main, split_args


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


@pytest.mark.e2e  # reads the session's trained markov run
def test_a_tool_with_nothing_readable_names_its_own_argument(markov_run, tmp_path, monkeypatch,
                                                            capsys):
    """The run's one checkpoint is damaged: the tool's refusal says what to give it (another
    path), not a training key (``checkpoint.resume=none``)."""
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(markov_run / "checkpoints", ckpts)
    _meta_file(ckpts / str(MARKOV_STEPS)).write_text('{"config": ')
    monkeypatch.setattr(sys, "argv", ["dxrun.export", str(tmp_path / "run"), "--to",
                                      str(tmp_path / "hf")])
    with pytest.raises(SystemExit) as stop:
        main("export", export_run)
    assert stop.value.code == 2 and not (tmp_path / "hf").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dxrun.export: error: path: no readable checkpoint in {ckpts}; give another path: a "
        "run dir, its checkpoints dir or one of its step dirs")


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


# The fastest rotation: a save every 5 steps, only the newest kept. A GPT-2-shaped model=tiny
# (tied embeddings): the export has an architecture to write.
LIVE = ["model=tiny", "model.tie_embeddings=true", "parallelism=dp2", "runtime.cpu_devices=2",
        "train.steps=1000000", "checkpoint.every=5", "checkpoint.keep=1", "logger=none",
        "train.eval_every=0", "train.log_every=1000", "data.batch_size=8", "data.seq_len=16"]


@pytest.mark.e2e  # a training process, read while it trains
def test_a_run_still_training_is_read_ten_times_in_ten(tmp_path, caplog):
    """A run saving every 5 steps and keeping one checkpoint: the checkpoint a reader chose goes
    while it is read, and the reader then takes the newest committed one. Ten loads of the
    tools (in this process) and one ``python -m dxrun.export`` all succeed while it trains."""
    run = tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-m", "dxrun", *LIVE, f"hydra.run.dir={run}"],
                               cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    out, export = Output(trainer), None
    try:
        deadline = time.monotonic() + 240
        while len(committed_steps(run / "checkpoints")) == 0:
            assert trainer.poll() is None and time.monotonic() < deadline, out.text()[-3000:]
            time.sleep(0.05)
        # The CLI's export beside this process's loads, each racing the rotation.
        export = subprocess.Popen(
            [sys.executable, "-m", "dxrun.export", str(run), "--to", str(tmp_path / "hf"),
             "runtime.cpu_devices=2"], cwd=tmp_path, env=subprocess_env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        steps = []
        with caplog.at_level(logging.INFO, logger="dxrun"):
            for _ in range(10):
                loaded = load(run, [], "path", with_data=False)
                assert loaded.path == run / "checkpoints" / str(loaded.step)
                assert sum(x.size for x in jax.tree.leaves(loaded.params)) == 109312
                steps.append(loaded.step)
        stdout, stderr = export.communicate(timeout=300)
        assert trainer.poll() is None, out.text()[-3000:]  # it trained all along
    finally:
        for proc in (trainer, export):
            if proc is not None:
                proc.kill()
                proc.wait()
    assert export.returncode == 0, stderr[-3000:]
    written = re.search(r"^wrote hf: GPT2LMHeadModel from run/checkpoints/(\d+) \(step (\d+)\)$",
                        stdout.strip())
    assert written and written[1] == written[2], stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == 2
    assert all(s % 5 == 0 for s in steps) and steps == sorted(steps), steps
    # The race was run: some reads found their checkpoint rotated away and read the newest.
    gone = [r.getMessage() for r in caplog.records if "was removed while it was read" in
            r.getMessage()] + [x for x in stderr.splitlines() if "was removed while" in x]
    assert gone, (steps, stderr[-3000:])
