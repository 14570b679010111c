"""Context parallelism in the model: the sequence split over the ``context`` mesh axis.

Every activation's ``seq`` axis maps to ``context`` in the rules table, so GSPMD splits the
residual stream, the MLP and the loss along the sequence with no code of their own. Attention
is the one place a token needs the others: ``attend`` runs it under ``jax.shard_map``, each
device all-gathering the keys and values of its sequence over ``context`` (one all-gather of
K and V together per layer, their gradients reduce-scattered backward) and attending with its
own queries, a block of keys at a time (``flash``), under a causal mask of the true positions.
The sequence is held in the zig-zag order of ``dxrun.plan.run_plan`` (``in_context_order``: the
step permutes the inputs and the targets once), which balances the causal work over the
devices; positions, learned or rotary, are the true ones (``true_positions``). Outside a mesh
with ``context`` > 1 every function here is the identity or None.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dxrun.model.sharding import active_axes, active_spec, constrain
from dxrun.plan import BLOCK, zigzag_order

FLOOR = float(np.finfo(np.float32).min)  # a masked score: exp() of it is 0, never a NaN


def context_size() -> int:
    """Devices each sequence is split over in the step being traced (1 outside a mesh)."""
    return math.prod(active_axes("seq").values())


def true_positions(seq_len: int) -> jax.Array | None:
    """The true position of each slot of a sequence held in context order; None when the
    sequence is in its own order (no context axis)."""
    cp = context_size()
    return None if cp == 1 else jnp.asarray(zigzag_order(seq_len, cp), jnp.int32)


def in_context_order(tokens_BxL: jax.Array) -> jax.Array:
    """Each sequence permuted into the zig-zag order and split over ``context``: a local
    gather, the tokens arrive whole on every device of the axis."""
    positions = true_positions(tokens_BxL.shape[1])
    if positions is None:
        return tokens_BxL
    return constrain(jnp.take(tokens_BxL, positions, axis=1), ("batch", "seq"))


def attend(q_BxLxHxE: jax.Array, k_BxLxKxE: jax.Array, v_BxLxKxE: jax.Array) -> jax.Array:
    """Causal attention of a sequence split over ``context``: each device's queries (l = L/cp
    of each sequence) against the whole sequence's keys and values, gathered."""
    axes = tuple(active_axes("seq"))
    L, cp = q_BxLxHxE.shape[1], context_size()
    q_spec = active_spec(("batch", "seq", "heads", "head_dim"))
    kv_spec = active_spec(("batch", "seq", "kv_heads", "head_dim"))

    def local(q_BxlxHxE: jax.Array, k_BxlxKxE: jax.Array, v_BxlxKxE: jax.Array) -> jax.Array:
        # K and V in one gather: one collective per layer, not two.
        kv_2xBxLxKxE = jax.lax.all_gather(jnp.stack([k_BxlxKxE, v_BxlxKxE]), axes, axis=2,
                                          tiled=True)
        order_L = jnp.asarray(zigzag_order(L, cp), jnp.int32)
        l = L // cp  # noqa: E741 - the local length, beside L
        mine_l = jax.lax.dynamic_slice_in_dim(order_L, jax.lax.axis_index(axes) * l, l)
        return flash(q_BxlxHxE, kv_2xBxLxKxE[0], kv_2xBxLxKxE[1], mine_l, order_L,
                     block_len(L, cp))

    # check_vma off: the kernel's scans start from constants, which it would have cast to
    # varying over every mesh axis; the gradients are the same either way.
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(
        q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)


