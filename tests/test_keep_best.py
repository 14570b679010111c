"""checkpoint.keep_best and train.early_stop across a kill and a resume: the best checkpoint
survives rotation and is what --best loads; the patience counter continues from the checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import cli_in_process, make_cfg, recorded_compiles, tree_digest

from dxrun.checkpointing import committed_steps
from dxrun.checks import logged_metrics, validate
from dxrun.config.errors import ConfigError
from dxrun.tools.checkpoint import BEST, split_args
from dxrun.tracking.monitor import Monitor
from dxrun.train import train

# data/tokens_seen only grows: under mode=min its first row stays the best, whatever the
# losses do. train/loss with min_delta=100 never improves after its first row: the patience
# runs out at a known row.
RUN = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8", "logger=none",
       "parallelism=dp2", "train.steps=20", "train.log_every=1", "train.eval_every=0",
       "checkpoint.every=2", "checkpoint.keep=1", "checkpoint.keep_best=data/tokens_seen",
       "checkpoint.keep_best_mode=min", "train.early_stop.monitor=train/loss",
       "train.early_stop.min_delta=100", "train.early_stop.patience=3"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Killed after step 3 (checkpoints 1, the best, and 2 committed), then resumed in place."""
    run_dir = tmp_path_factory.mktemp("best")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DXRUN_TEST_ERROR_AT_STEP", "3")
        with pytest.raises(RuntimeError, match="injected failure after step 3"):
            train(make_cfg(*RUN), run_dir)
    killed = committed_steps(run_dir / "checkpoints")
    summary = train(make_cfg(*RUN), run_dir)
    return run_dir, killed, summary


@pytest.mark.e2e  # a killed training and its resume (module fixture)
def test_the_best_checkpoint_survives_rotation_and_a_resume(resumed):
    run_dir, killed, summary = resumed
    # Step 1's row was the best: saved then (off the every-2 cadence), kept beside the newest.
    assert killed == [1, 2]
    assert committed_steps(run_dir / "checkpoints") == [1, 4]  # 2 rotated out, 1 kept
    best = json.loads((run_dir / "summary.json").read_text())["best_checkpoint"]
    assert best == summary["best_checkpoint"]
    assert (best["metric"], best["step"], best["path"]) == (
        "data/tokens_seen", 1, str(run_dir / "checkpoints" / "1"))
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert best["value"] == first["data/tokens_seen"] == 8 * 16


@pytest.mark.e2e  # a killed training and its resume (module fixture)
def test_early_stop_counts_across_the_resume(resumed):
    run_dir, _, summary = resumed
    # Row 1 set the best; rows 2 (before the kill, in checkpoint 2's meta), 3 and 4 did not
    # beat it: the patience of 3 ran out at step 4. A counter restarted by the resume would
    # have stopped at step 6.
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary["step"] == 4 and summary["early_stop"].startswith(
        "early stop: train/loss has not improved")
    assert "in 3 rows (train.early_stop.patience=3)" in summary["early_stop"]


@pytest.mark.e2e  # a killed training and its resume (module fixture)
def test_evaluate_best_loads_the_best_checkpoint(resumed):
    from dxrun.evaluate import evaluate_checkpoint

    run_dir, _, _ = resumed
    path, _, overrides = split_args("evaluate", [str(run_dir), BEST, "eval.batches=1"], {})
    assert path == run_dir and overrides == [BEST, "eval.batches=1"]
    assert evaluate_checkpoint(run_dir, overrides)["step"] == 1
    assert evaluate_checkpoint(run_dir, ["eval.batches=1"])["step"] == 4


