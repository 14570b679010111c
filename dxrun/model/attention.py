"""Causal multi-head / grouped-query attention, and rotary positions (``model.pos=rope``).

q, k, v are column-parallel (heads on ``tensor``), the output projection row-parallel. The kernel is
the run plan's (``MeshPlan.attention``, chosen by ``dxrun.plan.attention_kernel``); the written-out
``reference_attention`` is what every kernel is tested against. Shapes are in the names (the legend is in
``dxrun.model.transformer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.model import context_parallel, splash_attention
from dxrun.model.layers import add_bias, dense, param, zeros
from dxrun.model.sharding import active_axes

if TYPE_CHECKING:
    from dxrun.config.schema import ModelConfig


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


def reference_attention(q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                        mask_LxS: jax.Array | None = None, causal: bool = True) -> jax.Array:
    """Attention written out (``model.attention=reference``): what the fused kernel is tested
    against. Causal (L = S) unless ``mask_LxS`` says which keys each query sees (decoding
    against a key/value cache); ``causal=False`` and no mask: every key (masked diffusion)."""
    B, L, H, E = q_BxLxHxE.shape
    K = k_BxSxKxE.shape[2]
    # Head h uses kv head h // G; heads are split over `tensor` in contiguous blocks that
    # stay aligned with their kv heads (n_kv_heads % tp == 0 is checked by the plan).
    q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
    # Scores and softmax in fp32 for stability under bf16 compute.
    s_BxKxGxLxS = jnp.einsum("blkge,bske->bkgls", q_BxLxKxGxE, k_BxSxKxE,
                             preferred_element_type=jnp.float32) * E**-0.5
    if mask_LxS is None and causal:
        mask_LxS = jnp.tril(jnp.ones((L, L), bool))
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


class Attention(nnx.Module):
    """Causal multi-head / grouped-query attention (bidirectional for ``model.objective=mdlm``,
    masked diffusion). q, k, v are column-parallel (heads on ``tensor``), the output projection
    row-parallel: each device keeps whole heads. ``kernel``: (the attention kernel, whether
    interpreted), the run plan's (``attention_kernel.compiled_kernel``); the default, XLA's,
    is what a model built without a plan runs (tests, tools)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL):
        D, H, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        E, std = D // H, cfg.init_std
        self.H, self.K, self.E = H, K, E
        self.pos, self.theta = cfg.pos, cfg.rope_theta
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
        if cfg.bias:
            self.bq = zeros((H, E), ("heads", "head_dim"))
            self.bk = zeros((K, E), ("kv_heads", "head_dim"))
            self.bv = zeros((K, E), ("kv_heads", "head_dim"))
            # Row-parallel bias: replicated and added once, after XLA's reduction of the
            # partial sums (never pre-scaled by 1/tp).
            self.bo = zeros((D,), ("norm",))
        else:
            self.bq = self.bk = self.bv = self.bo = None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        positions_L = context_parallel.true_positions(x_BxLxD.shape[1])
        q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = self.qkv(
            x_BxLxD, 0 if positions_L is None else positions_L)
        name, interpret = self.kernel
        if positions_L is not None:  # the sequence split over `context`
            o_BxLxHxE = context_parallel.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
        elif name == "splash":
            o_BxLxHxE = splash_attention.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, self.causal,
                                                interpret)
        elif name in ("xla", "cudnn"):  # native grouped-query heads in BTNH
            # cuDNN takes half precision only: a model the plan chose it for, called in fp32
            # (a tool's forward), gets XLA's rather than JAX's refusal
            half = q_BxLxHxE.dtype in (jnp.bfloat16, jnp.float16)
            o_BxLxHxE = jax.nn.dot_product_attention(
                q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, is_causal=self.causal,
                implementation=name if half else "xla")
        else:
            o_BxLxHxE = reference_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE,
                                            causal=self.causal)
        return self.out(o_BxLxHxE)

    def qkv(self, x_BxLxD: jax.Array, start: Any = 0
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
        if self.pos == "rope":
            q_BxLxHxE = rope(q_BxLxHxE, self.theta, start, self.scaling)
            k_BxLxKxE = rope(k_BxLxKxE, self.theta, start, self.scaling)
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
