"""W&B runs read back from the files they write; W&B failures never stop training."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import finished_wandb_run, subprocess_env

from dxrun.run import Job, run_name
from dxrun.tracking.wandb_file import read_run
from dxrun.train import train

QUICK = ["train.steps=6", "train.log_every=3", "parallelism=dp2", "data.batch_size=8"]
INTERNAL = ("_timestamp", "_runtime", "_step")


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_run(run_dir):
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return finished_wandb_run(path)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two W&B runs in one process, as the jobs of a multirun are."""
    from conftest import make_cfg

    out = []
    for i, bs in enumerate((8, 16)):
        cfg = make_cfg(*QUICK, f"data.batch_size={bs}")
        run_dir = tmp_path_factory.mktemp(f"run{i}")
        job = Job(choices={"model": "tiny", "parallelism": "dp2", "data": "markov",
                           "optimizer": "adamw", "logger": "wandb"},
                  overrides=["parallelism=dp2", f"data.batch_size={bs}", "train.steps=6"],
                  group="sweep-test")
        train(cfg, run_dir, job)
        out.append(run_dir)
    return out


@pytest.mark.e2e
def test_wandb_history_equals_metrics_jsonl(two_runs):
    for run_dir in two_runs:
        run = _wandb_run(run_dir)
        history = [{k: v for k, v in row.items() if k not in INTERNAL} for row in run["history"]]
        assert history == _rows(run_dir)
        assert [r["step"] for r in history] == [3, 6]


@pytest.mark.e2e
def test_wandb_config_name_group_tags(two_runs):
    run = _wandb_run(two_runs[1])
    cfg = run["config"]
    assert cfg["choices"]["parallelism"] == "dp2" and cfg["choices"]["model"] == "tiny"
    assert cfg["plan"]["mesh_shape"] == [2, 1, 1, 1, 1]
    assert cfg["data"]["batch_size"] == 16 and cfg["n_params"] > 0
    assert cfg["jax"]["device_count"] == 8 and cfg["jax"]["version"]
    assert run["name"] == "tiny-dp2-bs16-steps6"
    assert run["group"] == "sweep-test" and run["job_type"] == "train"
    assert {"model:tiny", "parallelism:dp2", "data:markov", "optimizer:adamw"} <= set(run["tags"])
    assert run["summary"]["train/loss"]["min"] == min(r["train/loss"] for r in _rows(two_runs[1]))


@pytest.mark.e2e
def test_two_runs_in_one_process_are_distinct(two_runs):
    a, b = (_wandb_run(d) for d in two_runs)
    assert a["id"] != b["id"]
    assert a["config"]["data"]["batch_size"] == 8 and b["config"]["data"]["batch_size"] == 16
    assert a["history"][0]["train/loss"] != b["history"][0]["train/loss"]


def test_wandb_prints_nothing_after_the_run(cfg_factory, tmp_path, monkeypatch, capfd, caplog):
    """W&B's banner and its history and summary tables are off; the run says where its W&B
    run is in one line, and the offline files hold every row."""
    monkeypatch.delenv("WANDB_SILENT")  # the tests' own setting: a user's run has none
    with caplog.at_level(logging.INFO, logger="dxrun"):
        train(cfg_factory("train.steps=2", "train.log_every=1", "parallelism=dp2",
                          "data.batch_size=8", "train.eval_every=0"), tmp_path)
    out, err = capfd.readouterr()
    assert [x for x in (out + err).splitlines() if x.startswith("wandb:")] == []
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B:")]
    assert line == f"W&B: offline run in {path.parent} (upload: wandb sync {path.parent})"
    history = [{k: v for k, v in r.items() if k not in INTERNAL}
               for r in finished_wandb_run(path)["history"]]
    assert history == _rows(tmp_path) and [r["step"] for r in history] == [1, 2]


