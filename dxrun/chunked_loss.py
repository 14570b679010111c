"""The loss without the whole logits tensor (``model.loss_chunk``).

The output layer's fp32 logits, ``[batch, seq, vocab]``, are the largest activation of a
step with a GPT-2 vocabulary (3.3 GB for 16 x 1024 tokens of vocab 50304, and as much again for
their gradient). Chunked, the cross-entropy and the accuracy are computed over ``chunk``
positions of every sequence at a time under a scan: each chunk's logits come out of the output
matmul (compute dtype operands, fp32 accumulation and result, exactly as the unchunked head's),
their log-sum-exp in fp32, and only the chunk's two sums leave it. The backward (a custom VJP)
recomputes each chunk's logits instead of keeping every chunk's, so the whole tensor is never
live; the cost is the output matmul once more.

Chunks run along the sequence, so every chunk keeps the batch's sharding over (data, fsdp) and
the vocabulary's over ``tensor``: no data moves. The logits stay fp32 (not the compute dtype)
so the chunked loss is the unchunked one under bf16 as well; a chunk's are small.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dxrun.sharding import active_axes, without_mesh_axis


def chunked_cross_entropy(logits_fn: Any, w: Any, x_BxLxD: Any, targets_BxL: Any,
                          chunk: int) -> tuple[Any, Any]:
    """Mean cross-entropy and accuracy of ``logits_fn(w, x) -> fp32 logits`` (the model's
    output layer, padding masked) over ``targets_BxL``, ``chunk`` positions at a time.

    The output weight's gradient is reduced over the batch's devices once, after the chunks,
    as the unchunked step's is. Left to autodiff and the partitioner, each chunk's gradient of
    ``w`` (a contraction over the batch, split over data and fsdp) was all-reduced inside the
    backward scan: once per chunk. So the chunks run per replica, R of them, one per device
    group the active rules put ``batch`` on: a ``jax.vmap`` whose mapped axis takes those mesh
    axes (``spmd_axis_name``, as ``dxrun.step.accumulated_grads`` does for ``data``). Its
    forward gives each replica's sums, its custom VJP each replica's gradient of ``w``,
    accumulated in the scan with nothing to reduce and summed over the replicas after it: one
    reduction. Autodiff could not keep it per replica without ``w`` broadcast to R copies (its
    transpose is then the sum), a copy of the output layer on every device; a ``shard_map``
    manual over the batch axes would need the model's constraints rewritten inside it, and
    would nest under ``accumulated_grads``' vmap over ``data``."""
    B, L, D = x_BxLxD.shape
    replicas = active_axes("batch")
    R, axes, N = math.prod(replicas.values()), tuple(replicas), L // chunk

    def chunks(a: Any) -> Any:  # [B, L, ...] -> [N, R, B/R, chunk, ...]: replica r's rows
        return jnp.moveaxis(a.reshape(R, B // R, N, chunk, *a.shape[2:]), 2, 0)

    def per_replica(f: Any) -> Any:  # f(w, x, t) of one replica's chunk, on every replica
        mapped = jax.vmap(f, in_axes=(None, 0, 0), spmd_axis_name=axes or None)

        def run(*args: Any) -> Any:
            with _without(axes):  # the mapped axis holds the batch's mesh axes
                return mapped(*args)
        return run

    def one(w: Any, x_bxCxD: Any, t_bxC: Any) -> tuple[Any, Any]:
        logits_bxCxV = logits_fn(w, x_bxCxD)
        # optax.softmax_cross_entropy_with_integer_labels' formula, in fp32
        shifted = logits_bxCxV - jax.lax.stop_gradient(logits_bxCxV.max(-1, keepdims=True))
        label = jnp.take_along_axis(shifted, t_bxC[..., None], axis=-1)[..., 0]
        nll_bxC = jnp.log(jnp.exp(shifted).sum(-1)) - label
        correct = (logits_bxCxV.argmax(-1) == t_bxC).sum(dtype=jnp.float32)
        return nll_bxC.sum(), correct

    @jax.custom_vjp
    def sums(w: Any, x_N: Any, t_N: Any) -> tuple[Any, Any]:
        nll_NxR, correct_NxR = jax.lax.map(lambda xs: per_replica(one)(w, *xs), (x_N, t_N))
        return nll_NxR.sum(), correct_NxR.sum()

    def forward(w: Any, x_N: Any, t_N: Any) -> tuple[tuple[Any, Any], tuple]:
        return sums(w, x_N, t_N), (w, x_N, t_N)

    def backward(res: tuple, cts: tuple[Any, Any]) -> tuple[Any, Any, None]:
        w, x_N, t_N = res
        g = cts[0]  # the accuracy (an argmax) has no gradient

        def grads(w: Any, x_bxCxD: Any, t_bxC: Any) -> tuple[Any, Any]:
            # recomputes the chunk's logits: the forward kept none
            _, pull = jax.vjp(lambda w, x: one(w, x, t_bxC)[0], w, x_bxCxD)
            return pull(g)

        def add(dw_R: Any, xs: tuple) -> tuple[Any, Any]:
            dw, dx = per_replica(grads)(w, *xs)
            return dw_R + dw, dx

        dw_R = jnp.zeros((R, *w.shape), w.dtype)
        if axes:  # replica r's partial sum on the r-th device group
            dw_R = jax.lax.with_sharding_constraint(dw_R, P(axes, *[P.UNCONSTRAINED] * w.ndim))
        dw_R, dx_N = jax.lax.scan(add, dw_R, (x_N, t_N))
        return dw_R.sum(0), dx_N, None  # the one reduction over the replicas

    sums.defvjp(forward, backward)
    nll, correct = sums(w, chunks(x_BxLxD), chunks(targets_BxL))
    return nll / (B * L), correct / (B * L)


@contextlib.contextmanager
def _without(axes: tuple[str, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for axis in axes:
            stack.enter_context(without_mesh_axis(axis))
        yield
