"""A decoder-only transformer in Flax NNX, GPT-2 style or Llama style from the same knobs.

Parameters carry logical axis names (``axes=``); ``dxrun.sharding`` maps them to the mesh. Shapes
are in the names: B batch, L length, D d_model, H heads, K kv heads, G = H/K, E head dim, F d_ff,
V vocab, Vp padded vocab (see ``Transformer``). The module computes in the dtype it is called
with (``dtype``; default: its parameters' dtype); norms, softmax and logits run in fp32. Called
with fp32 parameters and a bf16 ``dtype`` (the train step's default), every weight is cast at
its use and every weight gradient is summed over the batch in fp32 (see ``dense``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dxrun.attention_kernel import CPU_TARGET, AttentionTarget
from dxrun.plan.attention import attention_implementation
from dxrun.sharding import constrain

ACT = ("batch", "seq", "act_embed")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _padded_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
                  n: int) -> nnx.Param:
    """A vocab-indexed table with zero rows appended up to ``n`` on its ``vocab`` axis. The real
    rows take the same random draw as an unpadded model's, so padding (which differs with tp)
    never changes the init of the real vocabulary."""
    x = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    pad = [(0, 0)] * len(shape)
    pad[axes.index("vocab")] = (0, n - shape[axes.index("vocab")])
    return nnx.Param(jnp.pad(x, pad), axes=axes)


def dense(x: jax.Array, w: jax.Array, spec: str, out_dtype: Any = None) -> jax.Array:
    """``einsum(spec, x, w)`` computed in ``x``'s dtype with fp32 accumulation, its output in
    ``out_dtype`` (default ``x``'s): every weight matmul of the model goes through here.

    When ``w`` is wider than ``x`` (fp32 master weight, bf16 compute) or the output is wider
    (fp32 logits), a custom VJP keeps the backward in the compute dtype with fp32 accumulation:
    the incoming gradient is cast to ``x``'s dtype (the LM head's fp32 logit gradient would
    otherwise make its backward matmuls fp32), and the weight gradient is accumulated in fp32
    and returned in ``w``'s dtype. The batch-contracted weight gradient is what XLA's
    partitioner all-reduces over data replicas, so an fp32 ``w`` gets an fp32 all-reduce and
    an unrounded fp32 gradient, where casting the weight before the matmul gives bf16 partial
    sums and a bf16 all-reduce. Same dtypes everywhere (fp32 runs): the plain einsum."""
    if x.dtype == w.dtype == (out_dtype or x.dtype):
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    # Named for model.remat=dots: checkpoint_dots sees only a custom VJP's call, not the matmul
    # inside it, so without the name a bf16 "dots" layer would keep nothing and recompute all.
    return checkpoint_name(_mixed_dense(x, w, spec, jnp.dtype(out_dtype or x.dtype)), DENSE)


DENSE = "dense"  # the checkpoint name of a mixed-precision weight matmul's output


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed_dense(x: jax.Array, w: jax.Array, spec: str, out_dtype: Any) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(out_dtype)


def _mixed_dense_fwd(x: jax.Array, w: jax.Array, spec: str, out_dtype: Any) -> tuple:
    return _mixed_dense(x, w, spec, out_dtype), (x, w)


def _mixed_dense_bwd(spec: str, out_dtype: Any, res: tuple, g: jax.Array) -> tuple:
    x, w = res
    ins, y = spec.split("->")
    xs, ws = ins.split(",")
    g = g.astype(x.dtype)  # bf16 operands, fp32 accumulation
    dx = jnp.einsum(f"{y},{ws}->{xs}", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{xs},{y}->{ws}", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_mixed_dense.defvjp(_mixed_dense_fwd, _mixed_dense_bwd)


def add_bias(x: jax.Array, b: jax.Array) -> jax.Array:
    """``x + b`` in ``x``'s dtype. An fp32 ``b`` is added in fp32 and the sum cast, so the bias
    gradient (a sum over the batch) is taken, and all-reduced, in fp32 (see ``dense``)."""
    return (x + b).astype(x.dtype)


def _zeros(shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


class Norm(nnx.Module):
    def __init__(self, d: int, kind: str, bias: bool):
        self.kind = kind
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), axes=("norm",))
        self.bias = _zeros((d,), ("norm",)) if bias and kind == "layernorm" else None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = x_BxLxD.astype(jnp.float32)  # statistics in fp32 whatever the compute dtype
        if self.kind == "layernorm":
            x = x - x.mean(-1, keepdims=True)
        x = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)
        x = x * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            x = x + self.bias[...].astype(jnp.float32)
        return x.astype(x_BxLxD.dtype)


def rope(x_BxLxNxE: jax.Array, theta: float, start: Any = 0) -> jax.Array:
    """Rotary position embedding, rotate-half convention (Llama), for positions ``start``,
    ``start + 1``, ... (decoding with a key/value cache passes the first new position)."""
    L, E = x_BxLxNxE.shape[1], x_BxLxNxE.shape[-1]
    freq_E2 = theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E)
    pos_L = (jnp.arange(L) + start).astype(jnp.float32)
    ang_LxE2 = pos_L[:, None] * freq_E2[None, :]
    cos, sin = jnp.cos(ang_LxE2)[None, :, None, :], jnp.sin(ang_LxE2)[None, :, None, :]
    x = x_BxLxNxE.astype(jnp.float32)
    x1, x2 = x[..., : E // 2], x[..., E // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxE.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def reference_attention(q_BxLxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                        mask_LxS: jax.Array | None = None) -> jax.Array:
    """Attention written out (``model.attention=reference``): what the fused kernel is tested
    against. Causal (L = S) unless ``mask_LxS`` says which keys each query sees (decoding
    against a key/value cache)."""
    B, L, H, E = q_BxLxHxE.shape
    K = k_BxSxKxE.shape[2]
    # Head h uses kv head h // G; heads are split over `tensor` in contiguous blocks that
    # stay aligned with their kv heads (n_kv_heads % tp == 0 is checked by the plan).
    q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
    # Scores and softmax in fp32 for stability under bf16 compute.
    s_BxKxGxLxS = jnp.einsum("blkge,bske->bkgls", q_BxLxKxGxE, k_BxSxKxE,
                             preferred_element_type=jnp.float32) * E**-0.5
    if mask_LxS is None:
        mask_LxS = jnp.tril(jnp.ones((L, L), bool))
    s_BxKxGxLxS = jnp.where(mask_LxS, s_BxKxGxLxS, jnp.finfo(jnp.float32).min)
    p_BxKxGxLxS = jax.nn.softmax(s_BxKxGxLxS, axis=-1).astype(v_BxSxKxE.dtype)
    o_BxLxKxGxE = jnp.einsum("bkgls,bske->blkge", p_BxKxGxLxS, v_BxSxKxE)
    o_BxLxHxE = o_BxLxKxGxE.reshape(B, L, H, E)
    return o_BxLxHxE


class Attention(nnx.Module):
    """Causal multi-head / grouped-query attention. q, k, v are column-parallel (heads on
    ``tensor``), the output projection row-parallel: each device keeps whole heads.
    ``target``: the devices it runs on, which decide the fused kernel (``attention_kernel``)."""

    def __init__(self, cfg: Any, rngs: nnx.Rngs, target: AttentionTarget = CPU_TARGET):
        D, H, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        E, std = D // H, cfg.init_std
        self.H, self.K, self.E = H, K, E
        self.pos, self.theta, self.impl = cfg.pos, cfg.rope_theta, cfg.attention
        self.target = target
        self.wq = _param(rngs, (D, H, E), ("embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (D, K, E), ("embed", "kv_heads", "head_dim"), std)
        # GPT-2 scales residual-branch outputs by depth at init.
        self.wo = _param(rngs, (H, E, D), ("heads", "head_dim", "embed"),
                         std / (2 * cfg.n_layers) ** 0.5)
        if cfg.bias:
            self.bq = _zeros((H, E), ("heads", "head_dim"))
            self.bk = _zeros((K, E), ("kv_heads", "head_dim"))
            self.bv = _zeros((K, E), ("kv_heads", "head_dim"))
            # Row-parallel bias: replicated and added once, after XLA's reduction of the
            # partial sums (never pre-scaled by 1/tp).
            self.bo = _zeros((D,), ("norm",))
        else:
            self.bq = self.bk = self.bv = self.bo = None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        q_BxLxHxE, k_BxLxKxE, v_BxLxKxE = self.qkv(x_BxLxD)
        if self.impl == "dot_product":
            # Native grouped-query heads in BTNH. JAX's default kernel is always XLA's (an
            # L x L score tensor per head); cuDNN's fused flash attention is asked for by name
            # where it takes these inputs: NVIDIA GPU, bf16/fp16, a head dim it supports.
            kernel = attention_implementation(self.target.platform, q_BxLxHxE.dtype, self.E,
                                              self.target.compute_capability,
                                              self.target.cudnn_version)
            o_BxLxHxE = jax.nn.dot_product_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE,
                                                     is_causal=True, implementation=kernel)
        else:
            o_BxLxHxE = reference_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE)
        return self.out(o_BxLxHxE)

    def qkv(self, x_BxLxD: jax.Array, start: Any = 0
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of tokens at positions ``start``, ``start + 1``, ...

        From one matmul: three separate ones each leave a partial sum of the input's gradient
        per tensor-parallel device, and XLA all-reduces each before adding them: three
        activation all-reduces in the backward where Megatron needs one. The three weights are
        laid side by side per kv head (D x K x (G+2) x E): a local concatenation, since
        ``tensor`` splits q heads in blocks aligned with their kv heads."""
        K, G, E = self.K, self.H // self.K, self.E
        w_DxKxCxE = jnp.concatenate([self.wq[...].reshape(-1, K, G, E),
                                     self.wk[...][:, :, None], self.wv[...][:, :, None]], axis=2)
        qkv_BxLxKxCxE = dense(x_BxLxD, w_DxKxCxE, "bld,dkce->blkce")
        if self.bq is not None:
            qkv_BxLxKxCxE = add_bias(qkv_BxLxKxCxE, jnp.concatenate(
                [self.bq[...].reshape(K, G, E), self.bk[...][:, None], self.bv[...][:, None]],
                axis=1))
        B, L = x_BxLxD.shape[:2]
        q_BxLxHxE = qkv_BxLxKxCxE[:, :, :, :G].reshape(B, L, K * G, E)
        k_BxLxKxE, v_BxLxKxE = qkv_BxLxKxCxE[:, :, :, G], qkv_BxLxKxCxE[:, :, :, G + 1]
        if self.pos == "rope":
            q_BxLxHxE = rope(q_BxLxHxE, self.theta, start)
            k_BxLxKxE = rope(k_BxLxKxE, self.theta, start)
        return q_BxLxHxE, k_BxLxKxE, v_BxLxKxE

    def out(self, o_BxLxHxE: jax.Array) -> jax.Array:
        """The row-parallel output projection of the heads' outputs."""
        y_BxLxD = dense(o_BxLxHxE, self.wo[...], "blhe,hed->bld")
        if self.bo is not None:
            y_BxLxD = add_bias(y_BxLxD, self.bo[...])
        return y_BxLxD


