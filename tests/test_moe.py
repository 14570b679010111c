"""Mixture of experts (dxrun/model/moe.py, the model.moe keys, the expert mesh axis): the router
and the dispatch against a written-out loop, the capacity's drops counted, the scan against the
loop, the refusals, and whole trainings on every preset with an expert axis against dp1."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_in_process, make_cfg, stepped, subprocess_env
from flax import nnx

from dxrun.checks import validate
from dxrun.config import ConfigError, moe_layers
from dxrun.experiment import Experiment
from dxrun.model import moe, router_losses
from dxrun.model.user_model import build_model
from dxrun.plan import make_plan
from dxrun.train import train

# Every preset with an expert axis, and the expert axis beside the context axis (no preset).
LAYOUTS = {name: [f"parallelism={name}"] for name in ("ep8", "dp2_ep4", "fsdp2_ep4",
                                                      "dp2_ep2_tp2")}
LAYOUTS["dp2_ep2_cp2"] = ["parallelism.dp=2", "parallelism.ep=2", "parallelism.cp=2"]
STEPS = 12
# 8 x 16 tokens a step, fp32, as tests/test_sharding.py's mesh equivalence
BASE = ["model=moe_tiny", "logger=none", "train.precision=fp32", "optimizer.warmup_steps=2",
        "data.batch_size=8", "data.seq_len=16", "data.vocab_size=64"]


def _weights(rng: np.random.Generator, N: int, D: int, F: int) -> tuple:
    return tuple(jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)
                 for s in ((N, D, F), (N, D, F), (N, F, D)))


def _loop(x_TxD, idx_TxK, gate_TxK, w_up, w_gate, w_down) -> np.ndarray:
    """The routed MLPs written out: each token, each of its experts, one at a time."""
    x, out = np.asarray(x_TxD), np.zeros(x_TxD.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx_TxK.shape[1]):
            e = int(idx_TxK[t, j])
            if e < 0:
                continue
            g, u = x[t] @ np.asarray(w_gate[e]), x[t] @ np.asarray(w_up[e])
            h = g / (1 + np.exp(-g)) * u
            out[t] += float(gate_TxK[t, j]) * (h @ np.asarray(w_down[e]))
    return out


@pytest.mark.parametrize("first, n", [(0, 6), (2, 3)])
def test_dropless_dispatch_is_the_loop_over_the_chosen_experts(first, n):
    """``expert_mlp`` over experts ``first .. first + n - 1`` (one expert device's): the loop
    over each token's chosen experts among them; the rest, and dropped (-1) ones, add nothing."""
    rng = np.random.default_rng(0)
    T, K, D, F = 24, 2, 8, 12
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(6, K, replace=False) for _ in range(T)]), jnp.int32)
    idx = idx.at[3, 1].set(-1)  # a dropped assignment
    gate = jnp.asarray(rng.uniform(size=(T, K)), jnp.float32)
    w_up, w_gate, w_down = _weights(rng, n, D, F)
    got = moe.expert_mlp(x, idx, gate, w_up, w_gate, w_down, first)
    mine = jnp.where((idx >= first) & (idx < first + n), idx - first, -1)
    np.testing.assert_allclose(got, _loop(x, mine, gate, w_up, w_gate, w_down), rtol=2e-5,
                               atol=2e-6)


