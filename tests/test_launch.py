"""``python -m dxrun.launch``: real processes joined through jax.distributed over loopback
(gloo collectives), against one process with the same 8 devices in this test process."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Output, make_cfg, run_cli, subprocess_env

from dxrun.checkpointing import committed_steps
from dxrun.launch import free_port
from dxrun.train import train

pytestmark = pytest.mark.e2e

# 16 x 16 tokens a step: what is tested is the processes' run, against one process's.
COMMON = ["data.batch_size=16", "data.seq_len=16", "train.steps=6", "train.log_every=1",
          "train.eval_every=0", "checkpoint.every=2", "optimizer.warmup_steps=2"]


def _env() -> dict[str, str]:
    env = subprocess_env()
    env.update(WANDB_MODE="offline", WANDB_ERROR_REPORTING="false", WANDB_SILENT="true")
    return env


# The processes of one run compile the same programs at the same moment: they leave JAX's
# shared on-disk compilation cache alone here, so each test stands on its own. (Not for speed:
# a cache of their own for the four signal tests' runs, one config, failed three of them with
# "Gloo context initialization failed: ... GetKeyValue() timed out with key: cpu:gloo/0,...".)
NO_CACHE = "runtime.compile_cache=null"


def launch(cwd: Path, *overrides: str, nproc: int = 2, timeout: int = 300, hosts: int = 1,
           devices: int = 8) -> subprocess.CompletedProcess:
    """``nproc`` processes of ``devices // nproc`` simulated devices each, declaring ``hosts``
    hosts (1: all on this one)."""
    return subprocess.run(
        [sys.executable, "-m", "dxrun.launch", "--nproc", str(nproc), "--devices-per-proc",
         str(devices // nproc), "--hosts", str(hosts), "--", NO_CACHE, *overrides], cwd=cwd,
        env=_env(), capture_output=True, text=True, timeout=timeout)


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
    # Two hosts (declared): the mesh spans them as on two nodes.
    # Every logger backend: process 0 alone writes each (test_two_processes_train_like_one).
    proc = launch(cwd, *COMMON, "parallelism=dp4_tp2", "logger=many",
                  "logger.backends=[wandb,tensorboard,csv,mlflow]", "hydra.run.dir=run", hosts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "run", proc


def test_two_processes_train_like_one(one_process, two_processes):
    run_dir, proc = two_processes
    assert_same(losses(run_dir), one_process[1], range(1, 7))
    # Process 0 alone wrote the run's files; each process its own log.
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".hydra", "checkpoints", "dxrun.0.log", "dxrun.1.log", "goodput.json", "metrics.csv",
        "metrics.jsonl", "mlruns", "plan.json", "status.json", "summary.json", "tensorboard",
        "wandb"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert len(list((run_dir / "mlruns").glob("*/*/meta.yaml"))) == 1  # one MLflow run
    with open(run_dir / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 7))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["processes"], plan["hosts"], plan["dcn_shape"], plan["local_shape"]) == (
        2, 2, [2, 1, 1, 1], [2, 1, 1, 2])
    assert "joined a 2-process run as process 1" in (run_dir / "dxrun.1.log").read_text()
    # The progress lines come once, from process 0.
    assert proc.stdout.count("step 6/6") == 1 and "[rank 0]" in proc.stdout


def test_four_processes_of_one_host_share_tensor_groups(tmp_path):
    """4 processes x 2 devices on one host with tp=4: each tensor group spans 2 processes of
    the host (no network between them), and the run trains like dp2_tp4 in one process."""
    # No saves: what is compared is the losses (a 4-process save is a collective of its own).
    proc = launch(tmp_path, *COMMON, "train.steps=3", "checkpoint.every=0", "parallelism.tp=4",
                  "logger=none", "hydra.run.dir=run", nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["mesh_shape"], plan["processes"], plan["hosts"], plan["dcn_shape"]) == (
        [2, 1, 1, 1, 4], 4, 1, [1, 1, 1, 1])
    want = in_process(tmp_path / "ref", "train.steps=3", "checkpoint.every=0",
                      "parallelism=dp2_tp4")
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


def test_a_tensor_group_across_processes_is_refused(tmp_path):
    # (an indivisible batch and the other refusals: test_distributed.py, without processes)
    message = ("parallelism.tp=8 puts each tensor-parallel group across 2 hosts (2 "
               "hosts x 4 devices)")
    proc = launch(tmp_path, "logger=none", "parallelism=tp8", "distributed.init_timeout_s=60",
                  timeout=180, hosts=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank {rank}] dxrun: error: {message}" in proc.stderr
    # The launcher's last line quotes the rank that refused first: no run dir holds its log.
    last = proc.stderr.strip().splitlines()[-1]
    first = re.fullmatch(r"dxrun\.launch: error: rank (\d) exited with 2 first; then rank (\d) "
                         r"exited with 2; rank \1 said: dxrun: error: (.+) \(no rank kept a log: "
                         r"their output is above\)", last)
    assert first and {first[1], first[2]} == {"0", "1"}, last
    assert first[3].startswith(message) and first[3].endswith("allow_cross_host_tp=true"), last
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing left behind


def test_one_process_refusing_the_memory_preflight_ends_every_process_with_its_line(
        tmp_path):
    """Each process checks the memory its own host gives: here process 1 shares its host with
    another (DXRUN_LOCAL_PROCESSES=2: half the budget) and process 0 does not. Process 1's
    refusal, with its suggestion searched over the run's processes, is every process's one
    line, exit 2; nothing is left behind."""
    coordinator = f"127.0.0.1:{free_port()}"
    # The step needs about 0.0031 GiB per device (4 devices each): 0.018 GiB / 4 devices fits,
    # / (4 x 2) does not.
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dxrun", NO_CACHE, "logger=none", "runtime.cpu_devices=4",
         "parallelism=dp", "data.batch_size=16", "runtime.memory_gb=0.018",
         # (out/run: a refused run also removes its run dir's parent when it is empty)
         "hydra.run.dir=out/run"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**_env(), "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": str(rank), "DXRUN_LOCAL_PROCESSES": str(rank + 1)})
        for rank in (0, 1)]
    try:
        ends = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [err.strip().splitlines()[-1] for _, err in ends]
    assert [p.returncode for p in procs] == [2, 2], lines
    assert lines[0] == lines[1], lines
    assert re.fullmatch(
        r"dxrun: error: the train step needs \S+ GiB per device x 4 device\(s\) = \S+ GiB, but "
        r"runtime\.memory_gb=0\.018 / 2 processes on this host gives 0\.009 GiB; try \S.* "
        r"\(or runtime\.skip_memory_check=true to run anyway\); where the memory goes: \S+",
        lines[0]), lines[0]
    assert "Traceback" not in "".join(out + err for out, err in ends)
    assert not list(tmp_path.iterdir())  # nothing left behind


def documented(path: str, command: str) -> list[str]:
    """The overrides of the example ``command ...`` line in the comments of ``path``."""
    lines = (ROOT / path).read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if command in x)
    text = lines[i]
    while text.endswith("\\"):  # a continued line
        i += 1
        text = text[:-1] + lines[i].lstrip("# ")
    words = text.split(command)[1].partition(" #")[0].split()
    return [w for w in words if w.startswith(("model", "parallelism"))]  # the layout


def test_the_documented_multi_node_commands_plan(tmp_path):
    """The 2-node recipes (sbatch, submitit) as 2 processes x 8 simulated devices declaring 2
    hosts, in plan mode (compile only): data=8 x tensor=2, the tensor pairs inside a host."""
    sbatch = documented("experiments/slurm_multinode.sbatch", "slurm_multinode.sbatch")
    submitit = documented("conf/hydra/launcher/slurm_multinode.yaml", "hydra/launcher=slurm_multinode")
    assert sbatch == submitit == ["model=large", "parallelism=dp4_tp2"]
    assert documented("docs/guide/multi-node.md", "slurm_multinode.sbatch") == sbatch
    assert documented("docs/guide/multi-node.md",
                      "python -m dxrun -m hydra/launcher=slurm_multinode") == sbatch
    proc = launch(tmp_path, *sbatch, "run.mode=plan", "plan.target=h100", "logger=none",
                  "hydra.run.dir=run", hosts=2, devices=16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["mesh_shape"], plan["processes"], plan["hosts"], plan["dcn_shape"],
            plan["local_shape"]) == ([8, 1, 1, 1, 2], 2, 2, [2, 1, 1, 1], [4, 1, 1, 2])
    assert plan["plan_mode"]["n_params"] == 774_090_240 and plan["plan_mode"]["target"]["fits"]


# One sequence of 16 tokens a device, one device a process: what is tested is how the
# processes stop, at steps they reach sooner with a smaller step, and each process's startup
# (its compile above all) is cheaper with one device than with four.
ENDLESS_BATCH = ("data.batch_size=2", "data.seq_len=16")


def start_endless(cwd: Path, *overrides: str, ctrl_c: bool = False, port: int = 0
                  ) -> tuple[subprocess.Popen, Output, dict[int, int]]:
    """A 2-process run without end (1 device each), once rank 0 has logged step 2: the
    launcher, its output and each rank's pid. ``ctrl_c``: the launcher in a process group of
    its own, which a test can signal as a terminal's Ctrl-C does. ``port``: the coordinator's
    (0: a free one)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "1",
         "--port", str(port), "--", NO_CACHE, "logger=none", "train.steps=100000", "train.log_every=1",
         "parallelism=dp",  # 100000 steps would pay for a layout search
         "checkpoint.every=0", *ENDLESS_BATCH, *overrides], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=ctrl_c)
    out = Output(proc)
    out.wait_for(lambda line: line.startswith("[rank 0]") and "step 2/" in line)
    pids = {int(m[1]): int(m[2]) for m in re.finditer(r"dxrun.launch: rank (\d) pid (\d+)",
                                                        out.text())}
    return proc, out, pids


