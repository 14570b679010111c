"""Runs that survive: real Orbax checkpoints, real subprocesses stopped by real signals, real
files damaged on disk; resumed runs compared number for number with uninterrupted ones."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from conftest import (
    Output,
    cli_in_process,
    make_cfg,
    recorded_compiles,
    run_cli,
    subprocess_env,
    tree_digest,
)

from dxrun.checkpointing import (
    Checkpointer,
    IncompleteMeta,
    Resume,
    check_compatible,
    check_meta,
    committed_steps,
    data_position,
    find_resume,
    locate,
    restore,
    time_due,
)
from dxrun.config.errors import ConfigError, NonFiniteError
from dxrun.experiment import Experiment
from dxrun.tracking.wandb_file import read_history, read_run
from dxrun.train import train

STEPS = 40
# Saves at 10, 20, 30, 40 (the newest 3 kept); a row every 5 steps.
# 8 x 16 tokens a step, one sequence a device (not 32 x 64): what is tested is saving,
# stopping and resuming, not the step.
BASE = ["model=tiny", f"train.steps={STEPS}", "train.log_every=5", "train.eval_every=0",
        "checkpoint.every=10", "checkpoint.keep=3", "data.seq_len=16", "data.batch_size=8"]


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (run_dir / name).read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _restore(ckpt_dir: Path, step: int, *overrides: str):
    exp = Experiment.build(make_cfg(*BASE, "logger=none", *overrides))
    state, meta, got = restore(Resume(ckpt_dir, step, in_place=False), exp.abstract_state())
    assert got == step
    return exp, state, meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run (dp8, in process)."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(make_cfg(*BASE, "logger=none"), run_dir)
    return run_dir


def _launch(cwd: Path, run_dir: Path, *extra: str, hold: int = 0) -> subprocess.Popen:
    """``python -m dxrun`` on BASE into ``run_dir``; ``hold``: from that step on, each step
    waits for a SIGUSR1 (the test-only DXRUN_TEST_HOLD_AT_STEP, dxrun/run/faults.py)."""
    env = {**subprocess_env(), **({"DXRUN_TEST_HOLD_AT_STEP": str(hold)} if hold else {})}
    return subprocess.Popen(
        [sys.executable, "-m", "dxrun", *BASE, f"hydra.run.dir={run_dir}", *extra],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, out: Output, timeout: float = 240) -> None:
    """Until ``predicate()`` holds; fails (killing the run) when the run ends first or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if out.proc.poll() is not None or time.monotonic() > deadline:
            out.proc.kill()
            raise AssertionError(("the run ended first" if out.proc.returncode is not None
                                  else f"timed out ({timeout} s)") + ":\n" + out.text()[-3000:])
        time.sleep(0.02)


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return max((json.loads(x)["step"] for x in text.splitlines() if x.endswith("}")), default=0)


# The signal tests hold their runs (``_launch``'s hold: from that step on, each step waits for
# a SIGUSR1), so every signal is acted on at a known step, whatever the machine's speed.
HOLD_FIRST, HOLD_SECOND = 11, 16


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """``python -m dxrun`` held at step 11: SIGUSR1 (saves at 11, trains step 12, holds
    again), then SIGTERM (saves at 12, exits 0); relaunched into the same dir, held at 16, and
    sent SIGINT (saves at 16, exits 130); relaunched again to the end. Returns the run dir and
    the three outputs."""
    cwd = tmp_path_factory.mktemp("preempt")
    run_dir = cwd / "run"
    first = _launch(cwd, run_dir, hold=HOLD_FIRST)
    out = Output(first)
    # Row 10 is written after step 10's save point: the loop is held at step 11 or on its way.
    _wait_for(lambda: _logged_step(run_dir) >= 10, out)
    first.send_signal(signal.SIGUSR1)
    _wait_for(lambda: HOLD_FIRST in committed_steps(run_dir / "checkpoints"), out)
    (usr1,) = [s for s in committed_steps(run_dir / "checkpoints") if s % 10]
    first.send_signal(signal.SIGTERM)
    out.wait_for(lambda line: "SIGTERM received" in line)
    first.send_signal(signal.SIGUSR1)  # lets the held step act on the stop
    out1 = out.finish()
    assert first.returncode == 0, out1[-3000:]
    stopped = int(out1.split("SIGTERM: stopped at step ")[1].split(";")[0])
    second = _launch(cwd, run_dir, hold=HOLD_SECOND)
    out = Output(second)
    _wait_for(lambda: _logged_step(run_dir) >= 15, out)
    second.send_signal(signal.SIGINT)
    out.wait_for(lambda line: "SIGINT received" in line)
    second.send_signal(signal.SIGUSR1)
    out2 = out.finish()
    third = _launch(cwd, run_dir)
    out3 = Output(third).finish()
    assert third.returncode == 0, out3[-3000:]
    return {"run_dir": run_dir, "outputs": (out1, out2, out3), "usr1": usr1,
            "stopped": stopped, "sigint_code": second.returncode}


