"""The attention kernel ``jax.nn.dot_product_attention`` is asked for: cuDNN's fused flash
attention on NVIDIA GPUs in bf16/fp16 within JAX's head-dim limits, XLA's everywhere else (fp32,
CPU, plan mode); a bf16 model on CPU lowers with XLA's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from omegaconf import OmegaConf

from dxrun.attention_kernel import AttentionTarget, attention_target
from dxrun.experiment import Experiment
from dxrun.model import Transformer
from dxrun.plan.attention import attention_implementation
from dxrun.schema import ModelConfig
from dxrun.sharding import in_mesh_context

H100 = ("gpu", "9.0", 91000)  # platform, compute capability, cuDNN 9.10
A100 = ("gpu", "8.0", 90100)


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
    ("tpu", jnp.bfloat16, 64, None, None, "xla"),
    ("rocm", jnp.bfloat16, 64, None, None, "xla"),
])
def test_selection_by_platform_dtype_and_head_dim(platform, dtype, head_dim, cc, cudnn, want):
    assert attention_implementation(platform, dtype, head_dim, cc, cudnn) == want


def test_bf16_model_on_cpu_and_in_plan_mode_lowers_with_xla_attention(cfg_factory):
    """The target comes from the mesh's devices: CPU here, in a run as in plan mode for an
    H200, so the compiled bf16 step has no cuDNN call."""
    shape = ("model=tiny", "parallelism=dp2", "logger=none", "data.seq_len=16",
             "train.precision=bf16")
    exp = Experiment.build(cfg_factory(*shape))
    assert exp.attention_target == AttentionTarget("cpu") == attention_target(jax.devices()[0])
    assert exp.attention_kernel == "xla"
    with in_mesh_context(exp.mesh, exp.plan.rules):
        text = exp.step.jitted.lower(exp.abstract_state(), exp.abstract_batch()).as_text()
    assert "dot_general" in text  # the step's program, lowered for these devices
    assert "cudnn" not in text.lower() and "fmha" not in text.lower()
    plan = Experiment.build(cfg_factory(*shape, "run.mode=plan", "plan.target=h200"), data=None,
                            with_data=False)
    assert plan.attention_kernel == "xla"
    ref = Experiment.build(cfg_factory(*shape, "model.attention=reference"), with_data=False)
    assert ref.attention_kernel == "reference"


def test_a_gpu_target_asks_jax_for_cudnn_in_bf16_only():
    """The model built for an H100 hands "cudnn" to jax.nn.dot_product_attention in bf16: this
    CPU-only JAX then says it has no cuDNN, which proves the kernel was asked for by name. In
    fp32 the same model traces with XLA's kernel."""
    cfg = OmegaConf.structured(ModelConfig(vocab_size=32, n_layers=1, d_model=64, n_heads=4))
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0),
                                                  target=AttentionTarget(*H100)))
    graphdef, state = nnx.split(abstract)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def forward(dtype):
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype),
                              nnx.to_pure_dict(state))
        return jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)

    assert "dot_product_attention" not in str(forward(jnp.float32))
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        forward(jnp.bfloat16)
