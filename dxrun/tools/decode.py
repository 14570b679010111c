"""Autoregressive decoding with a key/value cache, inside one ``jax.jit``; and masked
diffusion's reverse process (the last section).

The prompt (P tokens) is run once (the prefill), filling each layer's cache; then a
``lax.fori_loop`` makes one token per iteration, attending over the cache. The cache has a static
length T = P + N (N new tokens), so the whole generation compiles once: no recompilation per
token. The model's own modules compute it (``Transformer.embed``, ``Block.apply``,
``Attention.qkv`` / ``out``, ``Transformer.head``); only the attention over the cache is
written here. Parameters keep their mesh shardings, so tensor parallelism decodes too.

Sampling: ``temperature=0`` is greedy (argmax); otherwise logits / temperature, cut to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``, then
drawn with a key folded from (``seed``, position): deterministic given the seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.model import (
    Attention,
    in_mesh_context,
    mask_rate,
    objective_of,
    reference_attention,
    window_mask,
)

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


NEG = jnp.finfo(jnp.float32).min


class Sampling(NamedTuple):
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int = 0


class Cache(NamedTuple):
    k_NxBxTxKxE: jax.Array  # N layers (stacked, like the blocks' parameters)
    v_NxBxTxKxE: jax.Array


def _cached_attention(attn: Attention, x_BxSxD: jax.Array, k_BxTxKxE: jax.Array,
                      v_BxTxKxE: jax.Array, start: jax.Array, local: Any = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of S new tokens at positions start..start+S-1: their keys and values go into
    the cache, and each query sees the cache up to its own position. ``local``: a windowed
    layer's flag where the layers alternate (both kinds compiled, ``lax.cond`` picks)."""
    if attn.alternating and local is not None and not isinstance(local, bool):  # traced
        return jax.lax.cond(local, lambda: _cached_attention(attn, x_BxSxD, k_BxTxKxE,
                                                             v_BxTxKxE, start, True),
                            lambda: _cached_attention(attn, x_BxSxD, k_BxTxKxE, v_BxTxKxE,
                                                      start, False))
    window, theta = attn.layer_kind(local)
    q_BxSxHxE, k_BxSxKxE, v_BxSxKxE = attn.qkv(x_BxSxD, start, theta)
    k_BxTxKxE = jax.lax.dynamic_update_slice_in_dim(k_BxTxKxE, k_BxSxKxE.astype(
        k_BxTxKxE.dtype), start, axis=1)
    v_BxTxKxE = jax.lax.dynamic_update_slice_in_dim(v_BxTxKxE, v_BxSxKxE.astype(
        v_BxTxKxE.dtype), start, axis=1)
    S, T = x_BxSxD.shape[1], k_BxTxKxE.shape[1]
    mask_SxT = window_mask(start + jnp.arange(S), jnp.arange(T), window)
    o_BxSxHxE = reference_attention(q_BxSxHxE, k_BxTxKxE, v_BxTxKxE, mask_SxT,
                                    scale=attn.scale, softcap=attn.softcap)
    return attn.out(o_BxSxHxE), k_BxTxKxE, v_BxTxKxE


