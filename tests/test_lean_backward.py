"""The custom VJPs that keep only what a hand-written backward keeps (``dxrun.model.transformer``:
the norms, GELU, SwiGLU, the joined qkv weight): their gradients are JAX's autodiff of the same
forward to fp32 tolerance, their forward is the plain one bit for bit, and a layer keeps what the
memory model counts, less than JAX's own derivatives keep (the compiled step's temporaries say so
too)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dxrun.estimates import Shapes, layer_none
from dxrun.model import layers
from dxrun.model.attention import join_qkv


def plain_norm(x, scale, bias, centre):
    """The norm as JAX differentiates it (dxrun's forward before the custom VJP)."""
    y = x.astype(jnp.float32)
    if centre:
        y = y - y.mean(-1, keepdims=True)
    y = y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + layers.EPS) * scale
    return (y if bias is None else y + bias).astype(x.dtype)


def _inputs(dtype):
    k = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(k[0], (2, 8, 32)) + 1).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(k[1], (32,))
    bias = 0.1 * jax.random.normal(k[2], (32,))
    g = jax.random.normal(k[3], (2, 8, 32)).astype(dtype)
    return x, scale, bias, g


@pytest.mark.parametrize("centre,with_bias", [(True, True), (True, False), (False, False)])
def test_the_norms_vjp_is_jaxs_autodiff(centre, with_bias):
    x, scale, bias, g = _inputs(jnp.float32)
    bias = bias if with_bias else None
    ours, ours_vjp = jax.vjp(lambda *a: layers.norm(*a, centre), x, scale, bias)
    ref, ref_vjp = jax.vjp(lambda *a: plain_norm(*a, centre), x, scale, bias)
    assert np.array_equal(ours, ref)  # the forward is the plain one, bit for bit
    for a, b in zip(ours_vjp(g), ref_vjp(g), strict=True):
        if b is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # bf16 input: the same forward bits, gradients within bf16's rounding of the fp32 ones
    xb, gb = x.astype(jnp.bfloat16), g.astype(jnp.bfloat16)
    assert np.array_equal(layers.norm(xb, scale, bias, centre), plain_norm(xb, scale, bias, centre))
    dx = jax.vjp(lambda x: layers.norm(x, scale, bias, centre), xb)[1](gb)[0]
    dx32 = jax.vjp(lambda x: plain_norm(x, scale, bias, centre), xb.astype(jnp.float32)
                   )[1](gb.astype(jnp.float32))[0]
    np.testing.assert_allclose(dx.astype(jnp.float32), dx32, rtol=2e-2, atol=2e-2)


def test_gelus_vjp_is_jaxs_autodiff():
    x = 4 * jax.random.normal(jax.random.key(1), (4, 64))
    g = jax.random.normal(jax.random.key(2), (4, 64))
    ours, ours_vjp = jax.vjp(layers.gelu, x)
    ref, ref_vjp = jax.vjp(lambda x: jax.nn.gelu(x, approximate=True), x)
    assert np.array_equal(ours, ref)
    # fp32 rounding of a derivative of order 1 (where it cancels to ~0 at large |x|)
    np.testing.assert_allclose(ours_vjp(g)[0], ref_vjp(g)[0], rtol=1e-5, atol=4e-6)
    xb = x.astype(jnp.bfloat16)
    assert np.array_equal(layers.gelu(xb), jax.nn.gelu(xb, approximate=True))


# The gated units and what JAX differentiates for them: SwiGLU, GeGLU's tanh and exact forms.
GATED = {"swiglu": (layers.swiglu, jax.nn.silu),
         "geglu_tanh": (lambda a, u: layers.geglu(a, u, False),
                        lambda a: jax.nn.gelu(a, approximate=True)),
         "geglu_exact": (lambda a, u: layers.geglu(a, u, True),
                         lambda a: jax.nn.gelu(a, approximate=False))}