@pytest.mark.e2e  # a training that must run to its end
def test_failed_wandb_init_still_trains(cfg_factory, tmp_path, caplog):
    (tmp_path / "wandb").write_text("a file where W&B wants its folder")
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        summary = train(cfg_factory(*QUICK), tmp_path)
    assert [r["step"] for r in _rows(tmp_path)] == [3, 6]
    assert summary["train/loss"] == _rows(tmp_path)[-1]["train/loss"]
    warnings = [r.message for r in caplog.records if "W&B" in r.message]
    assert len(warnings) == 1 and "continuing with metrics.jsonl" in warnings[0]


def test_logger_none_writes_no_wandb(cfg_factory, tmp_path):
    train(cfg_factory(*QUICK, "logger=none"), tmp_path)
    assert not (tmp_path / "wandb").exists() and len(_rows(tmp_path)) == 2


def test_run_name_from_choices_and_overrides(cfg_factory):
    cfg = cfg_factory("parallelism=dp4_tp2", "data.batch_size=64", "optimizer.lr=0.01")
    job = Job(choices={"model": "tiny", "parallelism": "dp4_tp2"},
              overrides=["parallelism=dp4_tp2", "data.batch_size=64", "optimizer.lr=0.01"])
    assert run_name(cfg, job) == "tiny-dp4_tp2-bs64-lr0.01"


@pytest.mark.e2e
def test_dashboard_plots_only_metrics_dxrun_logs(two_runs, capsys):
    from dxrun.dashboard import load_spec, main, metrics_in, panel_lines

    logged = set().union(*(_rows(two_runs[0])))
    assert metrics_in(load_spec()) <= logged | {"perf/mfu"}  # mfu: where the peak is known
    # --print: the panels to add by hand, whether wandb-workspaces is installed or not (with it,
    # a plain call would try to save the workspace on the W&B server).
    main(["--entity", "someone", "--print"])
    out = capsys.readouterr().out.splitlines()
    assert "  [Loss] loss vs entropy floor: train/loss, data/entropy_floor" in out
    assert len(out) == 1 + len(panel_lines(load_spec())) and out[1:] == panel_lines(load_spec())


def test_failed_wandb_log_warns_once_and_keeps_jsonl(cfg_factory, tmp_path, caplog):
    from dxrun.tracking.logger import MetricsLogger

    logger = MetricsLogger(tmp_path, cfg_factory().logger, {"a": 1}, name="t")
    logger.log(1, {"train/loss": 3.0})
    logger.wandb.finish()  # the W&B run goes away under us: its next log call raises
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        logger.log(2, {"train/loss": 2.0})
        logger.log(3, {"train/loss": 1.0})
    logger.finish()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]
    warnings = [r.message for r in caplog.records if "W&B" in r.message]
    assert len(warnings) == 1 and "log failed" in warnings[0]


def test_run_name_has_no_slash_names_a_custom_size_and_is_cut_between_parts(cfg_factory):
    overrides = ["model.name=mine", "data.path=data/corpora/mycorpus/", "model.n_layers=4",
                 *[f"optimizer.warmup_steps={100 + i}" for i in range(20)]]
    job = Job(choices={"model": "tiny", "parallelism": "auto"}, overrides=overrides)
    name = run_name(cfg_factory("model.name=mine", "model.n_layers=4"), job)
    assert name.startswith("mine-auto-bs32-pathmycorpus-n_layers4-warmup_steps100-")
    assert "/" not in name and len(name) <= 120
    parts = name.split("-")
    assert parts[-1] in {f"warmup_steps{100 + i}" for i in range(20)}  # whole, never cut
    assert len(name) + len("-warmup_steps1nn") > 120  # and as many as fit


def _logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return max((json.loads(x)["step"] for x in text.splitlines() if x.endswith("}")), default=0)


# 8 x 16 tokens a step: what is tested is the rows and the W&B file, not the step.
KILLED = ["model=tiny", "train.steps=150", "train.log_every=1", "train.eval_every=0",
          "checkpoint.every=40", "parallelism=dp2", "data.batch_size=8", "data.seq_len=16"]


