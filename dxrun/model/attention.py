"""Causal multi-head / grouped-query attention, and rotary positions (``model.pos=rope``).

q, k, v are column-parallel (heads on ``tensor``), the output projection row-parallel. The
kernel is the run plan's (``MeshPlan.attention``, chosen by ``dxrun.plan.run_plan``); the
written-out ``reference_attention`` is what every kernel is tested against. Shapes are in the
names as in ``dxrun.model.transformer`` (B batch, L length, D d_model, H heads, K kv heads,
G = H/K, E head dim); scores and softmax run in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.model import context_parallel, splash_attention
from dxrun.model.layers import add_bias, dense, param, scale_of, zeros
from dxrun.model.sharding import active_axes

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


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
