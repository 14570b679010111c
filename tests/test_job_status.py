"""How a job ends (dxrun/launch/job_status.py's ``JobStatus``): one object writes status.json, the
one line and the exit code for whatever ended the job. Hydra's config is stood in for by the fields the
status reads; no JAX, no run."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from hydra.types import RunMode

from dxrun.config.errors import EXIT_CRASHED, NonFiniteError
from dxrun.launch import JobStatus
from dxrun.run import RunLog


def _hydra(output_dir, multirun: bool, num: int = 0) -> SimpleNamespace:
    return SimpleNamespace(mode=RunMode.MULTIRUN if multirun else RunMode.RUN,
                           job=SimpleNamespace(num=num),
                           overrides=SimpleNamespace(task=["train.steps=4"]),
                           runtime=SimpleNamespace(output_dir=str(output_dir)))


@pytest.fixture
def run_log():
    log = RunLog()
    yield log
    root = logging.getLogger()
    for h in (log.buffer, log.file):
        if h is not None:
            root.removeHandler(h)
            h.close()


def _status(run_dir) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def test_a_run_that_reached_its_end_is_ok(tmp_path, cfg_factory, run_log):
    with JobStatus(cfg_factory(), _hydra(tmp_path, multirun=False), run_log) as status:
        status.run_dir = tmp_path
        status.write("running")
        assert _status(tmp_path)["status"] == "running"
        status.ended({"early_stop": "train/loss has not improved for 2 rows"})
    record = _status(tmp_path)
    assert record["status"] == "ok" and record["reason"].startswith("train/loss")
    assert (record["job"], record["overrides"], record["attempt"], record["lost_attempts"]) == (
        None, ["train.steps=4"], 1, 0)
    assert record["finished"] >= record["started"]


def test_a_halt_in_a_single_run_exits_1_with_its_status(tmp_path, cfg_factory, run_log,
                                                       capsys):
    with pytest.raises(SystemExit) as exited, JobStatus(
            cfg_factory(), _hydra(tmp_path, multirun=False), run_log) as status:
        status.run_dir = tmp_path
        raise NonFiniteError("step 3: non-finite loss; checkpoint 2 is kept")
    assert exited.value.code == EXIT_CRASHED
    record = _status(tmp_path)
    assert (record["status"], record["kind"]) == ("failed", "nonfinite")
    assert record["reason"] == "step 3: non-finite loss; checkpoint 2 is kept"
    assert "dxrun: error: step 3: non-finite loss" in capsys.readouterr().err


def test_a_crash_in_a_multirun_is_recorded_and_the_sweep_goes_on(tmp_path, cfg_factory,
                                                                  run_log, capsys):
    run_dir = tmp_path / "3"
    with JobStatus(cfg_factory(), _hydra(run_dir, multirun=True, num=3), run_log) as status:
        status.run_dir = run_dir
        raise RuntimeError("boom\nsecond line")
    record = _status(run_dir)  # no exit: the next job of the sweep runs
    assert (record["status"], record["kind"], record["job"]) == ("failed", "crashed", 3)
    assert record["reason"] == "RuntimeError: boom"
    assert "second line" in (run_dir / "dxrun.log").read_text()  # the traceback, in the log
    err = capsys.readouterr().err
    assert f"dxrun: error: job #3: RuntimeError: boom (full traceback: {run_dir / 'dxrun.log'})" \
        in err


def test_what_is_no_ending_passes_through(tmp_path, cfg_factory, run_log):
    with pytest.raises(SystemExit), JobStatus(
            cfg_factory(), _hydra(tmp_path, multirun=False), run_log) as status:
        status.run_dir = tmp_path
        raise SystemExit(0)
    assert not (tmp_path / "status.json").exists()