def signal_mid_run(cwd: Path, signum: int, *overrides: str, timeout: int = 120,
                   ctrl_c: bool = False) -> tuple[int, str, float]:
    """A 2-process run without end; once rank 0 has logged step 2, rank 1 alone gets
    ``signum`` (``ctrl_c``: the launcher's whole process group, as a terminal's Ctrl-C does).
    Returns the launcher's exit code, its output and the seconds it took to exit."""
    proc, out, pids = start_endless(cwd, *overrides, ctrl_c=ctrl_c)
    try:
        if ctrl_c:
            os.killpg(proc.pid, signum)
        else:
            os.kill(pids[1], signum)
        sent = time.monotonic()
        text = out.finish(timeout=timeout)
        return proc.returncode, text, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_dead_process_stops_the_others_at_once(tmp_path):
    """Rank 1 is killed mid-run: the launcher stops rank 0 at once, not when JAX's heartbeat
    (distributed.heartbeat_timeout_s=100 by default) would have told it, names the first
    failure and marks the run failed in its status.json, which rank 1 could not write."""
    code, out, took = signal_mid_run(tmp_path, signal.SIGKILL, "hydra.run.dir=run", timeout=90)
    assert code == 128 + signal.SIGKILL and took < 30, out[-3000:]
    # Rank 0 is stopped, or (rarely: gloo aborts the collective rank 1 died in) ends by itself
    # between two looks of the launcher's loop.
    line = re.search(r"dxrun\.launch: error: (rank 1 was killed by SIGKILL first; then rank 0 "
                     r"(was stopped by the launcher|exited with 1|was killed by SIGABRT)) .*",
                     out)
    assert line, out[-3000:]
    run = tmp_path / "run"  # each rank's log, where it is
    assert line[0].endswith(f" (a process that loses another stops: see {run}/dxrun.0.log, "
                            f"{run}/dxrun.1.log)"), line[0]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["kind"]) == ("failed", "crashed"), status
    if status["reason"].startswith("rank 1 was killed"):  # rank 0 said nothing: the launcher did
        assert status["reason"].startswith(line[1]) and status["log"] == str(
            tmp_path / "run" / "dxrun.1.log"), status
    else:  # rank 0 saw its collective fail and wrote its own crash a moment before its end
        assert status["log"] == str(tmp_path / "run" / "dxrun.0.log"), status
    assert "checkpoint.every=0" in status["overrides"]  # the run's own fields are kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's parent-death signal")