@pytest.mark.e2e
def test_preempted_run_ends_bitwise_equal_to_uninterrupted(reference, preempted):
    run_dir, stopped = preempted["run_dir"], preempted["stopped"]
    _, out2, out3 = preempted["outputs"]
    assert stopped == HOLD_FIRST + 1 and preempted["sigint_code"] == 130, preempted
    assert f"resuming from step {stopped} (checkpoint {run_dir / 'checkpoints' / str(stopped)})" \
        in out2
    assert f"SIGINT: stopped at step {HOLD_SECOND};" in out2
    assert f"resuming from step {HOLD_SECOND}" in out3
    # metrics.jsonl: the uninterrupted run's, row for row (timing aside), bitwise.
    assert _untimed(_rows(run_dir)) == _untimed(_rows(reference))
    # The final parameters and optimizer state, read back from both last checkpoints: bitwise.
    _, got, meta = _restore(run_dir / "checkpoints", STEPS)
    _, want, _ = _restore(reference / "checkpoints", STEPS)
    for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(want)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert meta["data"] == {"step": STEPS}
    # W&B: three attempts, one run.
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3
    ids = {read_run(f)["id"] for f in files}
    assert ids == {meta["wandb_id"]}, ids
    assert [h["step"] for h in read_history(files)] == [r["step"] for r in _rows(run_dir)]


@pytest.mark.e2e
def test_sigusr1_saves_and_training_goes_on(preempted):
    # SIGUSR1 wrote a checkpoint off the checkpoint.every grid, and the run trained on past it
    # until SIGTERM stopped it.
    assert (preempted["usr1"], preempted["stopped"]) == (HOLD_FIRST, HOLD_FIRST + 1), preempted
    run_dir, stopped = preempted["run_dir"], preempted["stopped"]
    assert f"SIGUSR1: saving checkpoint {run_dir / 'checkpoints' / str(HOLD_FIRST)}; training " \
        "goes on" in preempted["outputs"][0]
    # The stop line gives the command that resumes the run, overrides and run dir included.
    assert (f"SIGTERM: stopped at step {stopped}; checkpoint {run_dir / 'checkpoints' / str(stopped)}"
            f" committed. Resume with: python -m dxrun {' '.join(BASE)} "
            f"hydra.run.dir={run_dir}") in preempted["outputs"][0]


@pytest.fixture(scope="module")
def requeued(tmp_path_factory):
    """SLURM's ``--requeue`` recipe: the same command (``hydra.run.dir=<dir>``) launched again
    after each end. Killed outright (SIGKILL) at step 6, before the first checkpoint; relaunched
    and killed at step 11, after checkpoint 10; relaunched and held at the last step's save
    point, sent SIGTERM (checkpoint 40 is committed, the summary never written); relaunched
    once more. Returns the run dir, the four outputs, and status.json after the third."""
    cwd = tmp_path_factory.mktemp("requeue")
    run_dir = cwd / "rq"
    outs = []
    for hold, until in ((6, lambda: _logged_step(run_dir) >= 5),
                        (11, lambda: _logged_step(run_dir) >= 10 and 10 in
                         committed_steps(run_dir / "checkpoints"))):
        proc = _launch(cwd, run_dir, "logger=none", hold=hold)
        out = Output(proc)
        _wait_for(until, out)
        proc.kill()
        outs.append(out.finish())
    proc = _launch(cwd, run_dir, "logger=none", hold=STEPS)
    out = Output(proc)
    # The last step's progress line comes before its save point, where the run is held.
    out.wait_for(lambda line: f"step {STEPS}/{STEPS}" in line)
    proc.send_signal(signal.SIGTERM)
    out.wait_for(lambda line: "SIGTERM received" in line)
    proc.send_signal(signal.SIGUSR1)  # lets the held save point act on the stop
    outs.append(out.finish())
    assert proc.returncode == 0, outs[-1][-3000:]
    stopped = json.loads((run_dir / "status.json").read_text())
    # The last relaunch finds nothing to train: through the entry point in this process.
    last = cli_in_process(*BASE, "logger=none", f"hydra.run.dir={run_dir}", cwd=cwd)
    outs.append(last.stdout + last.stderr)
    return {"cwd": cwd, "run_dir": run_dir, "outputs": outs, "stopped": stopped,
            "last": last}