@pytest.mark.e2e  # a killed training and its resume (module fixture)
def test_a_relaunch_of_a_run_that_stopped_early_has_nothing_to_train(resumed, tmp_path):
    """A run ended by train.early_stop is finished, as one that reached train.steps is: the
    same command relaunched into it (through the entry point, as ``python -m dxrun``) says so
    in one line, before its mesh plan, and leaves its files as they are (it
    used to train 0 steps and rewrite summary.json, goodput.json and status.json). Killed
    after its last save, before it recorded its end, the relaunch records it."""
    run_dir = tmp_path / "run"
    shutil.copytree(resumed[0], run_dir)
    before = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}, tree_digest(run_dir)
    proc = cli_in_process(*RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dxrun:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"dxrun: nothing to train: checkpoint {run_dir / 'checkpoints' / '4'} is where the run "
        "stopped early, train/loss has not improved on "), out[-3000:]
    assert lines[0].endswith("(step 1) by more than 100 in 3 rows (train.early_stop.patience=3); "
                             "the run's files are left as they are (raise "
                             "train.early_stop.patience, or set train.early_stop.monitor=null, "
                             "to train on)")
    assert "mesh plan" not in out and "Traceback" not in out
    assert ({str(p.relative_to(run_dir)) for p in run_dir.rglob("*")},
            tree_digest(run_dir)) == before
    # Killed after its last save, before its summary: the relaunch records the end.
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    (run_dir / "status.json").write_text('{"status": "running", "attempt": 2}')
    proc = cli_in_process(*RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is at the run's end, which it had not recorded" in proc.stderr
    recorded = json.loads((run_dir / "summary.json").read_text())
    assert (recorded["step"], recorded["early_stop"]) == (4, summary["early_stop"])
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["reason"]) == ("ok", summary["early_stop"])
    assert committed_steps(run_dir / "checkpoints") == [1, 4]


def test_monitor_modes_and_a_resume_that_changes_the_metric():
    m = Monitor("eval/acc", "max", 0.01)
    assert [m.see(s, {"eval/acc": v}) for s, v in enumerate([0.5, 0.505, 0.6, None])] == [
        True, False, True, None]
    assert (m.best, m.step, m.stale) == (0.6, 2, 0)
    assert Monitor.from_json(m.to_json(), "eval/acc", "max").step == 2
    assert Monitor.from_json(m.to_json(), "eval/loss", "max").best is None


def test_an_eval_monitor_without_evaluation_is_refused():
    with pytest.raises(ConfigError, match=r"^checkpoint.keep_best=eval/loss needs evaluation"):
        validate(make_cfg("checkpoint.keep_best=eval/loss", "train.eval_every=0"))


# What a training run's rows hold under each setting: eval/* with evaluation on, train/mask_rate
# under masked diffusion, train/skipped_steps under nan_policy=skip, data/entropy_floor for the
# markov chain (or a data._target_ of yours, which may give one).
ALWAYS = {"train/loss", "train/ppl", "train/accuracy", "train/grad_norm", "train/param_norm",
          "train/lr", "perf/step_time_s", "perf/tokens_per_s", "perf/tokens_per_s_per_device",
          "perf/tflops_per_device", "perf/mfu", "perf/data_wait_frac", "perf/compile_time_s",
          "perf/layout_search_s", "perf/checkpoint_block_s", "perf/profiled",
          "mem/step_bytes_per_device", "mem/peak_bytes_per_device", "data/tokens_seen"}
EVAL = {"eval/loss", "eval/ppl", "eval/accuracy"}
SETTINGS = [
    ((), ALWAYS | EVAL | {"data/entropy_floor"}),
    (("train.eval_every=0",), ALWAYS | {"data/entropy_floor"}),
    (("model.objective=mdlm", "train.nan_policy=skip"),
     ALWAYS | EVAL | {"data/entropy_floor", "train/mask_rate", "train/skipped_steps"}),
    (("data=text", "data.path=corpus.txt"), ALWAYS | EVAL),
]


@pytest.mark.parametrize("overrides, names", SETTINGS, ids=[" ".join(o) or "default"
                                                            for o, _ in SETTINGS])
def test_every_metric_the_run_logs_may_be_watched(overrides, names):
    cfg = make_cfg(*overrides)
    assert set(logged_metrics(cfg)) == names
    for name in names:  # each passes, under either key
        cfg.checkpoint.keep_best = cfg.train.early_stop.monitor = name
        validate(cfg)