def test_a_used_port_is_refused_and_the_ranks_die_with_their_launcher(tmp_path):
    """A second launch on the --port of a run in progress is refused before it starts any
    process (its ranks would have joined the first run and aborted it), and the first run
    trains on. Then its launcher is killed outright (SIGKILL: nothing of it runs again): its
    ranks, in sessions of their own, die with it."""
    port = free_port()
    proc, out, pids = start_endless(tmp_path, "hydra.run.dir=run", port=port)
    (tmp_path / "second").mkdir()
    second = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--port", str(port), "--",
         NO_CACHE, "logger=none"], cwd=tmp_path / "second", env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second_out = Output(second)
    try:
        text = second_out.finish(timeout=60)
        assert second.returncode == 2, text[-3000:]
        assert text.strip().splitlines() == [
            f"dxrun.launch: error: --port={port} is in use on this host (Address already in "
            "use; another run's coordinator?): give a free port, or leave --port out to take "
            "a free one"]
        assert not list((tmp_path / "second").iterdir())
        # The first run is unharmed: its ranks log further steps.
        out.wait_for(lambda line: line.startswith("[rank 0]") and "step 3/" in line,
                     timeout=120)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids.values()), pids
    finally:
        # Whatever failed above, no process of either launch is left running.
        started = re.findall(r"rank \d pid (\d+)", second_out.text())
        for pid in [*pids.values(), *map(int, started)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in (proc, second):
            if p.poll() is None:
                p.kill()


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_the_first_failure_is_the_first_to_exit_whatever_its_rank():
    """Ranks 0 and 1 both ended before the launcher looked: the one that ended first is named,
    a rank that ended cleanly is never a failure, and none failed gives None."""
    from dxrun.launch import first_failure

    assert first_failure({0: 10.002, 1: 10.001}, [-6, -9]) == (1, -9)
    assert first_failure({0: 10.0, 1: 10.1}, [0, 1]) == (1, 1)
    assert first_failure({0: 10.0}, [0, None]) is None


def test_when_the_others_are_stopped_depends_on_how_one_ended():
    """Killed by a signal: at once. An error: after the grace, time to say the same. A stop's
    code (0, 130 after SIGINT): never, the others are saving at the same step."""
    from dxrun.launch import stop_delay

    assert [stop_delay(c, 10.0) for c in (-9, -6, 1, 2, 0, 130)] == [
        0.0, 0.0, 10.0, 10.0, None, None]


def test_a_stop_while_starting_is_said_for_a_rank_0_that_never_saw_it(tmp_path):
    """The ranks' files in the launcher's startup folder: a stop passed on is one made while
    starting until a rank trains, whether or not a rank said it saw it (all may be inside a
    startup collective). Rank 0 silent, the launcher says its words from its claim of the run
    dir and writes its status.json; one rank 0 wrote itself stays."""
    from dxrun.launch import clean_stop, settle_starting_stop, stopped_while_starting
    from dxrun.run import LAUNCH_STARTUP, PROCESS_ID, tell_launcher_startup

    startup, run_dir, told = tmp_path / "startup", tmp_path / "run", tmp_path / "run_dir"
    startup.mkdir()
    run_dir.mkdir()
    rank = [{LAUNCH_STARTUP: str(startup), PROCESS_ID: str(r)} for r in (0, 1)]
    newest = f"{run_dir}/checkpoints/40"
    tell_launcher_startup("claimed", {"run_dir": str(run_dir), "step": 40, "checkpoint": newest,
                                      "attempt": 3, "lost_attempts": 1}, rank[0])
    assert stopped_while_starting(["SIGINT"], startup)
    assert not stopped_while_starting([], startup)

    stop = settle_starting_stop("SIGINT", [], startup, told, ["--nproc=2"], ["logger=none"],
                                ["logger=none", "hydra.run.dir=run", "runtime.cpu_devices=1"])
    command = f"python -m dxrun.launch --nproc=2 -- logger=none hydra.run.dir={run_dir}"
    words = f"SIGINT: stopped while starting; checkpoint {newest} is the newest. Resume with: "
    assert stop[0] == words + command
    assert clean_stop("SIGINT", [130, 130], stop, ["--nproc=2"], ["logger=none"]) == (
        f"dxrun.launch: stopped by SIGINT while starting: every rank stopped; {stop[3]}")
    status = json.loads((run_dir / "status.json").read_text())
    assert {k: status[k] for k in ("status", "signal", "step", "checkpoint", "relaunch",
                                   "reason", "overrides", "attempt", "lost_attempts")} == {
        "status": "stopped", "signal": "SIGINT", "step": 40, "checkpoint": newest,
        "relaunch": command, "reason": words + command,
        "overrides": ["logger=none", "runtime.cpu_devices=1"], "attempt": 3, "lost_attempts": 1}

    (run_dir / "status.json").write_text('{"status": "stopped", "by": "rank 0"}')
    told.write_text(str(run_dir))  # rank 0 wrote its status.json, then told the launcher
    settle_starting_stop("SIGINT", [], startup, told, ["--nproc=2"], [], [])
    assert json.loads((run_dir / "status.json").read_text())["by"] == "rank 0"
    tell_launcher_startup("training", None, rank[0])
    assert not stopped_while_starting(["SIGINT"], startup)


def test_a_signal_to_one_process_stops_all_at_the_same_step(tmp_path):
    """SIGTERM reaches rank 1 only (SLURM's signals do not arrive at the same instant): both
    processes agree on one step, save it together and exit 0."""
    code, out, _ = signal_mid_run(tmp_path, signal.SIGTERM, "hydra.run.dir=run")
    assert code == 0, out[-3000:]
    (step,) = committed_steps(tmp_path / "run" / "checkpoints")
    assert step % 10 == 0  # the first step at which the processes compare signals
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["signal"], status["step"]) == ("stopped", "SIGTERM", step)
    assert status["checkpoint"] == str(tmp_path / "run" / "checkpoints" / str(step))
    assert max(losses(tmp_path / "run")) == step


