"""The logged rows' numbers from plain numbers: no JAX, no run."""

from __future__ import annotations

import math

import pytest

from dxrun.tracking.goodput import Measured
from dxrun.tracking.summary import best_loss
from dxrun.train import StepCost, first_row, log_row, perf_row, perplexity

COST = StepCost(tokens=1024, flops=8e12, n_devices=8, peak_tflops=2.0)


def test_a_log_row_holds_its_parts_in_order():
    fetched = {"train/loss": 2.0, "train/lr": 1e-3}
    row = log_row(fetched, Measured(4.0, 2, 1.0, False), COST,
                  first_row(3.5, None, 1e6), peak_bytes=None, tokens_seen=4096,
                  entropy_floor=1.5)
    assert row == pytest.approx({
        "train/loss": 2.0, "train/lr": 1e-3, "train/ppl": math.exp(2.0),
        "perf/step_time_s": 2.0, "perf/tokens_per_s": 512.0,
        "perf/tokens_per_s_per_device": 64.0,
        "perf/tflops_per_device": 0.5, "perf/data_wait_frac": 0.25, "perf/mfu": 0.25,
        "perf/compile_time_s": 3.5, "mem/step_bytes_per_device": 1e6,
        "data/tokens_seen": 4096.0, "data/entropy_floor": 1.5})
    assert list(row)[:3] == ["train/loss", "train/lr", "train/ppl"]
    assert list(row)[-2:] == ["data/tokens_seen", "data/entropy_floor"]
    later = log_row(fetched, Measured(4.0, 2, 0.0, False), COST, None, 7e6, 8192, None)
    assert "perf/compile_time_s" not in later and "data/entropy_floor" not in later
    assert later["mem/peak_bytes_per_device"] == 7e6


def test_an_empty_or_traced_window_has_no_rates():
    assert perf_row(Measured(0.0, 0, 0.0, False), COST) == {}
    assert perf_row(Measured(0.0, 0, 0.0, True), COST) == {"perf/profiled": True}
    unknown_peak = StepCost(1024, 8e12, 8, None)
    assert "perf/mfu" not in perf_row(Measured(4.0, 2, 0.0, False), unknown_peak)


def test_the_layout_search_time_is_a_one_off_number():
    assert first_row(1.0, 2.5, None) == {"perf/compile_time_s": 1.0,
                                         "perf/layout_search_s": 2.5}


def test_perplexity_is_capped_and_best_loss_skips_non_finite():
    assert perplexity(1e9) == math.exp(50.0)
    best = None
    for loss in (float("nan"), 3.0, float("inf"), 2.5, 2.7, None):
        best = best_loss(best, loss)
    assert best == 2.5
