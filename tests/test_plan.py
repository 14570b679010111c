"""The mesh plan is a pure function: presets, inference, shrinking and every refusal."""

from __future__ import annotations

import pytest

from dxrun.checks import validate
from dxrun.config.errors import ConfigError
from dxrun.plan import RunPlan, make_plan, resolved_config

PRESETS = {
    "auto": (8, 1, 1, 1, 1), "dp": (8, 1, 1, 1, 1), "dp1": (1, 1, 1, 1, 1), "dp2": (2, 1, 1, 1, 1),
    "dp4": (4, 1, 1, 1, 1), "dp8": (8, 1, 1, 1, 1),
    "tp2": (1, 1, 1, 1, 2), "tp4": (1, 1, 1, 1, 4), "tp8": (1, 1, 1, 1, 8), "dp4_tp2": (4, 1, 1, 1, 2),
    "dp2_tp4": (2, 1, 1, 1, 4), "fsdp8": (1, 8, 1, 1, 1), "dp2_fsdp2_tp2": (2, 2, 1, 1, 2),
    "dp2_cp4": (2, 1, 1, 4, 1), "cp2_tp4": (1, 1, 1, 2, 4), "fsdp2_cp2_tp2": (1, 2, 1, 2, 2),
}


# The presets with a model axis infer data parallelism (dp=-1, n_devices=0): their name is their
# 8-device layout, and on more devices (2 nodes x 8 GPUs) they add data replicas.
ON_16 = {"dp4_tp2": (8, 1, 1, 1, 2), "dp2_tp4": (4, 1, 1, 1, 4), "dp2_fsdp2_tp2": (4, 2, 1, 1, 2),
         "fsdp8": (2, 8, 1, 1, 1), "tp8": (2, 1, 1, 1, 8), "auto": (16, 1, 1, 1, 1),
         "dp2_cp4": (4, 1, 1, 4, 1), "cp2_tp4": (2, 1, 1, 2, 4), "fsdp2_cp2_tp2": (2, 2, 1, 2, 2)}


def test_model_axis_presets_add_data_replicas_on_more_devices(cfg_factory):
    for preset, shape in ON_16.items():
        cfg = cfg_factory(f"parallelism={preset}", "model.n_heads=8", "model.n_kv_heads=8",
                          "data.batch_size=16")
        assert make_plan(cfg, 16).shape == shape, preset
    # On 4 devices dp4_tp2 is 2 replicas of the same 2-way tensor-parallel model.
    assert make_plan(cfg_factory("parallelism=dp4_tp2"), 4).shape == (2, 1, 1, 1, 2)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_resolves_on_8_devices(cfg_factory, preset):
    cfg = cfg_factory(f"parallelism={preset}", "model.n_heads=8", "model.n_kv_heads=8")
    plan = make_plan(cfg, 8)
    assert plan.shape == PRESETS[preset]
    assert plan.device_ids == tuple(range(plan.n_devices))
    assert plan.per_device_batch * plan.dp * plan.fsdp == cfg.data.batch_size
    assert plan.to_json()["mesh_shape"] == list(PRESETS[preset])


def test_one_axis_inferred(cfg_factory):
    plan = make_plan(cfg_factory("parallelism.dp=-1", "parallelism.tp=2"), 8)
    assert plan.shape == (4, 1, 1, 1, 2)
    plan = make_plan(cfg_factory("parallelism.dp=2", "parallelism.fsdp=-1"), 8)
    assert plan.shape == (2, 4, 1, 1, 1)


def test_n_devices_takes_the_first_k(cfg_factory):
    plan = make_plan(cfg_factory("parallelism=auto", "parallelism.n_devices=4"), 8)
    assert plan.shape == (4, 1, 1, 1, 1) and plan.device_ids == (0, 1, 2, 3)


def test_shrink_uses_largest_mesh_that_fits_and_warns(cfg_factory):
    cfg = cfg_factory("parallelism=dp4_tp2", "parallelism.dp=4", "parallelism.n_devices=4",
                      "parallelism.on_mismatch=shrink")
    plan = make_plan(cfg, 8)
    assert plan.shape == (2, 1, 1, 1, 2)
    assert plan.warnings and "dp=2 fsdp=1 tp=2" in plan.warnings[0]


