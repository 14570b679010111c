"""The attention kernels as one table (``dxrun.plan.run_plan``) and the one choice a run
makes, stored in its plan: splash on a TPU, cuDNN's fused flash attention on NVIDIA GPUs in
bf16/fp16 within JAX's head-dim limits, XLA's everywhere else; a kernel's name forces it or is
refused in one line. Splash itself (Pallas, interpreted on CPU) equals the reference, forward and
backward, causal and bidirectional, with grouped-query heads, on a sharded mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from omegaconf import OmegaConf

from dxrun.config.errors import ConfigError
from dxrun.config.schema import ModelConfig
from dxrun.experiment import Experiment
from dxrun.model import splash_attention
from dxrun.model.attention import reference_attention
from dxrun.model.sharding import in_mesh_context
from dxrun.model.transformer import Transformer
from dxrun.plan import (
    AUTO,
    KERNELS,
    AttentionTarget,
    Inputs,
    attention_target,
    check_remat,
    choose,
    compiled_kernel,
    kind_target,
)

H100 = ("gpu", "9.0", 91000)  # platform, compute capability, cuDNN 9.10
A100 = ("gpu", "8.0", 90100)


def attention_implementation(platform, dtype, head_dim, cc=None, cudnn=None, seq_len=1024):
    """The table's choice for ``model.attention=dot_product`` on these facts."""
    return choose("dot_product", Inputs(AttentionTarget(platform, cc, cudnn),
                                        jnp.dtype(dtype).name, head_dim, seq_len, True))


@pytest.mark.parametrize("platform, dtype, head_dim, cc, cudnn, want", [
    (*H100[:1], jnp.bfloat16, 64, *H100[1:], "cudnn"),
    ("cuda", jnp.float16, 128, "9.0", 91000, "cudnn"),
    (*H100[:1], jnp.bfloat16, 256, *H100[1:], "cudnn"),  # Hopper: up to 256
    (*A100[:1], jnp.bfloat16, 128, *A100[1:], "cudnn"),
    (*A100[:1], jnp.bfloat16, 256, *A100[1:], "xla"),  # before Hopper: at most 128
    (*H100[:1], jnp.bfloat16, 264, *H100[1:], "xla"),  # over 256
    (*H100[:1], jnp.bfloat16, 60, *H100[1:], "xla"),  # not a multiple of 8
    (*H100[:1], jnp.float32, 64, *H100[1:], "xla"),  # fp32: XLA
    ("gpu", jnp.bfloat16, 64, "7.0", 91000, "xla"),  # Volta: no fused flash attention
    ("gpu", jnp.bfloat16, 64, None, 91000, "xla"),  # capability unknown
    ("gpu", jnp.bfloat16, 64, "9.0", None, "xla"),  # no cuDNN loaded
    ("gpu", jnp.bfloat16, 64, "10.3", 91000, "xla"),  # 10.3 needs cuDNN 9.11
    ("gpu", jnp.bfloat16, 64, "10.3", 91100, "cudnn"),
    ("cpu", jnp.bfloat16, 64, None, None, "xla"),
    ("cpu", jnp.bfloat16, 64, "9.0", 91000, "xla"),  # CPU whatever else is said
    ("tpu", jnp.bfloat16, 64, None, None, "splash"),
    ("tpu", jnp.float32, 128, None, None, "splash"),
    ("rocm", jnp.bfloat16, 64, None, None, "xla"),
])
def test_selection_by_platform_dtype_and_head_dim(platform, dtype, head_dim, cc, cudnn, want):
    assert attention_implementation(platform, dtype, head_dim, cc, cudnn) == want


def test_tpu_sequences_splash_does_not_tile_get_xla():
    assert attention_implementation("tpu", jnp.bfloat16, 64, seq_len=1000) == "xla"
    assert attention_implementation("tpu", jnp.float16, 64) == "xla"


def test_the_table_holds_each_kernel_once_and_the_schema_offers_each():
    assert list(AUTO) == ["splash", "cudnn", "xla", "reference"]  # the last: a soft cap off TPU
    assert {k for k, v in KERNELS.items() if v.keeps_scores} == {"xla", "reference"}
    meta = ModelConfig.__dataclass_fields__["attention"].metadata
    assert set(meta["choices"]) == {"dot_product", *KERNELS} - {"blockwise"}


@pytest.mark.parametrize("setting, device, why", [
    ("splash", AttentionTarget("gpu", "9.0", 91000), "runs on tpu only"),
    ("cudnn", AttentionTarget("tpu"), "needs an NVIDIA GPU with cuDNN"),
    ("cudnn", AttentionTarget("cpu"), "needs an NVIDIA GPU with cuDNN"),
])
def test_a_forced_kernel_that_cannot_run_is_refused_in_one_line(setting, device, why):
    with pytest.raises(ConfigError) as e:
        choose(setting, Inputs(device, "bfloat16", 64, 1024, True))
    line = str(e.value)
    assert "\n" not in line and f"model.attention={setting}" in line and why in line
    assert "model.attention=dot_product" in line  # the fix


