"""The transformer's building blocks: parameters with logical axes (``axes=``; mapped to the mesh
by ``dxrun.model.sharding``), the weight matmul, the norms, the MLP and its activations, each
activation and the norm with a custom VJP that keeps for the backward pass only what a
hand-written kernel keeps.

Every weight matmul goes through ``dense``: computed in the input's dtype with fp32
accumulation, its weight gradient summed over the batch in fp32 (see ``dense``). Shapes are in
the names as in ``dxrun.model.transformer`` (B batch, L length, D d_model, F d_ff).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def padded_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
                 n: int) -> nnx.Param:
    """A vocab-indexed table with zero rows appended up to ``n`` on its ``vocab`` axis. The real
    rows take the same random draw as an unpadded model's, so padding (which differs with tp)
    never changes the init of the real vocabulary."""
    x = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    pad = [(0, 0)] * len(shape)
    pad[axes.index("vocab")] = (0, n - shape[axes.index("vocab")])
    return nnx.Param(jnp.pad(x, pad), axes=axes)


def dense(x: jax.Array, w: Any, spec: str, out_dtype: Any = None, join: Any = None
          ) -> jax.Array:
    """``einsum(spec, x, w)`` computed in ``x``'s dtype with fp32 accumulation, its output in
    ``out_dtype`` (default ``x``'s): every weight matmul of the model goes through here.

    When ``w`` is wider than ``x`` (fp32 master weight, bf16 compute) or the output is wider
    (fp32 logits), a custom VJP keeps the backward in the compute dtype with fp32 accumulation:
    the incoming gradient is cast to ``x``'s dtype (the LM head's fp32 logit gradient would
    otherwise make its backward matmuls fp32), and the weight gradient is accumulated in fp32
    and returned in ``w``'s dtype. The batch-contracted weight gradient is what XLA's
    partitioner all-reduces over data replicas, so an fp32 ``w`` gets an fp32 all-reduce and
    an unrounded fp32 gradient, where casting the weight before the matmul gives bf16 partial
    sums and a bf16 all-reduce. Same dtypes everywhere (fp32 runs): the plain einsum.

    ``join``: ``w`` is a tuple of parts and ``join(*w)`` the weight (``Attention.qkv`` lays
    q, k and v side by side). The custom VJP then keeps the parts for the backward pass and
    joins them again there: JAX's derivative of the join would keep the joined copy, an fp32
    weight per layer beside the parameters it is made of."""
    if join is None and x.dtype == w.dtype == (out_dtype or x.dtype):
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    # Named for model.remat=dots: checkpoint_dots sees only a custom VJP's call, not the matmul
    # inside it, so without the name a bf16 "dots" layer would keep nothing and recompute all.
    return checkpoint_name(_mixed_dense(x, w, spec, jnp.dtype(out_dtype or x.dtype), join),
                           DENSE)


DENSE = "dense"  # the checkpoint name of a mixed-precision weight matmul's output


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _mixed_dense(x: jax.Array, w: Any, spec: str, out_dtype: Any, join: Any) -> jax.Array:
    w = w if join is None else join(*w)
    return jnp.einsum(spec, x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_dense_fwd(x: jax.Array, w: Any, spec: str, out_dtype: Any, join: Any) -> tuple:
    return _mixed_dense(x, w, spec, out_dtype, join), (x, w)


def _mixed_dense_bwd(spec: str, out_dtype: Any, join: Any, res: tuple, g: jax.Array) -> tuple:
    x, parts = res
    w, split = (parts, None) if join is None else jax.vjp(join, *parts)
    ins, y = spec.split("->")
    xs, ws = ins.split(",")
    g = g.astype(x.dtype)  # bf16 operands, fp32 accumulation
    dx = jnp.einsum(f"{y},{ws}->{xs}", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{xs},{y}->{ws}", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx.astype(x.dtype), (dw if split is None else tuple(split(dw)))


_mixed_dense.defvjp(_mixed_dense_fwd, _mixed_dense_bwd)


def add_bias(x: jax.Array, b: jax.Array) -> jax.Array:
    """``x + b`` in ``x``'s dtype. An fp32 ``b`` is added in fp32 and the sum cast, so the bias
    gradient (a sum over the batch) is taken, and all-reduced, in fp32 (see ``dense``)."""
    return (x + b).astype(x.dtype)


def zeros(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


EPS = 1e-5  # model.norm_eps's default (a checkpoint's own: dxrun.config.hf_model)


class Norm(nnx.Module):
    """LayerNorm or RMSNorm; ``plus_one`` (``model.norm_plus_one``, Gemma's): the scale is
    1 + the weight, the weight starting at 0, so a checkpoint's tensor is the weight itself."""

    def __init__(self, d: int, kind: str, bias: bool, eps: float = EPS, plus_one: bool = False):
        self.kind, self.eps, self.plus_one = kind, eps, plus_one
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((d,), jnp.float32),
                               axes=("norm",))
        self.bias = zeros((d,), ("norm",)) if bias and kind == "layernorm" else None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        return norm(x_BxLxD, scale_of(self.scale[...], self.plus_one), bias,
                    self.kind == "layernorm", self.eps)


