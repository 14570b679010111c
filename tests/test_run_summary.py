"""The run's summary from rows fed by hand: no JAX, no run."""

from __future__ import annotations

from dxrun.tracking.summary import RunSummary

FIGURES = dict(steps=20, n_params=1000, flops_per_token=6e3, loop_tokens_per_s=50.0,
               compile_time_s=1.5, entropy_floor=None, device_kind="cpu", peak_tflops=None,
               checkpoint_saves=2, checkpoint_block_s=0.25)


def test_last_values_and_best_loss_carry_over_kept_rows():
    kept = [{"step": 5, "train/loss": 3.0, "perf/tokens_per_s": 10.0},
            {"step": 10, "train/loss": None}]  # a non-finite loss, written as null
    summary = RunSummary(kept)
    assert summary.logged and summary.best_loss == 3.0
    summary.add({"train/loss": 2.0, "perf/tokens_per_s": 40.0})
    summary.add({"eval/loss": 2.2})  # an evaluation off the log steps
    summary.add({"train/loss": 2.4})
    attempt = {"wall_s": 9.0, "goodput": 0.5}
    out = summary.record(**FIGURES, goodput_total={"goodput": 0.4, "attempts": 2},
                         attempt=attempt)
    assert out == {"step": 20, "train/loss": 2.4, "perf/tokens_per_s": 40.0, "eval/loss": 2.2,
                   "best/train_loss": 2.0, **{k: v for k, v in FIGURES.items() if k != "steps"},
                   "tokens_per_s": 40.0, "goodput": 0.4,
                   "goodput_s": attempt, "attempts": 2}
    assert list(out)[:2] == ["step", "train/loss"]


def test_a_fresh_run_has_logged_nothing():
    summary = RunSummary()
    assert not summary.logged and summary.best_loss is None
    out = summary.record(**FIGURES, goodput_total={"goodput": 0.0, "attempts": 1}, attempt={})
    assert out["train/loss"] is None and out["tokens_per_s"] is None
