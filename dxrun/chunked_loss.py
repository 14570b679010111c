"""The loss without the whole logits tensor (``model.loss_chunk``).

The output layer's fp32 logits, ``[batch, seq, vocab]``, are the largest activation of a
step with a GPT-2 vocabulary (3.3 GB for 16 x 1024 tokens of vocab 50304, and as much again for
their gradient). Chunked, the cross-entropy and the accuracy are computed over ``chunk``
positions of every sequence at a time under one ``lax.map`` (a scan): each chunk's logits come
out of the output matmul (compute dtype operands, fp32 accumulation and result, exactly as the
unchunked head's), their log-sum-exp in fp32, and only the chunk's two sums leave it. The chunk
is a ``jax.checkpoint``: its backward recomputes the chunk's logits instead of the scan keeping
every chunk's, so the whole tensor is never live; the cost is the output matmul once more.

Chunks run along the sequence, so every chunk keeps the batch's sharding over (data, fsdp) and
the vocabulary's over ``tensor``: no data moves. The logits stay fp32 (not the compute dtype)
so the chunked loss is the unchunked one under bf16 as well; a chunk's are small.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def chunked_cross_entropy(logits_fn: Any, w: Any, x_BxLxD: Any, targets_BxL: Any,
                          chunk: int) -> tuple[Any, Any]:
    """Mean cross-entropy and accuracy of ``logits_fn(w, x) -> fp32 logits`` (the model's
    output layer, padding masked) over ``targets_BxL``, ``chunk`` positions at a time."""

    B, L, D = x_BxLxD.shape
    N = L // chunk
    x_NxBxCxD = x_BxLxD.reshape(B, N, chunk, D).swapaxes(0, 1)
    t_NxBxC = targets_BxL.reshape(B, N, chunk).swapaxes(0, 1)

    @jax.checkpoint  # nothing saved: the backward recomputes the chunk's logits
    def one(w: Any, x_BxCxD: Any, t_BxC: Any) -> tuple[Any, Any]:
        logits_BxCxV = logits_fn(w, x_BxCxD)
        # optax.softmax_cross_entropy_with_integer_labels' formula, in fp32
        shifted = logits_BxCxV - jax.lax.stop_gradient(logits_BxCxV.max(-1, keepdims=True))
        label = jnp.take_along_axis(shifted, t_BxC[..., None], axis=-1)[..., 0]
        nll_BxC = jnp.log(jnp.exp(shifted).sum(-1)) - label
        correct = (logits_BxCxV.argmax(-1) == t_BxC).sum(dtype=jnp.float32)
        return nll_BxC.sum(), correct

    nll_N, correct_N = jax.lax.map(lambda xs: one(w, *xs), (x_NxBxCxD, t_NxBxC))
    return nll_N.sum() / (B * L), correct_N.sum() / (B * L)
