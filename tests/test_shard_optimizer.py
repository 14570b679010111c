"""ZeRO-1 (parallelism.shard_optimizer): the optimizer state split over the data replicas
trains to the same numbers, holds 1/dp of the bytes, and checkpoints across the flag."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import make_cfg

from dxrun import plan_mode
from dxrun import sharding as shd
from dxrun.autotune.fit import accelerator_memory
from dxrun.autotune.hlo import collectives
from dxrun.checkpointing.resume import Resume, restore
from dxrun.checkpointing.store import Checkpointer
from dxrun.experiment import Experiment
from dxrun.plan import targets
from dxrun.plan.targets import TARGETS

STEPS = 3
# One optimizer per mesh: Adam's moments, Lion's momentum, SGD's momentum. A clip_norm far
# below the gradients' norm (~2.7) so every update is clipped: equal losses need the global norm.
MESHES = {"dp8": ["optimizer=adamw"], "dp4_tp2": ["optimizer=lion", "optimizer.lr=1e-3"],
          "dp2_fsdp2_tp2": ["optimizer=sgd", "optimizer.momentum=0.9"]}


def _cfg(mesh: str, zero: bool, *extra: str):
    # 64 output classes for 16 symbols: a few clipped sgd steps visibly lower the loss.
    return make_cfg("model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "logger=none",
                    "data.vocab_size=64",
                    "train.precision=fp32", "optimizer.clip_norm=0.05", f"parallelism={mesh}",
                    f"parallelism.shard_optimizer={str(zero).lower()}", *MESHES[mesh], *extra)


def _train(exp: Experiment, params) -> tuple:
    state = exp.init_state(params)
    metrics = []
    for i in range(STEPS):
        state, m = exp.step(state, exp.batch(i))
        metrics.append(m)
    metrics = jax.device_get(metrics)
    return state, [float(m["train/loss"]) for m in metrics], [float(m["train/grad_norm"])
                                                              for m in metrics]


def _pair(mesh: str) -> dict:
    """Both settings on ``mesh`` trained from the same parameters: {zero: (exp, state, losses,
    grad norms)}."""
    params = jax.device_get(Experiment.build(_cfg(mesh, False)).init_params())
    out = {}
    for zero in (True, False):
        exp = Experiment.build(_cfg(mesh, zero))
        # Compiled with LLVM's optimisation off (analyse_step's options) and run: the same
        # HLO and buffer assignment as the run's compile (tests/test_plan_mode.py), only
        # cheaper CPU code generation; both settings alike.
        exp.step.compiled = exp.analyse_step()
        out[zero] = (exp, *_train(exp, params))
    return out


@pytest.fixture(scope="module")
def dp8() -> dict:
    """The dp8 pair every test below shares (one compile per setting)."""
    return _pair("dp8")


def _check_equal(pair: dict) -> None:
    _, _, on_loss, on_norm = pair[True]
    _, _, off_loss, off_norm = pair[False]
    assert on_loss[-1] < on_loss[0]  # it trains
    np.testing.assert_allclose(on_loss, off_loss, rtol=1e-6)
    # The clip saw the global norm (every update clipped: the norm is far above clip_norm).
    np.testing.assert_allclose(on_norm, off_norm, rtol=1e-6)
    assert min(on_norm) > 0.05 * 10


def test_losses_equal_with_and_without_on_dp8(dp8):
    _check_equal(dp8)


@pytest.mark.e2e  # two more compiled pairs: tensor and fsdp axes beside data
@pytest.mark.parametrize("mesh", ["dp4_tp2", "dp2_fsdp2_tp2"])
def test_losses_equal_with_and_without_on_mixed_meshes(mesh):
    _check_equal(_pair(mesh))


def test_optimizer_bytes_per_device_on_dp8(dp8):
    """Measured from the live arrays' shards: with ZeRO-1 each device holds 1/8 of what it
    holds without, except the tensors with no axis the data axis divides (and counters)."""
    on, off = dp8[True][1].opt_state, dp8[False][1].opt_state
    per_on, per_off = shd.bytes_per_device(on), shd.bytes_per_device(off)
    remainder = shd.replicated_bytes_over(on)
    assert shd.replicated_bytes_over(off) == pytest.approx(max(per_off.values()))
    for dev, nbytes in per_on.items():
        assert nbytes == pytest.approx((per_off[dev] - remainder) / 8 + remainder), dev
    # The replicated remainder is only the step counters here: within the goal's 3%.
    assert max(per_on.values()) <= max(per_off.values()) / 8 * 1.03


@pytest.mark.parametrize("mesh, dp", [("dp4_tp2", 4), ("dp2_fsdp2_tp2", 2)])
def test_optimizer_bytes_per_device_are_total_over_dp(mesh, dp):
    """From the shardings alone (nothing compiled): 1/dp of the state without ZeRO-1 on top
    of the tensor and fsdp split, up to what the data axis cannot split."""
    from dxrun.autotune.fit import _shard_bytes

    on = Experiment.build(_cfg(mesh, True)).abstract_state().opt_state
    off = Experiment.build(_cfg(mesh, False)).abstract_state().opt_state
    remainder = shd.replicated_bytes_over(on)
    assert _shard_bytes(on) == pytest.approx((_shard_bytes(off) - remainder) / dp + remainder)
    assert _shard_bytes(on) <= _shard_bytes(off) / dp * 1.03


def test_default_follows_data_replicas():
    from dxrun.plan.mesh import make_plan, shard_optimizer

    for mesh, want in (("dp8", True), ("dp1", False), ("tp2", False), ("dp4_tp2", True)):
        cfg = make_cfg("model=tiny", "logger=none", f"parallelism={mesh}")
        assert cfg.parallelism.shard_optimizer is None
        assert shard_optimizer(cfg.parallelism, make_plan(cfg, 8)) is want, mesh


def test_plan_mode_optimizer_bytes_follow_the_flag():
    for mesh, dp in (("dp8", 8), ("dp4_tp2", 4)):
        on = accelerator_memory(Experiment.build(_cfg(mesh, True)), TARGETS["h100"])
        off = accelerator_memory(Experiment.build(_cfg(mesh, False)), TARGETS["h100"])
        assert on.opt_state_bytes <= off.opt_state_bytes / dp * 1.03
        assert on.params_bytes == off.params_bytes
        assert on.total_bytes == pytest.approx(
            off.total_bytes - off.opt_state_bytes + on.opt_state_bytes)


def test_update_runs_on_shards_in_the_hlo(dp8):
    """dp8 without ZeRO-1: parameters are replicated, nothing is gathered. With it, each
    replica updates its shard and the parameters are all-gathered after the update."""
    on = collectives(dp8[True][0].step.compiled.as_text())
    off = collectives(dp8[False][0].step.compiled.as_text())
    assert off["all-gather"] == 0 and on["all-gather"] > 0


@pytest.mark.parametrize("saved_with", [True, False])
def test_checkpoint_restores_across_the_flag(dp8, tmp_path, saved_with):
    _, state, _, _ = dp8[saved_with]
    exp_into = dp8[not saved_with][0]
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(STEPS, state, {"step": STEPS})
    ckpt.wait()
    ckpt.close()
    got, _, step = restore(Resume(tmp_path, STEPS, in_place=False), exp_into.abstract_state())
    assert step == STEPS
    want_shardings = jax.tree.leaves(exp_into.state_shardings.opt_state)
    for have, sharding in zip(jax.tree.leaves(got.opt_state), want_shardings, strict=True):
        assert have.sharding.is_equivalent_to(sharding, have.ndim)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(got)),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise


def test_plan_table_says_the_optimizer_is_split(dp8):
    from omegaconf import OmegaConf


    exp = dp8[True][0]  # its step compiled already: plan mode compiles nothing more
    cfg = OmegaConf.merge(exp.cfg, {"plan": {"target": "h100"}})
    report = plan_mode.plan_report(cfg, exp, suggest=False)
    unsplit = report["opt_state_unsplit_bytes"]
    assert report["shard_optimizer"] is True and 0 < unsplit < 0.03 * report["per_device"][
        "opt_state_bytes"]
    assert f"(split over data; {targets.gb_text(unsplit)} not)" in plan_mode.plan_table(report)
