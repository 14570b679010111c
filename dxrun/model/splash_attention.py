"""Pallas' splash attention (TPU), the ``splash`` entry of ``dxrun.plan.run_plan``.

JAX ships the kernel (``jax.experimental.pallas.ops.tpu.splash_attention``): flash attention in
blocks whose fully masked blocks are skipped (the causal half), with its own backward (one fused
dK/dV/dQ kernel). It takes one sequence's heads, ``[heads, L, E]``; queries of a grouped-query
model go to its MQA form, one kv head's query group at a time. A Pallas call is opaque to XLA's
partitioner, so under a mesh it runs in a ``jax.shard_map`` over the batch and head axes the
rules put the activations on (each device attends its own rows and heads: no collective).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dxrun.model.sharding import active_spec
from dxrun.plan import RESIDUALS

# Longest block of queries and keys: on a v5e a 512-long block ran the GPT-2 shapes' forward and
# backward fastest (BENCHMARKS.md, "TPU"); shorter sequences take the longest multiple of 128
# that divides them.
SPLASH_BLOCK = 512


def block_len(seq_len: int) -> int:
    return max(b for b in range(128, min(SPLASH_BLOCK, seq_len) + 1, 128) if seq_len % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, seq_len: int, causal: bool, mqa: bool, interpret: bool,
            window: int | None = None, softcap: float | None = None):
    """The kernel for ``heads`` heads of one sequence (made once per shape: its mask is
    processed on the host, in numpy). ``window``: splash's local mask, the last ``window``
    keys up to the query (``model.sliding_window``); ``softcap``: its scores' soft cap."""
    # Pallas' kernels imported where splash runs, not in every process that imports the model
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (seq_len, seq_len)
    one = (sa.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window is not None
           else sa.CausalMask(shape) if causal else sa.FullMask(shape))
    b = block_len(seq_len)
    blocks = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                           block_kv_dkv=b, block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    make = sa.make_splash_mqa_single_device if mqa else sa.make_splash_mha_single_device
    # Made inside a trace, its mask's block tables must still be constants (it is cached).
    with jax.ensure_compile_time_eval():
        return make(sa.MultiHeadMask([one] * heads), block_sizes=blocks, interpret=interpret,
                    residual_checkpoint_name=RESIDUALS, attn_logits_soft_cap=softcap)


def _local(q_BxLxHxE: jax.Array, k_BxLxKxE: jax.Array, v_BxLxKxE: jax.Array, causal: bool,
           interpret: bool, window: int | None = None, softcap: float | None = None,
           scale: float | None = None) -> jax.Array:
    """Attention of the rows and heads this device holds."""
    B, L, H, E = q_BxLxHxE.shape
    K = k_BxLxKxE.shape[2]
    G = H // K
    # The kernel does not scale: the queries are, in their own dtype (a power of two for
    # E = 64 and 256, so exact there); ``scale``: model.attn_scalar's, else E^-1/2.
    q_BxLxHxE = q_BxLxHxE * jnp.asarray(scale or E**-0.5, q_BxLxHxE.dtype)
    k_BxKxLxE, v_BxKxLxE = (x.transpose(0, 2, 1, 3) for x in (k_BxLxKxE, v_BxLxKxE))
    if G == 1:
        kernel = _kernel(H, L, causal, False, interpret, window, softcap)
        o_BxHxLxE = jax.vmap(kernel)(q_BxLxHxE.transpose(0, 2, 1, 3), k_BxKxLxE, v_BxKxLxE)
        return o_BxHxLxE.transpose(0, 2, 1, 3)
    kernel = _kernel(G, L, causal, True, interpret, window, softcap)
    q_BxKxGxLxE = q_BxLxHxE.reshape(B, L, K, G, E).transpose(0, 2, 3, 1, 4)
    o_BxKxGxLxE = jax.vmap(jax.vmap(kernel))(q_BxKxGxLxE, k_BxKxLxE, v_BxKxLxE)
    return o_BxKxGxLxE.transpose(0, 3, 1, 2, 4).reshape(B, L, H, E)


def attend(q_BxLxHxE: jax.Array, k_BxLxKxE: jax.Array, v_BxLxKxE: jax.Array, causal: bool = True,
           interpret: bool = False, window: int | None = None, softcap: float | None = None,
           scale: float | None = None) -> jax.Array:
    """Splash attention of BTNH queries, keys and values (grouped-query heads: fewer kv heads).
    ``interpret``: Pallas' interpreter (CPU; the suite's check against ``reference``);
    ``window``, ``softcap``, ``scale``: ``reference_attention``'s."""
    local = functools.partial(_local, causal=causal, interpret=interpret, window=window,
                              softcap=softcap, scale=scale)
    q_spec = active_spec(("batch", "seq", "heads", "head_dim"))
    if q_spec == jax.sharding.PartitionSpec():  # no mesh, or every device holds everything
        return local(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
    kv_spec = active_spec(("batch", "seq", "kv_heads", "head_dim"))
    return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