def block_len(seq_len: int, cp: int, most: int = BLOCK) -> int:
    """Keys per block of ``flash``: the largest divisor of the sequence up to ``most`` and to
    one zig-zag chunk (so a short test sequence still runs several blocks)."""
    cap = min(most, seq_len // (2 * cp))
    return max(d for d in range(1, cap + 1) if seq_len % d == 0)


def _blocks(x_BxLx_: jax.Array, C: int) -> jax.Array:
    """[B, L, ...] -> [L/C, B, C, ...]: the blocks a scan runs over."""
    B, L = x_BxLx_.shape[:2]
    return jnp.moveaxis(x_BxLx_.reshape(B, L // C, C, *x_BxLx_.shape[2:]), 1, 0)


def _scores(q_BxlxKxGxE: jax.Array, k_BxCxKxE: jax.Array) -> jax.Array:
    # fp32 scores, as the other kernels', for stability under bf16 compute
    return jnp.einsum("blkge,bcke->bkglc", q_BxlxKxGxE, k_BxCxKxE,
                      preferred_element_type=jnp.float32) * q_BxlxKxGxE.shape[-1] ** -0.5


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash(q_BxlxHxE: jax.Array, k_BxLxKxE: jax.Array, v_BxLxKxE: jax.Array,
          q_pos_l: jax.Array, k_pos_L: jax.Array, C: int) -> jax.Array:
    """Softmax attention of queries at positions ``q_pos_l`` over keys and values at positions
    ``k_pos_L`` (query p sees the keys at positions <= p), ``C`` keys at a time with a running
    max and sum: flash attention's algorithm, written in JAX. Its backward recomputes each
    block's scores from the output and the log-sum-exp it keeps, so no l x L tensor is ever
    alive, forward or backward: one block's l x C."""
    return _forward(q_BxlxHxE, k_BxLxKxE, v_BxLxKxE, q_pos_l, k_pos_L, C)[0]


def _forward(q_BxlxHxE: jax.Array, k_BxLxKxE: jax.Array, v_BxLxKxE: jax.Array,
             q_pos_l: jax.Array, k_pos_L: jax.Array, C: int) -> tuple[jax.Array, tuple]:
    B, l, H, E = q_BxlxHxE.shape  # noqa: E741
    K = k_BxLxKxE.shape[2]
    q_BxlxKxGxE = q_BxlxHxE.reshape(B, l, K, H // K, E)

    def block(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        m_BxKxGxl, sum_BxKxGxl, o_BxlxKxGxE = carry
        k_BxCxKxE, v_BxCxKxE, k_pos_C = xs
        seen_lxC = q_pos_l[:, None] >= k_pos_C[None, :]
        s_BxKxGxlxC = jnp.where(seen_lxC, _scores(q_BxlxKxGxE, k_BxCxKxE), FLOOR)
        new_BxKxGxl = jnp.maximum(m_BxKxGxl, s_BxKxGxlxC.max(-1))
        p_BxKxGxlxC = jnp.where(seen_lxC, jnp.exp(s_BxKxGxlxC - new_BxKxGxl[..., None]), 0.0)
        scale_BxKxGxl = jnp.exp(m_BxKxGxl - new_BxKxGxl)
        sum_BxKxGxl = sum_BxKxGxl * scale_BxKxGxl + p_BxKxGxlxC.sum(-1)
        o_BxlxKxGxE = o_BxlxKxGxE * jnp.moveaxis(scale_BxKxGxl, -1, 1)[..., None] + jnp.einsum(
            "bkglc,bcke->blkge", p_BxKxGxlxC.astype(v_BxCxKxE.dtype), v_BxCxKxE,
            preferred_element_type=jnp.float32)
        return (new_BxKxGxl, sum_BxKxGxl, o_BxlxKxGxE), None

    init = (jnp.full((B, K, H // K, l), FLOOR, jnp.float32),
            jnp.zeros((B, K, H // K, l), jnp.float32),
            jnp.zeros((B, l, K, H // K, E), jnp.float32))
    (m_BxKxGxl, sum_BxKxGxl, o_BxlxKxGxE), _ = jax.lax.scan(
        block, init, (_blocks(k_BxLxKxE, C), _blocks(v_BxLxKxE, C), k_pos_L.reshape(-1, C)))
    o_BxlxKxGxE = o_BxlxKxGxE / jnp.moveaxis(sum_BxKxGxl, -1, 1)[..., None]
    o_BxlxHxE = o_BxlxKxGxE.reshape(B, l, H, E).astype(q_BxlxHxE.dtype)
    lse_BxKxGxl = m_BxKxGxl + jnp.log(sum_BxKxGxl)
    return o_BxlxHxE, (q_BxlxHxE, k_BxLxKxE, v_BxLxKxE, o_BxlxHxE, lse_BxKxGxl, q_pos_l, k_pos_L)


def _backward(C: int, saved: tuple, do_BxlxHxE: jax.Array) -> tuple:
    q_BxlxHxE, k_BxLxKxE, v_BxLxKxE, o_BxlxHxE, lse_BxKxGxl, q_pos_l, k_pos_L = saved
    B, l, H, E = q_BxlxHxE.shape  # noqa: E741
    K = k_BxLxKxE.shape[2]
    q_BxlxKxGxE = q_BxlxHxE.reshape(B, l, K, H // K, E)
    do_BxlxKxGxE = do_BxlxHxE.reshape(B, l, K, H // K, E)
    # D = rowsum(dO * O): the softmax's backward term, per query (flash attention's)
    d_BxKxGxl = jnp.einsum("blkge,blkge->bkgl", do_BxlxKxGxE.astype(jnp.float32),
                           o_BxlxHxE.reshape(B, l, K, H // K, E).astype(jnp.float32))

    def block(dq_BxlxKxGxE: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        k_BxCxKxE, v_BxCxKxE, k_pos_C = xs
        seen_lxC = q_pos_l[:, None] >= k_pos_C[None, :]
        p_BxKxGxlxC = jnp.where(seen_lxC, jnp.exp(_scores(q_BxlxKxGxE, k_BxCxKxE)
                                                  - lse_BxKxGxl[..., None]), 0.0)
        dv_BxCxKxE = jnp.einsum("bkglc,blkge->bcke", p_BxKxGxlxC.astype(do_BxlxHxE.dtype),
                                do_BxlxKxGxE, preferred_element_type=jnp.float32)
        dp_BxKxGxlxC = jnp.einsum("blkge,bcke->bkglc", do_BxlxKxGxE, v_BxCxKxE,
                                  preferred_element_type=jnp.float32)
        ds_BxKxGxlxC = p_BxKxGxlxC * (dp_BxKxGxlxC - d_BxKxGxl[..., None]) * E**-0.5
        dq_BxlxKxGxE = dq_BxlxKxGxE + jnp.einsum(
            "bkglc,bcke->blkge", ds_BxKxGxlxC.astype(k_BxCxKxE.dtype), k_BxCxKxE,
            preferred_element_type=jnp.float32)
        dk_BxCxKxE = jnp.einsum("bkglc,blkge->bcke", ds_BxKxGxlxC.astype(q_BxlxHxE.dtype),
                                q_BxlxKxGxE, preferred_element_type=jnp.float32)
        return dq_BxlxKxGxE, (dk_BxCxKxE.astype(k_BxLxKxE.dtype),
                              dv_BxCxKxE.astype(v_BxLxKxE.dtype))

    dq_BxlxKxGxE, (dk_NxBxCxKxE, dv_NxBxCxKxE) = jax.lax.scan(
        block, jnp.zeros((B, l, K, H // K, E), jnp.float32),
        (_blocks(k_BxLxKxE, C), _blocks(v_BxLxKxE, C), k_pos_L.reshape(-1, C)))

    def unblock(x_NxBxCx_: jax.Array) -> jax.Array:
        return jnp.moveaxis(x_NxBxCx_, 0, 1).reshape(B, -1, *x_NxBxCx_.shape[3:])

    def no_gradient(positions: jax.Array) -> np.ndarray:  # integer inputs: float0 cotangents
        return np.zeros(positions.shape, jax.dtypes.float0)

    return (dq_BxlxKxGxE.reshape(B, l, H, E).astype(q_BxlxHxE.dtype), unblock(dk_NxBxCxKxE),
            unblock(dv_NxBxCxKxE), no_gradient(q_pos_l), no_gradient(k_pos_L))


flash.defvjp(_forward, _backward)