def test_ctrl_c_stops_every_rank_and_says_how_to_resume(tmp_path):
    """A terminal's Ctrl-C reaches the launcher's process group: every rank saves at one step
    and stops; the launcher says so with the resume command, not as an error."""
    code, out, _ = signal_mid_run(tmp_path, signal.SIGINT, "hydra.run.dir=run", ctrl_c=True)
    assert code == 130, out[-3000:]
    (step,) = committed_steps(tmp_path / "run" / "checkpoints")
    assert "error" not in out and "second SIGINT" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"dxrun.launch: stopped by SIGINT: every rank saved and stopped at step {step}; "
        f"checkpoint {tmp_path / 'run' / 'checkpoints' / str(step)} committed. Resume with: "
        f"python -m dxrun.launch --nproc=2 --devices-per-proc=1 -- {NO_CACHE} logger=none "
        f"train.steps=100000 train.log_every=1 parallelism=dp checkpoint.every=0 "
        f"{' '.join(ENDLESS_BATCH)} hydra.run.dir={tmp_path}/run")
    # status.json's resume command is the launcher's, as that line gives it.
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["relaunch"] == out.strip().splitlines()[-1].split("Resume with: ")[1]


def _ctrl_c_once_claimed(tmp_path: Path, launch: list[str], env: dict[str, str]
                         ) -> tuple[subprocess.Popen, str, float]:
    """A launch of an endless run into ``tmp_path``/run, Ctrl-C'd (SIGINT to its process group)
    as soon as a rank holds the run dir: (the launcher, its output, seconds from the signal to
    its exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", *launch, "--", NO_CACHE, "logger=none",
         "parallelism=dp", *ENDLESS_BATCH, "hydra.run.dir=run"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Output(proc)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / ".hydra" / "lock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.text()[-3000:]
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        text = out.finish(timeout=150)
        return proc, text, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_while_starting_stops_and_says_how_to_resume_through_the_launcher(tmp_path):
    """A terminal's Ctrl-C once the rank holds the run dir, before any step: the launcher's last
    line is a stop, not the rank's exit code as an error; status.json resumes through the
    launcher, with its options, not the rank's single-process command. (One rank: two, signalled
    inside their startup collectives, can leave one waiting for the other or crash on its way
    out, a separate matter.)"""
    proc, text, _ = _ctrl_c_once_claimed(tmp_path, ["--nproc", "1", "--devices-per-proc", "1"],
                                         _env())
    command = (f"python -m dxrun.launch --nproc=1 --devices-per-proc=1 -- {NO_CACHE} logger=none "
               f"parallelism=dp {' '.join(ENDLESS_BATCH)} hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 130, text[-3000:]
    assert "error" not in text and "step 1/" not in text, text[-3000:]
    assert text.strip().splitlines()[-1] == (
        "dxrun.launch: stopped by SIGINT while starting: every rank stopped; no checkpoint yet. "
        f"Resume with: {command}")
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["signal"], status["relaunch"]) == (
        "stopped", "SIGINT", command)


def test_ctrl_c_before_the_ranks_listen_stops_them_once_they_do(tmp_path):
    """A Ctrl-C the moment the launcher has started its two ranks, before either has its stop
    handlers (it was Python's KeyboardInterrupt in each, two tracebacks and an error line): the
    launcher holds the signal back until each listens, each then stops while starting, and
    the launcher's last line says so, exit 130, within --grace."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun.launch", "--nproc", "2", "--devices-per-proc", "1",
         "--grace", "5", "--", NO_CACHE, "logger=none", "parallelism=dp", *ENDLESS_BATCH,
         "hydra.run.dir=run"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Output(proc)
    try:
        out.wait_for(lambda line: line.startswith("dxrun.launch: rank 1 pid"))
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        text = out.finish(timeout=150)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 15, (took, text[-3000:])
    assert "Traceback" not in text and "error" not in text, text[-3000:]
    assert text.strip().splitlines()[-1] == (
        "dxrun.launch: stopped by SIGINT while starting: every rank stopped; nothing was "
        "written")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("deaf", [1, 0])
def test_ctrl_c_while_a_rank_waits_in_a_startup_collective_stops_at_once(tmp_path, deaf):
    """A Ctrl-C reaches rank ``deaf`` inside a startup collective (DXRUN_TEST_DEAF_RANK: it
    never sees the signal) and the other rank outside one: that one stops, and the deaf one,
    left waiting for it, would wait for JAX's heartbeat (300 s). The launcher stops it after
    --grace and ends as for any stop while starting: its line, exit 130, status.json resuming
    through it. With rank 0 deaf, rank 1's stop is said nowhere but its own log, and the
    status.json rank 0 never wrote is the launcher's."""
    proc, text, took = _ctrl_c_once_claimed(
        tmp_path, ["--nproc", "2", "--devices-per-proc", "1", "--grace", "2"],
        {**_env(), "DXRUN_TEST_DEAF_RANK": str(deaf)})
    command = (f"python -m dxrun.launch --nproc=2 --devices-per-proc=1 -- {NO_CACHE} "
               f"logger=none parallelism=dp {' '.join(ENDLESS_BATCH)} "
               f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 130 and took < 60, (took, text[-3000:])
    assert "error" not in text and "step 1/" not in text, text[-3000:]
    assert f"dxrun.launch: stopping rank {deaf}: the run was stopped while starting" in text
    assert text.strip().splitlines()[-1] == (
        "dxrun.launch: stopped by SIGINT while starting: every rank stopped; no checkpoint yet. "
        f"Resume with: {command}")
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["signal"], status["step"], status["checkpoint"],
            status["relaunch"]) == ("stopped", "SIGINT", 0, None, command), status


# A run dir neither Hydra's override grammar nor a shell takes as it is: "=", both quotes, a
# space, a comma (a Hydra sweep), non-ASCII.
AWKWARD = """we=ird 'single' "double" ü,x"""


def read_back(command: str) -> str:
    """The run dir ``command`` resumes in, as a shell and then Hydra (and OmegaConf, which
    resolves interpolations) read its ``hydra.run.dir=`` word."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    (word,) = [w for w in shlex.split(command) if w.startswith("hydra.run.dir=")]
    value = OverridesParser.create().parse_override(word).value()
    return OmegaConf.create({"dir": value}).dir


# "${x}" too, an interpolation to Hydra, though Hydra itself cannot run in such a dir: the name
# of its log file resolves the dir a second time.
@pytest.mark.parametrize("name", ["run", "a=b", "it's", 'say "hi"', "two words", "ü", "a,b",
                                  "${x}", "back\\", AWKWARD])
def test_the_resume_command_reads_back_as_its_run_dir(name):
    """The resume command of a stopped run (``python -m dxrun``'s, in its stop line and
    status.json) and the launcher's, rebuilt from rank 0's, name the run dir exactly."""
    from dxrun.launch import STOP_LINE, clean_stop
    from dxrun.run import relaunch_command

    run_dir = f"/tmp/{name}/run"
    command = relaunch_command(["logger=none", "hydra.run.dir=elsewhere"], run_dir)
    assert read_back(command) == run_dir
    assert command.startswith("python -m dxrun logger=none ")
    line = (f"SIGINT: stopped at step 10; checkpoint {run_dir}/checkpoints/10 committed. "
            f"Resume with: {command}")
    launcher = clean_stop("SIGINT", [130, 130], STOP_LINE.search(line), ["--nproc=2"],
                          ["logger=none"])
    assert launcher is not None and read_back(launcher.split("Resume with: ")[1]) == run_dir


def test_a_run_in_an_awkward_dir_resumes_with_the_command_it_printed(tmp_path):
    """A run in a dir that Hydra and the shell must quote is stopped (SIGTERM); the command its
    status.json gives, run by a shell, resumes it there and trains to the end."""
    run_dir = tmp_path / AWKWARD / "run"
    hydra_quoted = str(run_dir).replace('"', '\\"')
    proc = subprocess.Popen(
        [sys.executable, "-m", "dxrun", NO_CACHE, "logger=none", "runtime.cpu_devices=2",
         "parallelism=dp", "data.batch_size=8", "train.steps=4", "train.log_every=1",
         "train.eval_every=0", "checkpoint.every=0", f'hydra.run.dir="{hydra_quoted}"'],
        cwd=tmp_path, env={**_env(), "DXRUN_TEST_HOLD_AT_STEP": "2"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Output(proc)
    out.wait_for(lambda line: "step 2/4" in line)  # held after step 2 until a SIGUSR1
    proc.send_signal(signal.SIGTERM)
    out.wait_for(lambda line: "SIGTERM received" in line)
    proc.send_signal(signal.SIGUSR1)
    text = out.finish()
    assert proc.returncode == 0, text[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"]) == ("stopped", 2), status
    assert f"Resume with: {status['relaunch']}" in text
    # The printed command as a user pastes it (this interpreter for "python"), without the
    # test's hold (an environment variable the printed command does not carry).
    program, _, rest = status["relaunch"].partition(" -m dxrun ")
    assert program == "python", status["relaunch"]
    resumed = subprocess.run(f"{shlex.quote(sys.executable)} -m dxrun {rest}",
                             shell=True, cwd=tmp_path, env=_env(),
                             text=True, capture_output=True, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resuming from step 2 (checkpoint {run_dir / 'checkpoints' / '2'})" in resumed.stdout
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]


def test_a_process_that_cannot_reach_the_coordinator_says_so(tmp_path):
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    proc = run_cli("logger=none", "distributed.init_timeout_s=2", cwd=tmp_path, env=env,
                   timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dxrun: error: process 1 of 2 could not reach the coordinator "
        f"{env['JAX_COORDINATOR_ADDRESS']} within distributed.init_timeout_s=2; check that "
        "process 0 was started and that its host and port are reachable")
    assert not list(tmp_path.iterdir())  # nothing left behind, not even an empty outputs/


def test_the_launcher_passes_sigusr1_and_sigterm_on_to_every_rank(tmp_path):
    """SIGUSR1, then SIGTERM, sent to the launcher alone (its ranks run in sessions of their
    own, so nothing else reaches them; Ctrl-C's SIGINT: the test above): every rank saves at
    one step and trains on, then every rank saves at a later one and stops, exit 0."""
    proc, out, pids = start_endless(tmp_path, "hydra.run.dir=run")
    ckpts = tmp_path / "run" / "checkpoints"
    try:
        assert all(os.getsid(pid) != os.getsid(proc.pid) for pid in pids.values())
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while not committed_steps(ckpts):
            assert proc.poll() is None and time.monotonic() < deadline, out.text()[-3000:]
            time.sleep(0.05)
        (saved,) = committed_steps(ckpts)
        out.wait_for(lambda line: line.startswith("[rank 0]") and f"step {saved + 1}/" in line)
        os.kill(proc.pid, signal.SIGTERM)
        text = out.finish(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.wait() < 0:  # a launcher killed by a signal has not waited for its ranks
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    saved_then, stopped = committed_steps(ckpts)
    assert saved_then == saved and saved % 10 == 0 and stopped % 10 == 0 and stopped > saved
    assert (f"dxrun.launch: stopped by SIGTERM: every rank saved and stopped at step {stopped}"
            in text), text[-3000:]
    # Rank 0 (the one that logs) says so at the step the processes agreed on, some steps after
    # the signal's own step.
    said = rf"\[rank 0\].*SIGUSR1: saving checkpoint \S+/{saved}; training goes on"
    assert re.search(said, text), text[-3000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["signal"], status["step"]) == ("stopped", "SIGTERM", stopped)
