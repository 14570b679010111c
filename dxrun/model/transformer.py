"""A decoder-only transformer in Flax NNX, GPT-2 style or Llama style from the same knobs: its
building blocks (parameters with logical axes, the weight matmul, norms, the MLP), attention
(causal multi-head or grouped-query, rotary positions; the kernel is the run plan's) and the
model that stacks them.

Parameters carry logical axis names (``axes=``); ``dxrun.model.sharding`` maps them to the mesh.
Shapes are in the names: B batch, L length, D d_model, H heads, K kv heads, G = H/K, E head dim,
F d_ff, V vocab, Vp padded vocab (see ``Transformer``). The module computes in the dtype it is
called with (``dtype``; default: its parameters' dtype); norms, softmax and logits run in fp32.
Called with fp32 parameters and a bf16 ``dtype`` (the train step's default), every weight is
cast at its use and every weight gradient is summed over the batch in fp32 (see ``dense``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dxrun.model import context_parallel, splash_attention
from dxrun.model.sharding import active_axes, constrain, gathered_backward
from dxrun.plan import RESIDUALS

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


# ------------------------------------------------------------------------------------------------
# The model's building blocks: parameters with logical axes, the weight matmul, norms, the MLP.
#
# Every weight matmul goes through ``dense``: computed in the input's dtype with fp32
# accumulation, its weight gradient summed over the batch in fp32 (see ``dense``). Shapes are in
# the names (the legend is in the module's docstring).

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


# ------------------------------------------------------------------------------------------------
# Causal multi-head / grouped-query attention, and rotary positions (``model.pos=rope``).
#
# q, k, v are column-parallel (heads on ``tensor``), the output projection row-parallel. The
# kernel is the run plan's (``MeshPlan.attention``, chosen by ``dxrun.plan.run_plan``); the
# written-out ``reference_attention`` is what every kernel is tested against. Shapes are in the
# names (the legend is in the module's docstring).

def rope(x_BxLxNxE: jax.Array, theta: float, start: Any = 0,
         scaling: Any = None) -> jax.Array:
    """Rotary position embedding, rotate-half convention (Llama), for positions ``start``,
    ``start + 1``, ... (decoding with a key/value cache passes the first new position), or at
    the L positions ``start`` lists (a sequence held in ``context_parallel``'s order).
    ``scaling``: Llama 3.1's frequency scaling (``model.rope_scaling``, its items)."""
    L, E = x_BxLxNxE.shape[1], x_BxLxNxE.shape[-1]
    freq_E2 = theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E)
    if scaling:
        freq_E2 = llama3_frequencies(freq_E2, **dict(scaling))
    pos_L = (jnp.arange(L) + start if jnp.ndim(start) == 0 else start).astype(jnp.float32)
    ang_LxE2 = pos_L[:, None] * freq_E2[None, :]
    cos, sin = jnp.cos(ang_LxE2)[None, :, None, :], jnp.sin(ang_LxE2)[None, :, None, :]
    x = x_BxLxNxE.astype(jnp.float32)
    x1, x2 = x[..., : E // 2], x[..., E // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxE.dtype)


def llama3_frequencies(freq_E2: jax.Array, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_max_position_embeddings: float
                       ) -> jax.Array:
    """Llama 3.1's rope scaling (transformers' ``rope_type: llama3``): long wavelengths slowed
    by ``factor``, short ones kept, the band between interpolated."""
    wavelen = 2 * jnp.pi / freq_E2
    old = original_max_position_embeddings
    slow = jnp.where(wavelen > old / low_freq_factor, freq_E2 / factor, freq_E2)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mixed = (1 - smooth) * slow / factor + smooth * slow
    medium = (wavelen >= old / high_freq_factor) & (wavelen <= old / low_freq_factor)
    return jnp.where(medium, mixed, slow)


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """Which keys (positions ``k_pos``) each query (``q_pos``) sees: those at or before it,
    and with ``window`` (``model.sliding_window``) only the last ``window`` of them."""
    seen = k_pos[None, :] <= q_pos[:, None]
    return seen if window is None else seen & (k_pos[None, :] > q_pos[:, None] - window)


def reference_attention(q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                        mask_LxS: jax.Array | None = None, causal: bool = True,
                        window: int | None = None, scale: float | None = None,
                        softcap: float | None = None) -> jax.Array:
    """Attention written out (``model.attention=reference``): what the fused kernel is tested
    against. Causal (L = S; ``window``: the last that many keys only) unless ``mask_LxS`` says
    which keys each query sees (decoding against a key/value cache); ``causal=False`` and no
    mask: every key (masked diffusion). Scores scaled by ``scale`` (default E^-1/2) and, with
    ``softcap`` (``model.attn_softcap``), capped to c tanh(s / c) before the mask."""
    B, L, H, E = q_BxLxHxE.shape
    K = k_BxSxKxE.shape[2]
    # Head h uses kv head h // G; heads are split over `tensor` in contiguous blocks that
    # stay aligned with their kv heads (n_kv_heads % tp == 0 is checked by the plan).
    q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
    # Scores and softmax in fp32 for stability under bf16 compute.
    s_BxKxGxLxS = jnp.einsum("blkge,bske->bkgls", q_BxLxKxGxE, k_BxSxKxE,
                             preferred_element_type=jnp.float32) * (scale or E**-0.5)
    if softcap:
        s_BxKxGxLxS = softcap * jnp.tanh(s_BxKxGxLxS / softcap)
    if mask_LxS is None and causal:
        mask_LxS = window_mask(jnp.arange(L), jnp.arange(L), window)
    if mask_LxS is not None:
        s_BxKxGxLxS = jnp.where(mask_LxS, s_BxKxGxLxS, jnp.finfo(jnp.float32).min)
    p_BxKxGxLxS = jax.nn.softmax(s_BxKxGxLxS, axis=-1).astype(v_BxSxKxE.dtype)
    o_BxLxKxGxE = jnp.einsum("bkgls,bske->blkge", p_BxKxGxLxS, v_BxSxKxE)
    o_BxLxHxE = o_BxLxKxGxE.reshape(B, L, H, E)
    return o_BxLxHxE


KERNEL = ("xla", False)  # what a model built without a run plan applies


def join_qkv(wq_DxHxE: jax.Array, wk_DxKxE: jax.Array, wv_DxKxE: jax.Array) -> jax.Array:
    """The q, k and v weights side by side per kv head (D x K x (G+2) x E), one matmul's."""
    D, K, E = wk_DxKxE.shape
    return jnp.concatenate([wq_DxHxE.reshape(D, K, -1, E), wk_DxKxE[:, :, None],
                            wv_DxKxE[:, :, None]], axis=2)


def kernel_attention(kernel: tuple[str, bool], q_BxLxHxE: jax.Array, k_BxLxKxE: jax.Array,
                     v_BxLxKxE: jax.Array, causal: bool, window: int | None,
                     scale: float | None, softcap: float | None) -> jax.Array:
    """Attention by ``kernel`` (its name, whether interpreted: the plan's), with
    ``reference_attention``'s arguments; the plan's kernel table refuses a kernel that lacks
    one of them (XLA's and cuDNN's have no soft cap)."""
    name, interpret = kernel
    if name == "splash":
        return splash_attention.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, causal, interpret,
                                       window, softcap, scale)
    if name in ("xla", "cudnn"):  # native grouped-query heads in BTNH
        # cuDNN takes half precision only: a model the plan chose it for, called in fp32
        # (a tool's forward), gets XLA's rather than JAX's refusal
        half = q_BxLxHxE.dtype in (jnp.bfloat16, jnp.float16)
        return jax.nn.dot_product_attention(
            q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, is_causal=causal, scale=scale,
            local_window_size=None if window is None else (window - 1, 0),
            implementation=name if half else "xla")
    return reference_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, causal=causal, window=window,
                               scale=scale, softcap=softcap)