def _wandb_steps(run_dir) -> list[int]:
    """The steps the (single, running) attempt's W&B file holds so far: W&B writes it in
    32 KiB blocks, so the newest rows are not there yet."""
    try:
        return [h["step"] for f in run_dir.glob("wandb/offline-run-*/run-*.wandb")
                for h in read_run(f)["history"]]
    except ValueError:
        return []


@pytest.mark.e2e
def test_run_killed_past_a_checkpoint_resumes_with_each_step_once(tmp_path):
    """SIGKILL once the W&B run holds steps past a committed checkpoint, the last line of
    metrics.jsonl cut short (as a kill mid-write leaves it), then the same command again:
    metrics.jsonl and the W&B run (both attempts' files, synced in order) hold every step once,
    with the resumed attempt's values."""
    import signal
    import subprocess
    import sys
    import time

    from dxrun.checkpointing import committed_steps
    from dxrun.tracking.wandb_file import read_history

    run_dir = tmp_path / "run"
    # Not this process's W&B service (set once a test here used W&B): each attempt has its own,
    # as a relaunch does; a shared one would still hold the killed attempt's run open.
    env = subprocess_env(drop=("WANDB_SERVICE",))
    cmd = [sys.executable, "-m", "dxrun", *KILLED, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while True:  # freeze it once W&B holds a step past a committed checkpoint, then kill it
        assert proc.poll() is None, proc.communicate(timeout=60)[0][-3000:]
        assert time.monotonic() < deadline, "timed out"
        if _logged(run_dir) > 40:
            proc.send_signal(signal.SIGSTOP)
            saved = committed_steps(run_dir / "checkpoints")
            if saved and max(_wandb_steps(run_dir), default=0) > saved[-1]:
                break
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    ckpt, killed_at = saved[-1], _logged(run_dir)
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text()
    torn = text.rstrip("\n").rsplit("\n", 1)[-1][:20]
    metrics.write_text(text.rstrip("\n").rsplit("\n", 1)[0] + "\n" + torn)
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resuming from step {ckpt}" in again.stdout + again.stderr
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 151))
    discarded = (run_dir / "metrics.discarded.jsonl").read_text().splitlines()
    assert discarded[-1] == torn and len(discarded) == killed_at - ckpt
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    history = read_history(files)
    assert [h["step"] for h in history] == list(range(1, 151))
    assert [h["train/loss"] for h in history] == [r["train/loss"] for r in rows]
    # The killed attempt ran no exit path, yet goodput.json counts it (written before each
    # row): its time, up to the last row it logged, and the steps past the checkpoint that
    # the second attempt did again.
    g = json.loads((run_dir / "goodput.json").read_text())
    first, second = g["attempts"]
    assert (first["first_step"], second["first_step"]) == (0, ckpt)
    assert killed_at <= first["last_step"] <= killed_at + 1
    assert g["lost_s"] > 0 and g["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    assert json.loads((run_dir / "summary.json").read_text())["attempts"] == 2


def test_a_resumed_wandb_run_catches_up_with_metrics_jsonl():
    """Where a resume rewinds its W&B run to and which kept rows it logs again, from the steps
    the run holds (``held``) and the rows metrics.jsonl kept."""
    from dxrun.tracking.backends import catch_up

    kept = [{"step": s} for s in (1, 2, 3, 4)]
    assert catch_up(kept, [1, 2, 3, 4]) == (None, [])  # all there: continued as it is
    assert catch_up(kept, [1, 2, 3, 4, 5, 6]) == (4, [])  # 5, 6 moved aside: rewound past them
    assert catch_up(kept, []) == (None, kept)  # a killed attempt's writer lost them all
    assert catch_up(kept, [1, 2]) == (None, kept[2:])
    assert catch_up(kept, [1, 2, 4, 5]) == (2, kept[2:])  # a gap: rewound to before it
    assert catch_up(kept, None) == (0, kept)  # a file unreadable: all of them again
