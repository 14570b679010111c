"""Your own model through ``model._target_``: the protocol a Flax NNX module follows for dxrun to
plan, shard, train, checkpoint, evaluate and sample it.

* Built as ``Target(**model.kwargs, vocab_size=model.vocab_size, rngs=nnx.Rngs(train.seed))``.
* Every variable is an ``nnx.Param`` with logical axis names (``axes=``, one per dimension,
  from dxrun's rules table ``LOGICAL_RULES`` or None): they map to the mesh as dxrun's own
  model's do. A variable without them (an ``nnx.Rngs`` kept in the module too) is refused.
* ``module(tokens_BxL) -> logits_BxLxV`` (checked when built), causal, over ``vocab_size``
  (which every mesh axis ``vocab`` is split over must divide). It may pin activations with
  ``dxrun.model.sharding.constrain``.
What differs from dxrun's model (``build_model`` builds either): no dropout key or compute
dtype is passed (it computes in its parameters' dtype); the loss is the unchunked one; plan
mode counts 6 FLOPs per parameter per token and XLA's memory (dxrun's formulas need its
block's shape); sampling recomputes the whole sequence for each new token (no KV cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.config import ConfigError, checked_factory, expert_d_ff, moe_layers
from dxrun.model.attention import KERNEL
from dxrun.model.moe import MoETransformer
from dxrun.model.transformer import Transformer
from dxrun.plan import LOGICAL_RULES

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


def build_model(m: ModelConfig, rngs: nnx.Rngs, padded_vocab: int | None = None,
                kernel: tuple[str, bool] = KERNEL, remat: str | None = None) -> nnx.Module:
    """``model._target_``'s module (checked: ``check_axes``), else dxrun's ``Transformer``."""
    if not m._target_:
        if m.moe.n_experts:
            return MoETransformer(m, moe_layers(m.n_layers, m.moe), expert_d_ff(m), rngs=rngs,
                                  padded_vocab=padded_vocab, kernel=kernel, remat=remat)
        return Transformer(m, rngs=rngs, padded_vocab=padded_vocab, kernel=kernel, remat=remat)
    factory = checked_factory("model", m._target_, m.kwargs)
    module = factory(**dict(m.kwargs), vocab_size=m.vocab_size, rngs=rngs)
    if not isinstance(module, nnx.Module):
        raise ConfigError(f"model._target_={m._target_} returned a {type(module).__name__}, "
                          "not a Flax NNX module")
    check_axes(m._target_, module)
    check_logits(m, module)
    return module


def check_axes(target: str, module: nnx.Module) -> None:
    """Every variable of ``module`` an ``nnx.Param`` with one known logical axis name (or None)
    per dimension; else a ConfigError naming the first that is not."""
    for path, v in nnx.iter_graph(module):
        if not isinstance(v, nnx.Variable):
            continue
        name = "/".join(map(str, path))
        axes = v.get_metadata().get("axes")
        fix = (f"give it nnx.Param(..., axes=(one name per dimension)), names from "
               f"{', '.join(LOGICAL_RULES)} or None")
        if not isinstance(v, nnx.Param):
            raise ConfigError(f"model._target_={target}: {name} is a {type(v).__name__}, not an "
                              "nnx.Param; keep only parameters in the module")
        if axes is None:
            raise ConfigError(f"model._target_={target}: parameter {name} has no logical axes; "
                              + fix)
        ndim = len(v.get_value().shape)
        if len(axes) != ndim or any(a is not None and a not in LOGICAL_RULES for a in axes):
            raise ConfigError(f"model._target_={target}: parameter {name} has axes {axes} for "
                              f"{ndim} dimensions; " + fix)


def check_logits(m: ModelConfig, module: nnx.Module) -> None:
    """``module(tokens_BxL)`` evaluated abstractly (nothing computed or allocated): logits of
    shape ``[B, L, model.vocab_size]``, else a ConfigError naming the shape it gave. A head of
    another width trains to a NaN loss (the targets index past it) that would read as a
    learning rate too high."""
    L = min(m.max_seq_len, 8)
    out = nnx.eval_shape(lambda mod, t: mod(t), module, jax.ShapeDtypeStruct((2, L), jnp.int32))
    shape = tuple(getattr(out, "shape", ()))
    if shape != (2, L, m.vocab_size):
        raise ConfigError(f"model._target_={m._target_}: module(tokens) gives logits of shape "
                          f"{list(shape)} for tokens [2, {L}], not [2, {L}, model.vocab_size="
                          f"{m.vocab_size}]; make its output layer vocab_size wide (the "
                          "vocab_size it is built with)")


def logits_of(model: nnx.Module, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None,
              dtype: Any = None) -> jax.Array:
    """The fp32 logits of either model: dxrun's with its dropout key and compute dtype, a user
    model's from the tokens alone."""
    if isinstance(model, Transformer):
        return model(tokens_BxL, dropout_key, dtype)
    return model(tokens_BxL).astype(jnp.float32)


def plan_line(m: ModelConfig, n_params: int) -> str:
    """Plan mode's model row for a user model: what its FLOPs are counted from."""
    return (f"model._target_={m._target_}: {n_params:,} parameters; FLOPs counted as 6 per "
            "parameter per token, memory and time from XLA's compile of it (dxrun's formulas "
            "and memory model need its own block's shape)")