@pytest.mark.e2e
def test_a_requeue_continues_the_run_in_its_dir_from_the_newest_checkpoint(reference, requeued):
    """Issue 47.1: an attempt killed before its first checkpoint used to send every relaunch to
    a new sibling dir, from step 0, each left "running". Now each relaunch continues the run in
    the dir it names, the killed attempts counted as lost, and the run ends bitwise equal to
    one never interrupted."""
    run_dir, (_, second, third, _) = requeued["run_dir"], requeued["outputs"]
    assert [p.name for p in requeued["cwd"].iterdir()] == ["rq"]  # no rq_1, rq_2
    assert "already holds a run" not in second + third
    assert (f"{run_dir}: attempt 2 of its run; the last one died (killed: its status still "
            "said running) before its first checkpoint, so this one starts again from step 0"
            ) in second
    assert f"resuming from step 10 (checkpoint {run_dir / 'checkpoints' / '10'})" in third
    assert _untimed(_rows(run_dir)) == _untimed(_rows(reference))
    # The first attempt's row is set aside, not lost; the second's rows up to 10 are kept.
    assert [r["step"] for r in _rows(run_dir, "metrics.discarded.jsonl")] == [5]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["attempt"], status["lost_attempts"]) == ("ok", 4, 2)
    attempts = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert [(a["first_step"], a["last_step"]) for a in attempts] == [(0, 5), (0, 10),
                                                                     (10, STEPS)]


@pytest.mark.e2e
def test_a_run_stopped_after_its_last_save_is_finished_by_the_relaunch(reference, requeued):
    """Issue 47.3: a run that committed its last checkpoint but was stopped (or killed) before
    its summary stayed "stopped" (or "running") for good: the relaunch said "nothing to train".
    Now the relaunch records its end: summary.json from metrics.jsonl, status ok."""
    run_dir, stopped, last = requeued["run_dir"], requeued["stopped"], requeued["last"]
    assert (stopped["status"], stopped["step"]) == ("stopped", STEPS)
    assert last.returncode == 0 and "Traceback" not in last.stdout + last.stderr
    (line,) = [x for x in last.stderr.splitlines() if x.startswith("dxrun:")]
    assert line == (f"dxrun: checkpoint {run_dir / 'checkpoints' / str(STEPS)} is at the run's "
                    "end, which it had not recorded (stopped or killed after its last save): "
                    "summary.json (from metrics.jsonl) and status ok written")
    summary = json.loads((run_dir / "summary.json").read_text())
    want = _rows(reference)[-1]
    assert summary["step"] == STEPS and summary["train/loss"] == want["train/loss"]
    assert summary["n_params"] == json.loads((reference / "summary.json").read_text())["n_params"]
    assert summary["attempts"] == 3  # the attempts goodput.json holds
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"


@pytest.mark.e2e
def test_a_second_launch_into_a_held_run_dir_is_refused_or_waits(reference, tmp_path):
    """Issue 47.2: two launches into a run dir with checkpoints both resumed and trained in
    place at once (metrics.jsonl held every step twice). Now the live run holds the dir: a
    second launch is refused in one line naming it, before it plans or compiles anything; with
    run.wait_for_lock it waits for the first to end and then continues the run from where
    the first stopped."""
    run_dir = tmp_path / "run"
    first = _launch(tmp_path, run_dir, "logger=none", hold=11)
    out = Output(first)
    _wait_for(lambda: _logged_step(run_dir) >= 10
              and 10 in committed_steps(run_dir / "checkpoints"), out)
    before = tree_digest(run_dir)
    # (The second launch through the entry point in this process: the lock it meets is the
    # first launch's, another process's.)
    second = cli_in_process(*BASE, "logger=none", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stdout + second.stderr
    (line,) = [x for x in second.stderr.splitlines() if x.startswith("dxrun:")]
    assert line.startswith(f"dxrun: error: {run_dir} is in use by a live run: pid {first.pid} "
                           f"on {socket.gethostname()} since "), line
    assert "run.wait_for_lock=true" in line
    assert "mesh plan" not in second.stdout + second.stderr  # refused before planning
    assert tree_digest(run_dir) == before
    third = _launch(tmp_path, run_dir, "logger=none", "run.wait_for_lock=600")
    waiting = Output(third)
    waiting.wait_for(lambda line: "waiting for it to end (run.wait_for_lock=600)" in line)
    first.send_signal(signal.SIGTERM)
    out.wait_for(lambda line: "SIGTERM received" in line)
    first.send_signal(signal.SIGUSR1)
    out.finish()
    assert first.returncode == 0
    text = waiting.finish()
    assert third.returncode == 0, text[-3000:]
    assert "resuming from step 11" in text
    assert _untimed(_rows(run_dir)) == _untimed(_rows(reference))  # every step once
    assert not (tmp_path / "run_1").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1],
                         ids=["SIGINT", "SIGTERM", "SIGUSR1"])