class QKNorm(nnx.Module):
    """``model.qk_norm``: RMSNorm of queries or keys (B x L x N x E) in fp32, over each head's
    E values (``head``: a scale of E) or over all N heads' together (``proj``: a scale of N x E,
    the projection's whole output)."""

    def __init__(self, kind: str, n: int, heads: str, E: int, eps: float,
                 plus_one: bool = False):
        self.whole, self.eps, self.plus_one = kind == "proj", eps, plus_one
        shape, axes = ((n, E), (heads, "head_dim")) if self.whole else ((E,), ("head_dim",))
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)(shape, jnp.float32),
                               axes=axes)

    def __call__(self, x_BxLxNxE: jax.Array) -> jax.Array:
        x = x_BxLxNxE.astype(jnp.float32)
        over = (-2, -1) if self.whole else (-1,)
        rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=over, keepdims=True) + self.eps)
        scale = scale_of(self.scale[...], self.plus_one).astype(jnp.float32)
        return (x * rstd * scale).astype(x_BxLxNxE.dtype)


class Attention(nnx.Module):
    """Causal multi-head / grouped-query attention (bidirectional for ``model.objective=mdlm``,
    masked diffusion). q, k, v are column-parallel (heads on ``tensor``), the output projection
    row-parallel: each device keeps whole heads. ``kernel``: (the attention kernel, whether
    interpreted), the run plan's (``run_plan.compiled_kernel``); the default, XLA's,
    is what a model built without a plan runs (tests, tools)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL):
        D, H, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        E, std = getattr(cfg, "head_dim", None) or D // H, cfg.init_std  # head_dim_of's
        self.H, self.K, self.E = H, K, E
        self.window = getattr(cfg, "sliding_window", None)
        self.pos, self.theta = cfg.pos, cfg.rope_theta
        # model.global_every: the layers alternate (``local`` of each call says which it is);
        # a windowed layer rotates with its own base (Gemma 3)
        self.alternating = getattr(cfg, "global_every", None) is not None
        self.local_theta = getattr(cfg, "rope_local_theta", None) or cfg.rope_theta
        self.softcap, scalar = getattr(cfg, "attn_softcap", None), getattr(cfg, "attn_scalar", None)
        self.scale = None if scalar is None else float(scalar) ** -0.5
        # A tuple, not a dict: static, hashable (NNX keeps a dict attribute as a graph node).
        self.scaling = tuple(sorted(dict(cfg.rope_scaling).items())) if cfg.rope_scaling else None
        # model.attention=reference is the einsum whatever the devices (no plan needed)
        self.kernel = ("reference", False) if cfg.attention == "reference" else kernel
        self.causal = getattr(cfg, "objective", "ar") != "mdlm"
        self.wq = param(rngs, (D, H, E), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        # GPT-2 scales residual-branch outputs by depth at init.
        self.wo = param(rngs, (H, E, D), ("heads", "head_dim", "embed"),
                         std / (2 * cfg.n_layers) ** 0.5)
        qkv_bias = cfg.bias or getattr(cfg, "qkv_bias", False)  # qkv_bias: q, k, v only (Qwen2)
        self.bq = zeros((H, E), ("heads", "head_dim")) if qkv_bias else None
        self.bk = zeros((K, E), ("kv_heads", "head_dim")) if qkv_bias else None
        self.bv = zeros((K, E), ("kv_heads", "head_dim")) if qkv_bias else None
        # Row-parallel bias: replicated and added once, after XLA's reduction of the partial
        # sums (never pre-scaled by 1/tp).
        self.bo = zeros((D,), ("norm",)) if cfg.bias else None
        qk_norm, plus_one = getattr(cfg, "qk_norm", "none"), getattr(cfg, "norm_plus_one", False)
        self.q_norm, self.k_norm = ((QKNorm(qk_norm, H, "heads", E, cfg.norm_eps, plus_one),
                                     QKNorm(qk_norm, K, "kv_heads", E, cfg.norm_eps, plus_one))
                                    if qk_norm != "none" else (None, None))

    def layer_kind(self, local: Any) -> tuple[int | None, float]:
        """(the window, the RoPE base) of a layer: ``local`` says whether it is a windowed one
        where the layers alternate (``model.global_every``); None: every layer alike."""
        if not self.alternating or local is None:
            return self.window, self.theta
        return (self.window, self.local_theta) if local else (None, self.theta)

    def __call__(self, x_BxLxD: jax.Array, local: Any = None) -> jax.Array:
        """``local``: a windowed layer's flag (a traced bool under the layers' scan) where the
        layers alternate: both kinds are compiled, each with its own static window, and
        ``lax.cond`` runs the layer's (a kernel's window is a compile-time constant)."""
        positions_L = context_parallel.true_positions(x_BxLxD.shape[1])
        start = 0 if positions_L is None else positions_L
        if self.alternating and local is not None:
            return jax.lax.cond(local, lambda: self.attend(x_BxLxD, start, True),
                                lambda: self.attend(x_BxLxD, start, False))
        return self.attend(x_BxLxD, start, None)

    def attend(self, x_BxLxD: jax.Array, start: Any, local: Any) -> jax.Array:
        """The layer's attention with the kernel the plan chose, for one kind of layer."""
        window, theta = self.layer_kind(local)
        q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = self.qkv(x_BxLxD, start, theta)
        if not isinstance(start, int):  # the sequence split over `context`
            return self.out(context_parallel.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE))
        return self.out(kernel_attention(self.kernel, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE,
                                         self.causal, window, self.scale, self.softcap))

    def qkv(self, x_BxLxD: jax.Array, start: Any = 0, theta: float | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of tokens at positions ``start``, ``start + 1``, ... (or
        those ``start`` lists, see ``rope``).

        Heads split over a mesh axis (``tensor``): from one matmul. Three separate ones each
        leave a partial sum of the input's gradient per tensor-parallel device, and XLA
        all-reduces each before adding them: three activation all-reduces in the backward where
        Megatron needs one. The three weights are laid side by side per kv head (D x K x (G+2)
        x E): a local concatenation, since ``tensor`` splits q heads in blocks aligned with
        their kv heads. Heads whole on each device: three matmuls, each free to lay its output
        out as the attention kernel reads it (on a TPU, slicing one joined output into splash's
        layout and joining the three gradients cost as much as the projection itself)."""
        if not active_axes("heads"):
            q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = (
                dense(x_BxLxD, w[...], "bld,dhe->blhe") for w in (self.wq, self.wk, self.wv))
            if self.bq is not None:
                q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = (
                    add_bias(a, b[...]) for a, b in ((q_BxLxHxE, self.bq), (k_BxLxKxE, self.bk),
                                                     (v_BxLxKxE, self.bv)))
        else:
            q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = self.joined_qkv(x_BxLxD)
        if self.q_norm is not None:
            q_BxLxHxE, k_BxLxKxE = self.q_norm(q_BxLxHxE), self.k_norm(k_BxLxKxE)
        if self.pos == "rope":
            theta = self.theta if theta is None else theta
            # a windowed layer's own base rotates without the global layers' scaling (Gemma 3)
            scaling = self.scaling if theta == self.theta else None
            q_BxLxHxE = rope(q_BxLxHxE, theta, start, scaling)
            k_BxLxKxE = rope(k_BxLxKxE, theta, start, scaling)
        return q_BxLxHxE, k_BxLxKxE, v_BxLxKxE

    def joined_qkv(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v from the one matmul of their weights side by side (``qkv``)."""
        K, G, E = self.K, self.H // self.K, self.E
        qkv_BxLxKxCxE = dense(x_BxLxD, (self.wq[...], self.wk[...], self.wv[...]),
                              "bld,dkce->blkce", join=join_qkv)
        if self.bq is not None:
            qkv_BxLxKxCxE = add_bias(qkv_BxLxKxCxE, jnp.concatenate(
                [self.bq[...].reshape(K, G, E), self.bk[...][:, None], self.bv[...][:, None]],
                axis=1))
        B, L = x_BxLxD.shape[:2]
        return (qkv_BxLxKxCxE[:, :, :, :G].reshape(B, L, K * G, E), qkv_BxLxKxCxE[:, :, :, G],
                qkv_BxLxKxCxE[:, :, :, G + 1])

    def out(self, o_BxLxHxE: jax.Array) -> jax.Array:
        """The row-parallel output projection of the heads' outputs."""
        y_BxLxD = dense(o_BxLxHxE, self.wo[...], "blhe,hed->bld")
        if self.bo is not None:
            y_BxLxD = add_bias(y_BxLxD, self.bo[...])
        return y_BxLxD


# ------------------------------------------------------------------------------------------------
# The model: the blocks above, stacked (scanned or in a loop), between the embeddings and the
# output head (the module's docstring has the shapes' legend and the dtypes).

ACT = ("batch", "seq", "act_embed")
# The residual stream between the blocks: as ACT, or with parallelism.sequence_parallel split
# along the sequence over `tensor` too (Megatron's sequence parallelism): the norms run on the
# split stream, their outputs are gathered for the column-parallel matmuls, and the row-parallel
# outputs are reduce-scattered into it; backward, the reverse (``gathered_backward``).
STREAM = ("batch", "stream_seq", "act_embed")


class Block(nnx.Module):
    """Attention then the MLP, each a residual branch with its norms where
    ``model.norm_position`` puts them: before (``ln1``, ``ln2``), after (``post``: the same two
    norms on the outputs) or both (``sandwich``: ``ln1_out``, ``ln2_out`` on the outputs).
    ``mlp``: the block's MLP (``dxrun.model.moe``'s MoE); None: ``MLP``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL,
                 mlp: nnx.Module | None = None):
        norms = block_norms(cfg)
        self.ln1 = Norm(cfg.d_model, **norms)
        self.attn = Attention(cfg, rngs, kernel)
        self.ln2 = Norm(cfg.d_model, **norms)
        self.mlp = MLP(cfg, rngs) if mlp is None else mlp
        self.rate = cfg.dropout
        position = getattr(cfg, "norm_position", "pre")
        self.post_norm = position == "post"
        sandwich = position == "sandwich"
        self.ln1_out = Norm(cfg.d_model, **norms) if sandwich else None
        self.ln2_out = Norm(cfg.d_model, **norms) if sandwich else None

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None = None,
                 dtype: Any = None, local: Any = None) -> jax.Array:
        """``local``: whether this is a windowed layer, where the layers alternate."""
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        return self.apply(x_BxLxD, lambda h: self.attn(h, local), k1, k2, dtype)

    def apply(self, x_BxLxD: jax.Array, attend: Any, k1: jax.Array | None = None,
              k2: jax.Array | None = None, dtype: Any = None) -> jax.Array:
        """The block with ``attend`` as its attention: ``self.attn`` when training, attention
        against a key/value cache when decoding (``dxrun.tools.decode``). ``dtype``: the compute
        dtype (default the parameters'); the residual may be wider (fp32)."""
        cd = dtype or self.attn.wq[...].dtype
        x_BxLxD = self.branch(x_BxLxD, attend, self.ln1, self.ln1_out, k1, cd)
        return self.branch(x_BxLxD, self.mlp, self.ln2, self.ln2_out, k2, cd)

    def branch(self, x_BxLxD: jax.Array, f: Any, ln: Norm, ln_out: Norm | None,
               key: jax.Array | None, cd: Any) -> jax.Array:
        """``x + f(ln(x))``; with ``model.norm_position=post`` ``x + ln(f(x))`` (OLMo 2), with
        ``sandwich`` ``x + ln_out(f(ln(x)))`` (Gemma 2/3)."""
        if self.post_norm:
            h = ln(gathered_backward(f(constrain(x_BxLxD.astype(cd), ACT)), ACT))
        else:
            h = gathered_backward(f(constrain(ln(x_BxLxD).astype(cd), ACT)), ACT)
            if ln_out is not None:
                h = ln_out(h)
        x_BxLxD = x_BxLxD + dropout(h, self.rate, key).astype(x_BxLxD.dtype)
        return constrain(x_BxLxD, STREAM)


# model.remat: "full" recomputes each layer in the backward pass (only its input is kept);
# "keep_attention" too, but keeps what the attention kernel's backward reads (its output and
# softmax statistics, named by the kernel), so attention's forward does not run twice;
# "dots" keeps the matmul outputs and recomputes the cheap elementwise rest: the plain matmuls
# (fp32 runs, attention's own) by checkpoint_dots, the mixed-precision weight matmuls (bf16
# compute, fp32 weights: a custom VJP) by their name.
REMAT_POLICIES = {"full": None,
                  "keep_attention": jax.checkpoint_policies.save_only_these_names(RESIDUALS),
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.checkpoint_dots,
                      jax.checkpoint_policies.save_only_these_names(DENSE))}


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL,
                   n: int | None = None, mlp: Any = None) -> Block:
    """``n`` (default ``n_layers``) blocks as one Block whose parameters have a leading
    ``layers`` axis (which the rules table leaves unsharded). Scanning over it compiles one
    layer, not n; the names (``blocks/attn/wq``, ...) are the same whether the layers then scan
    or loop. ``mlp(rngs)``: each block's MLP (None: ``MLP``)."""

    @nnx.split_rngs(splits=n or cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, kernel, None if mlp is None else mlp(rngs))

    blocks = make(rngs)
    for _, v in nnx.iter_graph(blocks):
        if isinstance(v, nnx.Variable) and "axes" in v.get_metadata():
            v.set_metadata(axes=("layers", *v.get_metadata()["axes"]))
    return blocks