def scale_of(w: jax.Array, plus_one: bool) -> jax.Array:
    """A norm's scale from its weight: the weight, or 1 + it in fp32 (Gemma's ``1.0 +
    weight.float()``)."""
    return 1.0 + w.astype(jnp.float32) if plus_one else w


def block_norms(cfg: ModelConfig) -> dict[str, Any]:
    """The model's norms' arguments after the width: ``Norm(d, **block_norms(cfg))``."""
    return dict(kind=cfg.norm, bias=cfg.bias, eps=cfg.norm_eps,
                plus_one=getattr(cfg, "norm_plus_one", False))


def _norm_stats(x_BxLxD: jax.Array, centre: bool, eps: float
                ) -> tuple[jax.Array, Any, jax.Array]:
    """The fp32 centred input, its mean (None for RMSNorm) and reciprocal deviation."""
    x = x_BxLxD.astype(jnp.float32)  # statistics in fp32 whatever the compute dtype
    mean = x.mean(-1, keepdims=True) if centre else None
    xc = x - mean if centre else x
    return xc, mean, jax.lax.rsqrt((xc * xc).mean(-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def norm(x_BxLxD: jax.Array, scale: jax.Array, bias: jax.Array | None, centre: bool,
         eps: float = EPS) -> jax.Array:
    """LayerNorm (``centre``) or RMSNorm of the last axis (``eps``: model.norm_eps), statistics
    in fp32, the output in the input's dtype. A custom VJP keeps for the backward pass only
    what a hand-written kernel (llm.c's) keeps: the input in its own dtype and the fp32 mean
    and reciprocal deviation per token. JAX's own derivative keeps the fp32 centred and normalised copies
    of the input (8 bytes an element where a bf16 input is 2); the backward here recomputes
    them from the input in fp32 instead."""
    return _norm_fwd(x_BxLxD, scale, bias, centre, eps)[0]


def _norm_fwd(x_BxLxD: jax.Array, scale: jax.Array, bias: jax.Array | None, centre: bool,
              eps: float) -> tuple[jax.Array, tuple]:
    xc, mean, rstd = _norm_stats(x_BxLxD, centre, eps)
    y = xc * rstd * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x_BxLxD.dtype), (x_BxLxD, mean, rstd, scale, bias)


def _norm_bwd(centre: bool, eps: float, res: tuple, g_BxLxD: jax.Array) -> tuple:
    x_BxLxD, mean, rstd, scale, bias = res
    x = x_BxLxD.astype(jnp.float32)
    xhat = (x - mean if centre else x) * rstd
    g = g_BxLxD.astype(jnp.float32)
    over = tuple(range(g.ndim - 1))
    dscale = (g * xhat).sum(over).astype(scale.dtype)
    dbias = None if bias is None else g.sum(over).astype(bias.dtype)
    gx = g * scale.astype(jnp.float32)
    # d(xhat)/dx applied to gx: rstd (gx - mean(gx) - xhat mean(gx xhat)); RMSNorm has no mean
    dx = gx - xhat * (gx * xhat).mean(-1, keepdims=True)
    if centre:
        dx = dx - gx.mean(-1, keepdims=True)
    return (dx * rstd).astype(x_BxLxD.dtype), dscale, dbias


norm.defvjp(_norm_fwd, _norm_bwd)


_GELU_C = (2 / np.pi) ** 0.5  # the tanh approximation's constants (jax.nn.gelu's)
_GELU_A = 0.044715


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's GELU (tanh approximation), ``jax.nn.gelu(approximate=True)``'s forward. A
    custom VJP keeps only its input for the backward pass (llm.c's ``fch``) and recomputes
    the derivative from it in fp32: JAX's own derivative keeps five intermediates of the
    input's size (the cube, the tanh, its derivative's factor, the CDF and the output)."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    d = gelu_and_slope(x.astype(jnp.float32), exact=False)[1]
    return ((g.astype(jnp.float32) * d).astype(x.dtype),)


def gelu_and_slope(x32: jax.Array, exact: bool) -> tuple[jax.Array, jax.Array]:
    """GELU of fp32 ``x32`` and its derivative: the tanh form's, or the exact one's
    (d(x Phi(x))/dx = Phi(x) + x phi(x))."""
    if exact:
        cdf = 0.5 * (1 + jax.lax.erf(x32 * 2**-0.5))
        return x32 * cdf, cdf + x32 * jnp.exp(-0.5 * x32 * x32) * (2 * np.pi) ** -0.5
    t = jnp.tanh(_GELU_C * (x32 + _GELU_A * x32**3))
    return (0.5 * x32 * (1 + t),
            0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_A * x32 * x32))


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Llama's gated unit, ``silu(gate) * up``. A custom VJP keeps only its two inputs (the
    gate and up projections' outputs) and recomputes the sigmoid from the gate in fp32: JAX's
    own derivative keeps SiLU's three intermediates and the product besides."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple]:
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = res
    a, u, g32 = (t.astype(jnp.float32) for t in (gate, up, g))
    sig = jax.nn.sigmoid(a)
    d_gate = g32 * u * sig * (1 + a * (1 - sig))  # d silu(a)/da = s + a s (1 - s)
    return d_gate.astype(gate.dtype), (g32 * a * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def geglu(gate: jax.Array, up: jax.Array, exact: bool) -> jax.Array:
    """Gemma's gated unit, ``gelu(gate) * up``: GELU's tanh form (``gelu_pytorch_tanh``) or its
    exact, erf form. A custom VJP keeps only its two inputs, as ``swiglu``'s: GELU and its
    derivative recomputed from the gate in fp32 (JAX's own keeps GELU's output besides)."""
    return jax.nn.gelu(gate, approximate=not exact) * up


def _geglu_fwd(gate: jax.Array, up: jax.Array, exact: bool) -> tuple[jax.Array, tuple]:
    return geglu(gate, up, exact), (gate, up)


def _geglu_bwd(exact: bool, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = res
    a, u, g32 = (t.astype(jnp.float32) for t in (gate, up, g))
    act, d = gelu_and_slope(a, exact)
    return (g32 * u * d).astype(gate.dtype), (g32 * act).astype(up.dtype)


geglu.defvjp(_geglu_fwd, _geglu_bwd)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class MLP(nnx.Module):
    """GELU (GPT-2), SwiGLU (Llama) or GeGLU (Gemma). Up and gate are column-parallel, down
    row-parallel."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F, std = cfg.d_model, cfg.d_ff, cfg.init_std
        self.kind, self.exact = cfg.mlp, getattr(cfg, "gelu", "tanh") == "exact"
        self.w_up = param(rngs, (D, F), ("embed", "mlp"), std)
        self.w_gate = (param(rngs, (D, F), ("embed", "mlp"), std)
                       if cfg.mlp in ("swiglu", "geglu") else None)
        self.w_down = param(rngs, (F, D), ("mlp", "embed"), std / (2 * cfg.n_layers) ** 0.5)
        self.b_up = zeros((F,), ("mlp",)) if cfg.bias else None
        self.b_down = zeros((D,), ("norm",)) if cfg.bias else None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxF = dense(x_BxLxD, self.w_up[...], "bld,df->blf")
        if self.b_up is not None:
            h_BxLxF = add_bias(h_BxLxF, self.b_up[...])
        if self.kind == "swiglu":
            h_BxLxF = swiglu(dense(x_BxLxD, self.w_gate[...], "bld,df->blf"), h_BxLxF)
        elif self.kind == "geglu":
            h_BxLxF = geglu(dense(x_BxLxD, self.w_gate[...], "bld,df->blf"), h_BxLxF, self.exact)
        else:
            h_BxLxF = jax.nn.gelu(h_BxLxF, approximate=False) if self.exact else gelu(h_BxLxF)
        y_BxLxD = dense(h_BxLxF, self.w_down[...], "blf,fd->bld")
        if self.b_down is not None:
            y_BxLxD = add_bias(y_BxLxD, self.b_down[...])
        return y_BxLxD


def softcapped(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (``model.logit_softcap``, Gemma 2's); ``x`` with none."""
    return x if cap is None else cap * jnp.tanh(x / cap)