class MLP(nnx.Module):
    """GELU (GPT-2) or SwiGLU (Llama). Up and gate are column-parallel, down row-parallel."""

    def __init__(self, cfg: Any, rngs: nnx.Rngs):
        D, F, std = cfg.d_model, cfg.d_ff, cfg.init_std
        self.kind = cfg.mlp
        self.w_up = _param(rngs, (D, F), ("embed", "mlp"), std)
        self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), std) if cfg.mlp == "swiglu" else None
        self.w_down = _param(rngs, (F, D), ("mlp", "embed"), std / (2 * cfg.n_layers) ** 0.5)
        self.b_up = _zeros((F,), ("mlp",)) if cfg.bias else None
        self.b_down = _zeros((D,), ("norm",)) if cfg.bias else None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxF = dense(x_BxLxD, self.w_up[...], "bld,df->blf")
        if self.b_up is not None:
            h_BxLxF = add_bias(h_BxLxF, self.b_up[...])
        if self.w_gate is not None:
            h_BxLxF = jax.nn.silu(dense(x_BxLxD, self.w_gate[...], "bld,df->blf")) * h_BxLxF
        else:
            h_BxLxF = jax.nn.gelu(h_BxLxF, approximate=True)
        y_BxLxD = dense(h_BxLxF, self.w_down[...], "blf,fd->bld")
        if self.b_down is not None:
            y_BxLxD = add_bias(y_BxLxD, self.b_down[...])
        return y_BxLxD


