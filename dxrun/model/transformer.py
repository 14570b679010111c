"""A decoder-only transformer in Flax NNX, GPT-2 style or Llama style from the same knobs.

Parameters carry logical axis names (``axes=``); ``dxrun.model.sharding`` maps them to the mesh. Shapes
are in the names: B batch, L length, D d_model, H heads, K kv heads, G = H/K, E head dim, F d_ff,
V vocab, Vp padded vocab (see ``Transformer``). The module computes in the dtype it is called
with (``dtype``; default: its parameters' dtype); norms, softmax and logits run in fp32. Called
with fp32 parameters and a bf16 ``dtype`` (the train step's default), every weight is cast at
its use and every weight gradient is summed over the batch in fp32 (see ``layers.dense``).
The blocks are in ``dxrun.model.layers`` and ``dxrun.model.attention``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dxrun.model import context_parallel
from dxrun.model.attention import KERNEL, Attention
from dxrun.model.layers import DENSE, MLP, Norm, dense, dropout, padded_param, param
from dxrun.model.sharding import constrain, gathered_backward
from dxrun.plan.attention_kernel import RESIDUALS

if TYPE_CHECKING:
    from dxrun.config.schema import ModelConfig

ACT = ("batch", "seq", "act_embed")
# The residual stream between the blocks: as ACT, or with parallelism.sequence_parallel split
# along the sequence over `tensor` too (Megatron's sequence parallelism): the norms run on the
# split stream, their outputs are gathered for the column-parallel matmuls, and the row-parallel
# outputs are reduce-scattered into it; backward, the reverse (``gathered_backward``).
STREAM = ("batch", "stream_seq", "act_embed")


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL):
        self.ln1 = Norm(cfg.d_model, cfg.norm, cfg.bias, cfg.norm_eps)
        self.attn = Attention(cfg, rngs, kernel)
        self.ln2 = Norm(cfg.d_model, cfg.norm, cfg.bias, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)
        self.rate = cfg.dropout

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None = None,
                 dtype: Any = None) -> jax.Array:
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        return self.apply(x_BxLxD, self.attn, k1, k2, dtype)

    def apply(self, x_BxLxD: jax.Array, attend: Any, k1: jax.Array | None = None,
              k2: jax.Array | None = None, dtype: Any = None) -> jax.Array:
        """The block with ``attend`` as its attention: ``self.attn`` when training, attention
        against a key/value cache when decoding (``dxrun.tools.decode``). ``dtype``: the compute
        dtype (default the parameters'); the residual may be wider (fp32)."""
        cd = dtype or self.attn.wq[...].dtype
        h = gathered_backward(attend(constrain(self.ln1(x_BxLxD).astype(cd), ACT)), ACT)
        x_BxLxD = x_BxLxD + dropout(h, self.rate, k1).astype(x_BxLxD.dtype)
        x_BxLxD = constrain(x_BxLxD, STREAM)
        h = gathered_backward(self.mlp(constrain(self.ln2(x_BxLxD).astype(cd), ACT)), ACT)
        x_BxLxD = x_BxLxD + dropout(h, self.rate, k2).astype(x_BxLxD.dtype)
        return constrain(x_BxLxD, STREAM)


# model.remat: "full" recomputes each layer in the backward pass (only its input is kept);
# "keep_attention" too, but keeps what the attention kernel's backward reads (its output and
# softmax statistics, named by the kernel), so attention's forward does not run twice;
# "dots" keeps the matmul outputs and recomputes the cheap elementwise rest: the plain matmuls
# (fp32 runs, attention's own) by checkpoint_dots, the mixed-precision weight matmuls (bf16
# compute, fp32 weights: a custom VJP) by their name.
REMAT_POLICIES = {"full": None,
                  "keep_attention": jax.checkpoint_policies.save_only_these_names(RESIDUALS),
                  "dots": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.checkpoint_dots,
                      jax.checkpoint_policies.save_only_these_names(DENSE))}


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL
                   ) -> Block:
    """``n_layers`` blocks as one Block whose parameters have a leading ``layers`` axis (which
    the rules table leaves unsharded). Scanning over it compiles one layer, not n; the names
    (``blocks/attn/wq``, ...) are the same whether the layers then scan or loop."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, kernel)

    blocks = make(rngs)
    for _, v in nnx.iter_graph(blocks):
        if isinstance(v, nnx.Variable) and "axes" in v.get_metadata():
            v.set_metadata(axes=("layers", *v.get_metadata()["axes"]))
    return blocks


class Transformer(nnx.Module):
    """``padded_vocab`` (from the mesh plan; None = ``cfg.vocab_size``) is the number of rows of
    ``wte`` / columns of ``lm_head``: the vocab axis is split over ``tensor``, so it must be a
    multiple of tp. Padding rows start at zero, their logits are masked to the fp32 minimum
    (no probability, never the argmax, zero gradient), so the model computes exactly what the
    unpadded one does. ``kernel``: the attention kernel the run plan chose (``attention_kernel.
    compiled_kernel``: its name, whether interpreted); the default runs XLA's."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, padded_vocab: int | None = None,
                 kernel: tuple[str, bool] = KERNEL, remat: str | None = None):
        D, V = cfg.d_model, cfg.vocab_size
        Vp = padded_vocab or V
        if Vp < V:
            raise ValueError(f"padded_vocab={Vp} is smaller than vocab_size={V}")
        self.vocab_size = V
        self.wte = padded_param(rngs, (V, D), ("vocab", "embed"), cfg.init_std, Vp)
        self.wpe = (param(rngs, (cfg.max_seq_len, D), ("pos", "embed"), cfg.init_std)
                    if cfg.pos == "learned" else None)
        self.blocks = stacked_blocks(cfg, rngs, kernel)
        # remat: the run plan's (a layout search may choose it); None: model.remat
        self.scan, self.remat = cfg.scan_layers, cfg.remat if remat is None else remat
        self.residual_fp32 = cfg.residual_dtype == "fp32"
        self.ln_f = Norm(D, cfg.norm, cfg.bias, cfg.norm_eps)
        self.lm_head = (None if cfg.tie_embeddings
                        else padded_param(rngs, (D, V), ("embed", "vocab"), cfg.init_std, Vp))
        self.rate = cfg.dropout

    def run_blocks(self, x_BxLxD: jax.Array, dropout_key: jax.Array | None,
                   dtype: Any = None) -> jax.Array:
        """All layers over the stacked block parameters: one ``lax.scan`` (compiled once,
        whatever the depth) or, with ``model.scan_layers=false``, a Python loop over the same
        parameters (the reference the scan is tested against). ``model.remat`` wraps each
        layer in ``jax.checkpoint``."""
        graphdef, stacked = nnx.split(self.blocks)
        n = jax.tree.leaves(stacked)[0].shape[0]
        keys = (None if dropout_key is None or self.rate == 0
                else jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(jnp.arange(n)))

        def layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, None]:
            params, key = inputs
            return nnx.merge(graphdef, params)(x, key, dtype), None

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
        if self.scan:
            return jax.lax.scan(layer, x_BxLxD, (stacked, keys))[0]
        for i in range(n):
            at_i = jax.tree.map(lambda a, i=i: a[i], (stacked, keys))
            x_BxLxD = layer(x_BxLxD, at_i)[0]
        return x_BxLxD

    def __call__(self, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None,
                 dtype: Any = None) -> jax.Array:
        """Logits (fp32) for every position, over the padded vocabulary (padding masked),
        computed in ``dtype`` (default: the parameters' dtype)."""
        return self.head(self.stream(tokens_BxL, dropout_key, dtype), dtype)

    def stream(self, tokens_BxL: jax.Array, dropout_key: jax.Array | None = None,
               dtype: Any = None) -> jax.Array:
        """The residual stream after the last block (the head's input)."""
        positions_L = context_parallel.true_positions(tokens_BxL.shape[1])
        x_BxLxD = self.embed(tokens_BxL, 0 if positions_L is None else positions_L, dtype)
        return self.run_blocks(x_BxLxD, dropout_key, dtype)

    def embed(self, tokens_BxL: jax.Array, start: Any = 0, dtype: Any = None) -> jax.Array:
        """The residual stream's input for tokens at positions ``start``, ``start + 1``, ...
        (or those ``start`` lists: a sequence held in ``context_parallel``'s order).
        Looked up and summed in the tables' dtype, then cast to ``dtype``: with fp32 tables the
        tables' gradients (a scatter and a sum over the batch) stay fp32."""
        L = tokens_BxL.shape[1]
        # FSDP gathers the table's embed shards first (as for every weight); then the lookup is
        # vocab-parallel (a masked gather over this device's rows, summed over `tensor`).
        # Gathering straight from the fsdp-sharded table made XLA replicate the whole batch's
        # activations ("Involuntary full rematerialization").
        wte_VpxD = constrain(self.wte[...], ("vocab", "act_embed"))
        x_BxLxD = jnp.take(wte_VpxD, tokens_BxL, axis=0)
        if self.wpe is not None:
            wpe_LxD = (self.wpe[...][:L] if isinstance(start, int) and start == 0
                       else jnp.take(self.wpe[...], start, axis=0) if jnp.ndim(start)
                       else jax.lax.dynamic_slice_in_dim(self.wpe[...], start, L))
            x_BxLxD = x_BxLxD + wpe_LxD[None]
        # model.residual_dtype=fp32: the stream between blocks in fp32
        x_BxLxD = x_BxLxD.astype(jnp.float32 if self.residual_fp32
                                 else dtype or self.wte[...].dtype)
        return constrain(x_BxLxD, STREAM)

    def head(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """Logits (fp32) over the padded vocabulary (padding masked) of the residual stream.
        ``dtype``: the compute dtype (default the parameters'), whatever the stream's."""
        return self.logits(self.output_weight(), self.final_norm(x_BxLxD, dtype))

    def final_norm(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """The output layer's input: the final norm of the stream, in the compute dtype."""
        return constrain(self.ln_f(x_BxLxD).astype(dtype or self.wte[...].dtype), ACT)

    def output_weight(self, gathered: bool = False) -> jax.Array:
        """``lm_head`` (D x Vp), or ``wte`` (Vp x D) with tied embeddings. ``gathered``: pinned
        to its layout at use, d_model whole (FSDP's shards gathered) and the vocabulary over
        ``tensor``, for a caller that keeps it for its own backward (``dxrun.model.chunked_loss``),
        which would otherwise gather the shards a second time."""
        if self.lm_head is None:
            w = self.wte[...]
            return constrain(w, ("vocab", "act_embed")) if gathered else w
        w = self.lm_head[...]
        return constrain(w, ("act_embed", "vocab")) if gathered else w

    def logits(self, w: jax.Array, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (fp32) of the output layer ``w`` (``output_weight``) over the padded
        vocabulary, padding masked; ``x_BxLxD`` the final norm's output. (``dxrun.model.chunked_loss``
        computes the same per chunk and vocabulary shard, masking by each shard's ids.)"""
        spec = "bld,dv->blv" if self.lm_head is not None else "bld,vd->blv"
        logits_BxLxVp = dense(x_BxLxD, w, spec, jnp.float32)
        Vp = logits_BxLxVp.shape[-1]
        if Vp > self.vocab_size:
            # A mask, not a slice: slicing the tensor-sharded vocab axis at V would reshard it.
            # The fp32 minimum, not -inf: exp() of it is exactly 0 all the same, but it never
            # makes a NaN (-inf - -inf, 0 * -inf) in the max-subtracted softmax or its gradient.
            real_Vp = jnp.arange(Vp) < self.vocab_size
            logits_BxLxVp = jnp.where(real_Vp, logits_BxLxVp, jnp.finfo(jnp.float32).min)
        return constrain(logits_BxLxVp, ("batch", "seq", "vocab"))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) or x is None


def count_params(params: Any, axes: Any = None, vocab_size: int | None = None) -> int:
    """Number of parameters; with the logical ``axes`` tree and ``vocab_size``, of the real
    vocabulary: the padding rows of ``wte`` / ``lm_head`` are not counted."""
    if axes is None:
        return sum(x.size for x in jax.tree.leaves(params))

    def real(names: tuple | None, x: Any) -> int:
        if names and "vocab" in names:
            return x.size // x.shape[names.index("vocab")] * vocab_size
        return x.size

    return sum(jax.tree.leaves(jax.tree.map(real, axes, params, is_leaf=_is_axes)))


def resize_vocab(params: dict, axes: dict, vocab_size: int, padded_vocab: int) -> dict:
    """Params of any padding brought to ``padded_vocab`` rows: the first ``vocab_size`` rows of
    each ``vocab`` axis kept, zero rows after. Moves a run's weights to a mesh with another tp
    (whose padding differs); arrays already of the right shape are passed through untouched."""

    def resize(names: tuple | None, x: Any) -> Any:
        if not names or "vocab" not in names:
            return x
        axis = names.index("vocab")
        if x.shape[axis] == padded_vocab:
            return x
        if x.shape[axis] < vocab_size:
            raise ValueError(f"a {x.shape} parameter has fewer than vocab_size={vocab_size} rows")
        x = np.take(np.asarray(x), np.arange(vocab_size), axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded_vocab - vocab_size)
        return np.pad(x, pad)

    return jax.tree.map(resize, axes, params, is_leaf=_is_axes)
