"""The default run: it reaches the markov floor and writes its files; short runs never spike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest
from conftest import CONF, make_cfg, optimised_steps, recorded_compiles, subprocess_env

from dxrun.experiment import Experiment, make_schedule
from dxrun.tracking.goodput import STARTUP_PHASES
from dxrun.train import train


@pytest.mark.e2e
def test_default_markov_run_reaches_entropy_floor(cfg_factory, tmp_path):
    """``python -m dxrun`` as the README runs it (its W&B run aside), compiled as a user's is:
    600 steps, whose time is in the steps (LLVM's passes on: half the CPU time of the
    suite's fast compiles)."""
    cfg = cfg_factory("logger=none")  # every other choice is the default
    proc = subprocess.run([sys.executable, "-m", "dxrun", "logger=none", "hydra.run.dir=run"],
                          cwd=tmp_path, env=subprocess_env(optimised=True), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    floor = summary["entropy_floor"]
    assert 0.5 < floor < 1.0
    assert summary["train/loss"] - floor < 0.1, summary
    assert summary["eval/loss"] - floor < 0.1, summary  # held-out stream, same chain
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == cfg.train.steps and len(rows) == cfg.train.steps // 50
    assert all(r["data/entropy_floor"] == floor for r in rows)
    assert rows[0]["train/loss"] > floor + 1.0  # it did learn, from far above the floor
    plan = json.loads((run / "plan.json").read_text())
    assert plan["mesh_shape"] == [8, 1, 1, 1, 1]  # every device data-parallel
    # parallelism=auto, the default, does not search here (600 steps of a tiny model pay for no
    # search): the log says so in its first words, and no search time is booked anywhere
    log = (run / "dxrun.log").read_text()
    assert ("  no layout search: the run keeps its starting layout, dp8 (all devices "
            "data-parallel); deciding took ") in log
    assert "layout search: parallelism.search" not in log
    attempt = json.loads((run / "goodput.json").read_text())["attempts"][0]
    assert attempt["search_s"] == 0.0 and rows[0]["perf/layout_search_s"] == 0.0
    (goodput,) = [x for x in log.splitlines() if "goodput " in x]
    assert ", search " not in goodput and ", compile " in goodput
    # The startup by phase, from the process's start: each marked, adding up to the startup.
    phases = attempt["startup_phases"]
    assert list(phases) == [*STARTUP_PHASES, "other"]
    assert all(phases[p] > 0 for p in ("launch", "compose", "jax", "decide", "init", "open"))
    assert sum(phases.values()) == pytest.approx(attempt["startup_s"])
    # No library warns in the README's run (Orbax warned of dxrun's own type handler); dxrun's
    # own warnings name a key to set.
    logged = (run / "dxrun.log").read_text().splitlines()
    assert not [x for x in logged if ("][WARNING]" in x or "][ERROR]" in x)
                and "][dxrun][" not in x], logged


# Every model preset (conf/model/*.yaml), each with its own optimizer defaults.
PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
# What a larger preset takes from its family's tiny preset (tiny for the GPT-2 blocks,
# tiny_llama for the Llama ones) to train in seconds on a CPU.
SHRUNK = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size")


def short_run(model: str, steps: int) -> Any:
    """A ``steps``-step run of ``model=<model>``, every step logged: tiny and tiny_llama on
    every device data-parallel (the default run's layout, without deciding whether to search);
    a larger preset shrunk (``SHRUNK``), on a quarter of the batch and one device."""
    family = "tiny_llama" if make_cfg(f"model={model}").model.norm == "rmsnorm" else "tiny"
    tiny = make_cfg(f"model={family}").model
    shrink = ["parallelism=dp"] if model == family else [
        f"model.{k}={tiny[k]}" for k in SHRUNK] + ["data.batch_size=8", "parallelism=dp1"]
    return make_cfg(f"model={model}", *shrink, f"train.steps={steps}",
                    "train.log_every=1", "logger=none", "train.eval_every=0",
                    "checkpoint.every=0")


def lr_of_each_step(cfg: Any) -> list[float]:
    lr = make_schedule(cfg.optimizer, cfg.optimizer.lr, cfg.train.steps)
    return [float(lr(count)) for count in range(cfg.train.steps)]


def logged_losses(cfg: Any, run_dir: Path) -> list[float]:
    """The loss of every step: a default preset's from the rows its run logs; a shrunk one's
    from its steps taken one by one on one device (the same step and batches the run takes,
    without the run's files, which its test does not read)."""
    if cfg.parallelism.name == "dp":
        train(cfg, run_dir)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in rows]
    exp = Experiment.build(cfg)
    state, losses = exp.init_state(), []
    for i in range(cfg.train.steps):  # one device: no collective for the host to run ahead of
        state, m = exp.step(state, exp.batch(i))
        losses.append(m["train/loss"])
    return [float(x) for x in jax.device_get(losses)]


@pytest.mark.e2e
@pytest.mark.parametrize("model", PRESETS)
def test_short_runs_of_every_preset_never_spike(tmp_path, model):
    """A 60-step run of every model preset, and a 20-step run of tiny and tiny_llama, every
    step logged, never log a loss above their first step's, nor one 0.25 nats above the best
    before it (a spike that stays below the first loss).

    tiny and tiny_llama run with every default (``parallelism=dp``: the layout the default run
    keeps). The larger presets keep what is theirs in a short run: the
    optimizer section (lr, warmup cut to the run, schedule, betas) and the block (norm, MLP,
    positions, biases, tying, RoPE theta); they take their family's tiny width, depth and
    vocabulary and a quarter of the batch, since at their own size 60 steps are far beyond a
    CPU test. So their lr is checked on their block at tiny's width, not at their own.

    The 20-step run's lr is the 60-step run's at every step for the tiny presets (a warmup of
    at most 20 steps): it is the 60-step run's first 20 steps and is not run again. A larger
    preset's warmup is cut to the run, so its lr rises over either run to the same peak, which
    the 60-step run holds for more steps: its 20-step run is not taken (the suite's time). The
    first update is taken at lr 0 (the warmup starts there), so step 2 scores step 1's weights
    on another batch, and may lie that batch's noise (under 0.05 nats) above step 1."""
    long = short_run(model, 60)
    with optimised_steps():  # 60 steps: their time is in the steps
        losses = {60: logged_losses(long, tmp_path / "60")}
    if long.parallelism.name == "dp":  # tiny, tiny_llama: the first 20 steps are the short run
        assert lr_of_each_step(short_run(model, 20)) == lr_of_each_step(long)[:20]
        losses[20] = losses[60][:20]
    for steps, loss in losses.items():
        assert len(loss) == steps
        assert max(loss[1:]) <= loss[0] + 0.05, (model, steps, loss)
        rise = max(x - min(loss[:k]) for k, x in enumerate(loss) if k)
        assert rise < 0.25, (model, steps, rise, loss)


@pytest.mark.e2e
def test_bf16_trains_close_to_fp32(cfg_factory, tmp_path):
    base = ["logger=none", "train.steps=10", "train.log_every=10", "parallelism=dp2_tp4",
            "model.n_heads=8", "model.n_kv_heads=8", "data.seq_len=16",
            "train.eval_every=0", "checkpoint.every=0"]  # (neither is compared here)
    fp32 = train(cfg_factory(*base), tmp_path / "fp32")
    bf16 = train(cfg_factory(*base, "train.precision=bf16"), tmp_path / "bf16")
    assert abs(bf16["train/loss"] - fp32["train/loss"]) < 0.05 * fp32["train/loss"]
    assert bf16["train/loss"] != fp32["train/loss"]  # it really computed in bf16


@pytest.mark.e2e
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lion"])
def test_every_optimizer_trains(cfg_factory, tmp_path, optimizer):
    # 16 tokens a sequence: the chain's context is its last 2 symbols, which a longer sequence
    # only repeats.
    s = train(cfg_factory(f"optimizer={optimizer}", "logger=none", "parallelism=dp2",
                          "train.steps=30", "train.log_every=1", "train.eval_every=0",
                          "checkpoint.every=0", "data.seq_len=16"), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The first step's loss is a uniform guess over the chain's 16 symbols (2.77 nats), and its
    # symbol frequencies alone are worth only 0.02 nats: 0.15 below it is the context learned.
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.15, (optimizer, rows[-1])
    assert s["train/lr"] > 0


@pytest.mark.e2e
def test_dropout_is_applied_in_training_only(cfg_factory, tmp_path):
    base = ["logger=none", "parallelism=dp2", "train.steps=2", "train.log_every=1",
            "train.eval_every=1", "eval.batches=1", "optimizer.warmup_steps=0",
            "optimizer.lr=1e-9",  # (the lr barely moves: both runs keep the same weights)
            "checkpoint.every=0"]
    plain = train(cfg_factory(*base), tmp_path / "plain")
    dropped = train(cfg_factory(*base, "model.dropout=0.3"), tmp_path / "dropout")
    assert dropped["train/loss"] != pytest.approx(plain["train/loss"], rel=1e-4)
    assert dropped["eval/loss"] == pytest.approx(plain["eval/loss"], rel=1e-4)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_diverged_run_writes_null_not_nan(cfg_factory, tmp_path, caplog):
    # sgd at lr 1e6 without clipping, 64 output classes for 16 symbols: the loss is 4e8 at step 2
    # and NaN from step 3 on.
    cfg = cfg_factory("logger=none", "parallelism=dp2", "parallelism.n_devices=2",
                      "optimizer=sgd", "optimizer.lr=1e6", "optimizer.clip_norm=0",
                      "data.vocab_size=64", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
                      "train.steps=4", "train.log_every=3", "train.eval_every=0",
                      "train.nan_policy=skip",  # halt would stop the run at step 3
                      "checkpoint.every=0")
    with caplog.at_level("WARNING", logger="dxrun"):
        train(cfg, tmp_path)
    rows = [_strict(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4]
    assert all(r["train/loss"] is None and r["train/ppl"] is None for r in rows)
    assert rows[0]["train/accuracy"] >= 0  # the finite numbers of the row are kept
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary["train/loss"] is None
    assert summary["best/train_loss"] is None  # no finite loss was logged: not Infinity
    (warning,) = [r.message for r in caplog.records if "not finite" in r.message]
    assert warning.startswith("step 3: ") and "train/loss" in warning


@pytest.mark.e2e
def test_odd_vocab_on_tp_reports_the_real_parameter_count(cfg_factory, tmp_path):
    from dxrun.cost import flops_per_token
    from dxrun.experiment import Experiment
    from dxrun.model.transformer import count_params

    base = ["logger=none", "data.vocab_size=65", "train.steps=2", "train.log_every=2",
            "train.eval_every=0", "checkpoint.every=0"]
    s = train(cfg_factory(*base, "parallelism=tp2", "parallelism.n_devices=2"), tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["vocab_size"], plan["padded_vocab"]) == (65, 66)
    unpadded = cfg_factory(*base, "parallelism=dp1")
    # Counted from the shapes of the unpadded model's parameters (nothing to compile or fill).
    n_real = count_params(Experiment.build(unpadded).abstract_state().params)
    assert s["n_params"] == n_real
    assert s["flops_per_token"] == flops_per_token(unpadded.model, n_real, 64)
    assert s["train/loss"] > 0


@pytest.mark.e2e
def test_a_run_compiles_once_whatever_its_length(cfg_factory, tmp_path):
    """Every program (init, step, eval, metrics) compiles in the first steps; more steps,
    log rows and evaluations compile nothing new."""
    base = ["logger=none", "parallelism=dp4_tp2", "model.n_heads=8", "model.n_kv_heads=8",
            "train.log_every=2", "train.eval_every=2", "eval.batches=2",
            "data.batch_size=8", "data.seq_len=16"]  # what is counted is compiles, not steps
    with recorded_compiles() as short:
        train(cfg_factory(*base, "train.steps=4"), tmp_path / "short")
    with recorded_compiles() as compiles:
        train(cfg_factory(*base, "train.steps=12"), tmp_path / "long")
    # Each program of the longer run once (a new run builds its programs anew), and none the
    # short run did not have: its 6 log rows and evaluations add no compile.
    assert {"jit(step)", "jit(init)", "jit(evaluate)"} <= set(short)
    assert sorted(set(compiles)) == sorted(compiles) and set(compiles) <= set(short)


@pytest.mark.e2e
def test_console_shows_off_step_evals_and_a_modified_model(cfg_factory, tmp_path, caplog):
    """An evaluation between log steps reaches the console, and a size made of overrides is
    never logged as the bare preset."""
    import logging

    cfg = cfg_factory("logger=none", "parallelism=dp1", "model.n_layers=1", "model.d_ff=128",
                      "train.steps=4", "train.log_every=4", "train.eval_every=3",
                      "eval.batches=1", "checkpoint.every=0")
    with caplog.at_level(logging.INFO, logger="dxrun"):
        train(cfg, tmp_path)
    lines = [r.getMessage() for r in caplog.records]
    (model,) = [x for x in lines if x.startswith("model ")]
    assert model.startswith("model tiny (modified: n_layers=1, d_ff=128): "), model
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4] and "train/loss" not in rows[0]
    (off_step,) = [x for x in lines if x.startswith("step 3/4")]
    assert off_step == (f"step 3/4  eval {rows[0]['eval/loss']:.4f}  "
                        f"eval acc {rows[0]['eval/accuracy']:.3f}")
    assert any(x.startswith("step 4/4  loss ") and "  eval " in x for x in lines)