class Block(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs, target: AttentionTarget = CPU_TARGET):
        self.ln1 = Norm(cfg.d_model, cfg.norm, cfg.bias)
        self.attn = Attention(cfg, rngs, target)
        self.ln2 = Norm(cfg.d_model, cfg.norm, cfg.bias)
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
        h = attend(self.ln1(x_BxLxD).astype(cd))
        x_BxLxD = x_BxLxD + dropout(h, self.rate, k1).astype(x_BxLxD.dtype)
        x_BxLxD = constrain(x_BxLxD, ACT)
        h = self.mlp(self.ln2(x_BxLxD).astype(cd))
        x_BxLxD = x_BxLxD + dropout(h, self.rate, k2).astype(x_BxLxD.dtype)
        return constrain(x_BxLxD, ACT)


# model.remat: "full" recomputes each layer in the backward pass (only its input is kept);
# "dots" keeps the matmul outputs and recomputes the cheap elementwise rest: the plain matmuls
# (fp32 runs, attention's own) by checkpoint_dots, the mixed-precision weight matmuls (bf16
# compute, fp32 weights: a custom VJP) by their name.
REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.checkpoint_dots,
    jax.checkpoint_policies.save_only_these_names(DENSE))}


def stacked_blocks(cfg: Any, rngs: nnx.Rngs, target: AttentionTarget = CPU_TARGET
                   ) -> Block:
    """``n_layers`` blocks as one Block whose parameters have a leading ``layers`` axis (which
    the rules table leaves unsharded). Scanning over it compiles one layer, not n; the names
    (``blocks/attn/wq``, ...) are the same whether the layers then scan or loop."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, target)

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
    unpadded one does. ``target``: the devices the model runs on (``attention_target`` of a
    mesh device; the default, CPU, runs XLA's attention)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs, padded_vocab: int | None = None,
                 target: AttentionTarget = CPU_TARGET, remat: str | None = None):
        D, V = cfg.d_model, cfg.vocab_size
        Vp = padded_vocab or V
        if Vp < V:
            raise ValueError(f"padded_vocab={Vp} is smaller than vocab_size={V}")
        self.vocab_size = V
        self.wte = _padded_param(rngs, (V, D), ("vocab", "embed"), cfg.init_std, Vp)
        self.wpe = (_param(rngs, (cfg.max_seq_len, D), ("pos", "embed"), cfg.init_std)
                    if cfg.pos == "learned" else None)
        self.blocks = stacked_blocks(cfg, rngs, target)
        # remat: the run plan's (a layout search may choose it); None: model.remat
        self.scan, self.remat = cfg.scan_layers, cfg.remat if remat is None else remat
        self.residual_fp32 = cfg.residual_dtype == "fp32"
        self.ln_f = Norm(D, cfg.norm, cfg.bias)
        self.lm_head = (None if cfg.tie_embeddings
                        else _padded_param(rngs, (D, V), ("embed", "vocab"), cfg.init_std, Vp))
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
        x_BxLxD = self.embed(tokens_BxL, dtype=dtype)
        return self.run_blocks(x_BxLxD, dropout_key, dtype)

    def embed(self, tokens_BxL: jax.Array, start: Any = 0, dtype: Any = None) -> jax.Array:
        """The residual stream's input for tokens at positions ``start``, ``start + 1``, ...
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
                       else jax.lax.dynamic_slice_in_dim(self.wpe[...], start, L))
            x_BxLxD = x_BxLxD + wpe_LxD[None]
        # model.residual_dtype=fp32: the stream between blocks in fp32
        x_BxLxD = x_BxLxD.astype(jnp.float32 if self.residual_fp32
                                 else dtype or self.wte[...].dtype)
        return constrain(x_BxLxD, ACT)

    def head(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """Logits (fp32) over the padded vocabulary (padding masked) of the residual stream.
        ``dtype``: the compute dtype (default the parameters'), whatever the stream's."""
        return self.logits(self.output_weight(), self.final_norm(x_BxLxD, dtype))

    def final_norm(self, x_BxLxD: jax.Array, dtype: Any = None) -> jax.Array:
        """The output layer's input: the final norm of the stream, in the compute dtype."""
        return self.ln_f(x_BxLxD).astype(dtype or self.wte[...].dtype)

    def output_weight(self) -> jax.Array:
        """``lm_head`` (D x Vp), or ``wte`` (Vp x D) with tied embeddings."""
        return self.wte[...] if self.lm_head is None else self.lm_head[...]

    def logits(self, w: jax.Array, x_BxLxD: jax.Array) -> jax.Array:
        """Logits (fp32) of the output layer ``w`` (``output_weight``) over the padded
        vocabulary, padding masked; ``x_BxLxD`` the final norm's output (any number of
        positions: ``dxrun.chunked_loss`` calls it per chunk)."""
        if self.lm_head is not None:
            logits_BxLxVp = dense(x_BxLxD, w, "bld,dv->blv", jnp.float32)
        else:
            logits_BxLxVp = dense(x_BxLxD, w, "bld,vd->blv", jnp.float32)
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