def test_a_signal_while_starting_stops_the_run_in_one_line(tmp_path, sig):
    """Issue 47.3: outside the train loop SIGINT printed a KeyboardInterrupt traceback, SIGTERM
    and SIGUSR1 killed the run silently, and status.json never said it stopped. The signal
    comes once the run holds its dir (its lock file is there), while it plans and compiles."""
    run_dir, name = tmp_path / "run", signal.Signals(sig).name
    proc = _launch(tmp_path, run_dir, "logger=none")
    out = Output(proc)
    _wait_for(lambda: (run_dir / ".hydra" / "lock").exists(), out)
    proc.send_signal(sig)
    text = out.finish()
    assert proc.returncode == (130 if sig == signal.SIGINT else 0), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert "mesh plan" not in text  # stopped while starting
    (line,) = [x for x in text.splitlines() if name in x]
    assert line.endswith(f" - {name}: stopped while starting; no checkpoint yet. Resume with: "
                         f"python -m dxrun {' '.join(BASE)} logger=none hydra.run.dir={run_dir}")
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["signal"], status["checkpoint"]) == ("stopped", name, None)
    assert not (run_dir / ".hydra" / "lock").exists()  # the dir is free for the relaunch


STOP_IN_A_GC_CALLBACK = """
import gc, os, signal, time
from dxrun.run import guard_signals
from dxrun.config.errors import Interrupted
guard_signals()
fired = []
def callback(phase, info):
    if not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs inside this gc callback
gc.callbacks.append(callback)
try:
    gc.collect()
    time.sleep(5)
    print("not stopped")
except Interrupted as e:
    print("stopped by", e.signal_name)
"""


# A busy host: the thread that sends the signal again fires before starting it has returned,
# that is while the hook that started it still runs (seen once in CI), every time.
BUSY_HOST = """
import threading, time
class Slow(threading.Timer):
    def start(self):
        super().start()
        time.sleep(0.3)
threading.Timer = Slow
"""


@pytest.mark.parametrize("host", ["idle", "busy"])
def test_a_stop_raised_inside_a_gc_callback_is_not_lost(host):
    """A signal whose handler runs inside a callback Python cannot raise from (JAX registers a
    gc callback; a compile collects garbage) had its stop printed as 'Exception ignored' and
    dropped, and the run went on: it is sent again and stops the run in ordinary code, also
    when the resent signal comes back before the hook that sent it has returned."""
    code = (BUSY_HOST if host == "busy" else "") + STOP_IN_A_GC_CALLBACK
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, env=subprocess_env())
    assert proc.stdout.strip() == "stopped by SIGUSR1", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.e2e
def test_refused_resume_leaves_the_run_untouched(preempted):
    """Through the CLI's entry point (in this process): exit 2, one line, nothing written. One
    refused key is enough here: every refusal is raised by resume.check_compatible inside
    prepare(), before anything is written, and each one's message (data.batch_size's
    included) is test_what_cannot_change_on_resume_is_refused's, so a second launch here would
    test nothing more."""
    change, key, ours, theirs = "model.d_model=128", "model.d_model", "128", "64"
    run_dir = preempted["run_dir"]
    before = tree_digest(run_dir)
    proc = cli_in_process(*BASE, f"hydra.run.dir={run_dir}", change, cwd=run_dir.parent)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert len(errors) == 1, proc.stderr
    assert f"{key}={ours} but checkpoint" in errors[0] and f"{key}={theirs}" in errors[0]
    assert tree_digest(run_dir) == before


@pytest.mark.e2e
@pytest.mark.parametrize("mesh", ["dp2_tp4", "fsdp8", "dp2_fsdp2_tp2", "dp1"])
def test_resume_onto_another_mesh(reference, tmp_path, mesh):
    """Written under dp8, read straight into the new mesh's shards; the run goes on the same."""
    exp, state, _ = _restore(reference / "checkpoints", 20, f"parallelism={mesh}")
    for x, want in zip(jax.tree.leaves(state), jax.tree.leaves(exp.state_shardings), strict=True):
        assert x.sharding.is_equivalent_to(want, x.ndim)
        assert len(x.addressable_shards) == exp.plan.n_devices
        for shard in x.addressable_shards:
            assert shard.data.shape == want.shard_shape(x.shape)
    split = [x for x in jax.tree.leaves(state.params) if x.sharding.shard_shape(x.shape) != x.shape]
    assert bool(split) == (mesh != "dp1")  # some weights really are split on the new mesh
    cfg = make_cfg(*BASE, "logger=none", f"parallelism={mesh}",
                   f"checkpoint.resume={reference / 'checkpoints' / '20'}")
    train(cfg, tmp_path)
    got = [r["train/loss"] for r in _rows(tmp_path)]
    want = [r["train/loss"] for r in _rows(reference) if r["step"] > 20]
    assert [r["step"] for r in _rows(tmp_path)] == [25, 30, 35, 40]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.e2e
