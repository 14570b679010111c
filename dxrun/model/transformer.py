"""A decoder-only transformer in Flax NNX, GPT-2 style or Llama style from the same knobs: the
block (attention then the MLP, each a residual branch with its norms) and the model that stacks
them between the embeddings and the output head; its building blocks are in ``layers``, its
attention in ``attention``.

Parameters carry logical axis names (``axes=``); ``dxrun.model.sharding`` maps them to the mesh.
Shapes are in the names: B batch, L length, D d_model, H heads, K kv heads, G = H/K, E head dim,
F d_ff, V vocab, Vp padded vocab (see ``Transformer``). The module computes in the dtype it is
called with (``dtype``; default: its parameters' dtype); norms, softmax and logits run in fp32.
Called with fp32 parameters and a bf16 ``dtype`` (the train step's default), every weight is
cast at its use and every weight gradient is summed over the batch in fp32 (see
``layers.dense``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dxrun.model import context_parallel
from dxrun.model.attention import KERNEL, Attention
from dxrun.model.layers import (
    DENSE,
    MLP,
    Norm,
    block_norms,
    dense,
    dropout,
    padded_param,
    param,
    softcapped,
)
from dxrun.model.sharding import constrain, gathered_backward
from dxrun.plan import RESIDUALS

if TYPE_CHECKING:
    from dxrun.config import ModelConfig


ACT = ("batch", "seq", "act_embed")
# The residual stream between the blocks: as ACT, or with parallelism.sequence_parallel split
# along the sequence over `tensor` too (Megatron's sequence parallelism): the norms run on the
# split stream, their outputs are gathered for the column-parallel matmuls, and the row-parallel
# outputs are reduce-scattered into it; backward, the reverse (``gathered_backward``).
STREAM = ("batch", "stream_seq", "act_embed")


class Block(nnx.Module):
    """Attention then the MLP, each a residual branch with its norms where
    ``model.norm_position`` puts them: before (``ln1``, ``ln2``), after (``post``: the same two
    norms on the outputs) or both (``sandwich``: ``ln1_out``, ``ln2_out`` on the outputs).
    ``mlp``: the block's MLP (``dxrun.model.moe``'s MoE); None: ``MLP``."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL,
                 mlp: nnx.Module | None = None):
        norms = block_norms(cfg)
        self.ln1 = Norm(cfg.d_model, **norms)
        self.attn = Attention(cfg, rngs, kernel)
        self.ln2 = Norm(cfg.d_model, **norms)
        self.mlp = MLP(cfg, rngs) if mlp is None else mlp
        self.rate = cfg.dropout
        position = getattr(cfg, "norm_position", "pre")
        self.post_norm = position == "post"
        sandwich = position == "sandwich"
        self.ln1_out = Norm(cfg.d_model, **norms) if sandwich else None
        self.ln2_out = Norm(cfg.d_model, **norms) if sandwich else None

    def __call__(self, x_BxLxD: jax.Array, key: jax.Array | None = None,
                 dtype: Any = None, local: Any = None) -> jax.Array:
        """``local``: whether this is a windowed layer, where the layers alternate."""
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        return self.apply(x_BxLxD, lambda h: self.attn(h, local), k1, k2, dtype)

    def apply(self, x_BxLxD: jax.Array, attend: Any, k1: jax.Array | None = None,
              k2: jax.Array | None = None, dtype: Any = None) -> jax.Array:
        """The block with ``attend`` as its attention: ``self.attn`` when training, attention
        against a key/value cache when decoding (``dxrun.tools.decode``). ``dtype``: the compute
        dtype (default the parameters'); the residual may be wider (fp32)."""
        cd = dtype or self.attn.wq[...].dtype
        x_BxLxD = self.branch(x_BxLxD, attend, self.ln1, self.ln1_out, k1, cd)
        return self.branch(x_BxLxD, self.mlp, self.ln2, self.ln2_out, k2, cd)

    def branch(self, x_BxLxD: jax.Array, f: Any, ln: Norm, ln_out: Norm | None,
               key: jax.Array | None, cd: Any) -> jax.Array:
        """``x + f(ln(x))``; with ``model.norm_position=post`` ``x + ln(f(x))`` (OLMo 2), with
        ``sandwich`` ``x + ln_out(f(ln(x)))`` (Gemma 2/3)."""
        if self.post_norm:
            h = ln(gathered_backward(f(constrain(x_BxLxD.astype(cd), ACT)), ACT))
        else:
            h = gathered_backward(f(constrain(ln(x_BxLxD).astype(cd), ACT)), ACT)
            if ln_out is not None:
                h = ln_out(h)
        x_BxLxD = x_BxLxD + dropout(h, self.rate, key).astype(x_BxLxD.dtype)
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


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, kernel: tuple[str, bool] = KERNEL,
                   n: int | None = None, mlp: Any = None) -> Block:
    """``n`` (default ``n_layers``) blocks as one Block whose parameters have a leading
    ``layers`` axis (which the rules table leaves unsharded). Scanning over it compiles one
    layer, not n; the names (``blocks/attn/wq``, ...) are the same whether the layers then scan
    or loop. ``mlp(rngs)``: each block's MLP (None: ``MLP``)."""

    @nnx.split_rngs(splits=n or cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, kernel, None if mlp is None else mlp(rngs))

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
        self.blocks = None if cfg.moe.n_experts else stacked_blocks(cfg, rngs, kernel)  # MoE: moe.py
        # remat: the run plan's (a layout search may choose it); None: model.remat
        self.scan, self.remat = cfg.scan_layers, cfg.remat if remat is None else remat
        self.residual_fp32 = cfg.residual_dtype == "fp32"
        self.ln_f = Norm(D, **block_norms(cfg))
        # Gemma's: the embeddings times sqrt(d_model) in the stream's dtype, the logits capped
        self.embed_scale = D**0.5 if getattr(cfg, "embed_scale", False) else None
        self.logit_softcap, self.local_layers = getattr(cfg, "logit_softcap", None), windowed_layers(cfg)
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
        keys, local = _layer_inputs(n, self.rate, dropout_key, self.local_layers)

        def layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, None]:
            params, key, is_local = inputs
            return nnx.merge(graphdef, params)(x, key, dtype, is_local), None

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
        if self.scan:
            return jax.lax.scan(layer, x_BxLxD, (stacked, keys, local))[0]
        for i in range(n):
            at_i = jax.tree.map(lambda a, i=i: a[i], (stacked, keys, local))
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
        # FSDP gathers the table's embed shards first (as for every weight); then the lookup is
        # vocab-parallel (a masked gather over this device's rows, summed over `tensor`).
        # Gathering straight from the fsdp-sharded table made XLA replicate the whole batch's
        # activations ("Involuntary full rematerialization").
        wte_VpxD = constrain(self.wte[...], ("vocab", "act_embed"))
        x_BxLxD = jnp.take(wte_VpxD, tokens_BxL, axis=0)
        if self.wpe is not None:
            x_BxLxD = x_BxLxD + learned_positions(self.wpe[...], start, tokens_BxL.shape[1])
        # model.residual_dtype=fp32: the stream between blocks in fp32
        x_BxLxD = x_BxLxD.astype(jnp.float32 if self.residual_fp32
                                 else dtype or self.wte[...].dtype)
        if self.embed_scale is not None:
            x_BxLxD = x_BxLxD * jnp.asarray(self.embed_scale, x_BxLxD.dtype)
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
        ``tensor``, for a caller that keeps it for its own backward (``dxrun.model.losses``),
        which would otherwise gather the shards a second time."""
        if self.lm_head is None:
            w = self.wte[...]
            return constrain(w, ("vocab", "act_embed")) if gathered else w
        w = self.lm_head[...]
        return constrain(w, ("act_embed", "vocab")) if gathered else w

    def logits(self, w: jax.Array, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (fp32) of the output layer ``w`` (``output_weight``) over the padded
        vocabulary, padding masked; ``x_BxLxD`` the final norm's output. (``dxrun.model.losses``
        computes the same per chunk and vocabulary shard, masking by each shard's ids.)"""
        spec = "bld,dv->blv" if self.lm_head is not None else "bld,vd->blv"
        logits_BxLxVp = softcapped(dense(x_BxLxD, w, spec, jnp.float32), self.logit_softcap)
        Vp = logits_BxLxVp.shape[-1]
        if Vp > self.vocab_size:
            # A mask, not a slice: slicing the tensor-sharded vocab axis at V would reshard it.
            # The fp32 minimum, not -inf: exp() of it is exactly 0 all the same, but it never
            # makes a NaN (-inf - -inf, 0 * -inf) in the max-subtracted softmax or its gradient.
            real_Vp = jnp.arange(Vp) < self.vocab_size
            logits_BxLxVp = jnp.where(real_Vp, logits_BxLxVp, jnp.finfo(jnp.float32).min)
        return constrain(logits_BxLxVp, ("batch", "seq", "vocab"))