@pytest.mark.parametrize("overrides, needles", [
    (["parallelism.n_devices=16"], ["parallelism.n_devices=16", "8", "runtime.cpu_devices"]),
    # dp4_tp2 infers dp (2 on 4 devices); a fixed dp that does not fit is the mismatch.
    (["parallelism=dp4_tp2", "parallelism.dp=4", "parallelism.n_devices=4"],
     ["4*1*2", "on_mismatch=shrink"]),
    (["data.batch_size=30"], ["data.batch_size=30", "dp*fsdp=8", "multiple of 8"]),
    (["parallelism=tp8"], ["model.n_heads=4", "parallelism.tp=8"]),
    (["parallelism=tp2", "model=tiny_llama", "model.n_kv_heads=1"],
     ["model.n_kv_heads=1", "parallelism.tp=2"]),
    (["parallelism.dp=-1", "parallelism.tp=-1"], ["parallelism.dp", "parallelism.tp", "-1"]),
    (["parallelism=auto", "parallelism.n_devices=6", "parallelism.tp=4"],
     ["parallelism.tp=4", "6 devices", "cannot be inferred", "1, 2, 3, 6"]),
    # The user typed tp only: the message is about tp and the device count, not about dp.
    (["parallelism.tp=3"], ["parallelism.tp=3", "8 devices", "pick parallelism.tp from 1, 2, 4, 8"]),
    (["parallelism.fsdp=2", "parallelism.tp=3"],
     ["parallelism.fsdp=2 x parallelism.tp=3", "8 devices"]),
    (["parallelism=dp4_tp2", "parallelism.dp=4", "parallelism.n_devices=4"],
     ["parallelism=dp4_tp2", "parallelism.dp=4", "tp=2", "parallelism.n_devices=4"]),
    # The balanced causal split cuts a sequence into 2*cp chunks.
    (["parallelism=dp2_cp4", "data.seq_len=20"],
     ["parallelism.cp=4", "data.seq_len=20", "2*cp=8", "data.seq_len=16"]),
    (["parallelism=dp2_cp4", "parallelism.dp=4"], ["dp*fsdp*cp*tp = 4*1*4*1 = 16", "cp=4"]),
    (["parallelism.cp=3"], ["parallelism.cp=3", "8 devices", "cannot be inferred"]),
])
def test_impossible_meshes_say_what_to_change(cfg_factory, overrides, needles):
    with pytest.raises(ConfigError) as err:
        make_plan(cfg_factory(*overrides), 8)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_table_names_the_mesh(cfg_factory):
    table = make_plan(cfg_factory("parallelism=dp2_fsdp2_tp2"), 8).table()
    assert "data=2 x fsdp=2 x tensor=2" in table and "8 per replica x 4 replicas" in table
    table = make_plan(cfg_factory("parallelism=fsdp2_cp2_tp2"), 8).table()
    assert "data=1 x fsdp=2 x context=2 x tensor=2" in table
    assert "32 positions per device of 64: chunks i and 3-i of 4" in table


@pytest.mark.parametrize("vocab, preset, platform, padded", [
    (64, "tp8", "cpu", 64),  # already a multiple: no padding
    (65, "dp1", "cpu", 65),
    (65, "tp2", "cpu", 66),
    (65, "tp8", "cpu", 72),
    (50257, "tp2", "gpu", 50304),  # GPT-2's tokenizer: nanoGPT's 50304
    (50257, "dp1", "tpu", 50304),
    (50304, "tp8", "gpu", 50304),
])
def test_vocab_padded_to_tp_and_accelerator_alignment(cfg_factory, vocab, preset, platform,
                                                      padded):
    cfg = cfg_factory(f"parallelism={preset}", f"data.vocab_size={vocab}", "model.n_heads=8",
                      "model.n_kv_heads=8")
    plan = make_plan(cfg, 8, platform)
    assert (plan.vocab_size, plan.padded_vocab) == (vocab, padded)
    assert plan.to_json()["padded_vocab"] == padded
    line = [x for x in plan.table().splitlines() if x.strip().startswith("vocab")]
    if padded == vocab:
        assert line == []
    else:
        assert line[0].split(None, 1)[1].startswith(f"{vocab} padded to {padded} for tp=")


# parallelism preset -> (replicas dp*fsdp, devices): a tensor-parallel group shares one batch.
REPLICAS = {"dp1": (1, 1), "dp2": (2, 2), "dp4": (4, 4), "dp8": (8, 8), "dp4_tp2": (4, 8),
            "fsdp8": (8, 8)}


def test_vocab_align_lays_out_another_platforms_padding(cfg_factory):
    # parallelism.vocab_align=128: a GPU's padding on CPU (0: the platform's, 1 on CPU).
    cfg = cfg_factory("parallelism=tp2", "data.vocab_size=65", "parallelism.vocab_align=128")
    plan = make_plan(cfg, 8, "cpu")
    assert (plan.padded_vocab, plan.vocab_align) == (128, 128)
    assert "65 padded to 128 for tp=2 and 128-alignment" in plan.table()
    cfg.parallelism.vocab_align = 0
    assert make_plan(cfg, 8, "cpu").padded_vocab == 66
    assert make_plan(cfg, 8, "gpu").padded_vocab == 128