def test_a_checkpoint_saved_with_sequences_split_resumes_on_dp8_and_cp2_tp4(reference, tmp_path):
    """A run on dp2_cp4 (each sequence split over 4 devices) trains as the dp8 reference does;
    its step-20 checkpoint, read into dp8's shards and into cp2_tp4's (the sequences split in
    two, the weights in four), goes on as the reference: a checkpoint holds no trace of the
    context axis."""
    split = tmp_path / "dp2_cp4"
    train(make_cfg(*BASE, "logger=none", "parallelism=dp2_cp4"), split)
    want = [r["train/loss"] for r in _rows(reference)]
    np.testing.assert_allclose([r["train/loss"] for r in _rows(split)], want, rtol=1e-5)
    for mesh in ("dp8", "cp2_tp4"):
        cfg = make_cfg(*BASE, "logger=none", f"parallelism={mesh}",
                       f"checkpoint.resume={split / 'checkpoints' / '20'}")
        train(cfg, tmp_path / mesh)
        assert [r["step"] for r in _rows(tmp_path / mesh)] == [25, 30, 35, 40]
        np.testing.assert_allclose([r["train/loss"] for r in _rows(tmp_path / mesh)],
                                   want[4:], rtol=1e-5, err_msg=mesh)


@pytest.mark.e2e
def test_truncated_newest_checkpoint_falls_back(reference, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    newest = run_dir / "checkpoints" / str(STEPS)
    for f in newest.rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="dxrun"):
        train(make_cfg(*BASE, "logger=none"), run_dir)
    text = caplog.text
    assert f"checkpoint {newest} is incomplete or corrupt" in text
    assert f"resuming from step 30 (checkpoint {run_dir / 'checkpoints' / '30'})" in text
    assert (run_dir / "checkpoints" / f"{STEPS}.corrupt").is_dir()  # set aside, not deleted
    discarded = [json.loads(x)["step"]
                 for x in (run_dir / "metrics.discarded.jsonl").read_text().splitlines()]
    assert discarded == [35, 40]
    assert _untimed(_rows(run_dir)) == _untimed(_rows(reference))
    assert committed_steps(run_dir / "checkpoints") == [20, 30, 40]


NAN = ["model=tiny", "train.steps=10", "train.log_every=1", "train.eval_every=0",
       "checkpoint.every=4", "logger=none", "parallelism=dp2", "data.batch_size=8",
       "data.seq_len=16"]


@pytest.fixture
def nan_at_step_7(monkeypatch):
    """Step 7's loss poisoned (the test-only DXRUN_TEST_NAN_AT_STEP, dxrun/run/faults.py)."""
    monkeypatch.setenv("DXRUN_TEST_NAN_AT_STEP", "7")


@pytest.mark.e2e
def test_nan_halt_stops_at_that_step_keeping_the_last_good_checkpoint(tmp_path, nan_at_step_7):
    with pytest.raises(NonFiniteError, match="non-finite loss or gradients at step 7") as e:
        train(make_cfg(*NAN), tmp_path)
    assert f"last good checkpoint is {tmp_path / 'checkpoints' / '4'}" in str(e.value)
    assert committed_steps(tmp_path / "checkpoints") == [4]
    assert [r["step"] for r in _rows(tmp_path)][-1] == 7
    exp = Experiment.build(make_cfg(*NAN))
    state, meta, step = restore(Resume(tmp_path / "checkpoints", None, False),
                                exp.abstract_state())
    assert step == 4 and meta["data"] == {"step": 4}
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