@pytest.mark.parametrize("kernel", ["xla", "cudnn", "reference", "blockwise"])
def test_keep_attention_needs_a_kernel_that_names_its_residuals(kernel):
    check_remat("keep_attention", "splash")  # splash names them
    check_remat("full", kernel)
    with pytest.raises(ConfigError) as e:
        check_remat("keep_attention", kernel)
    line = str(e.value)
    assert "\n" not in line and f"({kernel})" in line and "model.remat=full" in line


def test_splash_forced_on_cpu_runs_interpreted_and_plan_mode_stands_xla_in():
    x = Inputs(AttentionTarget("cpu"), "float32", 64, 128, True)
    assert choose("splash", x) == "splash"  # Pallas interprets it here
    assert compiled_kernel("splash", "splash", "cpu") == ("splash", True)
    assert compiled_kernel("splash", "dot_product", "cpu") == ("xla", False)  # a v5e plan's
    assert compiled_kernel("splash", "dot_product", "tpu") == ("splash", False)
    assert compiled_kernel("cudnn", "cudnn", "cpu") == ("xla", False)  # no interpreter
    assert choose("dot_product", x, cp=2) == "blockwise"
    assert kind_target("TPU v5 lite") == AttentionTarget("tpu")
    assert kind_target("NVIDIA H100 80GB HBM3") == AttentionTarget(*H100)


def test_windows_and_soft_caps_take_a_kernel_that_has_them_or_are_refused_in_one_line():
    """model.sliding_window and model.attn_softcap: splash (its local masks, its soft cap) on a
    TPU; off it a window takes XLA's, a soft cap the reference (jax.nn.dot_product_attention
    has none); XLA's forced with a soft cap, or a context axis with either, one line each."""
    x = Inputs(AttentionTarget("tpu"), "bfloat16", 128, 1024, True, window=256)
    capped = x._replace(softcap=50.0)
    assert choose("dot_product", x) == choose("dot_product", capped) == "splash"
    cpu = AttentionTarget("cpu")
    assert choose("dot_product", x._replace(device=cpu)) == "xla"
    assert choose("dot_product", capped._replace(device=cpu)) == "reference"
    for setting, cp, y, words in (
            ("xla", 1, capped, "model.attention=xla cannot run here: it has no soft cap of the "
             "scores (model.attn_softcap=50.0)"),
            ("dot_product", 2, x, "parallelism.cp=2 attends with its blockwise kernel, which "
             "has no model.sliding_window in dxrun (model.sliding_window=256); set "
             "parallelism.cp=1 or model.sliding_window=null"),
            ("dot_product", 2, x._replace(window=None, scalar=144.0), "which has no "
             "model.attn_scalar in dxrun (model.attn_scalar=144.0); set parallelism.cp=1 or "
             "model.attn_scalar=null")):
        with pytest.raises(ConfigError) as e:
            choose(setting, y, cp=cp)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_splash_with_a_window_a_soft_cap_and_a_scale_equals_the_reference():
    """Splash's local mask (the last 40 of 128 keys), its soft cap and a scale of its own
    (Gemma 2's pieces), grouped-query heads: the outputs and the gradients of q, k and v."""
    B, L, H, K, E = 1, 128, 4, 2, 32
    r = np.random.default_rng(1)
    q = jnp.asarray(3 * r.normal(size=(B, L, H, E)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, L, K, E)), jnp.float32) for _ in range(2))
    w = jnp.asarray(r.normal(size=(B, L, H, E)), jnp.float32)
    kw = dict(window=40, softcap=5.0, scale=24.0**-0.5)

    def run(fn):
        grads = jax.grad(lambda *a: (fn(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        return fn(q, k, v), grads

    o1, g1 = run(lambda *a: splash_attention.attend(*a, interpret=True, **kw))
    o2, g2 = run(lambda *a: reference_attention(*a, **kw))
    np.testing.assert_allclose(o1, o2, atol=2e-5)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=1e-4)


# grouped-query heads causal: the whole step's test below
@pytest.mark.parametrize("causal, heads, kv_heads", [(True, 4, 4), (False, 4, 1)])
def test_splash_equals_the_reference_forward_and_backward(causal, heads, kv_heads):
    """Pallas' splash attention in its interpreter, causal (ar) and both ways (mdlm), MHA,
    grouped-query and multi-query heads: the outputs and the gradients of q, k and v."""
    B, L, E = 2, 128, 32
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, L, heads, E)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, L, kv_heads, E)), jnp.float32) for _ in range(2))
    w = jnp.asarray(r.normal(size=(B, L, heads, E)), jnp.float32)

    def run(fn):
        out, grads = jax.value_and_grad(lambda *a: (fn(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        return fn(q, k, v), grads

    o1, g1 = run(lambda *a: splash_attention.attend(*a, causal=causal, interpret=True))
    o2, g2 = run(lambda *a: reference_attention(*a, causal=causal))
    np.testing.assert_allclose(o1, o2, atol=2e-5)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=1e-4)


def test_bf16_model_on_cpu_and_in_plan_mode_lowers_with_xla_attention(cfg_factory):
    """The target comes from the mesh's devices: CPU here, in a run as in plan mode for an
    H200, so the compiled bf16 step has no cuDNN call."""
    shape = ("model=tiny", "parallelism=dp2", "logger=none", "data.seq_len=16",
             "train.precision=bf16")
    exp = Experiment.build(cfg_factory(*shape))
    assert exp.plan.attention_device == AttentionTarget("cpu") == attention_target(
        jax.devices()[0])
    assert exp.attention_kernel == exp.plan.attention == "xla"
    with in_mesh_context(exp.mesh, exp.plan.rules):
        text = exp.step.jitted.lower(exp.abstract_state(), exp.abstract_batch()).as_text()
    assert "dot_general" in text  # the step's program, lowered for these devices
    assert "cudnn" not in text.lower() and "fmha" not in text.lower()
    from dxrun.autotune import planned

    plan = planned(cfg_factory(*shape, "run.mode=plan", "plan.target=h200")).exp
    assert plan.attention_kernel == "cudnn"  # what the run on an H200 runs: the plan's choice
    with in_mesh_context(plan.mesh, plan.plan.rules):  # compiled here with XLA's standing in
        text = plan.step.jitted.lower(plan.abstract_state(), plan.abstract_batch()).as_text()
    assert "cudnn" not in text.lower() and "fmha" not in text.lower()
    ref = Experiment.build(cfg_factory(*shape, "model.attention=reference"), with_data=False)
    assert ref.attention_kernel == "reference"


def test_a_gpu_plan_asks_jax_for_cudnn_by_name():
    """The model built with the plan's "cudnn" hands it to jax.nn.dot_product_attention: this
    CPU-only JAX then says it has no cuDNN, which proves the kernel was asked for by name."""
    cfg = OmegaConf.structured(ModelConfig(vocab_size=32, n_layers=1, d_model=64, n_heads=4))
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0),
                                                  kernel=("cudnn", False)))
    graphdef, state = nnx.split(abstract)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def forward(dtype):
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype),
                              nnx.to_pure_dict(state))
        return jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)

    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        forward(jnp.bfloat16)


