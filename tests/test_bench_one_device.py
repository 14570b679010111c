"""The one-device benchmark's hand-written step (``benchmarks/one_device.py``) trains the same
model as dxrun's step: the same losses from the same init, two steps running."""

from __future__ import annotations

import pytest

from benchmarks import one_device
from benchmarks.speed import compose_cfg
from dxrun.experiment import Experiment


@pytest.mark.e2e  # two trainings, step for step
def test_nanogpt_step_trains_dxruns_model_step_for_step():
    exp = Experiment.build(compose_cfg("model=tiny", "data.seq_len=32", "data.batch_size=8",
                                       "data.vocab_size=64", "parallelism=dp1"))
    runs = one_device.runners(exp)
    for _ in range(2):  # the second loss follows the first update: the optimizers agree
        losses = {name: float(run()) for name, run in runs.items()}
        assert losses["nanogpt"] == pytest.approx(losses["dxrun"], rel=2e-5)
        assert losses["reference"] == pytest.approx(losses["dxrun"], rel=2e-5)