REFUSED = [
    # a typo: the names the run logs, the nearest first
    (["checkpoint.keep_best=eval/los"],
     "checkpoint.keep_best=eval/los names no metric this run logs; did you mean eval/loss? It "
     "logs train/loss, train/ppl, "),
    (["train.early_stop.monitor=train/los"],
     "train.early_stop.monitor=train/los names no metric this run logs; did you mean "
     "train/loss? It logs train/loss, "),
    (["train.early_stop.monitor=loss", "train.eval_every=0"],
     "train.early_stop.monitor=loss names no metric this run logs; did you mean train/loss? "
     "It logs train/loss, "),
    # a metric of another setting, or of no training row
    (["checkpoint.keep_best=train/mask_rate"],
     "checkpoint.keep_best=train/mask_rate is logged only with model.objective=mdlm (this run "
     "has model.objective=ar); set model.objective=mdlm, or watch another metric"),
    (["train.early_stop.monitor=train/skipped_steps"],
     "train.early_stop.monitor=train/skipped_steps is logged only with train.nan_policy=skip "
     "(this run has train.nan_policy=halt); set train.nan_policy=skip, or watch another metric"),
    (["checkpoint.keep_best=data/entropy_floor", "data=text", "data.path=corpus.txt"],
     "checkpoint.keep_best=data/entropy_floor is logged only with data.name=markov (this run "
     "has data.name=text); set data.name=markov, or watch another metric"),
    (["checkpoint.keep_best=eval/tokens"],
     "checkpoint.keep_best=eval/tokens is dxrun.evaluate's metric, in no training run's rows; "
     "watch a metric this run logs: train/loss, "),
    (["train.early_stop.monitor=best/train_loss"],
     "train.early_stop.monitor=best/train_loss is summary.json's metric, in no training run's "
     "rows; watch a metric this run logs: train/loss, "),
]


@pytest.mark.parametrize("overrides, line", REFUSED, ids=[o[0] for o, _ in REFUSED])
def test_a_metric_the_run_never_logs_is_refused(overrides, line):
    cfg = make_cfg(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(line)
    if "It logs" in line or "this run logs:" in line:  # the whole list, as the run logs it
        listed = str(e.value).split("logs")[-1].strip(" :")
        assert listed.split(", ") == logged_metrics(cfg)


def test_a_misspelt_metric_is_one_line_before_anything_is_made(tmp_path):
    """Through the entry point: exit 2, the one line, nothing compiled, no dir left."""
    with recorded_compiles() as compiled:
        # (a run of one small step, were it not refused)
        proc = cli_in_process("checkpoint.keep_best=eval/los", "logger=none", "train.steps=1",
                              "data.seq_len=16", "data.batch_size=8", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert line.startswith("dxrun: error: checkpoint.keep_best=eval/los names no metric this "
                           "run logs; did you mean eval/loss?")
    assert compiled == [] and not list(tmp_path.iterdir())



def test_an_early_stop_before_the_first_log_row_logs_its_last_row(tmp_path):
    """eval/loss at every step, the train log only at step 20: with min_delta=100 the patience
    of 1 runs out at step 2's evaluation. That row holds train/* as a normal end's last row
    does (it ended ``done: loss nan`` with ``"train/loss": null`` in summary.json)."""
    run = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
           "logger=none", "parallelism=dp1", "train.steps=20", "train.log_every=20",
           "train.eval_every=1", "eval.batches=1", "checkpoint.every=0",
           "train.early_stop.monitor=eval/loss", "train.early_stop.min_delta=100",
           "train.early_stop.patience=1"]
    summary = train(make_cfg(*run), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "train/loss" not in rows[0]
    assert {"train/loss", "eval/loss", "perf/tokens_per_s", "data/tokens_seen"} <= rows[1].keys()
    written = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == written["step"] == 2
    assert summary["train/loss"] == written["train/loss"] == rows[1]["train/loss"] > 0