def test_splash_in_the_model_on_a_sharded_mesh_equals_the_reference(cfg_factory):
    """The whole train step with model.attention=splash (under shard_map: each device its rows
    and its kv-head group) against the einsum reference on dp2 x fsdp2 x tp2: the loss and the
    gradient norm of one step, grouped-query heads (tiny_llama: 4 heads, 2 kv heads), weights
    drawn wide enough (init_std) that a wrong scale or mask shows in both."""
    shape = ("model=tiny_llama", "parallelism=dp2_fsdp2_tp2",
             "logger=none", "data.seq_len=128", "data.batch_size=8", "model.init_std=0.3")
    out = {}
    for kernel in ("splash", "reference"):
        exp = Experiment.build(cfg_factory(*shape, f"model.attention={kernel}"))
        assert exp.attention_kernel == kernel
        _, metrics = exp.step(exp.init_state(), exp.batch(0))
        out[kernel] = (float(metrics["train/loss"]), float(metrics["train/grad_norm"]))
    np.testing.assert_allclose(out["splash"], out["reference"], rtol=2e-5)


def test_splash_in_alternating_soft_capped_layers_keeps_its_residuals_as_the_reference(
        cfg_factory):
    """Gemma 2's attention in the whole train step: windowed and full layers alternating
    (``lax.cond`` between two splash kernels, one with a local mask), soft-capped scores and a
    score scale of its own, under model.remat=keep_attention (its named residuals inside the
    cond) on dp4 x tp2: the loss and gradient norm of one step equal the reference's."""
    shape = ("model=tiny_llama", "model.n_layers=2", "parallelism=dp4_tp2", "logger=none",
             "data.seq_len=128", "data.batch_size=8", "model.init_std=0.3",
             "model.sliding_window=40", "model.global_every=2", "model.rope_local_theta=100",
             "model.attn_softcap=2", "model.attn_scalar=12")
    out = {}
    for kernel, remat in (("splash", "keep_attention"), ("reference", "none")):
        exp = Experiment.build(cfg_factory(*shape, f"model.attention={kernel}",
                                           f"model.remat={remat}"))
        assert exp.attention_kernel == kernel
        _, metrics = exp.step(exp.init_state(), exp.batch(0))
        out[kernel] = (float(metrics["train/loss"]), float(metrics["train/grad_norm"]))
    np.testing.assert_allclose(out["splash"], out["reference"], rtol=2e-5)
