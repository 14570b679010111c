"""The launcher as a user runs it: ``python -m dxrun ...`` in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli_in_process, recorded_compiles, run_cli, subprocess_env, tree_digest

from dxrun.tracking.wandb_file import read_run


def _run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in (cwd / "outputs").glob("*/*/plan.json"))


@pytest.fixture(scope="module")
def dp4_tp2_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    # No test reads its checkpoint: none saved. 16-token sequences: the markov chain's context
    # is its last 2 symbols.
    proc = run_cli("parallelism=dp4_tp2", "model=tiny", "train.steps=20", "train.log_every=5",
                   "checkpoint.every=0", "data.seq_len=16", cwd=cwd)
    return cwd, proc


@pytest.mark.e2e
def test_dp4_tp2_subprocess_run(dp4_tp2_run):
    cwd, proc = dp4_tp2_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = _run_dirs(cwd)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["dp"], plan["fsdp"], plan["tp"]) == (4, 1, 2)
    assert plan["mesh_shape"] == [4, 1, 1, 1, 2] and plan["n_devices"] == 8
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.1  # loss falls
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 20 and summary["n_params"] > 0 and summary["tokens_per_s"] > 0
    assert summary["train/loss"] == rows[-1]["train/loss"]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "parallelism=dp4_tp2" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    log = (run_dir / "dxrun.log").read_text()
    assert "data=4 x fsdp=1 x tensor=2" in log and "simulating 8 CPU devices" in log
    assert "simulated CPU devices, and XLA:CPU" not in log  # the mesh uses all 8
    assert "step 20/20  loss" in log and "step 20/20  loss" in proc.stdout + proc.stderr


@pytest.mark.e2e
def test_subprocess_wandb_run_holds_choices_plan_and_history(dp4_tp2_run):
    cwd, proc = dp4_tp2_run
    (run_dir,) = _run_dirs(cwd)
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = read_run(path)
    assert run["config"]["choices"]["parallelism"] == "dp4_tp2"
    assert run["config"]["plan"]["mesh_shape"] == [4, 1, 1, 1, 2]
    assert run["name"] == "tiny-dp4_tp2-bs32-steps20-log_every5-every0-seq_len16"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = [{k: v for k, v in r.items() if not k.startswith("_")} for r in run["history"]]
    assert history == rows
    for key in ("train/ppl", "train/param_norm", "perf/tokens_per_s_per_device",
                "perf/tflops_per_device", "data/tokens_seen", "data/entropy_floor"):
        assert key in rows[-1], key
    assert "perf/compile_time_s" in rows[0] and rows[0]["mem/step_bytes_per_device"] > 0


@pytest.mark.e2e
def test_progress_bar_on_a_terminal(tmp_path):
    """Under a pseudo-terminal the run shows a rich progress bar; the log file keeps lines."""
    import os
    import select
    import subprocess
    import sys
    import time

    main, child = os.openpty()
    env = subprocess_env()
    env.update(COLUMNS="120", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "dxrun", "train.steps=8", "train.log_every=4",
                             "logger=none", "runtime.peak_tflops=1", "checkpoint.every=0",
                             "data.batch_size=8", "data.seq_len=16"],  # the bar, not the step
                            cwd=tmp_path,
                            stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    out, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([main], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=30) == 0
    screen = out.decode(errors="replace")
    assert "8/8" in screen and "━" in screen and "MFU" in screen
    (log,) = tmp_path.glob("outputs/*/*/dxrun.log")
    assert "step 8/8  loss" in log.read_text()


BAD = [
    (["model=huge"], "model=huge", "tiny"),
    (["model.foo=1"], "model.foo", "valid:"),
    (["+model.foo=1"], "model.foo", "valid:"),
    (["train.steps=abc"], "train.steps", "Integer"),
    (["parallelism=dp4_tp2", "parallelism.dp=4", "parallelism.n_devices=4"], "4*1*2",
     "on_mismatch=shrink"),
    # (parallelism=auto, the default, would take a layout whose data axes divide 30)
    (["parallelism=dp", "data.batch_size=30"], "data.batch_size=30", "multiple of 8"),
    (["parallelism=tp8"], "model.n_heads=4", "parallelism.tp=8"),
    (["parallelism.n_devices=16"], "parallelism.n_devices=16", "runtime.cpu_devices"),
    (["optimizer.lr=0"], "optimizer.lr", "> 0"),
    (["train.steps=0"], "train.steps", "(0, 2^31)"),
    (["data.seq_len=-8"], "data.seq_len", "> 0"),
    (["data=text", "data.path=/no/such/corpus.txt"], "data.path=/no/such/corpus.txt",
     "give the path"),
    # An inferred axis that fails names the axis the user typed, and values that divide.
    (["parallelism.tp=3"], "parallelism.tp=3", "pick parallelism.tp from 1, 2, 4, 8"),
    (["optimizer.b2=1.0"], "optimizer.b2=1.0", "[0, 1)"),
    (["optimizer.decay_frac=0"], "optimizer.decay_frac=0", "(0, 1]"),
    (["model.init_std=0"], "model.init_std=0", "> 0"),
    (["data.per_device_batch_size=4", "data.batch_size=64"],
     "data.batch_size=64 and data.per_device_batch_size=4 are both set", "data.batch_size=null"),
    # How schedulers and sweeps launch: hydra.* overrides and -m keep the one-line errors.
    (["hydra.run.dir=outputs/sched", "train.stepz=5"], "train.stepz", "valid:"),
    (["hydra.run.dir=outputs/sched", "model=huge"], "model=huge", "tiny"),
    (["-m", "hydra.sweep.dir=multirun/x", "train.steps=2,abc"], "train.steps", "Integer"),
    (["-m", "model=tiny,huge"], "model=huge", "tiny"),
    (["-m", "data.batch_size=16,32", "model.widht=3"], "model.widht", "valid:"),
    # The memory preflight: the compiled step needs more than this (pretend) host has. Already
    # full recomputation, fsdp and 1 sequence per device: no nearer setting to compile and try
    # (plan_mode.candidates is empty), so the refusal costs one compile, not nine.
    (["runtime.memory_gb=0.004", "parallelism=fsdp8", "data.per_device_batch_size=1",
      "model.remat=full"], "runtime.memory_gb=0.004 gives 0.004 GiB",  # not "0.0 GiB"
     "runtime.skip_memory_check=true"),
]


# Through a real process: one refused while composing (before Hydra runs the job), one once
# JAX has started (the mesh plan). The others call the same entry point in this process (an
# interpreter and a JAX start each saved): the same code from the command line to the line
# printed and the exit code.
SUBPROCESS = {"model=huge", "parallelism=tp8"}


@pytest.mark.e2e
@pytest.mark.parametrize("args, key, fix", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_input_one_clear_line(dp4_tp2_run, args, key, fix):
    cwd, _ = dp4_tp2_run
    before = tree_digest(cwd / "outputs")
    if " ".join(args) in SUBPROCESS:
        proc = run_cli(*args, "logger=none", cwd=cwd, timeout=120)
    else:
        proc = cli_in_process(*args, "logger=none", cwd=cwd)
    code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert code == 2, (code, err[-2000:])  # 2: bad input; 1 is a crash
    assert "Traceback" not in err + out
    errors = [line for line in err.splitlines() if line.startswith("dxrun: error:")]
    assert len(errors) == 1, err
    assert key in errors[0] and fix in errors[0], errors[0]
    assert tree_digest(cwd / "outputs") == before  # the earlier run's files are untouched
    assert len(_run_dirs(cwd)) == 1
    assert not (cwd / "multirun").exists()


# Dirs that cannot be made, refused before Hydra makes its run or sweep dir and before anything
# compiles. {file} is a file of the earlier run, {run} its dir. /proc takes no new dir even from
# root, whom permission bits never refuse (tests may run as root).
BAD_DIRS = [
    (["hydra.run.dir=/proc/x"],
     "hydra.run.dir=/proc/x cannot be created: /proc is not writable", "leave hydra.run.dir out"),
    (["hydra.run.dir={file}/run"],
     "hydra.run.dir={file}/run cannot be created: {file} is a file, not a directory",
     "leave hydra.run.dir out"),
    (["-m", "hydra.sweep.dir=/proc/y", "train.steps=5"],
     "hydra.sweep.dir=/proc/y cannot be created: /proc is not writable",
     "leave hydra.sweep.dir out"),
    (["-m", "hydra.sweep.dir={file}", "train.steps=5"],
     "hydra.sweep.dir={file} is a file, not a directory", "leave hydra.sweep.dir out"),
    (["checkpoint.dir={file}", "train.steps=20"],
     "checkpoint.dir={file} is a file, not a directory", "leave checkpoint.dir null"),
    (["checkpoint.dir={file}/ckpt"],
     "checkpoint.dir={file}/ckpt cannot be created: {file} is a file, not a directory",
     "leave checkpoint.dir null"),
    (["checkpoint.dir=/proc/ckpt"],
     "checkpoint.dir=/proc/ckpt cannot be created: /proc is not writable",
     "leave checkpoint.dir null"),
    # A name over the filesystem's NAME_MAX (255 bytes): named, shortened, in one line (it was
    # two tracebacks of "OSError: [Errno 36] File name too long" from Hydra, exit 1).
    (["hydra.run.dir={long}"],
     f"hydra.run.dir={'x' * 32}...{'x' * 16} (300 characters) cannot be created: its name "
     f"{'x' * 32}...{'x' * 16} is 300 bytes, over the ", "shorten it, give a dir"),
    # A relaunch into the earlier run's dir: refused before that dir is claimed or written to.
    (["hydra.run.dir={run}", "checkpoint.dir=/proc/ckpt"],
     "checkpoint.dir=/proc/ckpt cannot be created", "leave checkpoint.dir null"),
]


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root``, dirs too (an empty dir left behind counts), files by digest."""
    files = tree_digest(root)
    return {str(p.relative_to(root)): files.get(str(p.relative_to(root)), "dir")
            for p in root.rglob("*")}


