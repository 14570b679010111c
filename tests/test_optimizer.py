"""Schedules, the batch-size lr scaling rule and the weight-decay mask."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dxrun.checks import config_warnings
from dxrun.experiment import decay_mask, make_schedule
from dxrun.plan import scaled_lr


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_rules(cfg_factory, rule, factor):
    opt = cfg_factory(f"optimizer.lr_scaling={rule}", "optimizer.base_batch_size=32").optimizer
    assert scaled_lr(opt, 128) == pytest.approx(opt.lr * factor)


def test_schedules(cfg_factory):
    opt = cfg_factory("optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1").optimizer
    cos = make_schedule(opt, 1.0, 100)
    assert float(cos(0)) == 0 and float(cos(10)) == pytest.approx(1.0)
    assert float(cos(100)) == pytest.approx(0.1)
    opt.schedule = "wsd"
    opt.decay_frac = 0.2
    wsd = make_schedule(opt, 1.0, 100)
    assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(80)) == pytest.approx(1.0)
    assert float(wsd(90)) == pytest.approx(0.55) and float(wsd(100)) == pytest.approx(0.1)
    opt.schedule = "constant"
    const = make_schedule(opt, 1.0, 100)
    assert float(const(5)) == pytest.approx(0.5) and float(const(99)) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["warmup_cosine", "constant", "wsd"])
def test_a_warmup_longer_than_the_run_is_cut_to_it_and_the_warning_says_so(cfg_factory,
                                                                            schedule):
    """``model=small train.steps=6`` (warmup 200): the lr the steps use (count 0..5) climbs
    linearly over the 6 steps to 5/6 of the peak, and the one warning says exactly that."""
    cfg = cfg_factory("model=small", "train.steps=6", f"optimizer.schedule={schedule}")
    assert cfg.optimizer.warmup_steps == 200
    lr = make_schedule(cfg.optimizer, 6e-4, 6)
    used = [float(lr(count)) for count in range(6)]
    assert used == pytest.approx([6e-4 * k / 6 for k in range(6)])
    (warning,) = config_warnings(cfg)
    assert ("optimizer.warmup_steps=200 >= train.steps=6: the warmup is cut to the run's 6 "
            "steps, so the learning rate climbs for the whole run and its last step uses 5/6 "
            "of optimizer.lr") in warning


def test_decay_mask_skips_norms_biases_embeddings():
    params = {"wte": np.zeros((4, 2)), "wpe": np.zeros((3, 2)), "lm_head": np.zeros((2, 4)),
              "blocks": {0: {"attn": {"wq": np.zeros((2, 1, 2)), "bq": np.zeros((1, 2))},
                             "ln1": {"scale": np.zeros(2), "bias": np.zeros(2)}}}}
    mask = decay_mask(params, decay_all=False)
    assert mask["lm_head"] and mask["blocks"][0]["attn"]["wq"]
    assert not any([mask["wte"], mask["wpe"], mask["blocks"][0]["ln1"]["scale"],
                    mask["blocks"][0]["ln1"]["bias"]])
    assert not mask["blocks"][0]["attn"]["bq"]  # a 2-D (heads x head_dim) bias
    assert all(jax.tree.leaves(decay_mask(params, decay_all=True)))