@pytest.mark.e2e
def test_a_halted_run_ends_its_log_with_its_error_line(tmp_path, nan_at_step_7):
    """Through the entry point: the halt's one line, exit 1, is also the last line of the
    run's dxrun.log (it was on stderr and in status.json only)."""
    proc = cli_in_process(*NAN, "train.steps=8", "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert "non-finite loss or gradients at step 7" in line
    last = (tmp_path / "run" / "dxrun.log").read_text().splitlines()[-1]
    assert last.endswith(f"[dxrun][ERROR] - {line}"), last


@pytest.mark.e2e
def test_nan_skip_leaves_the_update_out_and_counts_it(tmp_path, nan_at_step_7):
    train(make_cfg(*NAN, "train.nan_policy=skip"), tmp_path)
    rows = {r["step"]: r for r in _rows(tmp_path)}
    assert [rows[s]["train/skipped_steps"] for s in (6, 7, 10)] == [0, 1, 1]
    assert rows[7]["train/loss"] is None or np.isnan(rows[7]["train/loss"])  # null once logged so
    assert np.isfinite(rows[10]["train/loss"])
    assert rows[7]["train/param_norm"] == rows[6]["train/param_norm"]  # parameters unchanged
    assert rows[8]["train/loss"] < rows[6]["train/loss"]  # and training went on
    assert committed_steps(tmp_path / "checkpoints") == [4, 8, 10]
    # train/lr is the lr the update used: the schedule at the optimizer's count, one behind
    # state.step after the skipped step 7.
    schedule = Experiment.build(make_cfg(*NAN, "train.nan_policy=skip")).schedule
    applied = [s - 1 if s <= 7 else s - 2 for s in range(1, 11)]
    np.testing.assert_allclose([rows[s]["train/lr"] for s in range(1, 11)],
                               [float(schedule(c)) for c in applied], rtol=1e-6)


def test_what_cannot_change_on_resume_is_refused():
    base = [x for x in BASE if not x.startswith("data.batch_size=")]  # the default batch, 32
    saved = make_cfg(*base)
    ok = make_cfg(*base, "parallelism=dp2_tp4", "optimizer.lr=0.001", "train.steps=200")
    check_compatible(ok, saved, Path("ckpt/25"))  # mesh, lr, length may change
    for change, key in [("model.n_layers=3", "model.n_layers"),
                        ("model=tiny_llama", "model.n_kv_heads"),
                        ("data.vocab_size=128", "model.vocab_size"),
                        ("data.symbols=8", "data.symbols"),
                        ("data.seq_len=32", "data.seq_len")]:
        with pytest.raises(ConfigError, match=f"{key}=.* but checkpoint ckpt/25 was written "
                                              f"with {key}="):
            check_compatible(make_cfg(*base, change), saved, Path("ckpt/25"))
    # A new global batch is refused, naming both values, unless allowed.
    with pytest.raises(ConfigError, match="^data.batch_size=64 but checkpoint ckpt/25 was "
                                          "written with data.batch_size=32; resume with "
                                          "data.batch_size=32, or set checkpoint.allow_batch"):
        check_compatible(make_cfg(*base, "data.batch_size=64"), saved, Path("ckpt/25"))
    bigger = make_cfg(*base, "data.batch_size=64", "checkpoint.allow_batch_change=true")
    check_compatible(bigger, saved, Path("ckpt/25"))
    meta = {"data": {"step": 75}, "config": {"data": {"batch_size": 32}}}
    assert data_position(meta, 64) == {"step": 37}  # same tokens seen, rounded down
    assert data_position(meta, 32) == {"step": 75}


def test_a_meta_whose_counts_are_whole_floats_is_read_as_ints():
    """``"step": 40.0`` (another JSON writer's 40) is the whole number it is, read as 40 (it was
    called "not a whole number" and the checkpoint set aside as damaged); 40.5 is not one."""
    def meta(step: float) -> dict:
        return {"config": {"data": {"batch_size": 8.0}, "train": {"steps": 80.0}},
                "data": {"step": step}, "tokens_seen": 5120.0,
                "early_stop": {"stale": 1.0, "step": 30.0, "best": 2.0}}

    whole = meta(40.0)
    check_meta(whole)
    assert json.dumps(whole) == json.dumps(
        {"config": {"data": {"batch_size": 8}, "train": {"steps": 80}}, "data": {"step": 40},
         "tokens_seen": 5120, "early_stop": {"stale": 1, "step": 30, "best": 2.0}})
    assert data_position(whole, 4) == {"step": 80}
    with pytest.raises(IncompleteMeta, match=r"^its meta's data.step is 40.5, not a whole "
                                             r"number$"):
        check_meta(meta(40.5))


def test_bad_checkpoint_settings_are_refused(tmp_path):
    from dxrun.checks import validate

    for override, key in [("checkpoint.every=-1", "checkpoint.every=-1"),
                          ("checkpoint.keep=0", "checkpoint.keep=0"),
                          ("train.nan_policy=ignore", "train.nan_policy='ignore'"),
                          ("run.wait_for_lock=soon", "run.wait_for_lock='soon'"),
                          ("run.wait_for_lock=-1", "run.wait_for_lock=-1")]:
        with pytest.raises(ConfigError, match=key):
            validate(make_cfg(override))
    with pytest.raises(ConfigError, match="holds no committed checkpoint"):
        cfg = make_cfg(f"checkpoint.resume={tmp_path}")
        find_resume(cfg.checkpoint, tmp_path / "new", cfg)
    # A run dir whose run saved nothing (debug=fast: checkpoint.every=0) says so, not "give a
    # run dir": what a tool reading it (dxrun.sample, evaluate, export) prints.
    fast = tmp_path / "fast"
    train(make_cfg("debug=fast", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8"),
          fast)
    with pytest.raises(ConfigError, match=rf"^path={fast} is a run dir whose run saved no "
                       r"checkpoint \(it ran with checkpoint.every=0, as debug=fast does, or "
                       r"stopped before its first save\); train it with checkpoint.every=N"):
        locate(fast, key="path")


@pytest.mark.e2e
def test_second_sigint_exits_at_once_without_saving(tmp_path):
    """Ctrl-C twice: the first asks for a save; the second, before that save, exits 130 at
    once, and no checkpoint appears. The run is held at step 6 (``_launch``'s hold, no SIGUSR1
    ever comes), so the first SIGINT's save cannot start, let alone be committed, before the
    second arrives, nor can the checkpoint.every=10 cadence of BASE save. BASE as it is (the
    hold is host-side): the programs are ``reference``'s, from the session's compile cache."""
    run_dir = tmp_path / "run"
    proc = _launch(tmp_path, run_dir, "logger=none", hold=6)
    out = Output(proc)
    _wait_for(lambda: _logged_step(run_dir) >= 5, out)
    proc.send_signal(signal.SIGINT)
    # Two signals sent back to back arrive as one: the second waits for the first's answer.
    out.wait_for(lambda line: "SIGINT received" in line)
    proc.send_signal(signal.SIGINT)
    text = out.finish(timeout=120)
    assert proc.returncode == 130, text[-2000:]
    assert "second SIGINT: exiting now without saving" in text
    assert "SIGINT: stopped at step" not in text  # the first SIGINT's save never finished
    committed = [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    assert committed == [], committed


def test_the_wall_clock_cadence_is_due_after_its_minutes():
    assert not time_due(1e9, 0.0, 0.0)  # checkpoint.every_minutes=0: off
    assert not time_due(59.9, 0.0, 60.0)
    assert time_due(60.0, 0.0, 60.0)
    assert not time_due(499.0, 440.0, 60.0) and time_due(500.0, 440.0, 60.0)


def test_a_save_compiles_nothing_and_restores_bitwise(tmp_path):
    """Every leaf replicated over the 8 simulated devices (dp8). Orbax's default save splits a
    replicated shard over its replicas, which compiled a slice program per array and device:
    a tiny run's first save held the loop 2.8 s (0.2 s now), model=small's under fsdp8 1.05 s
    (0.06 s). With one writer per shard a save compiles nothing."""
    exp = Experiment.build(make_cfg(*BASE, "logger=none", "parallelism=dp8"))
    state = exp.init_state()
    with recorded_compiles() as compiled:
        saver = Checkpointer(tmp_path, keep=1)
        saver.save(1, state, {"step": 1})
        saver.close()
    assert compiled == []
    restored, meta, step = restore(Resume(tmp_path, None, in_place=False),
                                   exp.abstract_state())
    assert (step, meta["step"]) == (1, 1)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.e2e  # a whole run (train(), three saves)
def test_every_minutes_saves_by_the_clock_and_each_save_logs_its_block(tmp_path):
    """No step cadence (checkpoint.every=0) and a clock cadence far below a step: a save after
    every step, each one's time in the next row (the window it held), the last one's in the
    summary only, which sums them all."""
    train(make_cfg("model=tiny", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                   "checkpoint.every=0", "checkpoint.every_minutes=1e-7", "checkpoint.keep=5",
                   "parallelism=dp2", "data.batch_size=8", "logger=none"), tmp_path)
    assert committed_steps(tmp_path / "checkpoints") == [1, 2, 3]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "perf/checkpoint_block_s" not in rows[0]  # the first save runs after its window
    blocks = [r["perf/checkpoint_block_s"] for r in rows[1:]]
    assert all(b > 0 for b in blocks)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checkpoint_saves"] == 3
    assert summary["checkpoint_block_s"] > sum(blocks)  # the final save: in no row
    attempt = json.loads((tmp_path / "goodput.json").read_text())["attempts"][-1]
    assert attempt["checkpoint_block_s"] == summary["checkpoint_block_s"]


class _Big(NamedTuple):
    """A state whose write takes a while (64 MB of noise: no compression shortens it)."""

    w: jax.Array


def test_the_older_checkpoint_goes_only_after_the_new_one_is_committed(tmp_path):
    """checkpoint.keep=1: while step 2 is written, a watcher lists the committed steps as fast
    as it can; step 1 is there until step 2 is, so a crash at any moment leaves one to resume
    from."""
    directory = tmp_path / "ckpts"
    saver = Checkpointer(directory, keep=1)
    noise = np.random.default_rng(0).standard_normal(16 * 2**20, dtype=np.float32)
    saver.save(1, _Big(jax.numpy.asarray(noise)), {"step": 1})
    saver.wait()
    seen: list[tuple[int, ...]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(tuple(committed_steps(directory)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        saver.save(2, _Big(jax.numpy.asarray(noise + 1)), {"step": 2})
        saver.wait()
    finally:
        done.set()
        watcher.join()
        saver.close()
    seen.append(tuple(committed_steps(directory)))
    changes = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    assert changes in ([(1,), (1, 2), (2,)], [(1,), (2,)]), changes
    assert len(seen) > 10  # the watcher really looked during the save


# A full disk. Tests run as root and mount a small tmpfs (a real full disk); where mounting is
# refused they fall back to injecting the error the disk would give (never skipped).
SMALL = ["model=tiny", "train.steps=3", "checkpoint.every=1", "train.log_every=1",
         "train.eval_every=0", "logger=none", "parallelism=dp2", "data.batch_size=8"]
# model=tiny's checkpoint takes 1.4 MB: the first save fits, the second does not.
DISK_KIB = 2200


@contextlib.contextmanager
def small_disk(path: Path, kib: int):
    """``path`` as a tmpfs of ``kib`` KiB; yields whether it could be mounted (else ``path`` is
    a plain dir). Unmounted after, whatever happened."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


# Where no tmpfs can be mounted: the checkpoint writer's save of step 2 fails as a full disk
# makes it fail (tensorstore's ENOSPC, raised by Orbax as it is).
_INJECT_ENOSPC = """
import sys, orbax.checkpoint as ocp
save = ocp.CheckpointManager.save
def full(self, step, *a, **k):
    if step == 2:
        raise ValueError("RESOURCE_EXHAUSTED: Failed to write 205453 bytes to file 6: No space "
                         "left on device [os_error_code='28']")
    return save(self, step, *a, **k)
ocp.CheckpointManager.save = full
sys.argv = ["dxrun", *sys.argv[1:]]
from dxrun.__main__ import cli
cli()
"""


@pytest.mark.e2e  # two runs through the CLI
def test_a_full_disk_is_one_line_and_the_relaunch_resumes(tmp_path):
    """The second save finds no space: one line naming it and the checkpoint kept, status
    failed with kind disk (not an out-of-memory report, though tensorstore says
    RESOURCE_EXHAUSTED), no traceback, the failed save's partial files gone; with space again
    the same command resumes from the checkpoint kept."""
    disk = tmp_path / "disk"
    run_dir = disk / "run"
    ckpts = run_dir / "checkpoints"
    args = [*SMALL, f"hydra.run.dir={run_dir}"]
    with small_disk(disk, DISK_KIB) as mounted:
        if mounted:
            proc = run_cli(*args, cwd=tmp_path, timeout=300)
        else:
            proc = subprocess.run([sys.executable, "-c", _INJECT_ENOSPC, *args], cwd=tmp_path,
                                  env=subprocess_env(), capture_output=True, text=True,
                                  timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-3000:]
        line = (f"checkpoint {ckpts / '2'}: no space left on device (checkpoint 1 kept); free "
                "space and relaunch the same command to resume from it")
        assert [x for x in proc.stderr.splitlines() if x.startswith("dxrun:")] == [
            f"dxrun: error: {line}"], out[-3000:]
        assert "Traceback" not in out and "OutOfMemory" not in out and "[ERROR]" not in out
        status = json.loads((run_dir / "status.json").read_text())
        assert (status["status"], status["kind"], status["reason"]) == ("failed", "disk", line)
        assert not (run_dir / "memory_breakdown.txt").exists()
        assert sorted(p.name for p in ckpts.iterdir()) == ["1"]  # the partial save is gone
        if mounted:  # space again
            subprocess.run(["mount", "-o", f"remount,size={8 * DISK_KIB}k", str(disk)],
                           check=True)
        again = cli_in_process(*args, cwd=tmp_path)  # the same command (its entry point here)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert f"resuming from step 1 (checkpoint {ckpts / '1'})" in again.stdout + again.stderr
        assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
                .splitlines()] == [1, 2, 3]
        assert committed_steps(ckpts) == [1, 2, 3]
        assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"


def test_a_status_the_full_disk_refuses_is_one_warning(tmp_path, caplog):
    """The failure path's own status write on a full disk: one warning naming the status the
    file still holds, nothing raised, the intact file and no half-written one left."""
    from dxrun.run import write_status

    run_dir = tmp_path / "disk"
    with small_disk(run_dir, 64) as mounted:
        write_status(run_dir, "running")
        if mounted:
            with contextlib.suppress(OSError), open(run_dir / "filler", "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * 4096)
        else:  # writes to /dev/full fail with ENOSPC, as those to a full disk do
            (run_dir / "status.json.tmp").symlink_to("/dev/full")
        before = (run_dir / "status.json").read_text()
        with caplog.at_level(logging.WARNING, logger="dxrun"):
            write_status(run_dir, "failed", kind="disk", reason="no space")
        assert [r.getMessage() for r in caplog.records] == [
            f"could not write {run_dir / 'status.json'} (No space left on device): it still "
            "says 'running'"]
        assert (run_dir / "status.json").read_text() == before
        assert not (run_dir / "status.json.tmp").exists()