@pytest.mark.e2e
@pytest.mark.parametrize("args, key, fix", BAD_DIRS, ids=[" ".join(a) for a, _, _ in BAD_DIRS])
def test_a_dir_that_cannot_be_made_is_one_clear_line(dp4_tp2_run, args, key, fix):
    cwd, _ = dp4_tp2_run
    (run_dir,) = _run_dirs(cwd)
    names = {"file": run_dir / "plan.json", "run": run_dir, "long": "x" * 300}
    before = _tree(cwd)
    args = [a.format(**names) for a in args]
    if any(a.startswith("checkpoint.dir=") for a in args):
        # Refused by the job once JAX has started: a fresh process, in which JAX logs every
        # compile under JAX_LOG_COMPILES; the refusal comes before the first.
        proc = run_cli(*args, "logger=none", cwd=cwd, timeout=120, env={"JAX_LOG_COMPILES": "1"})
        code, out, err = proc.returncode, proc.stdout, proc.stderr
        assert "Compiling" not in err + out
    else:  # hydra.run.dir, hydra.sweep.dir: refused before Hydra runs anything, in process
        with recorded_compiles() as compiled:
            proc = cli_in_process(*args, "logger=none", cwd=cwd)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
        assert compiled == []
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err + out
    errors = [line for line in err.splitlines() if line.startswith("dxrun: error:")]
    assert len(errors) == 1, err
    assert key.format(**names) in errors[0] and fix in errors[0], errors[0]
    assert _tree(cwd) == before  # no dir made, the earlier run's files as they were


