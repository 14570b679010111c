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

from typing import TYPE_CHECKING, Any

from dxrun.errors import ConfigError

if TYPE_CHECKING:
    from dxrun.plan import MeshPlan
    from dxrun.schema import ModelConfig

AUTO_ON_BYTES = 512 * 2**20  # null: chunk when one micro-batch's fp32 logits exceed this
CHUNK_BYTES = 256 * 2**20  # null: the largest chunk whose fp32 logits fit in this


def resolve_loss_chunk(value: int | None, rows: int, seq_len: int, vocab: int) -> int:
    """Positions per chunk (0 = unchunked) for ``model.loss_chunk=value`` when each device
    computes ``rows`` sequences of ``seq_len`` over ``vocab`` (padded, per device) logits.
    null: unchunked while the fp32 logits fit in ``AUTO_ON_BYTES``, else the largest divisor
    of ``seq_len`` whose chunk fits in ``CHUNK_BYTES``. A chunk of the whole sequence or more
    is the unchunked loss."""
    if value == 0:
        return 0
    if value is not None:
        if value >= seq_len:
            return 0
        if seq_len % value:
            divisors = [d for d in range(1, seq_len) if seq_len % d == 0]
            near = min(divisors, key=lambda d: abs(d - value))
            raise ConfigError(f"model.loss_chunk={value} does not divide data.seq_len={seq_len}; "
                              f"pick a divisor (e.g. {near}), 0 (off) or null (auto)")
        return value
    per_position = rows * vocab * 4
    if per_position * seq_len <= AUTO_ON_BYTES:
        return 0
    fits = [d for d in range(1, seq_len) if seq_len % d == 0 and d * per_position <= CHUNK_BYTES]
    return max(fits, default=1)


def loss_chunk_for(m: ModelConfig, grad_accum: int, plan: MeshPlan) -> int:
    """``resolve_loss_chunk`` for the model ``m`` (``train.grad_accum`` micro-batches) on
    ``plan``'s mesh: one micro-batch's rows per device and the vocabulary's padded rows per
    tensor-parallel device."""
    rows = max(1, plan.global_batch // (plan.dp * plan.fsdp * grad_accum))
    vocab = (plan.padded_vocab or m.vocab_size) // plan.tp
    # The plan's sequence length: data.seq_len may still be null (the platform's default) here.
    return resolve_loss_chunk(m.loss_chunk, rows, plan.seq_len, vocab)


def chunked_cross_entropy(logits_fn: Any, w: Any, x_BxLxD: Any, targets_BxL: Any,
                          chunk: int) -> tuple[Any, Any]:
    """Mean cross-entropy and accuracy of ``logits_fn(w, x) -> fp32 logits`` (the model's
    output layer, padding masked) over ``targets_BxL``, ``chunk`` positions at a time."""
    import jax  # here: the resolving above is imported by config validation, without JAX
    import jax.numpy as jnp

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
