"""A run killed again and again ends as if nothing had happened.

One ``model=tiny`` run is SIGKILLed (no handler runs, nothing is saved: a node crash or the OOM
killer) during a checkpoint save, while a relaunch restores, and right after a
``metrics.jsonl`` row past its newest checkpoint, whose last line is then cut short (as a kill
mid-write or a full disk leaves it); each time it is relaunched with the same command into the
same run dir. It ends with the uninterrupted run's metrics and parameters, bitwise, every
committed checkpoint readable, and each step at most once in the W&B run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import Output, make_cfg, subprocess_env

from dxrun.checkpointing import Resume, committed_steps, restore
from dxrun.experiment import Experiment
from dxrun.tracking.wandb_file import read_history
from dxrun.train import train

STEPS = 40
# 8 x 16 tokens a step (not 32 x 64): what is tested is the kills and relaunches, not the step.
CHAOS = ["model=tiny", f"train.steps={STEPS}", "train.log_every=5", "train.eval_every=0",
         "checkpoint.every=10", "checkpoint.keep=10", "data.batch_size=8", "data.seq_len=16"]
TORN = '{"step": 99, "train/lo'


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _launch(cwd: Path, run_dir: Path) -> subprocess.Popen:
    # Each attempt has its own W&B service, as a relaunch on a cluster does (a shared one would
    # still hold the killed attempt's run open).
    env = subprocess_env(drop=("WANDB_SERVICE",))
    return subprocess.Popen(
        [sys.executable, "-m", "dxrun", *CHAOS, f"hydra.run.dir={run_dir}"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_when(proc: subprocess.Popen, predicate, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate(timeout=60)[0][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _second_save_started(ckpts: Path) -> bool:
    """Step 10 committed and the next save under way (Orbax's tmp dir) or just committed."""
    names = [p.name for p in ckpts.iterdir()] if ckpts.is_dir() else []
    committed = [n for n in names if n.isdigit()]
    return bool(committed) and (len(committed) > 1 or len(names) > len(committed))


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return max((json.loads(x)["step"] for x in text.splitlines() if x.endswith("}")), default=0)


def _restore(ckpts: Path, step: int):
    exp = Experiment.build(make_cfg(*CHAOS, "logger=none"))
    state, _, got = restore(Resume(ckpts, step, in_place=False), exp.abstract_state())
    assert got == step
    return jax.device_get(state)


@pytest.mark.e2e
def test_a_run_killed_three_times_ends_as_if_uninterrupted(tmp_path):
    reference = tmp_path / "reference"
    train(make_cfg(*CHAOS, "logger=none"), reference)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"

    # 1. Killed while saving its second checkpoint.
    _kill_when(_launch(tmp_path, run_dir), lambda: _second_save_started(ckpts))
    # 2. Killed while the relaunch restores (its plan is printed just before the restore).
    proc = _launch(tmp_path, run_dir)
    Output(proc).wait_for(lambda line: "mesh plan" in line, timeout=300)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    # 3. Killed right after a metrics row past its newest checkpoint; the last line is torn.
    _kill_when(_launch(tmp_path, run_dir), lambda: _logged_step(run_dir) > max(
        committed_steps(ckpts), default=0))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(TORN)
    resumed_at = max(committed_steps(ckpts))
    # 4. Relaunched to the end.
    last = _launch(tmp_path, run_dir)
    out = last.communicate(timeout=600)[0]
    assert last.returncode == 0, out[-3000:]
    assert f"resuming from step {resumed_at}" in out

    assert _untimed(_rows(run_dir)) == _untimed(_rows(reference))
    assert (run_dir / "metrics.discarded.jsonl").read_text().splitlines()[-1] == TORN
    steps = committed_steps(ckpts)
    assert steps == list(range(10, STEPS + 1, 10))
    for step in steps:  # every committed checkpoint reads back
        _restore(ckpts, step)
    got, want = _restore(ckpts, STEPS), _restore(reference / "checkpoints", STEPS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    # W&B, the attempts' files synced in order: each step of metrics.jsonl once, in order, with
    # its values; a killed attempt keeps only what its W&B service had written, and a resume
    # logs again the kept rows it lost.
    rows = {r["step"]: r for r in _rows(run_dir)}
    history = read_history(sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")))
    assert [h["step"] for h in history] == list(rows)
    assert all(h["train/loss"] == rows[h["step"]]["train/loss"] for h in history)


# Three attempts into one run dir: killed (kill -9) while held at step 5 after its rows 1-4 and
# checkpoints 2 and 4; relaunched and killed again before its first row (held at step 5 again,
# whose row waits for that save point); relaunched with another lr to the end. W&B on: a kill
# loses what W&B's writer had not written (here, all of the first attempt's rows).
RECORDS = ["model=tiny", "train.steps=8", "train.log_every=1", "train.eval_every=0",
           "checkpoint.every=2", "checkpoint.keep=10", "parallelism=dp2", "data.batch_size=8",
           "data.seq_len=16"]


def _launch_records(cwd: Path, run_dir: Path, *extra: str, hold: int = 0) -> subprocess.Popen:
    # hold: from that step on, each step waits for a SIGUSR1 (DXRUN_TEST_HOLD_AT_STEP).
    env = subprocess_env(drop=("WANDB_SERVICE",))
    if hold:
        env["DXRUN_TEST_HOLD_AT_STEP"] = str(hold)
    return subprocess.Popen(
        [sys.executable, "-m", "dxrun", *RECORDS, f"hydra.run.dir={run_dir}", *extra],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def three_attempts(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("records")
    run_dir = cwd / "run"
    first = _launch_records(cwd, run_dir, hold=5)
    _kill_when(first, lambda: _logged_step(run_dir) >= 4 and 4 in committed_steps(
        run_dir / "checkpoints"))
    second = _launch_records(cwd, run_dir, hold=5)
    Output(second).wait_for(lambda line: "step 5/8" in line)  # its row waits for step 5's save
    second.kill()
    assert second.wait(timeout=60) == -signal.SIGKILL
    assert _logged_step(run_dir) == 4
    third = _launch_records(cwd, run_dir, "optimizer.lr=0.005")
    out = third.communicate(timeout=600)[0]
    assert third.returncode == 0, out[-3000:]
    assert "resuming from step 4" in out
    return run_dir


@pytest.mark.e2e
def test_goodput_and_saves_count_every_attempt(three_attempts):
    """The attempt killed before its first row is on record from its start; the summary's saves
    are the run's, over its attempts."""
    record = json.loads((three_attempts / "goodput.json").read_text())
    attempts = record["attempts"]
    assert [(a["first_step"], a["last_step"]) for a in attempts] == [(0, 4), (4, 4), (4, 8)]
    assert all(a["wall_s"] > 0 for a in attempts) and attempts[1]["startup_s"] > 0
    assert record["wall_s"] == pytest.approx(sum(a["wall_s"] for a in attempts))
    assert [a["checkpoint_saves"] for a in attempts] == [2, 0, 2]
    summary = json.loads((three_attempts / "summary.json").read_text())
    assert summary["attempts"] == 3 and summary["checkpoint_saves"] == 4
    assert summary["checkpoint_block_s"] == pytest.approx(
        sum(a["checkpoint_block_s"] for a in attempts))


@pytest.mark.e2e
def test_each_attempt_keeps_its_config_and_the_status_lists_them(three_attempts):
    import yaml

    lrs = [yaml.safe_load((three_attempts / ".hydra" / "attempts" / str(n) / "config.yaml")
                          .read_text())["optimizer"]["lr"] for n in (1, 2, 3)]
    assert lrs == [0.01, 0.01, 0.005]
    status = json.loads((three_attempts / "status.json").read_text())
    assert status["status"] == "ok"
    assert [(a["attempt"], a["status"], a["config"]) for a in status["attempts"]] == [
        (n, s, f".hydra/attempts/{n}/config.yaml")
        for n, s in ((1, "killed"), (2, "killed"), (3, "ok"))]
    assert status["attempts"][0]["started"] == status["started"]


@pytest.mark.e2e
def test_wandb_gets_the_kept_rows_its_killed_attempts_lost(three_attempts):
    rows = {r["step"]: r for r in _rows(three_attempts)}
    assert sorted(rows) == list(range(1, 9))
    history = read_history(sorted(three_attempts.glob("wandb/offline-run-*/run-*.wandb")))
    assert [h["step"] for h in history] == list(rows)
    assert all(h["train/loss"] == rows[h["step"]]["train/loss"] for h in history)