def test_softmax_router_weights_and_balanced_statistics():
    # token t prefers expert t % 4, then (t + 1) % 4: the load is exactly uniform
    T, N = 16, 4
    eye = np.eye(N)
    logits = jnp.asarray(eye[np.arange(T) % N] * 2.0 + eye[(np.arange(T) + 1) % N],
                         jnp.float32)[None]
    idx, gate, stats = moe.route(logits, 2, "softmax", renormalize=True)
    np.testing.assert_allclose(gate.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.asarray(idx[0, :, 0]) == np.arange(T) % N)
    raw = moe.route(logits, 2, "softmax", renormalize=False)[1]
    total = np.exp(2.0) + np.exp(1.0) + 2
    p = np.exp(2.0) / total  # the top probability, unrenormalised (Qwen2-MoE)
    np.testing.assert_allclose(raw[0, :, 0], p, rtol=1e-6)
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(stats["load_N"], [T * 2 / N] * N)
    # uniform load and uniform mean probability: the balancing loss is exactly 1
    np.testing.assert_allclose(stats["aux_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["z_loss"], np.log(total) ** 2, rtol=1e-6)


def test_sigmoid_router_bias_picks_but_never_weighs():
    logits = jnp.asarray([[[0.0, 1.0, 2.0, 3.0]]], jnp.float32)
    bias = jnp.asarray([5.0, 0.0, 0.0, 0.0], jnp.float32)
    idx, gate, _ = moe.route(logits, 2, "sigmoid", renormalize=False, bias_N=bias, scale=2.5)
    assert sorted(np.asarray(idx[0, 0]).tolist()) == [0, 3]
    s = 1 / (1 + np.exp(-np.asarray([0.0, 3.0])))
    np.testing.assert_allclose(sorted(np.asarray(gate[0, 0])), sorted(2.5 * s), rtol=1e-6)


def test_capacity_drops_are_counted():
    """8 tokens all choose experts 0 then 1 of 4: capacity ceil(0.5 x 8 x 2 / 4) = 2 per expert,
    so each of the two experts keeps its first 2 and 12 of the 16 assignments are dropped."""
    logits = jnp.tile(jnp.asarray([3.0, 2.0, 0.0, 0.0]), (1, 8, 1))
    idx, _, stats = moe.route(logits, 2, "softmax", True, capacity_factor=0.5)
    assert np.asarray(idx[0, :2]).tolist() == [[0, 1], [0, 1]]
    assert np.all(np.asarray(idx[0, 2:]) == -1)
    assert float(stats["dropped"]) == pytest.approx(12 / 16)
    np.testing.assert_allclose(stats["load_N"], [2, 2, 0, 0])


def _model(*overrides: str):
    cfg = make_cfg("model=moe_tiny", "model.n_layers=5", "model.moe.first_dense=1",
                   "model.moe.every=2", "model.moe.shared_d_ff=32", "model.moe.shared_gate=true",
                   *overrides)
    return cfg, build_model(cfg.model, nnx.Rngs(0))


def test_layers_in_groups_scan_as_they_loop():
    """5 layers, one dense then two groups of (dense, MoE): the scanned and the looped stacks
    compute the same logits and the same statistics; the loss gains the penalties."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 16)), jnp.int32)
    out = {}
    for scan in (True, False):
        cfg, model = _model(f"model.scan_layers={str(scan).lower()}")
        assert moe_layers(5, cfg.model.moe) == (False, False, True, False, True)
        with router_losses.router_statistics() as found:
            logits = model(tokens)
        out[scan] = (logits, found)
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    loss, metrics = router_losses.with_router_losses(jnp.float32(2.0), {}, out[True][1])
    aux, z = float(metrics["moe/aux_loss"]), float(metrics["moe/z_loss"])
    assert float(loss) == pytest.approx(2.0 + 0.01 * aux + 0.001 * z, rel=1e-6)
    assert metrics["moe/load_max"] >= 1.0 >= metrics["moe/load_min"] >= 0.0
    assert jax.tree.map(np.shape, out[True][1][0])["load_N"] == (2, 8)  # 2 MoE layers x 8


@pytest.mark.parametrize("overrides, needle", [
    (["model.moe.top_k=9"], "model.moe.top_k=9 is more than model.moe.n_experts=8; set"),
    (["model.moe.every=3"], "model.moe.every=3 does not divide the 2 layers after"),
    (["model.moe.shared_gate=true"], "model.moe.shared_gate=true gates a shared expert"),
    (["model.moe.bias_rate=0.001"], "model.moe.bias_rate=0.001 moves the sigmoid router's"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor=0.0 is outside its range > 0; set"),
])
def test_malformed_moe_keys_are_refused(overrides, needle):
    with pytest.raises(ConfigError) as err:
        validate(make_cfg("model=moe_tiny", *overrides))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (["model=moe_tiny", "model.moe.n_experts=6", "parallelism=dp2_ep4"],
     "model.moe.n_experts=6 is not divisible by parallelism.ep=4; pick an ep that divides 6"),
    (["model=tiny_llama", "parallelism=ep8"],
     "parallelism.ep=8 splits the experts, but model.moe.n_experts=0"),
])
def test_the_expert_axis_must_divide_the_experts(overrides, needle):
    with pytest.raises(ConfigError) as err:
        make_plan(make_cfg(*overrides), 8, "cpu")
    assert str(err.value).startswith(needle) and "\n" not in str(err.value), str(err.value)


def test_a_refusal_is_one_line_and_exit_2(tmp_path):
    proc = cli_in_process("model=moe_tiny", "model.moe.top_k=9", "logger=none", cwd=tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert any("model.moe.top_k=9 is more than" in x for x in lines), proc.stderr


def test_the_layout_search_tries_the_expert_axis_only_for_experts():
    from dxrun.cost import candidates
    dense, _ = candidates(make_cfg("parallelism=auto"), 8, "cpu")
    assert {x.ep for x in dense} == {1}
    sparse, _ = candidates(make_cfg("model=moe_tiny", "parallelism=auto"), 8, "cpu")
    assert {x.ep for x in sparse} == {1, 2, 4, 8}
    plan = make_plan(make_cfg("model=moe_tiny", "parallelism=dp2_ep4"), 8, "cpu")
    assert (plan.replicas, plan.per_device_batch, plan.ep) == (8, 4, 4)
    assert plan.rules["batch"] == ("data", "fsdp", "expert")


def _losses(exp: Experiment, params) -> tuple[list[float], dict]:
    rows = stepped(exp, params, STEPS)[1]
    return [float(r["train/loss"]) for r in rows], rows[-1]


@pytest.fixture(scope="module")
def dp1_run():
    exp = Experiment.build(make_cfg(*BASE, "parallelism=dp1"))
    params = jax.device_get(exp.seeded.params())
    return params, _losses(exp, params)


@pytest.mark.e2e  # six 12-step trainings (one compile each)
@pytest.mark.parametrize("preset", LAYOUTS)
def test_every_expert_preset_trains_as_dp1(dp1_run, preset):
    """Dropless, fp32: the same 12 losses as dp1 within 1e-5, and the same MoE statistics."""
    params, (ref, ref_row) = dp1_run
    exp = Experiment.build(make_cfg(*BASE, *LAYOUTS[preset]))
    expert = exp.param_shardings["moe_blocks"]["mlp"]["w_up"].spec
    assert expert[1] == "expert"  # [layers, experts, D, F]: the experts split over `expert`
    losses, row = _losses(exp, params)
    assert ref[-1] < ref[0] - 0.3  # it trains
    np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=preset)
    for name in ("moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/load_min"):
        np.testing.assert_allclose(row[name], ref_row[name], rtol=1e-4, err_msg=name)
    assert float(row["moe/dropped"]) == 0.0


def _rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                      .splitlines())}


@pytest.mark.e2e  # four 12-step trainings in process
def test_an_expert_parallel_run_resumes_exactly_and_reshards_onto_dp8(tmp_path):
    """A dp2_ep4 run stopped after step 6 and resumed is bitwise the run that never stopped; its
    step-6 checkpoint, read into dp8's shards (the experts whole on every device), goes on as
    the dp2_ep4 run does, within 1e-5. A constant lr: the schedule follows train.steps."""
    run = [*BASE, "train.steps=12", "train.log_every=2", "train.eval_every=0",
           "checkpoint.every=6", "optimizer.schedule=constant", "optimizer.warmup_steps=0"]
    train(make_cfg(*run, "parallelism=dp2_ep4"), tmp_path / "straight")
    train(make_cfg(*run, "parallelism=dp2_ep4", "train.steps=6"), tmp_path / "split")
    train(make_cfg(*run, "parallelism=dp2_ep4"), tmp_path / "split")  # resumes from step 6
    straight, split = _rows(tmp_path / "straight"), _rows(tmp_path / "split")
    assert sorted(split) == [2, 4, 6, 8, 10, 12]
    for step in (8, 10, 12):
        for name in ("train/loss", "train/grad_norm", "moe/aux_loss", "moe/load_max"):
            assert split[step][name] == straight[step][name], (step, name)
    train(make_cfg(*run, "parallelism=dp8",
                   f"checkpoint.resume={tmp_path / 'straight' / 'checkpoints' / '6'}"),
          tmp_path / "dp8")
    moved = _rows(tmp_path / "dp8")
    assert sorted(moved) == [8, 10, 12]
    np.testing.assert_allclose([moved[s]["train/loss"] for s in (8, 10, 12)],
                               [straight[s]["train/loss"] for s in (8, 10, 12)], rtol=1e-5)


@pytest.mark.e2e  # the default run's 600 steps (a few minutes on 2 cores)
def test_moe_tiny_learns_the_markov_data_to_its_floor(tmp_path):
    """``python -m dxrun model=moe_tiny`` on the default 8 simulated devices ends within 0.05
    of the markov data's entropy floor, its rows carrying the MoE metrics."""
    proc = subprocess.run([sys.executable, "-m", "dxrun", "model=moe_tiny", "logger=none",
                           "hydra.run.dir=run"], cwd=tmp_path,
                          env=subprocess_env(optimised=True), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    floor = summary["entropy_floor"]
    assert summary["train/loss"] - floor < 0.05 and summary["eval/loss"] - floor < 0.05, summary
    last = _rows(tmp_path / "run")[600]
    assert last["moe/dropped"] == 0.0 and 0.5 < last["moe/aux_loss"] < 2.0
    assert last["moe/load_max"] >= 1.0 >= last["moe/load_min"]


def test_flops_count_the_active_parameters():
    """MFU's FLOPs count each token's experts only: an 8-expert top-2 model's active parameters
    are a 2-expert model's plus the wider router (every expert's logit is computed)."""
    from dxrun.cost import active_params, flops_per_token
    from dxrun.model.transformer import count_params

    def n(*overrides: str) -> tuple:
        cfg, model = _model(*overrides)
        return cfg.model, count_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    m8, n8 = n()
    m2, n2 = n("model.moe.n_experts=2")
    D, moe_layers = m8.d_model, 2
    assert active_params(m8, n8) == n2 + moe_layers * D * (8 - 2) < n8
    assert active_params(m2, n2) == n2
    assert flops_per_token(m8, n8, 16) == flops_per_token(m2, n2, 16) + 6 * moe_layers * D * 6


@pytest.mark.parametrize("preset, total, active", [
    ("mixtral_8x7b", 46_702_792_704, 12_879_925_248),
    ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704),
])
def test_the_published_moe_shapes(preset, total, active):
    """The presets have their published models' parameters (their config.json, counted as
    transformers counts them), all of them and a token's, without building a weight."""
    from dxrun.cost import active_params
    from dxrun.model.sharding import param_axes
    from dxrun.model.transformer import count_params

    cfg = make_cfg(f"model={preset}")
    validate(cfg)
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0))), nnx.Param)
    n = count_params(nnx.to_pure_dict(state), param_axes(state), cfg.model.vocab_size)
    assert (n, active_params(cfg.model, n)) == (total, active)


