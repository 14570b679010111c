"""Every debug= option runs, tiny, and does what its preset says."""

from __future__ import annotations

import json

import pytest
from conftest import make_cfg

from dxrun.checks import config_warnings
from dxrun.config.errors import NonFiniteError
from dxrun.train import train

TINY = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
        "parallelism=dp1", "logger=none"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fast_is_a_few_steps_one_eval_no_saves(tmp_path):
    cfg = make_cfg(*TINY, "debug=fast")
    assert cfg.logger.name == "none" and cfg.checkpoint.resume == "none"
    assert config_warnings(cfg) == []  # its warmup is within its 3 steps
    train(cfg, tmp_path)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/loss" in r] == [3]
    assert not (tmp_path / "checkpoints").exists()  # no save, no empty dir either


def test_limit_trains_few_batches_and_evaluates_on_one(tmp_path):
    cfg = make_cfg(*TINY, "debug=limit", "train.steps=5")
    assert (cfg.eval.batches, cfg.train.eval_every, cfg.checkpoint.every) == (1, 5, 5)
    assert config_warnings(cfg) == []  # its warmup is within even 5 steps
    train(cfg, tmp_path)
    assert [r["step"] for r in _rows(tmp_path) if "eval/loss" in r] == [5]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").glob("[0-9]*")) == [5]


def test_overfit_drives_the_loss_on_one_batch_far_down(tmp_path):
    cfg = make_cfg(*TINY, "debug=overfit")
    # Enough steps for the default model's batch (32 x 64 tokens) to go far below the floor:
    # the former 30 ended at 2.49 against 0.86.
    assert cfg.train.steps >= 150 and cfg.optimizer.schedule == "constant"
    summary = train(cfg, tmp_path)
    losses = [r["train/loss"] for r in _rows(tmp_path)]
    assert len(losses) == cfg.train.steps // cfg.train.log_every
    assert losses[:3] == sorted(losses[:3], reverse=True)
    # Below the data's entropy floor: no model predicts fresh batches of the chain that well.
    assert losses[-1] < 0.5 * summary["entropy_floor"] < losses[0]


def test_profile_writes_a_trace_of_its_steps(tmp_path):
    cfg = make_cfg(*TINY, "debug=profile")
    assert config_warnings(cfg) == []
    train(cfg, tmp_path)
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert [r["step"] for r in _rows(tmp_path) if r.get("perf/profiled")] == [3, 4]


def test_nans_raises_at_the_first_nan(tmp_path):
    cfg = make_cfg(*TINY, "debug=nans", "optimizer.lr=1.0e+30", "optimizer.warmup_steps=0",
                   "train.steps=4", "train.log_every=1")
    assert cfg.train.debug_nans
    with pytest.raises(NonFiniteError) as e:
        train(cfg, tmp_path)
    # The step, and the checkpoint only where one was saved (none: no empty dir named either).
    assert str(e.value).startswith("train.debug_nans: a NaN in the outputs of step 2; "
                                   "no checkpoint was saved before it; lower optimizer.lr")



def test_a_group_option_hydra_reads_as_a_number_is_one_line():
    """``debug=nan`` (the option is ``nans``): Hydra's grammar reads nan as a float and its
    own error is a traceback; the command-line check names the group's options instead."""
    from dxrun.checks import composition_refusal

    assert composition_refusal(["debug=nan"]) == (
        "debug=nan: Hydra reads this as a float, not an option of the debug group; choose one "
        "of: fast, limit, nans, overfit, profile")
    assert composition_refusal(["debug=fast", "data.seq_len=16"]) is None
