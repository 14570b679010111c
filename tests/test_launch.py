"""``python -m dxrun.launch``: real processes joined through jax.distributed over loopback
(gloo collectives), against one process with the same 8 devices in this test process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_cfg

from dxrun.train import train

pytestmark = pytest.mark.e2e

COMMON = ["data.batch_size=16", "train.steps=6", "train.log_every=1", "train.eval_every=0",
          "checkpoint.every=2", "optimizer.warmup_steps=2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(WANDB_MODE="offline", WANDB_ERROR_REPORTING="false", WANDB_SILENT="true")
    return env


def launch(cwd: Path, *overrides: str, nproc: int = 2, timeout: int = 300,
           ) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dxrun.launch", "--nproc", str(nproc), "--devices-per-proc",
         str(8 // nproc), "--", *overrides], cwd=cwd, env=_env(), capture_output=True,
        text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows}


def in_process(run_dir: Path, *overrides: str) -> dict[int, float]:
    """The same run in this process: one process with 8 devices."""
    train(make_cfg(*COMMON, "logger=none", *overrides), run_dir)
    return losses(run_dir)


def assert_same(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    return run_dir, in_process(run_dir, "parallelism=dp4_tp2")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("two")
    proc = launch(cwd, *COMMON, "parallelism=dp4_tp2", "logger=wandb", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "run", proc


def test_two_processes_train_like_one(one_process, two_processes):
    run_dir, proc = two_processes
    assert_same(losses(run_dir), one_process[1], range(1, 7))
    # Process 0 alone wrote the run's files; each process its own log.
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra", "checkpoints", "dxrun.0.log", "dxrun.1.log", "metrics.jsonl", "plan.json",
        "status.json", "summary.json", "wandb"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["processes"], plan["dcn_shape"], plan["local_shape"]) == (2, [2, 1, 1],
                                                                          [2, 1, 2])
    assert "joined a 2-process run as process 1" in (run_dir / "dxrun.1.log").read_text()
    # The progress lines come once, from process 0.
    assert proc.stdout.count("step 6/6") == 1 and "[rank 0]" in proc.stdout
    assert "[Gloo]" not in proc.stdout + proc.stderr


def test_two_processes_dp8(tmp_path):
    proc = launch(tmp_path, *COMMON, "train.steps=3", "parallelism=dp8", "logger=none",
                  "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = in_process(tmp_path / "ref", "train.steps=3", "parallelism=dp8")
    assert_same(losses(tmp_path / "run"), want, range(1, 4))


def test_checkpoint_of_two_processes_resumes_in_one(one_process, two_processes, tmp_path):
    got = in_process(tmp_path / "resumed", "parallelism=dp4_tp2",
                     f"checkpoint.resume={two_processes[0] / 'checkpoints' / '4'}")
    assert_same(got, one_process[1], range(5, 7))


def test_checkpoint_of_one_process_resumes_in_two(one_process, tmp_path):
    ckpt = one_process[0] / "checkpoints" / "4"
    proc = launch(tmp_path, *COMMON, "parallelism=dp4_tp2", "logger=none",
                  f"checkpoint.resume={ckpt}", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same(losses(tmp_path / "run"), one_process[1], range(5, 7))


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallelism=tp8"], "parallelism.tp=8 puts each tensor-parallel group across 2 "
                          "processes (2 processes x 4 devices)"),
    (["parallelism=dp8", "data.batch_size=12"], "data.batch_size=12 is not divisible by "
                                                "dp*fsdp=8"),
])
def test_refused_layouts(tmp_path, overrides, message):
    proc = launch(tmp_path, "logger=none", *overrides, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank {rank}] dxrun: error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.json"))


def test_a_dead_process_stops_the_other(tmp_path):
    """Rank 1 is killed mid-run: rank 0 notices through the heartbeat and exits non-zero
    with a message saying so, and the launcher names the first failure. No hang."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
         "logger=none", "train.steps=100000", "train.log_every=1", "checkpoint.every=0",
         "distributed.heartbeat_timeout_s=10"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, pids = [], {}
    try:
        for line in proc.stdout:
            seen.append(line)
            if m := re.match(r"dxrun.launch: rank (\d) pid (\d+)", line):
                pids[int(m[1])] = int(m[2])
            if line.startswith("[rank 0]") and "step 2/" in line:
                break
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode not in (0, None) and took < 60, out[-3000:]
    assert "another task died" in out  # rank 0, from JAX's distributed runtime
    assert "dxrun.launch: error: rank 1 was killed by SIGKILL first; then rank 0" in out


def test_a_signal_to_one_process_stops_all_at_the_same_step(tmp_path):
    """SIGTERM reaches rank 1 only (SLURM's signals do not arrive at the same instant): both
    processes agree on one step, save it together and exit 0; the relaunch resumes it."""
    overrides = ["logger=none", "train.steps=100000", "train.log_every=1", "checkpoint.every=0",
                 "hydra.run.dir=run"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "4", "--",
         *overrides], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    seen, pids = [], {}
    try:
        for line in proc.stdout:
            seen.append(line)
            if m := re.match(r"dxrun.launch: rank (\d) pid (\d+)", line):
                pids[int(m[1])] = int(m[2])
            if line.startswith("[rank 0]") and "step 3/" in line:
                break
        os.kill(pids[1], signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(seen) + rest
    assert proc.returncode == 0, out[-3000:]
    from dxrun.checkpoint import committed_steps

    (step,) = committed_steps(tmp_path / "run" / "checkpoints")
    assert step % 10 == 0  # the first step at which the processes compare signals
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["kind"], status["reason"]) == ("stopped", f"stopped by SIGTERM at step {step}")
    assert max(losses(tmp_path / "run")) == step