@pytest.mark.e2e
def test_a_refused_first_run_leaves_the_dir_as_it_was(tmp_path):
    """Hydra makes outputs/<date>/<time> before dxrun can check the config: a refused run takes
    it all away again, outputs/ too when the run made it, and keeps an outputs/ that was there.
    (Through the entry point in this process: what the working dir held is noted by ``cli``,
    as at a process's start; the exit code and line of a real process are
    test_bad_input_one_clear_line's.)"""
    proc = cli_in_process("optimizer.lr=0", "logger=none", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    (tmp_path / "outputs").mkdir()
    proc = cli_in_process("optimizer.lr=0", "logger=none", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    assert not list((tmp_path / "outputs").iterdir())
    # A run dir straight under the working dir: the run dir goes, the working dir stays.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli_in_process("optimizer.lr=0", "logger=none", "hydra.run.dir=run", cwd=empty)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert empty.is_dir() and not list(empty.iterdir())


@pytest.mark.e2e
def test_crash_is_one_line_and_the_traceback_is_in_the_log(tmp_path):
    """Not bad input but a failure while training (the test-only DXRUN_TEST_ERROR_AT_STEP: a
    too-large allocation fails on one host and is overcommitted or OOM-killed on another): one
    readable line naming the log; the traceback goes to the run dir's log file, not the
    terminal."""
    proc = run_cli("logger=none", "train.steps=2", cwd=tmp_path,
                   env={"DXRUN_TEST_ERROR_AT_STEP": "1"})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert "RuntimeError: injected failure after step 1" in line and "full traceback:" in line
    log = Path(line.rsplit("full traceback: ", 1)[1].rstrip(")"))
    assert log.is_file() and log.parent.parent.parent == tmp_path / "outputs"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "injected failure after step 1" in text


@pytest.mark.e2e
def test_sweep_runs_every_valid_job_and_reports_the_bad_one(tmp_path):
    proc = run_cli("-m", "data.batch_size=30,16", "parallelism=dp2,dp8", "train.steps=2",
                   "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",  # no saves
                   cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert len(errors) == 2, proc.stderr  # the refused job (30 on dp8), then the summary
    assert "job #1: data.batch_size=30 is not divisible by dp*fsdp=8" in errors[0]
    assert "1 sweep job(s) failed" in errors[-1]
    done = sorted(tmp_path.glob("multirun/*/*/*/metrics.jsonl"))
    assert [p.parent.name for p in done] == ["0", "2", "3"]
    # The valid jobs share the sweep's W&B group; batch 16 trains identically on dp2 and dp8.
    losses = [json.loads(p.read_text().splitlines()[-1])["train/loss"] for p in done]
    assert losses[1] == pytest.approx(losses[2], rel=1e-5)
    groups = {read_run(next(p.parent.glob("wandb/offline-run-*/run-*.wandb")))["group"]
              for p in done}
    assert len(groups) == 1 and groups.pop().startswith("sweep-")
    # Their saved configs say the same (the sweep report's W&B upload reads them).
    from omegaconf import OmegaConf

    for p in done:
        saved = OmegaConf.load(p.parent / ".hydra" / "config.yaml").logger
        assert (saved.group, saved.job_type) == (read_run(next(p.parent.glob(
            "wandb/offline-run-*/run-*.wandb")))["group"], "sweep")


@pytest.fixture(scope="module")
def tokens_runs(tmp_path_factory):
    """A corpus prepared by the user, trained with just its path (vocab, dtype: meta.json),
    then relaunched into the same hydra.run.dir."""
    from dxrun.data.prepare import prepare

    cwd = tmp_path_factory.mktemp("tokens")
    (cwd / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prepare(str(cwd / "corpus.txt"), str(cwd / "data" / "mycorpus"))
    args = ["data=tokens", "data.path=data/mycorpus", "model.n_layers=1", "train.steps=2",
            "train.log_every=1", "train.eval_every=0", "hydra.run.dir=run"]
    first = run_cli(*args, cwd=cwd)
    before = tree_digest(cwd / "run")  # the first run's files, to compare after the relaunch
    # A fresh start (not a resume from the first run's checkpoints) in the same hydra.run.dir,
    # through the entry point in this process: where it writes is the point, not the process.
    again = cli_in_process(*args, "logger=none", "checkpoint.resume=none", "checkpoint.every=0",
                           cwd=cwd)  # (no test reads its checkpoints: none saved)
    return cwd, first, again, before


@pytest.mark.e2e
def test_wandb_name_of_a_path_override_and_the_vocab_from_meta(tokens_runs):
    cwd, first, _, _ = tokens_runs
    assert first.returncode == 0, first.stderr[-3000:]
    (path,) = (cwd / "run").glob("wandb/offline-run-*/run-*.wandb")
    run = read_run(path)
    assert run["name"] == "tiny-auto-bs32-pathmycorpus-n_layers1-steps2-log_every1-eval_every0"
    assert run["config"]["model"]["vocab_size"] == run["config"]["data"]["vocab_size"] == 256
    log = (cwd / "run" / "dxrun.log").read_text()
    assert "model tiny (modified: n_layers=1): " in log


@pytest.mark.e2e
def test_relaunch_into_a_used_dir_gets_its_own_dir_and_log(tokens_runs):
    """A scheduler relaunching with the same hydra.run.dir must not write into the earlier
    run's files, its log included. (The relaunch of ``tokens_runs``: no run of its own.)"""
    cwd, first, again, before = tokens_runs
    assert first.returncode == 0 and again.returncode == 0, again.stderr[-2000:]
    assert tree_digest(cwd / "run") == before
    new = cwd / "run_1"
    assert (new / "plan.json").is_file() and "step 2/2" in (new / "dxrun.log").read_text()


@pytest.mark.e2e
def test_relaunch_says_where_it_writes_in_its_first_lines(tokens_runs):
    cwd, _, again, _ = tokens_runs
    assert again.returncode == 0, again.stderr[-3000:]
    notice = f"{cwd / 'run'} already holds a run: this run writes to {cwd / 'run_1'}"
    for text in (again.stdout + again.stderr, (cwd / "run_1" / "dxrun.log").read_text()):
        lines = text.splitlines()
        at = next(i for i, x in enumerate(lines) if notice in x)
        assert at <= 2 and at < next(i for i, x in enumerate(lines) if "mesh plan" in x), lines


@pytest.mark.e2e
def test_a_relaunch_whose_new_dir_would_be_too_long_is_one_clear_line(tmp_path):
    """A finished run (no checkpoint to continue) in a dir whose name is 254 bytes: the
    relaunch's new run would take its sibling ``<name>_1``, 256 bytes, over NAME_MAX. One line
    naming both and the fix, exit 2, the earlier run as it was (it was three chained
    tracebacks of ``OSError: File name too long``, exit 1)."""
    name = "r" * 254
    args = ["model.n_layers=1", "train.steps=2", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "logger=none", f"hydra.run.dir={name}"]
    first = cli_in_process(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = _tree(tmp_path)
    again = cli_in_process(*args, cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    errors = [x for x in again.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert errors == [
        f"dxrun: error: the run dir {'r' * 32}...{'r' * 16} (254 characters) holds a run, and "
        f"this run's own dir beside it cannot be created: its name {'r' * 32}...{'r' * 14}_1 is "
        "256 bytes, over the 255 a file name may have on this filesystem (NAME_MAX); give a "
        "shorter hydra.run.dir"]
    assert _tree(tmp_path) == before
