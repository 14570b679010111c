"""The hand-written step dxrun's own is measured against: a GPT-2 forward written out in plain
``jax.numpy`` over the same parameter dict, the same optax optimizer, one bare ``jax.jit``.

It is what someone would write without a framework: no in/out shardings (the parameters arrive
already placed by the same rules, and the jit follows them), no activation constraints, the loss
as its only metric, the batch placed with ``jax.device_put``. Only the GPT-2 block (layernorm,
GELU, biases, learned positions) is written out: it is what the suite measures.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dxrun.plan import RESIDUALS


def _layernorm(x_BxLxD: jax.Array, p: dict) -> jax.Array:
    x = x_BxLxD.astype(jnp.float32)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return y.astype(x_BxLxD.dtype)


def _block(x_BxLxD: jax.Array, p: dict, attend: Any = None) -> tuple[jax.Array, None]:
    a, m = p["attn"], p["mlp"]
    h = _layernorm(x_BxLxD, p["ln1"])
    q = jnp.einsum("bld,dhe->blhe", h, a["wq"]) + a["bq"]
    k = jnp.einsum("bld,dhe->blhe", h, a["wk"]) + a["bk"]
    v = jnp.einsum("bld,dhe->blhe", h, a["wv"]) + a["bv"]
    o = (attend or partial(jax.nn.dot_product_attention, is_causal=True))(q, k, v)
    x_BxLxD = x_BxLxD + jnp.einsum("blhe,hed->bld", o, a["wo"]) + a["bo"]
    h = jax.nn.gelu(_layernorm(x_BxLxD, p["ln2"]) @ m["w_up"] + m["b_up"], approximate=True)
    return x_BxLxD + h @ m["w_down"] + m["b_down"], None


def loss(params: dict, tokens_BxT: jax.Array, dtype: Any = None, attend: Any = None,
         remat: str = "none") -> jax.Array:
    """Next-token cross-entropy of the tied-embedding GPT-2 whose parameters dxrun made.
    ``dtype``: the compute dtype the (fp32) parameters are cast to at the start (None: as they
    are); the norms and the loss in fp32. ``attend(q, k, v)``: causal attention (None: jax.nn's)."""
    if dtype is not None:
        params = jax.tree.map(lambda p: p.astype(dtype), params)
    inputs_BxL, targets_BxL = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
    L = inputs_BxL.shape[1]
    x_BxLxD = params["wte"][inputs_BxL] + params["wpe"][:L]
    block = partial(_block, attend=attend)
    if remat != "none":
        policies = {"full": None, "dots": jax.checkpoint_policies.checkpoint_dots,
                    # splash's output and log-sum-exp, by the name its residuals are given
                    "keep_attention": jax.checkpoint_policies.save_only_these_names(RESIDUALS)}
        block = jax.checkpoint(block, policy=policies[remat])
    x_BxLxD, _ = jax.lax.scan(block, x_BxLxD, params["blocks"])
    x_BxLxD = _layernorm(x_BxLxD, params["ln_f"])
    head = params["lm_head"].T if "lm_head" in params else params["wte"]
    logits_BxLxV = jnp.einsum("bld,vd->blv", x_BxLxD, head,
                              preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()


def make_step(tx: optax.GradientTransformation, donate: bool = True, dtype: Any = None,
              attend: Any = None, remat: str = "none") -> Any:
    """``step(params, opt_state, tokens) -> (params, opt_state, loss)``, jitted bare.
    ``remat``: each block under ``jax.checkpoint``, ``full`` (its input kept), ``keep_attention``
    (splash's residuals kept too, by their name) or ``dots`` (its matmul outputs kept: JAX's
    ``checkpoint_dots``), as anyone would write it."""
    def step(params: dict, opt_state: Any, tokens_BxT: jax.Array):
        value, grads = jax.value_and_grad(loss)(params, tokens_BxT, dtype, attend, remat)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
