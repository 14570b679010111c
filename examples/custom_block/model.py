"""A small decoder-only model with its own block (GPT-J's parallel block: attention and MLP
read the same RMS-normed input and are added to the residual together), written against
dxrun's model protocol (``dxrun/model/user_model.py``):

* ``CustomLM(**model.kwargs, vocab_size=..., rngs=...)`` builds it;
* every parameter is an ``nnx.Param`` with logical axes, one name per dimension, from dxrun's
  rules table (``vocab``, ``embed``, ``heads``, ``head_dim``, ``mlp``, ``pos``, ``norm``, ...);
  dxrun maps them to the mesh (``heads``, ``mlp``, ``vocab`` over ``tensor``);
* ``model(tokens_BxL) -> logits_BxLxV``, causal.

Train it (from the repository root)::

    PYTHONPATH=examples python -m dxrun model._target_=custom_block.CustomLM \\
        +model.kwargs.d_model=32 +model.kwargs.n_layers=2 parallelism=dp4_tp2
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
           std: float = 0.02) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _rms(x: jax.Array, scale: nnx.Param) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale[...]


class ParallelBlock(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, rngs: nnx.Rngs):
        E = d_model // n_heads
        self.scale = nnx.Param(jnp.ones((d_model,)), axes=("norm",))
        self.wqkv = _param(rngs, (d_model, 3, n_heads, E), ("embed", None, "heads", "head_dim"))
        self.wo = _param(rngs, (n_heads, E, d_model), ("heads", "head_dim", "embed"))
        self.w_up = _param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_down = _param(rngs, (d_ff, d_model), ("mlp", "embed"))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxD = _rms(x_BxLxD, self.scale)
        q, k, v = jnp.unstack(jnp.einsum("bld,dthe->tblhe", h_BxLxD, self.wqkv[...]))
        L = x_BxLxD.shape[1]
        causal_LxL = jnp.tril(jnp.ones((L, L), bool))
        o_BxLxHxE = jax.nn.dot_product_attention(q, k, v, mask=causal_LxL)
        attn_BxLxD = jnp.einsum("blhe,hed->bld", o_BxLxHxE, self.wo[...])
        mlp_BxLxD = jax.nn.gelu(h_BxLxD @ self.w_up[...]) @ self.w_down[...]
        return x_BxLxD + attn_BxLxD + mlp_BxLxD


class CustomLM(nnx.Module):
    def __init__(self, vocab_size: int, rngs: nnx.Rngs, d_model: int = 32, n_layers: int = 2,
                 n_heads: int = 4, d_ff: int = 128, max_seq_len: int = 128):
        self.wte = _param(rngs, (vocab_size, d_model), ("vocab", "embed"))
        self.wpe = _param(rngs, (max_seq_len, d_model), ("pos", "embed"))
        self.blocks = nnx.List([ParallelBlock(d_model, n_heads, d_ff, rngs)
                                for _ in range(n_layers)])
        self.scale = nnx.Param(jnp.ones((d_model,)), axes=("norm",))
        self.lm_head = _param(rngs, (d_model, vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        L = tokens_BxL.shape[1]
        x_BxLxD = jnp.take(self.wte[...], tokens_BxL, axis=0) + self.wpe[...][:L][None]
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return _rms(x_BxLxD, self.scale) @ self.lm_head[...]
