"""The next token's loss without the whole logits tensor (``model.loss_chunk``).

The output layer's fp32 logits, ``[batch, seq, vocab]``, are the largest activation of a
step with a GPT-2 vocabulary (3.3 GB for 16 x 1024 tokens of vocab 50304, and as much again for
their gradient). Chunked, the cross-entropy and the accuracy are computed over ``chunk``
positions of every sequence at a time under a scan: each chunk's logits come out of the output
matmul (compute dtype operands, fp32 accumulation and result, exactly as the unchunked head's),
and only per-position statistics leave it. With the vocabulary on one shard, each chunk's
gradient (``softmax - onehot``) is made in the forward, while its logits are at hand: the loss
is the step's last operation, so its cotangent is one scalar the backward multiplies in. Split
over ``tensor``, the backward (a custom VJP) recomputes each chunk's logits instead, after the
one reduction of the statistics over the shards. Either way the whole tensor is never live.
Chunks run along the sequence: each keeps the batch's sharding over (data, fsdp) and the
vocabulary's over ``tensor`` (no data moves). The logits stay fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dxrun.model.layers import dense, softcapped
from dxrun.model.sharding import active_axes, without_mesh_axis


def chunked_cross_entropy(w: Any, x_BxLxD: Any, targets_BxL: Any, chunk: int, *,
                          vocab_size: int, vocab_axis: int, weights_BxL: Any = None,
                          softcap: float | None = None) -> tuple[Any, Any]:
    """Mean cross-entropy and accuracy over ``targets_BxL`` of the output layer ``w`` (its
    padded vocabulary on axis ``vocab_axis``, ids from ``vocab_size`` on masked) applied to
    ``x_BxLxD``, ``chunk`` positions at a time. Every collective is the unchunked step's, once
    per step: the chunks run per device, R batch replicas (the mesh axes the rules put
    ``batch`` on) by T vocabulary shards (``vocab``'s: ``tensor``), a ``jax.vmap`` over each
    whose mapped axis takes those mesh axes (``spmd_axis_name``, as
    ``dxrun.experiment.accumulated_grads`` does for ``data``). A chunk's shard gives its max,
    sum-exp, label logit and first argmax (its padding masked by its own ids, as the model's
    head masks), stacked over the chunks and reduced over the shards once, after them; the
    backward (autodiff's formula for the unchunked loss, written out) keeps each replica's
    gradient of ``w`` and each shard's part of the input gradient, summed once after the
    scan. Left to autodiff and the partitioner, each was all-reduced once per chunk.
    ``weights_BxL`` (masked diffusion's, ``dxrun.model.objectives``): each position's cross-entropy
    weighted, still divided by B x L, and the accuracy over the positions of non-zero weight.
    ``softcap``: the logits capped as the model's head caps them (``model.logit_softcap``)."""
    B, L, _ = x_BxLxD.shape
    c = _Chunks.of(w, vocab_axis, vocab_size, B, L, chunk, softcap)

    def shard_stats(w_t: Any, offset: Any, x_bxCxD: Any, t_bxC: Any) -> tuple:
        return _stats(c, w_t, offset, x_bxCxD, t_bxC)

    def fused(w_t: Any, offset: Any, x_bxCxD: Any, t_bxC: Any, g_bxC: Any) -> tuple:
        """One shard's statistics and gradients of a chunk (the vocabulary on one shard)."""
        logits_bxCxV, ids_V = _logits(c, w_t, offset, x_bxCxD)
        m, s, label, first = _stats(c, w_t, offset, x_bxCxD, t_bxC, logits_bxCxV, ids_V)
        return (m, s, label, first), _grads(c, w.dtype, w_t, x_bxCxD, t_bxC, logits_bxCxV,
                                            ids_V, m, s, g_bxC)

    def recomputed(w_t: Any, offset: Any, x_bxCxD: Any, t_bxC: Any, m_bxC: Any, s_bxC: Any,
                   g_bxC: Any) -> tuple:
        """A shard's gradients of a chunk from its logits recomputed (the forward kept none)."""
        logits_bxCxV, ids_V = _logits(c, w_t, offset, x_bxCxD)
        return _grads(c, w.dtype, w_t, x_bxCxD, t_bxC, logits_bxCxV, ids_V, m_bxC, s_bxC,
                      g_bxC)

    def statistics(w_T: Any, x_N: Any, t_N: Any) -> tuple:  # [N, R, T, b, C] each
        return jax.lax.map(lambda xs: c.per_device(shard_stats, 2)(w_T, c.offsets_T, *xs),
                           (x_N, t_N))

    @jax.custom_vjp
    def sums(w: Any, x_N: Any, t_N: Any, wt_N: Any) -> tuple[Any, Any]:
        # per shard, no reduction over the vocabulary in the loop
        return _totals(*statistics(c.split(w), x_N, t_N), t_N, wt_N)[0]

    def forward(w: Any, x_N: Any, t_N: Any, wt_N: Any) -> tuple[tuple[Any, Any], tuple]:
        w_T = c.split(w)
        if c.T > 1:  # the statistics only: the gradients need their reduction over the shards
            sums_, m_max, s_sum = _totals(*statistics(w_T, x_N, t_N), t_N, wt_N)
            return sums_, (w, x_N, t_N, m_max, s_sum, wt_N, None)

        def add(dw_RT: Any, xs: tuple) -> tuple[Any, tuple]:
            st, (dw, dx) = c.per_device(fused, 2)(w_T, c.offsets_T, *xs)
            return dw_RT + dw, (st, dx)

        # the gradients for a cotangent of 1: the backward scales them by the one it gets
        dw_RT, (st, dx_NxRxT) = jax.lax.scan(add, c.zeros(w_T), (x_N, t_N, _weights(t_N, wt_N)))
        sums_ = _totals(*st, t_N, wt_N)[0]
        return sums_, (w, x_N, None, None, None, None, (dw_RT.sum(0), dx_NxRxT.sum(2)))

    def backward(res: tuple, cts: tuple[Any, Any]) -> tuple[Any, Any, None, None]:
        w, x_N, t_N, m_N, s_N, wt_N, made = res
        g = cts[0]  # the accuracy (an argmax) has no gradient
        if made is not None:  # the forward's, for a cotangent of 1
            dw_T, dx_N = made
        else:
            w_T = c.split(w)

            def add(dw_RT: Any, xs: tuple) -> tuple[Any, Any]:
                dw, dx = c.per_device(recomputed, 2)(w_T, c.offsets_T, *xs)
                return dw_RT + dw, dx

            dw_RT, dx_NxRxT = jax.lax.scan(add, c.zeros(w_T), (x_N, t_N, m_N, s_N,
                                                              g * _weights(t_N, wt_N)))
            # the one reduction over the replicas, and the one over the shards
            dw_T, dx_N, g = dw_RT.sum(0), dx_NxRxT.sum(2), 1.0
        return (c.join(dw_T * g).astype(w.dtype), (dx_N * g).astype(x_N.dtype), None, None)

    sums.defvjp(forward, backward)
    wt_N = None if weights_BxL is None else c.chunks(weights_BxL.astype(jnp.float32))
    nll, correct = sums(w, c.chunks(x_BxLxD), c.chunks(targets_BxL), wt_N)
    counted = B * L if weights_BxL is None else jnp.maximum((weights_BxL != 0).sum(), 1)
    return nll / (B * L), correct / counted


@dataclass(frozen=True)
class _Chunks:
    """How the loss is cut: N chunks of ``chunk`` positions, each run per device over R batch
    replicas (the mesh axes ``batch_axes``) by T vocabulary shards (``vocab_axes``) of Vs of
    the Vp padded rows, ``vocab_size`` of them real."""

    B: int
    L: int
    chunk: int
    R: int
    N: int
    T: int
    Vp: int
    Vs: int
    vocab_size: int
    vocab_axis: int
    batch_axes: tuple[str, ...]
    vocab_axes: tuple[str, ...]
    softcap: float | None = None

    @classmethod
    def of(cls, w: Any, vocab_axis: int, vocab_size: int, B: int, L: int,
           chunk: int, softcap: float | None = None) -> _Chunks:
        replicas, shards = active_axes("batch"), active_axes("vocab")
        T, Vp = math.prod(shards.values()), w.shape[vocab_axis]
        return cls(B, L, chunk, math.prod(replicas.values()), L // chunk, T, Vp, Vp // T,
                   vocab_size, vocab_axis, tuple(replicas), tuple(shards), softcap)

    @property
    def padded(self) -> bool:
        return self.Vp > self.vocab_size

    @property
    def specs(self) -> tuple[str, str]:  # the output matmul's einsum and its weight's letters
        return ("bcd,vd->bcv", "vd") if self.vocab_axis == 0 else ("bcd,dv->bcv", "dv")

    @property
    def offsets_T(self) -> Any:  # each shard's first vocabulary id
        return jnp.arange(self.T, dtype=jnp.int32) * self.Vs

    def chunks(self, a: Any) -> Any:  # [B, L, ...] -> [N, R, B/R, chunk, ...]: replica r's rows
        return jnp.moveaxis(a.reshape(self.R, self.B // self.R, self.N, self.chunk,
                                      *a.shape[2:]), 2, 0)

    def split(self, w: Any) -> Any:  # [.., Vp, ..] -> [T, .., Vs, ..]: shard t's columns first
        ax = self.vocab_axis
        w_T = jnp.moveaxis(w.reshape(*w.shape[:ax], self.T, self.Vs, *w.shape[ax + 1:]), ax, 0)
        return _pin(w_T, (self.vocab_axes,))

    def join(self, w_T: Any) -> Any:
        w = jnp.moveaxis(w_T, 0, self.vocab_axis)
        return w.reshape(*w.shape[:self.vocab_axis], self.Vp, *w.shape[self.vocab_axis + 2:])

    def zeros(self, w_T: Any) -> Any:  # a gradient of ``w_T`` per replica, kept there
        return _pin(jnp.zeros((self.R, *w_T.shape), w_T.dtype), (self.batch_axes, self.vocab_axes))

    def per_device(self, f: Any, shard_args: int) -> Any:
        """``f(*shard_args, *replica_args)`` of one shard and one replica's chunk, on every
        device: [R, T, ...] results."""
        def on_replicas(*args: Any) -> Any:
            def one_replica(*a: Any) -> Any:
                return jax.vmap(f, in_axes=(0,) * shard_args + (None,) * len(a),
                                spmd_axis_name=self.vocab_axes or None)(*args[:shard_args], *a)
            return jax.vmap(one_replica, spmd_axis_name=self.batch_axes or None)(
                *args[shard_args:])

        def run(*args: Any) -> Any:
            with _without(self.batch_axes + self.vocab_axes):  # the mapped axes hold them
                return on_replicas(*args)
        return run


def _logits(c: _Chunks, w_t: Any, offset: Any, x_bxCxD: Any) -> tuple[Any, Any]:
    """A shard's fp32 logits (its padding too; soft-capped as the model's head caps them) and
    its vocabulary ids."""
    return (softcapped(dense(x_bxCxD, w_t, c.specs[0], jnp.float32), c.softcap),
            offset + jnp.arange(c.Vs, dtype=jnp.int32))


def _real(c: _Chunks, logits_bxCxV: Any, ids_V: Any) -> Any:
    """The logits of real ids, for the reductions. On one shard the padding is its last
    columns: sliced off, a slice each reduction reads in place (a mask of every logit was
    a pass of its own). Split over shards, each masks its own by its ids (as the model's
    head: the fp32 minimum, whose exp() is 0 and which never makes a NaN)."""
    if not c.padded:
        return logits_bxCxV
    if c.T == 1:
        return logits_bxCxV[..., :c.vocab_size]
    return jnp.where(ids_V < c.vocab_size, logits_bxCxV, jnp.finfo(jnp.float32).min)


def _stats(c: _Chunks, w_t: Any, offset: Any, x_bxCxD: Any, t_bxC: Any, logits_bxCxV: Any = None,
           ids_V: Any = None) -> tuple:
    """A shard's max, sum-exp, label logit (0 off the shard) and first argmax of a chunk."""
    if logits_bxCxV is None:
        logits_bxCxV, ids_V = _logits(c, w_t, offset, x_bxCxD)
    m_bxC, s_bxC, first = _softmax_stats(_real(c, logits_bxCxV, ids_V))
    local = t_bxC - offset
    inside = (local >= 0) & (local < c.Vs)
    label = jnp.take_along_axis(logits_bxCxV, jnp.clip(local, 0, c.Vs - 1)[..., None],
                                axis=-1)[..., 0]
    return m_bxC, s_bxC, jnp.where(inside, label, 0.0), first + offset


def _grads(c: _Chunks, w_dtype: Any, w_t: Any, x_bxCxD: Any, t_bxC: Any, logits_bxCxV: Any,
           ids_V: Any, m_bxC: Any, s_bxC: Any, g_bxC: Any) -> tuple:
    """The chunk's gradients of ``w_t`` and ``x_bxCxD`` for the cotangent ``g_bxC`` of each
    position's cross-entropy: autodiff's formula for the unchunked loss, in its order."""
    p_g = jnp.exp(logits_bxCxV - m_bxC[..., None]) * (g_bxC / s_bxC)[..., None]
    if c.padded:  # no probability, no gradient: in the same pass
        p_g = jnp.where(ids_V < c.vocab_size, p_g, 0.0)
    d_bxCxV = p_g - jnp.where(ids_V == t_bxC[..., None], g_bxC[..., None], 0.0)
    if c.softcap is not None:  # d(c tanh(z / c))/dz = 1 - tanh^2, from the capped logits
        d_bxCxV = d_bxCxV * (1 - jnp.square(logits_bxCxV / c.softcap))
    d_bxCxV = d_bxCxV.astype(x_bxCxD.dtype)
    # dxrun.model.layers.dense's backward: compute dtype operands, fp32 accumulation; the input
    # gradient kept fp32, as the unchunked partial sum the partitioner reduces
    w_spec = c.specs[1]
    dx = jnp.einsum(f"bcv,{w_spec}->bcd", d_bxCxV, w_t.astype(x_bxCxD.dtype),
                    preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"bcd,bcv->{w_spec}", x_bxCxD, d_bxCxV, preferred_element_type=jnp.float32)
    return dw.astype(w_dtype), dx


def _totals(m: Any, s: Any, label: Any, first: Any, t_N: Any, wt_N: Any) -> tuple:
    """The loss's and the accuracy's sums from the [N, R, T, b, C] statistics, reduced over the
    shards once."""
    m_max = m.max(2)  # the one max over the shards
    s_sum = (s * jnp.exp(m - m_max[:, :, None])).sum(2)  # the one sum
    lse = jnp.log(s_sum) + m_max  # jax.nn.logsumexp's, as optax's (the unchunked loss)
    # the label logits reduced over the shards as the unchunked step's (a masked gather)
    nll_N = lse - label.sum(2)
    nll = (nll_N if wt_N is None else wt_N * nll_N).sum()
    # the shards' first maxima reduced to the first overall, as jnp.argmax's reduction
    _, argmax = jax.lax.reduce((m, first), (jnp.float32(-jnp.inf), jnp.int32(0)), _first_max,
                               (2,))
    right_N = argmax == t_N
    correct = (right_N if wt_N is None else right_N & (wt_N != 0)).sum(dtype=jnp.float32)
    return (nll, correct), m_max, s_sum


def _weights(t_N: Any, wt_N: Any) -> Any:  # each position's share of the loss: 1 or its own
    return jnp.ones(t_N.shape, jnp.float32) if wt_N is None else wt_N


def _softmax_stats(logits: Any) -> tuple[Any, Any, Any]:
    """The max, the sum of ``exp(logit - max)`` and the first argmax over the last axis, in one
    pass over the logits: one reduction of (value, sum, id) triples whose sums are rescaled to
    the larger max as they meet (the online softmax's). A max and then a sum of exponentials
    read the logits twice, and the logits are the largest tensor the loss reads."""
    last = logits.ndim - 1
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, last)
    return jax.lax.reduce((logits, jnp.ones_like(logits), ids),
                          (jnp.float32(-jnp.inf), jnp.float32(0), jnp.int32(0)), _online, (last,))


def _online(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """``_softmax_stats``' reducer: the first max (``_first_max``) and the two sums, each
    rescaled to it (the initial value's -inf adds nothing)."""
    (a_max, a_sum, a_id), (b_max, b_sum, b_id) = a, b
    m, first = _first_max((a_max, a_id), (b_max, b_id))

    def part(x_max: Any, x_sum: Any) -> Any:
        return jnp.where(x_max == -jnp.inf, 0.0, x_sum * jnp.exp(x_max - m))

    return m, part(a_max, a_sum) + part(b_max, b_sum), first


def _first_max(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    """``jax.lax.argmax``'s reducer on (value, id) pairs: the larger value (a NaN wins), on a
    tie the smaller id."""
    (a_val, a_id), (b_val, b_id) = a, b
    pick_a = (a_val > b_val) | (a_val != a_val)
    pick_a_id = pick_a | ((a_val == b_val) & (a_id < b_id))
    return jnp.where(pick_a, a_val, b_val), jnp.where(pick_a_id, a_id, b_id)


def _pin(a: Any, leading: tuple[tuple[str, ...], ...]) -> Any:
    """``a`` laid out with its leading dimensions over those mesh axes (when any), the rest
    left to the partitioner: a value kept per replica or per shard."""
    if not any(leading):
        return a
    spec = [axes or None for axes in leading]
    return jax.lax.with_sharding_constraint(
        a, P(*spec, *[P.UNCONSTRAINED] * (a.ndim - len(spec))))


@contextlib.contextmanager
def _without(axes: tuple[str, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for axis in axes:
            stack.enter_context(without_mesh_axis(axis))
        yield