@pytest.mark.parametrize("preset", sorted(REPLICAS))
@pytest.mark.parametrize("accum", [1, 2])
def test_per_device_batch_gives_the_global_batch(cfg_factory, preset, accum):
    replicas, devices = REPLICAS[preset]
    cfg = cfg_factory(f"parallelism={preset}", f"parallelism.n_devices={devices}",
                      "data.per_device_batch_size=4", f"train.grad_accum={accum}")
    validate(cfg)
    plan = make_plan(cfg, 8)
    assert plan.global_batch == 4 * replicas * accum
    assert plan.per_device_batch_size == 4 and plan.batch_set_by == "data.per_device_batch_size"
    out = plan.to_json()
    assert (out["global_batch"], out["per_device_batch_size"], out["batch_set_by"]) == (
        4 * replicas * accum, 4, "data.per_device_batch_size")
    (row,) = [x for x in plan.table().splitlines() if x.strip().startswith("batch")]
    assert f"{4 * replicas * accum} global = 4 per replica x {replicas} replicas" in row
    assert ("x 2 micro-batches (train.grad_accum)" in row) == (accum == 2)
    assert row.endswith("set by data.per_device_batch_size=4")
    # The run saves the global batch; planning that config again follows the mesh.
    cfg = resolved_config(cfg, RunPlan(plan))
    assert cfg.data.batch_size == plan.global_batch
    assert make_plan(cfg, 8).global_batch == plan.global_batch


def test_global_batch_is_the_default_and_says_so(cfg_factory):
    cfg = cfg_factory("parallelism=dp4")
    assert cfg.data.batch_size == 32 and cfg.data.per_device_batch_size is None
    plan = make_plan(cfg, 8)
    assert (plan.global_batch, plan.per_device_batch_size, plan.batch_set_by) == (
        32, 8, "data.batch_size")
    assert "32 global = 8 per replica x 4 replicas, seq_len 64; set by data.batch_size" in (
        plan.table())


@pytest.mark.parametrize("overrides, needles", [
    (["data.per_device_batch_size=4", "data.batch_size=64"],
     ["data.batch_size=64 and data.per_device_batch_size=4 are both set", "data.batch_size=null"]),
    # Also when the global batch comes from a preset (tp_scaling sets data.batch_size: 32).
    (["experiment=tp_scaling", "data.per_device_batch_size=4"],
     ["data.batch_size=32 and data.per_device_batch_size=4", "data.batch_size=null"]),
    (["data.batch_size=null"], ["data.batch_size=null", "data.per_device_batch_size"]),
    (["data.per_device_batch_size=0"], ["data.per_device_batch_size=0", "in (0, 2^31)"]),
])
def test_batch_keys_refused_with_the_fix(cfg_factory, overrides, needles):
    with pytest.raises(ConfigError) as err:
        validate(cfg_factory(*overrides))
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 8.0), ("sqrt", 8 ** 0.5)])
def test_plan_shows_the_scaled_lr_of_the_resolved_batch(cfg_factory, rule, factor):
    cfg = cfg_factory("parallelism=dp8", "data.per_device_batch_size=32", "optimizer.lr=0.01",
                      f"optimizer.lr_scaling={rule}", "optimizer.base_batch_size=32")
    plan = make_plan(cfg, 8)
    assert plan.global_batch == 256 and plan.peak_lr == pytest.approx(0.01 * factor)
    assert plan.to_json()["peak_lr"] == pytest.approx(0.01 * factor)
    assert f"{0.01 * factor:.4g} peak (optimizer.lr_scaling={rule} at batch 256)" in plan.table()


def test_precision_and_gradient_sums_are_decided_once_by_the_platform(cfg_factory):
    """train.precision=auto and train.grad_reduce_dtype=auto (the defaults), decided in the
    plan: bf16 over fp32 masters on an accelerator, the gradients' sums in bf16 on a TPU
    (faster there, BENCHMARKS.md), fp32 on CPU; a key the user gives always wins."""
    from dxrun.plan import AttentionTarget

    def plan(platform, *keys):
        return make_plan(cfg_factory("parallelism=dp8", *keys), 8, platform,
                         device=AttentionTarget(platform))

    cpu, tpu, gpu = plan("cpu"), plan("tpu"), plan("gpu")
    assert (cpu.precision, cpu.compute_dtype, cpu.grad_reduce_dtype) == ("fp32", "float32", "fp32")
    assert (tpu.precision, tpu.compute_dtype, tpu.grad_reduce_dtype) == ("bf16", "bfloat16", "bf16")
    assert (gpu.precision, gpu.grad_reduce_dtype) == ("bf16", "fp32")
    assert cpu.precision_auto and tpu.precision_auto
    assert "compute  bf16, fp32 master weights, bf16 gradient sums" in tpu.table()
    given = plan("tpu", "train.precision=fp32")
    assert (given.precision, given.precision_auto, given.grad_reduce_dtype) == ("fp32", False,
                                                                               "fp32")
    assert plan("tpu", "train.grad_reduce_dtype=fp32").grad_reduce_dtype == "fp32"
    assert plan("cpu", "train.precision=bf16").grad_reduce_dtype == "fp32"
    assert plan("cpu", "train.precision=bf16", "train.grad_reduce_dtype=bf16"
                ).grad_reduce_dtype == "bf16"
    assert tpu.to_json()["grad_reduce_dtype"] == "bf16"  # plan.json records the decision