def forward_cached(model: Any, tokens_BxS: jax.Array, cache: Cache, start: jax.Array
                   ) -> tuple[jax.Array, Cache]:
    """Logits of S new tokens at positions start..start+S-1 and the updated cache: the layers
    under one ``lax.scan`` over the stacked block parameters and their caches."""
    graphdef, stacked = nnx.split(model.blocks)

    def layer(x_BxSxD: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        params, k_BxTxKxE, v_BxTxKxE, local = xs
        block = nnx.merge(graphdef, params)
        new: dict[str, jax.Array] = {}

        def attend(h_BxSxD: jax.Array) -> jax.Array:
            y, new["k"], new["v"] = _cached_attention(block.attn, h_BxSxD, k_BxTxKxE,
                                                      v_BxTxKxE, start, local)
            return y

        x_BxSxD = block.apply(x_BxSxD, attend)
        return x_BxSxD, (new["k"], new["v"])

    x_BxSxD = model.embed(tokens_BxS, start)
    local = None if model.local_layers is None else jnp.asarray(model.local_layers)
    x_BxSxD, (k, v) = jax.lax.scan(layer, x_BxSxD, (stacked, *cache, local))
    return model.head(x_BxSxD), Cache(k, v)


def pick(logits_BxV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """The next token of each row: argmax (temperature 0) or a draw after the top-k/top-p cut."""
    if s.temperature == 0:
        return logits_BxV.argmax(-1).astype(jnp.int32)
    logits_BxV = logits_BxV / s.temperature
    if s.top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, s.top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, NEG, logits_BxV)
    if s.top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        # Keep a token while the probability of the more likely ones is still short of top_p
        # (so the most likely token is always kept).
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        cut_Bx1 = jnp.min(jnp.where(before_BxV < s.top_p, sorted_BxV, jnp.inf), axis=-1,
                          keepdims=True)
        logits_BxV = jnp.where(logits_BxV < cut_Bx1, NEG, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def make_generate(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, rules: dict,
                  param_shardings: Any, prompt_len: int, new_tokens: int, sampling: Sampling,
                  n_layers: int, kv_heads: int, head_dim: int, dtype: Any = jnp.float32,
                  with_logits: bool = False) -> Any:
    """``generate(params, prompt_BxP) -> tokens_BxT`` (prompt and continuation; with
    ``with_logits`` also the logits each new token was picked from, ``B x N x Vp``), jitted
    once for these static lengths. ``dtype``: the compute dtype; the (fp32) parameters are cast
    to it once per call, before the token loop, so each token reads weights of that width.
    ``generate.lower(params, prompt_BxP)`` lowers the program without running it."""
    T = prompt_len + new_tokens

    def generate(params: dict, prompt_BxP: jax.Array) -> Any:
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
        B = prompt_BxP.shape[0]
        zeros = jnp.zeros((n_layers, B, T, kv_heads, head_dim), dtype)
        logits_BxPxV, cache = forward_cached(model, prompt_BxP, Cache(zeros, zeros),
                                             jnp.int32(0))
        tokens_BxT = jnp.zeros((B, T), jnp.int32).at[:, :prompt_len].set(prompt_BxP)
        seen_BxNxV = jnp.zeros((B, new_tokens, logits_BxPxV.shape[-1]), jnp.float32)
        root = jax.random.key(sampling.seed)

        def one(i: jax.Array, carry: tuple) -> tuple:
            tokens_BxT, cache, logits_BxV, seen_BxNxV = carry
            pos = prompt_len + i
            token_B = pick(logits_BxV, jax.random.fold_in(root, pos), sampling)
            tokens_BxT = jax.lax.dynamic_update_slice_in_dim(tokens_BxT, token_B[:, None], pos,
                                                             axis=1)
            seen_BxNxV = jax.lax.dynamic_update_slice_in_dim(seen_BxNxV, logits_BxV[:, None],
                                                             i, axis=1)
            logits_Bx1xV, cache = forward_cached(model, token_B[:, None], cache, pos)
            return tokens_BxT, cache, logits_Bx1xV[:, 0], seen_BxNxV

        carry = (tokens_BxT, cache, logits_BxPxV[:, -1], seen_BxNxV)
        tokens_BxT, _, _, seen_BxNxV = jax.lax.fori_loop(0, new_tokens, one, carry)
        return (tokens_BxT, seen_BxNxV) if with_logits else tokens_BxT

    return _runner(jax.jit(generate, in_shardings=(param_shardings, None)), mesh, rules)


def make_generate_recomputed(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, rules: dict,
                             param_shardings: Any, prompt_len: int, new_tokens: int,
                             sampling: Sampling, with_logits: bool = False) -> Any:
    """``make_generate``'s ``generate`` for a model without dxrun's cached decode (a user model,
    ``model._target_``): each new token runs the model over the whole sequence buffer (static
    length, so one compile), the causal model reading only the positions before it."""
    T = prompt_len + new_tokens

    def generate(params: dict, prompt_BxP: jax.Array) -> Any:
        model = nnx.merge(graphdef, params)
        B = prompt_BxP.shape[0]
        tokens_BxT = jnp.zeros((B, T), jnp.int32).at[:, :prompt_len].set(prompt_BxP)
        root = jax.random.key(sampling.seed)

        def one(i: jax.Array, carry: tuple) -> tuple:
            tokens_BxT, seen_BxNxV = carry
            pos = prompt_len + i
            logits_BxTxV = model(tokens_BxT).astype(jnp.float32)
            logits_BxV = jax.lax.dynamic_index_in_dim(logits_BxTxV, pos - 1, 1, keepdims=False)
            token_B = pick(logits_BxV, jax.random.fold_in(root, pos), sampling)
            tokens_BxT = jax.lax.dynamic_update_slice_in_dim(tokens_BxT, token_B[:, None], pos,
                                                             axis=1)
            seen_BxNxV = jax.lax.dynamic_update_slice_in_dim(seen_BxNxV, logits_BxV[:, None],
                                                             i, axis=1)
            return tokens_BxT, seen_BxNxV

        V = jax.eval_shape(model, tokens_BxT).shape[-1]
        seen_BxNxV = jnp.zeros((B, new_tokens, V), jnp.float32)
        tokens_BxT, seen_BxNxV = jax.lax.fori_loop(0, new_tokens, one, (tokens_BxT, seen_BxNxV))
        return (tokens_BxT, seen_BxNxV) if with_logits else tokens_BxT

    return _runner(jax.jit(generate, in_shardings=(param_shardings, None)), mesh, rules)


def _runner(jitted: Any, mesh: jax.sharding.Mesh, rules: dict) -> Any:
    """``jitted(params, prompt)`` run under the mesh and rules, with a ``lower`` beside it."""

    def run(params: dict, prompt_BxP: Any) -> Any:
        with in_mesh_context(mesh, rules):
            return jitted(params, jnp.asarray(prompt_BxP, jnp.int32))

    def lower(params: dict, prompt_BxP: Any) -> Any:
        with in_mesh_context(mesh, rules):
            return jitted.lower(params, jnp.asarray(prompt_BxP, jnp.int32))

    run.lower = lower  # type: ignore[attr-defined]
    return run


# ------------------------------------------------------------------------------------------------
# Sampling a masked-diffusion model (``model.objective=mdlm``) by its reverse process.
#
# The continuation starts as N [MASK] tokens after the prompt (which is never masked, so it stays
# as given). ``steps`` denoising steps walk t from 1 to 0 on a uniform grid; each runs the model
# over the whole window (no key/value cache: attention goes both ways), proposes a token for every
# position (``pick``: greedy at temperature 0, else drawn after the top-k/top-p cut) and
# unmasks some of the masked positions, keeping every token unmasked before (MDLM's carry-over):
#
# * ``random`` (MDLM's ancestral sampler): each masked position is unmasked with probability
#   (alpha(s) - alpha(t)) / (1 - alpha(t)) on the step from t to s;
# * ``confidence`` (LLaDA's low-confidence remasking): the positions whose proposed token is the
#   most probable are unmasked, as many as leave N (1 - alpha(s)) masked.
#
# The last step (s = 0) unmasks every position left. One ``jax.jit``; keys from (``seed``, step).

def reveal(masked_BxN: jax.Array, confidence_BxN: jax.Array, u_BxN: jax.Array,
           t: jax.Array, s: jax.Array, schedule: str, unmask: str) -> jax.Array:
    """Which of the masked positions (``masked_BxN``) the step from time t to s unmasks."""
    if unmask == "random":
        rate_t, rate_s = mask_rate(schedule, t), mask_rate(schedule, s)
        return masked_BxN & (u_BxN < (rate_t - rate_s) / rate_t)
    N = masked_BxN.shape[1]
    keep_masked = jnp.floor(N * mask_rate(schedule, s)).astype(jnp.int32)
    n_reveal_B = jnp.maximum(masked_BxN.sum(1) - keep_masked, 0)
    score_BxN = jnp.where(masked_BxN, confidence_BxN, -jnp.inf)
    # a position's rank among its row's masked ones, the most confident first
    rank_BxN = jnp.argsort(jnp.argsort(-score_BxN, axis=1, stable=True), axis=1, stable=True)
    return masked_BxN & (rank_BxN < n_reveal_B[:, None])


def make_denoise(graphdef: nnx.GraphDef, mesh: jax.sharding.Mesh, rules: dict,
                 param_shardings: Any, prompt_len: int, new_tokens: int, sampling: Sampling,
                 steps: int, unmask: str, model: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """``generate(params, prompt_BxP) -> tokens_BxT`` (prompt and continuation), jitted once for
    these static lengths, in the compute dtype ``dtype`` (the logits stay fp32): ``steps``
    denoising steps, ``unmask`` random or confidence; ``model``: the run's model section."""
    objective = objective_of(model, seed=0)  # its [MASK] and schedule (no training noise)
    T, mask_id, K = prompt_len + new_tokens, objective.mask_id, steps

    def generate(params: dict, prompt_BxP: jax.Array) -> jax.Array:
        net = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
        B = prompt_BxP.shape[0]
        tokens_BxT = jnp.full((B, T), mask_id, jnp.int32).at[:, :prompt_len].set(prompt_BxP)
        root = jax.random.key(sampling.seed)

        def one(k: jax.Array, tokens_BxT: jax.Array) -> jax.Array:
            t, s = 1.0 - k / K, 1.0 - (k + 1) / K
            key_pick, key_order = jax.random.split(jax.random.fold_in(root, k))
            logits_BxNxV = net(tokens_BxT, None, dtype)[:, prompt_len:]
            V = logits_BxNxV.shape[-1]
            flat_BNxV = logits_BxNxV.reshape(B * new_tokens, V)
            proposed_BxN = pick(flat_BNxV, key_pick, sampling).reshape(B, new_tokens)
            logp_BxNxV = jax.nn.log_softmax(logits_BxNxV, axis=-1)
            confidence_BxN = jnp.take_along_axis(logp_BxNxV, proposed_BxN[..., None], -1)[..., 0]
            masked_BxN = tokens_BxT[:, prompt_len:] == mask_id
            u_BxN = jax.random.uniform(key_order, (B, new_tokens))
            last = k == K - 1  # s = 0: every position left is revealed, whatever the rounding
            now_BxN = masked_BxN & (last | reveal(masked_BxN, confidence_BxN, u_BxN, t,
                                                   jnp.maximum(s, 0.0), objective.schedule,
                                                   unmask))
            new_BxN = jnp.where(now_BxN, proposed_BxN, tokens_BxT[:, prompt_len:])
            return tokens_BxT.at[:, prompt_len:].set(new_BxN)

        return jax.lax.fori_loop(0, K, one, tokens_BxT)

    return _runner(jax.jit(generate, in_shardings=(param_shardings, None)), mesh, rules)