def _layer_inputs(n: int, rate: float, dropout_key: jax.Array | None,
                  local_layers: tuple[bool, ...] | None) -> tuple[Any, Any]:
    """Each of the n layers' dropout key (None: no dropout) and windowed flag (None: the
    layers are alike), the layers' scan's inputs beside their parameters."""
    keys = (None if dropout_key is None or rate == 0
            else jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(jnp.arange(n)))
    return keys, None if local_layers is None else jnp.asarray(local_layers)


def learned_positions(wpe_PxD: jax.Array, start: Any, L: int) -> jax.Array:
    """The learned position embeddings (1 x L x D) of positions ``start``, ``start + 1``, ...
    (or those ``start`` lists)."""
    wpe_LxD = (wpe_PxD[:L] if isinstance(start, int) and start == 0
               else jnp.take(wpe_PxD, start, axis=0) if jnp.ndim(start)
               else jax.lax.dynamic_slice_in_dim(wpe_PxD, start, L))
    return wpe_LxD[None]


def windowed_layers(cfg: ModelConfig) -> tuple[bool, ...] | None:
    """``model.global_every``: whether each layer is a windowed one (the last of each run of
    ``global_every`` attends to the whole prefix); None where the layers are all alike."""
    every = getattr(cfg, "global_every", None)
    return None if every is None else tuple(bool((i + 1) % every) for i in range(cfg.n_layers))


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
