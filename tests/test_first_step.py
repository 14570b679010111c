"""The time to a run's first step: the train step compiled once before it, on an accelerator
too (where an analysis compile is the full one)."""

from __future__ import annotations

import pytest
from conftest import make_cfg, recorded_compiles

from dxrun import step as step_module
from dxrun.prepare import prepare, start_state

# One device, one layer, short sequences: what is counted is compiles, not their size.
SMALL = ("logger=none", "model.n_layers=1", "data.batch_size=4", "data.seq_len=16",
         "parallelism.n_devices=1")


@pytest.mark.parametrize("layout", [
    ("parallelism=dp1",),
    ("parallelism=auto",),  # search=measure: its one candidate's compile is the run's
    ("parallelism=auto", "parallelism.search=model"),  # ranked by the estimate alone
], ids=lambda layout: " ".join(layout))
def test_an_accelerator_run_compiles_its_step_once_before_the_first_step(
        layout, monkeypatch, tmp_path):
    """The memory preflight's compile (or the layout search's) is the executable the first
    step runs: one compile of ``jit(step)`` from the launch to the first step's result. On a
    GPU or TPU an analysis compile has no cheaper options (``step.analysis_options``), so a
    search that ranks from analysis compiles keeps the chosen one for the run instead of
    compiling the same program again."""
    monkeypatch.setattr(step_module, "analysis_options", lambda platform: {})  # a GPU's or TPU's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no earlier decision cached
    cfg = make_cfg(*SMALL, *layout)
    with recorded_compiles() as compiled:
        prepared = prepare(cfg, tmp_path / "run")
        preflight = prepared.exp.step.compiled
        exp = prepared.exp
        state = start_state(exp, prepared.resume, prepared.handover).state
        state, metrics = exp.step(state, exp.batch(0))
        float(metrics["train/loss"])
    assert compiled.count("jit(step)") == 1, compiled
    assert preflight is not None and exp.step.compiled is preflight
    assert exp.step.compile_time_s > 0
