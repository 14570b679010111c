"""What the model is trained to predict besides the next token: masked diffusion (MDLM, Sahoo
et al. 2024, ``model.objective=mdlm``), its forward process, its bound and its batches (its
account follows the imports). The next token's loss is ``losses``'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dxrun.model.sharding import constrain

# The forward process replaces each token of a window x by [MASK] with probability 1 - alpha(t).
# [MASK] is id ``model.vocab_size``, the vocabulary table's first padding row (the mesh plan pads
# the table to hold it): its embedding trains, its logit stays masked, so it is never predicted.
# The same backbone, attending both ways, predicts x at every position; the loss is the
# continuous-time bound on -log p(x), averaged over all B x L tokens (nats per token, as AR's):
#
#     E_t [ w(t) * sum over the masked positions l of -log p(x_l | x_t) ] / L,
#     w(t) = -alpha'(t) / (1 - alpha(t)),  t ~ U[T_MIN, 1]
#
# A step's noise is drawn for the global batch from (train.seed, step): the same on every mesh
# and for any train.grad_accum; a held-out batch's from its index alone. t is low-discrepancy over
# the rows (one uniform u; row i's t from (u + i/B) mod 1, as MDLM's): less variance.

# Below it, w(t) ~ 1/t would weigh the one or two masked tokens of a row enormously (MDLM's
# sampling eps). Under loglinear and cosine (whose masking rate grows with t) drawing t from
# [T_MIN, 1] only raises the estimate: the part left out is scored at a higher cross-entropy.
T_MIN = 1e-3
LINEAR_RATE = 7.0  # the linear schedule's sigma(1) (MDLM's configs/noise/linear.yaml)
EVAL_SEED = 0  # the held-out masks' root key: one for every run, so that runs compare alike
SCHEDULES = ("loglinear", "cosine", "linear")


def mask_rate(schedule: str, t: Any) -> Any:
    """1 - alpha(t), the probability that a token is masked at time t: loglinear t; cosine
    1 - cos(pi t / 2); linear 1 - exp(-7 t), rescaled to reach 1 at t = 1."""
    if schedule == "loglinear":
        return t
    if schedule == "cosine":
        return 1.0 - jnp.cos(jnp.pi / 2 * t)
    return jnp.expm1(-LINEAR_RATE * t) / jnp.expm1(-LINEAR_RATE)


def weight(schedule: str, t: Any) -> Any:
    """-alpha'(t) / (1 - alpha(t)): the bound's weight of a token masked at time t. loglinear
    1/t; cosine (pi/2) sin(pi t/2) / (1 - cos(pi t/2)) = (pi/2) / tan(pi t/4); linear
    7 / (exp(7 t) - 1) (the rescaling cancels)."""
    if schedule == "loglinear":
        return 1.0 / t
    if schedule == "cosine":
        return (jnp.pi / 2) / jnp.tan(jnp.pi / 4 * t)
    return LINEAR_RATE / jnp.expm1(LINEAR_RATE * t)


class Noised(NamedTuple):
    """A batch through the forward process: the clean window, the masked one, each row's
    weight w(t). The masked positions are where ``xt_BxL`` holds [MASK]."""

    x0_BxL: jax.Array
    xt_BxL: jax.Array
    w_B: jax.Array


def elbo(logits_BxLxV: Any, x0_BxL: Any, masked_BxL: Any, w_B: Any) -> tuple[Any, Any]:
    """(The bound in nats per token: each masked token's cross-entropy times its row's weight,
    summed and divided by all B x L tokens; the accuracy on the masked tokens)."""
    B, L = x0_BxL.shape
    ce_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, x0_BxL)
    loss = (w_B[:, None] * jnp.where(masked_BxL, ce_BxL, 0.0)).sum() / (B * L)
    right = masked_BxL & (logits_BxLxV.argmax(-1) == x0_BxL)
    accuracy = right.sum() / jnp.maximum(masked_BxL.sum(), 1)
    return loss, accuracy.astype(jnp.float32)


class MaskedDiffusion(NamedTuple):
    """The objective as the steps use it (hashable: a static part of the jitted functions).
    ``mask_id``: ``model.vocab_size``; ``seed``: the training masks' (``train.seed``'s)."""

    mask_id: int
    schedule: str = "loglinear"
    seed: int = 0
    draws: int = 1  # eval.draws

    def draw(self, key: jax.Array, x0_BxL: jax.Array) -> Noised:
        """The forward process on the whole batch ``x0_BxL`` (one key: mesh-independent)."""
        B, L = x0_BxL.shape
        key_t, key_mask = jax.random.split(key)
        u = jax.random.uniform(key_t, ())
        t_B = T_MIN + (1.0 - T_MIN) * jnp.mod(u + jnp.arange(B) / B, 1.0)
        masked_BxL = jax.random.uniform(key_mask, (B, L)) < mask_rate(self.schedule, t_B)[:, None]
        xt_BxL = constrain(jnp.where(masked_BxL, self.mask_id, x0_BxL), ("batch", None))
        return Noised(x0_BxL, xt_BxL, weight(self.schedule, t_B))

    def train_batch(self, step: jax.Array, tokens_BxT: jax.Array) -> Noised:
        """Step ``step``'s noised batch: the window is the AR inputs (the first T - 1 tokens),
        so the backbone sees the positions AR's does."""
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        return self.draw(key, tokens_BxT[:, :-1])

    def position_weights(self, batch: Noised) -> jax.Array:
        """Each position's weight in the bound: its row's w(t) where masked, else 0 (what
        ``dxrun.model.losses`` weighs each cross-entropy by)."""
        masked_BxL = batch.xt_BxL == self.mask_id
        return jnp.where(masked_BxL, batch.w_B[:, None], 0.0)

    def masked_share(self, batch: Noised) -> jax.Array:
        """The share of the batch's tokens masked (train/mask_rate)."""
        return (batch.xt_BxL == self.mask_id).mean(dtype=jnp.float32)

    def loss(self, logits_fn: Any, batch: Noised) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``logits_fn(tokens) -> fp32 logits`` (the model with its dropout key and dtype)."""
        loss, accuracy = elbo(logits_fn(batch.xt_BxL), batch.x0_BxL,
                              batch.xt_BxL == self.mask_id, batch.w_B)
        return loss, {"train/loss": loss, "train/accuracy": accuracy}

    def evaluate(self, logits_fn: Any, tokens_BxT: jax.Array, index: jax.Array
                 ) -> dict[str, jax.Array]:
        """The held-out bound and masked accuracy of batch ``index``, averaged over ``draws``
        draws whose keys come from (EVAL_SEED, index, draw) only."""
        x0_BxL = tokens_BxT[:, :-1]
        keys = jax.random.split(jax.random.fold_in(jax.random.key(EVAL_SEED), index),
                                self.draws)
        per_draw = jax.lax.map(lambda k: self.loss(logits_fn, self.draw(k, x0_BxL))[1], keys)
        return {"eval/loss": per_draw["train/loss"].mean(),
                "eval/accuracy": per_draw["train/accuracy"].mean()}


def objective_of(model: Any, seed: int, draws: int = 1) -> MaskedDiffusion | None:
    """The objective of the model section ``model`` (``model.objective``): None for ar."""
    if model.objective != "mdlm":
        return None
    return MaskedDiffusion(model.vocab_size, model.noise_schedule, seed, draws)