@pytest.mark.e2e  # three training steps on dp2_ep4
def test_the_sigmoid_routers_bias_moves_towards_the_mean_load():
    """model.moe.bias_rate (DeepSeek-V3): after each update every layer's bias moves by the rate
    up for an expert under the mean load and down for one over it, outside the gradient, and
    the step's rows do not carry the step."""
    cfg = make_cfg(*BASE, "parallelism=dp2_ep4", "model.moe.router=sigmoid",
                   "model.moe.bias_rate=0.01", "model.moe.aux_loss=0")
    exp = Experiment.build(cfg)
    state, rows = stepped(exp, exp.seeded.params(), 3)
    m = rows[-1]
    assert router_losses.BIAS_STEP not in m and "moe/load_max" in m
    bias = np.asarray(jax.device_get(state.params["moe_blocks"]["mlp"]["bias"]))
    assert bias.shape == (2, 8) and np.any(bias != 0)
    steps = np.round(bias / 0.01)
    np.testing.assert_allclose(bias, steps * 0.01, atol=1e-6)  # whole steps of the rate
    assert np.all(np.abs(steps) <= 3)


@pytest.mark.e2e  # two short trainings
def test_micro_batches_on_expert_parallel_replicas():
    """train.grad_accum=2 on dp2_ep4: each micro-batch's gradient reduced over the replicas (the
    grouped matmuls cannot run under the per-replica vmap): dp1's losses, the balancing and z
    losses off (their statistics are taken per micro-batch, so they would differ)."""
    base = [*BASE, "data.batch_size=16", "model.moe.aux_loss=0", "model.moe.z_loss=0"]
    ref = Experiment.build(make_cfg(*base, "parallelism=dp1"))
    params = jax.device_get(ref.seeded.params())
    want = _losses(ref, params)[0]
    got = _losses(Experiment.build(make_cfg(*base, "parallelism=dp2_ep4", "train.grad_accum=2")),
                  params)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_plan_modes_model_row_says_the_experts_and_the_active_parameters():
    from dxrun.estimates import shape_line

    line = shape_line(make_cfg("model=mixtral_8x7b").model, 46_702_792_704)
    assert "32 MoE layers of 8 experts (d_ff 14336, top 2)" in line
    assert line.endswith("46,702,792,704 parameters, 12,879,925,248 active")
    assert "active" not in shape_line(make_cfg("model=small").model, 124_475_904)


def test_the_time_model_counts_a_tokens_experts():
    """Plan mode's matmuls count each token's experts: Mixtral's MLP is two of its experts wide
    (28,672); an MoE layer every other one averages with the dense layers' width."""
    from dxrun.cost import active_d_ff

    assert active_d_ff(make_cfg("model=mixtral_8x7b").model) == 2 * 14336
    assert active_d_ff(make_cfg("model=small").model) == 3072
    m = make_cfg("model=moe_tiny", "model.n_layers=4", "model.moe.every=2",
                 "model.moe.shared_d_ff=32").model
    assert active_d_ff(m) == (2 * 128 + 2 * (2 * 64 + 32)) / 4