@pytest.mark.parametrize("unit", GATED)
def test_the_gated_units_vjp_is_jaxs_autodiff(unit):
    ours_f, act = GATED[unit]
    k = jax.random.split(jax.random.key(4), 3)
    gate, up, g = (3 * jax.random.normal(k[i], (4, 64)) for i in range(3))
    ours, ours_vjp = jax.vjp(ours_f, gate, up)
    ref, ref_vjp = jax.vjp(lambda a, u: act(a) * u, gate, up)
    assert np.array_equal(ours, ref)
    for a, b in zip(ours_vjp(g), ref_vjp(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    gb, ub = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    assert np.array_equal(ours_f(gb, ub), act(gb) * ub)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_joined_weights_vjp_is_the_joined_copys(dtype):
    """``dense`` with ``join``: the same output and gradients as joining the weight first."""
    k = jax.random.split(jax.random.key(3), 5)
    wq, wk, wv = (jax.random.normal(k[i], (16, n, 4)) for i, n in enumerate((4, 2, 2)))
    x = jax.random.normal(k[3], (2, 8, 16)).astype(dtype)
    spec = "bld,dkce->blkce"

    def ours(x, *w):
        return layers.dense(x, w, spec, jnp.float32, join=join_qkv).sum()

    def joined(x, *w):
        return layers.dense(x, join_qkv(*w), spec, jnp.float32).sum()

    assert ours(x, wq, wk, wv) == joined(x, wq, wk, wv)
    for a, b in zip(jax.grad(ours, range(4))(x, wq, wk, wv),
                    jax.grad(joined, range(4))(x, wq, wk, wv), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # fp32 rounding of sums of d_model products (the matmuls' order of summation differs)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def _block(llama: bool):
    from dxrun.config.schema import ModelConfig
    from dxrun.model import transformer

    cfg = ModelConfig(name="t", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4 // (1 + llama),
                      d_ff=256, vocab_size=64, max_seq_len=32, bias=not llama,
                      norm="rmsnorm" if llama else "layernorm", mlp="swiglu" if llama else "gelu",
                      pos="rope" if llama else "learned")
    return cfg, nnx.split(transformer.Block(cfg, nnx.Rngs(0)))


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
def test_a_bf16_layer_keeps_what_the_memory_model_counts(llama):
    """JAX's list of what a bf16 block keeps without remat (the layer input included: in the
    scan it is a stacked residual) is the memory model's ``layer_none``, but for the attention
    core: JAX saves the causal mask and masked scores too, which XLA's compile drops
    (``test_the_model_agrees_with_xla_in_fp32`` holds that count), so the score-sized
    residuals are held to the model's two plus what XLA drops. Per token and layer a GPT-2
    block keeps 32 x d_model bytes (llm.c's count) and the norms' statistics."""
    from jax._src.ad_checkpoint import saved_residuals

    cfg, (graphdef, params) = _block(llama)
    b, s, h, heads = 2, 32, cfg.d_model, cfg.n_heads
    x = jnp.ones((b, s, h), jnp.bfloat16)
    saved = saved_residuals(
        lambda p, x: nnx.merge(graphdef, p)(x, None, jnp.bfloat16).astype(jnp.float32).sum(),
        params, x)
    kept = [a for a, src in saved if a.shape and "from the argument p" not in src]
    score = [a for a in kept if a.shape[-2:] in ((s, s), (s, 1)) and a.ndim == 5]
    rest = sum(a.size * a.dtype.itemsize for a in kept if not any(a is c for c in score))
    shapes = Shapes(b=b, s=s, h=h, f=cfg.d_ff, heads=heads, kv_heads=cfg.n_kv_heads,
                       head_dim=h // heads, vocab=64, n_layers=2, c=2, mlp=cfg.mlp,
                       bias=cfg.bias, remat="none", kernel="xla", residual=2, norm=cfg.norm,
                       rope=llama)
    parts = layer_none(shapes)
    assert rest == sum(parts.values()) - parts["scores"]
    if not llama:  # llm.c's 16 bf16 tensors of d_model, and LayerNorm's two statistics
        assert rest == 32 * b * s * h + 2 * 2 * 4 * b * s
    jax_scores = sum(a.size * a.dtype.itemsize for a in score)
    mask_and_masked = (1 + 4) * heads * b * s * s
    assert jax_scores == parts["scores"] + mask_and_masked


def test_the_compiled_step_keeps_less_than_jaxs_own_derivatives():
    """Four bf16 layers of norm, up projection, GELU, down projection in a scan without remat,
    the gradient compiled on CPU: the custom VJPs' step needs fewer temporary bytes than the
    same step differentiated by JAX (XLA's memory analysis of both)."""
    D, F, n = 128, 512, 4

    def step(norm, gelu):
        def layer(x, w):
            up, down, scale = w
            h = norm(x, scale, None, True)
            h = layers.dense(gelu(layers.dense(h, up, "bld,df->blf")), down, "blf,fd->bld")
            return x + h, None

        def loss(ws, x):
            return jax.lax.scan(layer, x, ws)[0].astype(jnp.float32).sum()

        return jax.jit(jax.grad(loss))

    ws = (jnp.ones((n, D, F)), jnp.ones((n, F, D)), jnp.ones((n, D)))
    x = jnp.ones((8, 256, D), jnp.bfloat16)

    def temp(norm, gelu) -> int:
        return step(norm, gelu).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    ours = temp(layers.norm, layers.gelu)
    jaxs = temp(plain_norm, lambda h: jax.nn.gelu(h, approximate=True))
    tokens = 8 * 256
    # JAX's keep the norm's two fp32 copies and GELU's five intermediates per layer
    assert jaxs - ours > n * tokens * (2 * 4 * D + 2 * 2 * F), (ours, jaxs)
