"""Sampling a masked-diffusion model (``model.objective=mdlm``) by its reverse process.

The continuation starts as N [MASK] tokens after the prompt (which is never masked, so it stays
as given). ``steps`` denoising steps walk t from 1 to 0 on a uniform grid; each runs the model
over the whole window (no key/value cache: attention goes both ways), proposes a token for every
position (``decode.pick``: greedy at temperature 0, else drawn after the top-k/top-p cut) and
unmasks some of the masked positions, keeping every token unmasked before (MDLM's carry-over):

* ``random`` (MDLM's ancestral sampler): each masked position is unmasked with probability
  (alpha(s) - alpha(t)) / (1 - alpha(t)) on the step from t to s;
* ``confidence`` (LLaDA's low-confidence remasking): the positions whose proposed token is the
  most probable are unmasked, as many as leave N (1 - alpha(s)) masked.

The last step (s = 0) unmasks every position left. One ``jax.jit``; keys from (``seed``, step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.model.mdlm import mask_rate, objective_of
from dxrun.tools.decode import Sampling, _runner, pick

if TYPE_CHECKING:
    from dxrun.config.schema import ModelConfig


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
