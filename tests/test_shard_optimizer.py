"""ZeRO-1 (parallelism.shard_optimizer): the optimizer state split over the data replicas
trains to the same numbers, holds 1/dp of the bytes at any data-parallel size (padded where no
axis divides), and checkpoints across the flag and across data-parallel sizes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import CONF, make_cfg, subprocess_env

from dxrun.autotune import accelerator_memory, collectives, plan_report, plan_table
from dxrun.autotune.footprint import _shard_bytes
from dxrun.checkpointing import Checkpointer, Resume, restore
from dxrun.cost import TARGETS, gb_text
from dxrun.experiment import Experiment, adopt
from dxrun.model import sharding

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
                    f"parallelism.shard_optimizer={str(zero).lower()}",
                    *MESHES.get(mesh, ["optimizer=adamw"]), *extra)


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
    params = jax.device_get(Experiment.build(_cfg(mesh, False)).seeded.params())
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
    per_on, per_off = sharding.bytes_per_device(on), sharding.bytes_per_device(off)
    remainder = sharding.replicated_bytes_over(on)
    assert sharding.replicated_bytes_over(off) == pytest.approx(max(per_off.values()))
    for dev, nbytes in per_on.items():
        assert nbytes == pytest.approx((per_off[dev] - remainder) / 8 + remainder), dev
    # The replicated remainder is only the step counters here: within the goal's 3%.
    assert max(per_on.values()) <= max(per_off.values()) / 8 * 1.03


@pytest.mark.parametrize("mesh, dp", [("dp4_tp2", 4), ("dp2_fsdp2_tp2", 2)])
def test_optimizer_bytes_per_device_are_total_over_dp(mesh, dp):
    """From the shardings alone (nothing compiled): 1/dp of the state without ZeRO-1 on top
    of the tensor and fsdp split, up to what the data axis cannot split."""
    from dxrun.autotune.footprint import _shard_bytes

    on = Experiment.build(_cfg(mesh, True)).abstract_state().opt_state
    off = Experiment.build(_cfg(mesh, False)).abstract_state().opt_state
    remainder = sharding.replicated_bytes_over(on)
    assert _shard_bytes(on) == pytest.approx((_shard_bytes(off) - remainder) / dp + remainder)
    assert _shard_bytes(on) <= _shard_bytes(off) / dp * 1.03


def test_default_follows_data_replicas():
    from dxrun.plan import make_plan

    for mesh, want in (("dp8", True), ("dp1", False), ("tp2", False), ("dp4_tp2", True)):
        cfg = make_cfg("model=tiny", "logger=none", f"parallelism={mesh}")
        assert cfg.parallelism.shard_optimizer is None
        assert make_plan(cfg, 8).shard_optimizer is want, mesh


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
    got = _restored(state, tmp_path, dp8[not saved_with][0])  # in the other layout
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(got)),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise


def test_plan_table_says_the_optimizer_is_split(dp8):
    from omegaconf import OmegaConf


    exp = dp8[True][0]  # its step compiled already: plan mode compiles nothing more
    cfg = OmegaConf.merge(exp.cfg, {"plan": {"target": "h100"}})
    report = plan_report(cfg, exp, suggest=False)
    unsplit = report["opt_state_unsplit_bytes"]
    assert report["shard_optimizer"] is True and 0 < unsplit < 0.03 * report["per_device"][
        "opt_state_bytes"]
    assert f"(split over data; {gb_text(unsplit)} not)" in plan_table(report)


# A data-parallel size that divides none of the tiny model's power-of-two axes: 6 of the 8
# devices, 12 rows a step.
DP6 = ["parallelism.n_devices=6", "data.batch_size=12"]


@pytest.fixture(scope="module")
def dp6() -> dict:
    """The dp8 fixture's pair on dp6: Adam's moments padded from 64 to 66 rows (or 256 to 258)
    to split 6 ways."""
    params = jax.device_get(Experiment.build(_cfg("dp", False, *DP6)).seeded.params())
    out = {}
    for zero in (True, False):
        exp = Experiment.build(_cfg("dp", zero, *DP6))
        exp.step.compiled = exp.analyse_step()
        out[zero] = (exp, *_train(exp, params))
    return out


@pytest.mark.e2e  # trainings with and without the split (module fixture)
def test_dp6_splits_the_state_and_trains_as_unsplit(dp6):
    """No axis divides by 6, yet each device holds a sixth of the state (3% of padding at
    most), none of it replicated but the counters, and the losses, gradient norms and
    parameters are those without ZeRO-1."""
    _check_equal(dp6)
    on, off = dp6[True][1].opt_state, dp6[False][1].opt_state
    assert sharding.replicated_bytes_over(on) <= 2 * 4  # the step counters
    assert max(sharding.bytes_per_device(on).values()) <= max(
        sharding.bytes_per_device(off).values()) / 6 * 1.03
    assert _shard_bytes(dp6[True][0].abstract_state().opt_state) == max(
        sharding.bytes_per_device(on).values())  # what plan mode reads is what the run holds
    for (path, a), b in zip(jax.tree.leaves_with_path(jax.device_get(dp6[True][1].params)),
                            jax.tree.leaves(jax.device_get(dp6[False][1].params)), strict=True):
        name = jax.tree_util.keystr(path)
        if name.endswith("['bk']"):  # zero gradient: Adam's normalised rounding noise
            assert np.abs(a).max() < 1e-6 and np.abs(b).max() < 1e-6, name
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)


def _restored(state, tmp_path, into: Experiment):
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(STEPS, state, {"step": STEPS})
    ckpt.wait()
    ckpt.close()
    got, _, step = restore(Resume(tmp_path, STEPS, in_place=False), into.abstract_state())
    assert step == STEPS
    want = into.abstract_state()
    for have, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert have.shape == w.shape and have.sharding.is_equivalent_to(w.sharding, w.ndim)
    return got


@pytest.mark.e2e  # trainings with and without the split (module fixture)
def test_checkpoint_moves_between_data_parallel_sizes(dp6, tmp_path):
    """A dp6 checkpoint (its moments padded) restores on dp4 (unpadded: 4 divides) and back:
    every real value bitwise, the padding zero; the round trip gives the dp6 state exactly."""
    exp6, state6 = dp6[True][0], dp6[True][1]
    exp4 = Experiment.build(_cfg("dp4", True, "data.batch_size=12"))
    state4 = _restored(state6, tmp_path / "6to4", exp4)
    assert sharding.replicated_bytes_over(state4.opt_state) <= 2 * 4
    want = jax.device_get(state6)
    got = jax.device_get(state4)
    padded = 0
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        real = tuple(slice(0, n) for n in b.shape)
        np.testing.assert_array_equal(a[real], b)  # bitwise
        padded += a.size - b.size
        pad = np.ones(a.shape, bool)
        pad[real] = False
        assert not a[pad].any()  # the rest of the dp6 array is padding: zeros
    assert padded > 0  # dp6 really padded
    back = jax.device_get(_restored(state4, tmp_path / "4to6", exp6))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_optimizer_state_split_48_ways():
    """48 simulated devices (a subprocess: the device count is set before JAX starts), a model
    none of whose axes 48 divides (d_model 1000, d_ff 4000): from the shardings alone, each
    device holds 1/48 of the state without ZeRO-1 (1% of padding), none of it replicated but
    the counters."""
    code = textwrap.dedent(f"""
        import json
        from dxrun.run import simulate_cpu_devices
        simulate_cpu_devices(48)
        from hydra import compose, initialize_config_dir
        from dxrun.model import sharding
        from dxrun.autotune.footprint import _shard_bytes
        from dxrun.config.registry import register
        from dxrun.experiment import Experiment, adopt
        register()
        out = {{}}
        for zero in ("true", "false"):
            with initialize_config_dir(config_dir={str(CONF)!r}, version_base="1.3"):
                cfg = compose(config_name="config", overrides=[
                    "model=tiny", "model.d_model=1000", "model.d_ff=4000", "logger=none",
                    "parallelism=dp", "data.batch_size=48",
                    f"parallelism.shard_optimizer={{zero}}"])
            state = Experiment.build(cfg).abstract_state().opt_state
            out[zero] = [_shard_bytes(state), sharding.replicated_bytes_over(state)]
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (on, on_unsplit), (off, off_unsplit) = out["true"], out["false"]
    assert off_unsplit == off > 48e6 / 48  # without: every device holds it all
    assert on_unsplit <= 2 * 4  # the step counters
    assert off / 48 <= on <= off / 48 * 1.01


@pytest.mark.e2e  # trainings with and without the split (module fixture)
def test_layout_hand_over_refits_the_padding(dp6):
    """parallelism=auto hands a trained state between layouts of the same devices
    (``experiment.adopt``): dp6 pads w_up's moments along d_ff (256 to 258), dp3_tp2, whose
    tensor axis splits d_ff, along d_model (64 to 66). Handed over and back: bitwise."""
    exp6, state6 = dp6[True][0], dp6[True][1]
    exp32 = Experiment.build(_cfg("dp", True, *DP6, "parallelism.dp=3", "parallelism.tp=2"))
    moved = adopt(exp32, state6)
    shapes = {x.shape for x in jax.tree.leaves(moved.opt_state)} - {
        x.shape for x in jax.tree.leaves(state6.opt_state)}
    assert (2, 66, 256) in shapes  # another padding really
    back = adopt(exp6, moved)
    for a, b in zip(jax.tree.leaves(jax.device_get(state6)), jax.tree.leaves(jax.device_get(back)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
