"""The default run, in process: it reaches the markov floor and writes its files."""

from __future__ import annotations

import json

import pytest

from dxrun.train import train


@pytest.mark.e2e
def test_default_markov_run_reaches_entropy_floor(cfg_factory, tmp_path):
    cfg = cfg_factory("logger=none")  # every other choice is the default
    summary = train(cfg, tmp_path)
    floor = summary["entropy_floor"]
    assert 0.5 < floor < 1.0
    assert summary["train/loss"] - floor < 0.1, summary
    assert summary["eval/loss"] - floor < 0.1, summary  # held-out stream, same chain
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == cfg.train.steps and len(rows) == cfg.train.steps // 50
    assert all(r["data/entropy_floor"] == floor for r in rows)
    assert rows[0]["train/loss"] > floor + 1.0  # it did learn, from far above the floor
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh_shape"] == [8, 1, 1]  # parallelism=auto: every device data-parallel


def test_bf16_trains_close_to_fp32(cfg_factory, tmp_path):
    base = ["logger=none", "train.steps=30", "train.log_every=30", "parallelism=dp2_tp4",
            "model.n_heads=8", "model.n_kv_heads=8"]
    fp32 = train(cfg_factory(*base), tmp_path / "fp32")
    bf16 = train(cfg_factory(*base, "train.precision=bf16"), tmp_path / "bf16")
    assert abs(bf16["train/loss"] - fp32["train/loss"]) < 0.05 * fp32["train/loss"]
    assert bf16["train/loss"] != fp32["train/loss"]  # it really computed in bf16


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lion"])
def test_every_optimizer_trains(cfg_factory, tmp_path, optimizer):
    s = train(cfg_factory(f"optimizer={optimizer}", "logger=none", "parallelism=dp2",
                          "train.steps=30", "train.log_every=1", "train.eval_every=0"), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.5, (optimizer, rows[-1])
    assert s["train/lr"] > 0


def test_dropout_is_applied_in_training_only(cfg_factory, tmp_path):
    base = ["logger=none", "parallelism=dp2", "train.steps=2", "train.log_every=1",
            "train.eval_every=1", "eval.batches=1", "optimizer.warmup_steps=0",
            "optimizer.lr=1e-9"]  # (the lr barely moves: both runs keep the same weights)
    plain = train(cfg_factory(*base), tmp_path / "plain")
    dropped = train(cfg_factory(*base, "model.dropout=0.3"), tmp_path / "dropout")
    assert dropped["train/loss"] != pytest.approx(plain["train/loss"], rel=1e-4)
    assert dropped["eval/loss"] == pytest.approx(plain["eval/loss"], rel=1e-4)