class Transformer(nnx.Module):
    """``padded_vocab`` (from the mesh plan; None = ``cfg.vocab_size``) is the number of rows of
    ``wte`` / columns of ``lm_head``: the vocab axis is split over ``tensor``, so it must be a
    multiple of tp. Padding rows start at zero, their logits are masked to the fp32 minimum
    (no probability, never the argmax, zero gradient), so the model computes exactly what the
    unpadded one does. ``kernel``: the attention kernel the run plan chose (``attention_kernel.
    compiled_kernel``: its name, whether interpreted); the default runs XLA's."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, padded_vocab: int | None = None,
                 kernel: tuple[str, bool] = KERNEL, remat: str | None = None):
        D, V = cfg.d_model, cfg.vocab_size
        Vp = padded_vocab or V
        if Vp < V:
            raise ValueError(f"padded_vocab={Vp} is smaller than vocab_size={V}")
        self.vocab_size = V
        self.wte = padded_param(rngs, (V, D), ("vocab", "embed"), cfg.init_std, Vp)
        self.wpe = (param(rngs, (cfg.max_seq_len, D), ("pos", "embed"), cfg.init_std)
                    if cfg.pos == "learned" else None)
        self.blocks = None if cfg.moe.n_experts else stacked_blocks(cfg, rngs, kernel)  # MoE: moe.py
        # remat: the run plan's (a layout search may choose it); None: model.remat
        self.scan, self.remat = cfg.scan_layers, cfg.remat if remat is None else remat
        self.residual_fp32 = cfg.residual_dtype == "fp32"
        self.ln_f = Norm(D, **block_norms(cfg))
        # Gemma's: the embeddings times sqrt(d_model) in the stream's dtype, the logits capped
        self.embed_scale = D**0.5 if getattr(cfg, "embed_scale", False) else None
        self.logit_softcap, self.local_layers = getattr(cfg, "logit_softcap", None), windowed_layers(cfg)
        self.lm_head = (None if cfg.tie_embeddings
                        else padded_param(rngs, (D, V), ("embed", "vocab"), cfg.init_std, Vp))
        self.rate = cfg.dropout

    def run_blocks(self, x_BxLxD: jax.Array, dropout_key: jax.Array | None,
                   dtype: Any = None) -> jax.Array:
        """All layers over the stacked block parameters: one ``lax.scan`` (compiled once,
        whatever the depth) or, with ``model.scan_layers=false``, a Python loop over the same
        parameters (the reference the scan is tested against). ``model.remat`` wraps each
        layer in ``jax.checkpoint``."""
        graphdef, stacked = nnx.split(self.blocks)
        n = jax.tree.leaves(stacked)[0].shape[0]
        keys, local = _layer_inputs(n, self.rate, dropout_key, self.local_layers)

        def layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, None]:
            params, key, is_local = inputs
            return nnx.merge(graphdef, params)(x, key, dtype, is_local), None

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
        if self.scan:
            return jax.lax.scan(layer, x_BxLxD, (stacked, keys, local))[0]
        for i in range(n):
            at_i = jax.tree.map(lambda a, i=i: a[i], (stacked, keys, local))
            x_BxLxD = layer(x_BxLxD, at_i)[0]
        return x_BxLxD

    def __call__(self, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None,
                 dtype: Any = None) -> jax.Array:
        """Logits (fp32) for every position, over the padded vocabulary (padding masked),
        computed in ``dtype`` (default: the parameters' dtype)."""
        return self.head(self.stream(tokens_BxL, dropout_key, dtype), dtype)

    def stream(self, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None,
               dtype: Any = None) -> jax.Array:
        """The residual stream after the last block (the head's input)."""
        positions_L = context_parallel.true_positions(tokens_BxL.shape[1])
        x_BxLxD = self.embed(tokens_BxL, 0 if positions_L is None else positions_L, dtype)
        return self.run_blocks(x_BxLxD, dropout_key, dtype)

    def embed(self, tokens_BxL: jax.Array, start: Any = 0, dtype: Any = None) -> jax.Array:
        """The residual stream's input for tokens at positions ``start``, ``start + 1``, ...
        (or those ``start`` lists: a sequence held in ``context_parallel``'s order).
        Looked up and summed in the tables' dtype, then cast to ``dtype``: with fp32 tables the
        tables' gradients (a scatter and a sum over the batch) stay fp32."""
        # FSDP gathers the table's embed shards first (as for every weight); then the lookup is
        # vocab-parallel (a masked gather over this device's rows, summed over `tensor`).
        # Gathering straight from the fsdp-sharded table made XLA replicate the whole batch's
        # activations ("Involuntary full rematerialization").
        wte_VpxD = constrain(self.wte[...], ("vocab", "act_embed"))
        x_BxLxD = jnp.take(wte_VpxD, tokens_BxL, axis=0)
        if self.wpe is not None:
            x_BxLxD = x_BxLxD + learned_positions(self.wpe[...], start, tokens_BxL.shape[1])
        # model.residual_dtype=fp32: the stream between blocks in fp32
        x_BxLxD = x_BxLxD.astype(jnp.float32 if self.residual_fp32
                                 else dtype or self.wte[...].dtype)
        if self.embed_scale is not None:
            x_BxLxD = x_BxLxD * jnp.asarray(self.embed_scale, x_BxLxD.dtype)
        return constrain(x_BxLxD, STREAM)

    def head(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """Logits (fp32) over the padded vocabulary (padding masked) of the residual stream.
        ``dtype``: the compute dtype (default the parameters'), whatever the stream's."""
        return self.logits(self.output_weight(), self.final_norm(x_BxLxD, dtype))

    def final_norm(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """The output layer's input: the final norm of the stream, in the compute dtype."""
        return constrain(self.ln_f(x_BxLxD).astype(dtype or self.wte[...].dtype), ACT)

    def output_weight(self, gathered: bool = False) -> jax.Array:
        """``lm_head`` (D x Vp), or ``wte`` (Vp x D) with tied embeddings. ``gathered``: pinned
        to its layout at use, d_model whole (FSDP's shards gathered) and the vocabulary over
        ``tensor``, for a caller that keeps it for its own backward (``dxrun.model.objectives``),
        which would otherwise gather the shards a second time."""
        if self.lm_head is None:
            w = self.wte[...]
            return constrain(w, ("vocab", "act_embed")) if gathered else w
        w = self.lm_head[...]
        return constrain(w, ("act_embed", "vocab")) if gathered else w

    def logits(self, w: jax.Array, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (fp32) of the output layer ``w`` (``output_weight``) over the padded
        vocabulary, padding masked; ``x_BxLxD`` the final norm's output. (``dxrun.model.objectives``
        computes the same per chunk and vocabulary shard, masking by each shard's ids.)"""
        spec = "bld,dv->blv" if self.lm_head is not None else "bld,vd->blv"
        logits_BxLxVp = softcapped(dense(x_BxLxD, w, spec, jnp.float32), self.logit_softcap)
        Vp = logits_BxLxVp.shape[-1]
        if Vp > self.vocab_size:
            # A mask, not a slice: slicing the tensor-sharded vocab axis at V would reshard it.
            # The fp32 minimum, not -inf: exp() of it is exactly 0 all the same, but it never
            # makes a NaN (-inf - -inf, 0 * -inf) in the max-subtracted softmax or its gradient.
            real_Vp = jnp.arange(Vp) < self.vocab_size
            logits_BxLxVp = jnp.where(real_Vp, logits_BxLxVp, jnp.finfo(jnp.float32).min)
        return constrain(logits_BxLxVp, ("batch", "seq", "vocab"))


def _layer_inputs(n: int, rate: float, dropout_key: jax.Array | None,
                  local_layers: tuple[bool, ...] | None) -> tuple[Any, Any]:
    """Each of the n layers' dropout key (None: no dropout) and windowed flag (None: the
    layers are alike), the layers' scan's inputs beside their parameters."""
    keys = (None if dropout_key is None or rate == 0
            else jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(jnp.arange(n)))
    return keys, None if local_layers is None else jnp.asarray(local_layers)


def learned_positions(wpe_PxD: jax.Array, start: Any, L: int) -> jax.Array:
    """The learned position embeddings (1 x L x D) of positions ``start``, ``start + 1``, ...
    (or those ``start`` lists)."""
    wpe_LxD = (wpe_PxD[:L] if isinstance(start, int) and start == 0
               else jnp.take(wpe_PxD, start, axis=0) if jnp.ndim(start)
               else jax.lax.dynamic_slice_in_dim(wpe_PxD, start, L))
    return wpe_LxD[None]


def windowed_layers(cfg: ModelConfig) -> tuple[bool, ...] | None:
    """``model.global_every``: whether each layer is a windowed one (the last of each run of
    ``global_every`` attends to the whole prefix); None where the layers are all alike."""
    every = getattr(cfg, "global_every", None)
    return None if every is None else tuple(bool((i + 1) % every) for i in range(cfg.n_layers))


def softcapped(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (``model.logit_softcap``, Gemma 2's); ``x`` with none."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) or x is None


def count_params(params: Any, axes: Any = None, vocab_size: int | None = None) -> int:
    """Number of parameters; with the logical ``axes`` tree and ``vocab_size``, of the real
    vocabulary: the padding rows of ``wte`` / ``lm_head`` are not counted."""
    if axes is None:
        return sum(x.size for x in jax.tree.leaves(params))

    def real(names: tuple | None, x: Any) -> int:
        if names and "vocab" in names:
            return x.size // x.shape[names.index("vocab")] * vocab_size
        return x.size

    return sum(jax.tree.leaves(jax.tree.map(real, axes, params, is_leaf=_is_axes)))


def resize_vocab(params: dict, axes: dict, vocab_size: int, padded_vocab: int) -> dict:
    """Params of any padding brought to ``padded_vocab`` rows: the first ``vocab_size`` rows of
    each ``vocab`` axis kept, zero rows after. Moves a run's weights to a mesh with another tp
    (whose padding differs); arrays already of the right shape are passed through untouched."""

    def resize(names: tuple | None, x: Any) -> Any:
        if not names or "vocab" not in names:
            return x
        axis = names.index("vocab")
        if x.shape[axis] == padded_vocab:
            return x
        if x.shape[axis] < vocab_size:
            raise ValueError(f"a {x.shape} parameter has fewer than vocab_size={vocab_size} rows")
        x = np.take(np.asarray(x), np.arange(vocab_size), axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded_vocab - vocab_size)
        return np.pad(x, pad)

    return jax.tree.map(resize, axes, params, is_leaf=_is_axes)
