"""Run bookkeeping: the run dir claimed atomically (concurrent launches never share one) and
held by one live run (a relaunch continues the newest run of its dir), the allocator peak of
this run, JSON-safe numbers."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_cfg, run_cli, subprocess_env

from dxrun import run as runtime
from dxrun.config.errors import ConfigError
from dxrun.run import (
    claim_run_dir,
    finite_or_null,
    write_status,
)


def _claim(path: str, barrier, out) -> None:
    barrier.wait()  # all claim at the same instant, like a SLURM array starting
    out.put(str(claim_run_dir(Path(path))))


def test_concurrent_launches_claim_distinct_dirs(tmp_path):
    ctx = mp.get_context("spawn")
    n = 6
    barrier, out = ctx.Barrier(n), ctx.Queue()
    target = tmp_path / "outputs" / "12-00-00"
    procs = [ctx.Process(target=_claim, args=(str(target), barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert len(set(got)) == n
    assert got == sorted([str(target)] + [f"{target}_{i}" for i in range(1, n)])
    assert all((Path(d) / ".hydra").is_dir() for d in got)


def _hold(run_dir: Path, then: str) -> subprocess.Popen:
    """Another process that takes ``run_dir``'s lock, says so, then runs ``then``."""
    code = ("import os, sys, time; from pathlib import Path; from dxrun.run import RunLock; "
            f"lock = RunLock.acquire(Path({str(run_dir)!r})); print('held', flush=True); {then}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    assert proc.stdout.readline() == "held\n"
    return proc


def test_one_owner_per_run_dir_while_it_lives(tmp_path):
    """The lock names its holder; a second claim is refused naming it, or waits for its end; a
    holder killed outright (SIGKILL) leaves its lock file but no obstacle."""
    run = tmp_path / "run"
    run.mkdir()
    write_status(run, "running")  # a run whose holder is alive (or was killed)
    named = {"named": True, "fresh": False, "has_checkpoints": lambda d: False}
    holder = _hold(run, "time.sleep(60)")
    try:
        assert runtime.holder(run).pid == holder.pid
        with pytest.raises(ConfigError, match=f"^{re.escape(str(run))} is in use by a live run: "
                                              f"pid {holder.pid} on {socket.gethostname()} since "):
            runtime.claim(run, **named)
        with pytest.raises(ConfigError, match=r"\(waited 0.2 s, run.wait_for_lock\)"):
            runtime.claim(run, wait_s=0.2, **named)
        # A generated dir (Hydra's timestamp, shared by chance) takes the next sibling instead.
        got = runtime.claim(run, named=False, fresh=False, has_checkpoints=lambda d: False)
        assert got.dir == tmp_path / "run_1" and not got.continues
        got.release()
    finally:
        holder.kill()
        holder.wait()
    assert (run / runtime.LOCK).is_file()  # left by the killed holder: no obstacle
    mine = runtime.claim(run, **named)
    assert mine.continues and runtime.holder(run).pid == os.getpid()
    assert runtime.RunLock.acquire(run) is None  # held, in this process too
    mine.release()
    assert not (run / runtime.LOCK).exists()  # a lock file only while a run holds the dir
    ended = _hold(run, "time.sleep(1)")  # ends on its own
    t = time.monotonic()
    waited = runtime.claim(run, wait_s=60, **named)
    assert ended.wait(timeout=10) == 0 and time.monotonic() - t > 0.5
    waited.release()


def test_a_stop_once_the_lock_is_taken_leaves_the_claim_with_the_caller(tmp_path):
    """A signal after the claim took the dir's lock but before it returned (here: raised by
    the check that the dir did not change meanwhile) still leaves the caller holding the dir,
    so the stop names the run dir and its resume command and frees the lock for the relaunch
    (it said "nothing was written" and left the lock file behind)."""
    from dxrun.config.errors import Interrupted

    run = tmp_path / "run"
    run.mkdir()
    write_status(run, "running")

    def has_checkpoints(d: Path) -> bool:
        if (d / runtime.LOCK).exists():  # the re-check, after the lock
            raise Interrupted("SIGTERM", "while starting")
        return False

    held: list = []
    with pytest.raises(Interrupted):
        runtime.claim(run, named=True, fresh=False, has_checkpoints=has_checkpoints, held=held)
    (claim,) = held
    assert claim.dir == run and runtime.holder(run).pid == os.getpid()
    claim.release()
    assert not (run / runtime.LOCK).exists()


# The launcher's handlers; the signal comes from inside ``RunLock.acquire``, once the lock file
# is open and locked (the lock names its host): where the run's CI saw it come.
STOP_WHILE_LOCKING = """
import os, signal, socket, sys
from pathlib import Path
from dxrun import run as runtime
from dxrun.run import SIGNALS, guard_signals
from dxrun.config.errors import Interrupted
guard_signals()
hostname = socket.gethostname
def host():
    os.kill(os.getpid(), signal.SIGUSR1)
    return hostname()
socket.gethostname = host
held = []
for named in (True, False):
    SIGNALS.start_job()  # each launch of a multirun
    try:
        runtime.claim(Path(sys.argv[1]) / str(named), named=named, fresh=False,
                      has_checkpoints=lambda d: False, held=held)
        print("not stopped")
    except Interrupted as e:
        print(e.signal_name, [c.dir.name for c in held], runtime.holder(held[0].dir).pid == os.getpid())
        held.pop().release()
"""


def test_a_stop_while_the_lock_is_taken_waits_until_the_claim_is_recorded(tmp_path):
    """A signal between the lock file's creation and the claim's record stopped the run as one
    that held no dir ("nothing was written"), its lock file left behind (seen in CI): the stop
    now waits for the record, for a named dir and for a generated one."""
    out = subprocess.run([sys.executable, "-c", STOP_WHILE_LOCKING, str(tmp_path)],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["SIGUSR1 ['True'] True", "SIGUSR1 ['False'] True"], out
    assert not list(tmp_path.glob("*/.hydra/lock"))  # released


def test_a_relaunch_continues_the_newest_run_of_its_dir(tmp_path):
    """What ``runtime.pick`` decides from the files: an unfinished run, or one with checkpoints,
    is continued; a finished one without checkpoints (or a plan-mode dir) leads to the next
    sibling, which the next relaunch follows."""
    rq = tmp_path / "rq"
    ckpts = lambda d: (d / "checkpoints").is_dir()  # noqa: E731

    def make(path: Path, status: str | None = None, checkpoint: bool = False) -> None:
        (path / ".hydra").mkdir(parents=True)
        if status:
            write_status(path, status)
        if checkpoint:
            (path / "checkpoints").mkdir()

    assert runtime.pick(rq, ckpts) == (rq, False)  # nothing there yet
    make(rq, "running")  # killed before its first checkpoint: continued in place
    assert runtime.pick(rq, ckpts) == (rq, True)
    write_status(rq, "ok")  # finished, no checkpoint: a new run beside it
    assert runtime.pick(rq, ckpts) == (tmp_path / "rq_1", False)
    make(tmp_path / "rq_1", "stopped")  # ... which the next relaunch follows
    assert runtime.pick(rq, ckpts) == (tmp_path / "rq_1", True)
    write_status(tmp_path / "rq_1", "ok")
    (tmp_path / "rq_1" / "checkpoints").mkdir()  # finished with checkpoints: its own to judge
    assert runtime.pick(rq, ckpts) == (tmp_path / "rq_1", True)
    plan = tmp_path / "plan"  # a plan-mode dir: its config and plan, no status
    (plan / ".hydra").mkdir(parents=True)
    (plan / ".hydra" / "config.yaml").write_text("{}")
    assert runtime.pick(plan, ckpts) == (tmp_path / "plan_1", False)
    # An attempt that continues counts the ones before it, and those that died without a word.
    claim = runtime.Claim(rq, earlier={"status": "running", "attempt": 2, "lost_attempts": 1})
    assert (claim.attempt, claim.lost_attempts) == (3, 2)
    assert (runtime.Claim(rq).attempt, runtime.Claim(rq).lost_attempts) == (1, 0)
    # checkpoint.resume=none: a new run in the first dir no run has taken.
    fresh = runtime.claim(rq, named=True, fresh=True, has_checkpoints=ckpts)
    assert fresh.dir == tmp_path / "rq_2" and not fresh.continues
    fresh.release()


# A process of its own: the suite's processes keep glibc's defaults (conftest.py), and a thread
# keeps the arena it started with, so the setting is only ever tried in a fresh process.
KEPT_FOR_REUSE = """
import json
from pathlib import Path

import numpy as np

from dxrun.run import release_freed_memory, reuse_freed_memory


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


applied = reuse_freed_memory()
before = rss()
block = np.ones(400 * 2**20, np.uint8)  # from the heap: no mmap, under the trim threshold
del block
kept = rss()
release_freed_memory()
print(json.dumps({"applied": applied, "before": before, "kept": kept, "released": rss()}))
"""


def test_freed_memory_is_kept_for_reuse_until_released():
    """Under ``reuse_freed_memory`` (a run whose buffers pay for it: ``reuse_pays``) a freed
    400 MB block stays in the process for the next step, and ``release_freed_memory`` (after
    each layout the search times) hands it back."""
    proc = subprocess.run([sys.executable, "-c", KEPT_FOR_REUSE], capture_output=True,
                          text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rss = json.loads(proc.stdout)
    assert rss["applied"]  # a CPU-only glibc host
    assert rss["kept"] - rss["before"] > 300 * 2**20
    assert rss["kept"] - rss["released"] > 300 * 2**20


def test_non_finite_numbers_become_null_with_their_keys():
    row = {"step": 3, "train/loss": math.nan, "ok": 1.5, "nested": {"x": [1.0, -math.inf]}}
    clean, bad = finite_or_null(row)
    assert clean == {"step": 3, "train/loss": None, "ok": 1.5, "nested": {"x": [1.0, None]}}
    assert bad == ["train/loss", "nested.x[1]"]


def test_the_suite_runs_on_cpu_whatever_the_machine():
    """conftest.py sets JAX_PLATFORMS=cpu before JAX starts (unless DXRUN_TEST_GPU=1), so a GPU
    machine runs the suite, and the subprocesses it starts, on simulated CPU devices."""
    import os

    import jax

    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.default_backend() == "cpu" and jax.device_count() == 8


def test_cpu_fallback_on_a_gpu_host_is_refused(tmp_path):
    """The probe reads device nodes under a root (here a tmp dir standing for /); JAX on CPU
    beside an NVIDIA node is refused naming the install, unless CPU was chosen."""
    from dxrun.run import cpu_fallback_refusal, nvidia_device_node

    assert nvidia_device_node(tmp_path) is None
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    node = nvidia_device_node(tmp_path)
    assert node == tmp_path / "dev" / "nvidia0"
    (tmp_path / "dev" / "nvidiactl").touch()
    assert nvidia_device_node(tmp_path) == tmp_path / "dev" / "nvidiactl"

    line = cpu_fallback_refusal("cpu", node, None, allow_cpu=False)
    assert "pip install -e '.[gpu]'" in line and "runtime.allow_cpu=true" in line
    assert str(node) in line and "\n" not in line
    assert cpu_fallback_refusal("cpu", node, "cuda,cpu", allow_cpu=False) == line
    # Chosen: the override, or JAX_PLATFORMS naming only cpu (as the test suite sets it).
    assert cpu_fallback_refusal("cpu", node, None, allow_cpu=True) is None
    assert cpu_fallback_refusal("cpu", node, "cpu", allow_cpu=False) is None
    # No GPU on the host, or JAX found it: nothing to refuse.
    assert cpu_fallback_refusal("cpu", None, None, allow_cpu=False) is None
    assert cpu_fallback_refusal("gpu", node, None, allow_cpu=False) is None


@pytest.mark.e2e
def test_a_second_launch_takes_its_compiled_programs_from_the_cache(tmp_path):
    """runtime.compile_cache=auto (the default): the first launch writes the compiled step to
    $XDG_CACHE_HOME/dxrun/jax; a second launch of the same config reads it back instead of
    compiling (JAX's own log of each lookup, at debug level), and its counted compile time
    drops."""
    # LLVM's passes on: a fast-compile flag makes a miss no slower than a hit read back, whose
    # lowering stays. One simulated device, one block, sgd and 8 x 16 tokens: what is tested
    # is the cache, and a bigger step only takes longer to compile with those passes on (the
    # first launch took 11-13 CPU s against 16-17 with tiny's defaults and adamw; its compile
    # still about 4 times the second's).
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_DEBUG_LOG_MODULES": "jax._src.compiler",
           "XLA_FLAGS": subprocess_env(optimised=True).get("XLA_FLAGS", "")}
    run = ["model=tiny", "model.n_layers=1", "optimizer=sgd", "data.batch_size=8",
           "data.seq_len=16", "train.steps=1", "train.eval_every=0", "checkpoint.every=0",
           "logger=none", "runtime.compile_cache=auto", "runtime.cpu_devices=1"]
    lookups = re.compile(r"(PERSISTENT COMPILATION CACHE MISS|Persistent compilation cache "
                         r"hit) for '(jit_\w+)'")
    outcome = {}
    for name in ("first", "second"):
        proc = run_cli(*run, f"hydra.run.dir={name}", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outcome[name] = {program: result.split()[0] for result, program in
                         lookups.findall(proc.stdout + proc.stderr)}
    # The first compiled the step and wrote it (JAX logs its misses even with no cache on).
    assert outcome["first"]["jit_step"] == "PERSISTENT"
    assert list((tmp_path / "xdg" / "dxrun" / "jax").glob("jit_step-*"))
    assert outcome["second"]["jit_step"] == "Persistent"  # a hit: nothing compiled
    compile_s = [json.loads((tmp_path / name / "summary.json").read_text())["compile_time_s"]
                 for name in ("first", "second")]
    assert compile_s[1] < compile_s[0], compile_s


def test_the_thread_pool_note_only_where_a_mesh_uses_fewer_simulated_devices_than_cores_run():
    from dxrun.run import thread_pool_note

    note = thread_pool_note(1, 8, 2)
    assert note is not None and "1 of 8 simulated CPU devices" in note
    assert "8 on 2 cores" in note and "runtime.cpu_devices=1" in note
    assert thread_pool_note(8, 8, 2) is None  # the mesh uses them all
    assert thread_pool_note(1, 8, 16) is None  # a thread per core already: none added
    assert thread_pool_note(1, 2, 2) is None
    assert thread_pool_note(2, 8, None) is None  # cores unknown


def test_the_allocator_setting_is_decided_by_the_step_it_serves():
    """runtime.reuse_freed_memory=auto, decided before JAX starts: glibc's defaults for the
    default run (the tiny model's batch split over 8 devices: faults it barely takes, against a
    lock every thread takes), one arena where the buffers a device holds are big (the same run
    on one device, the suite's model, GPT-2 small on fsdp8); always/never as asked."""
    from dxrun.run import reuse_pays

    mid = ("model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
           "data.vocab_size=256", "data.seq_len=128", "data.batch_size=16")
    assert not reuse_pays(make_cfg(), 8)
    assert reuse_pays(make_cfg("parallelism=dp1"), 8)
    assert reuse_pays(make_cfg(*mid, "parallelism=dp8"), 8)
    assert reuse_pays(make_cfg("model=small", "data.batch_size=8", "data.seq_len=16",
                               "parallelism=fsdp8"), 8)
    assert reuse_pays(make_cfg("runtime.reuse_freed_memory=always"), 8)
    assert not reuse_pays(make_cfg(*mid, "runtime.reuse_freed_memory=never"), 8)
    # a rank of a launch sees its own devices only: fewer than the layout's axes name
    assert reuse_pays(make_cfg("parallelism=dp2_tp4"), 1)
