"""Mixture of experts: the MoE MLP (``model.moe``), its router and dispatch, and the model whose
layers are dense or MoE (``MoETransformer``); docs/guide/moe.md is its guide.

Shapes are in the names as in ``dxrun.model.transformer`` (B batch, L length, D d_model), and: N
experts (n the experts one device of the ``expert`` axis holds), K top_k, T tokens (B*L), A
routed assignments (T*K), F an expert's hidden width.

Routing runs on the whole batch under the mesh's sharding: its statistics are global, the same
on every layout. The experts run dropless, the assignments sorted by expert through grouped
matmuls, under ``jax.shard_map`` over the ``expert`` axis (``experts``). The layers' statistics
leave the scanned stack as the scan's outputs and reach the train step's loss through
``dxrun.model.router_losses.router_statistics`` / ``record`` (its ``with_router_losses`` adds
the penalties and the metrics).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from dxrun.model.attention import KERNEL
from dxrun.model.layers import MLP, dense, gelu, param, swiglu, zeros
from dxrun.model.router_losses import BIAS_STEP, record, router_statistics
from dxrun.model.sharding import active_axes, active_spec
from dxrun.model.transformer import REMAT_POLICIES, Transformer, stacked_blocks

if TYPE_CHECKING:
    from dxrun.config import ModelConfig

# ------------------------------------------------------------------------------------------------
# The router: which experts each token goes to, with what weight, and the batch's statistics.

def route(logits_BxLxN: jax.Array, top_k: int, kind: str, renormalize: bool,
          bias_N: jax.Array | None = None, capacity_factor: float | None = None,
          scale: float = 1.0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(each token's K experts, -1 where dropped; their weights; the statistics) of fp32 router
    logits. ``kind``: softmax (the top k of the softmax: Mixtral, Qwen) or sigmoid (the top k
    of the sigmoid scores plus ``bias_N``, which picks but never weighs: DeepSeek-V3).
    ``capacity_factor``: each expert takes its first ``ceil(c T K / N)`` assignments, first
    choices before second ones (Switch's priority), the rest dropped."""
    B, L, N = logits_BxLxN.shape
    T = B * L
    if kind == "softmax":
        probs_BxLxN = jax.nn.softmax(logits_BxLxN, axis=-1)
        gate_BxLxK, idx_BxLxK = jax.lax.top_k(probs_BxLxN, top_k)
    else:
        probs_BxLxN = jax.nn.sigmoid(logits_BxLxN)
        _, idx_BxLxK = jax.lax.top_k(probs_BxLxN + jax.lax.stop_gradient(bias_N), top_k)
        gate_BxLxK = jnp.take_along_axis(probs_BxLxN, idx_BxLxK, axis=-1)
    if renormalize:
        gate_BxLxK = gate_BxLxK / (gate_BxLxK.sum(-1, keepdims=True) + 1e-20)
    hot_BxLxKxN = jax.nn.one_hot(idx_BxLxK, N, dtype=jnp.float32)
    count_N = hot_BxLxKxN.sum((0, 1, 2))
    # Each expert's share of the assignments times its mean probability (normalised scores
    # for sigmoid), times N: 1 when the load and the probabilities are uniform.
    share_N = (probs_BxLxN / probs_BxLxN.sum(-1, keepdims=True)).mean((0, 1))
    aux = N * jnp.sum(count_N / (T * top_k) * share_N)
    z = jnp.mean(jax.nn.logsumexp(logits_BxLxN, axis=-1) ** 2)
    keep_BxLxK = jnp.ones(idx_BxLxK.shape, bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * top_k / N)
        hot_AxN = jnp.moveaxis(hot_BxLxKxN, 2, 0).reshape(-1, N)  # choice-major order
        before_AxN = jnp.cumsum(hot_AxN, axis=0) - hot_AxN
        place_A = jnp.sum(before_AxN * hot_AxN, axis=-1)
        keep_BxLxK = jnp.moveaxis((place_A < capacity).reshape(top_k, B, L), 0, 2)
    computed_N = jnp.einsum("blkn,blk->n", hot_BxLxKxN, keep_BxLxK.astype(jnp.float32))
    stats = {"aux_loss": aux, "z_loss": z, "load_N": computed_N,
             "dropped": 1 - keep_BxLxK.mean(dtype=jnp.float32)}
    return jnp.where(keep_BxLxK, idx_BxLxK, -1), gate_BxLxK * scale, stats


# ------------------------------------------------------------------------------------------------
# The experts: the routed assignments sorted by expert through grouped matmuls.

def expert_mlp(x_TxD: jax.Array, idx_TxK: jax.Array, gate_TxK: jax.Array,
               w_up_nxDxF: jax.Array, w_gate_nxDxF: jax.Array | None, w_down_nxFxD: jax.Array,
               first: Any = 0) -> jax.Array:
    """The weighted sum over each token's experts among the n held here (experts ``first``,
    ``first + 1``, ...) of their MLPs' outputs, computed in ``x_TxD``'s dtype with fp32
    accumulation; assignments to other experts (or dropped: -1) add nothing. The assignments
    are sorted by expert (theirs last, where ``ragged_dot`` leaves zeros) and each matmul is
    one ``jax.lax.ragged_dot`` over the groups."""
    T, K = idx_TxK.shape
    n = w_up_nxDxF.shape[0]
    cd = x_TxD.dtype
    local_TxK = idx_TxK - first
    mine_TxK = (idx_TxK >= 0) & (local_TxK >= 0) & (local_TxK < n)
    group_A = jnp.where(mine_TxK, local_TxK, n).reshape(-1)
    order_A = jnp.argsort(group_A, stable=True)
    sizes_n = jnp.sum(jax.nn.one_hot(group_A, n, dtype=jnp.int32), axis=0)
    xs_AxD = jnp.take(x_TxD, order_A // K, axis=0)

    def grouped(a: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(a, w.astype(cd), sizes_n,
                                  preferred_element_type=jnp.float32).astype(cd)

    h_AxF = grouped(xs_AxD, w_up_nxDxF)
    h_AxF = gelu(h_AxF) if w_gate_nxDxF is None else swiglu(grouped(xs_AxD, w_gate_nxDxF), h_AxF)
    y_AxD = jax.lax.ragged_dot(h_AxF, w_down_nxFxD.astype(cd), sizes_n,
                               preferred_element_type=jnp.float32)
    y_TxKxD = jnp.take(y_AxD, jnp.argsort(order_A), axis=0).reshape(T, K, -1)
    weights_TxK = jnp.where(mine_TxK, gate_TxK, 0).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK).astype(cd)


def experts(x_BxLxD: jax.Array, idx_BxLxK: jax.Array, gate_BxLxK: jax.Array,
            weights: tuple[jax.Array, jax.Array | None, jax.Array]) -> jax.Array:
    """``expert_mlp`` of every token: on the whole batch outside a mesh, else under
    ``jax.shard_map``: each device gathers the tokens of its expert group (the devices that
    split the batch over ``expert``), computes its own experts on the assignments routed to
    them, and the group's partial outputs are summed and scattered back to their tokens'
    devices (all-gather forward and reduce-scatter, their transposes backward: Megatron's
    all-gather dispatcher, chosen over an all-to-all because it needs no ragged exchange and
    the sum is exact, so every layout computes what one device does)."""
    B, L, D = x_BxLxD.shape
    K = idx_BxLxK.shape[-1]
    if jax.sharding.get_abstract_mesh().empty:
        return expert_mlp(x_BxLxD.reshape(B * L, D), idx_BxLxK.reshape(B * L, K),
                          gate_BxLxK.reshape(B * L, K), *weights).reshape(B, L, D)
    group = tuple(active_axes("expert"))
    x_spec = active_spec(("batch", "seq", "act_embed"))
    k_spec = active_spec(("batch", "seq", None))
    w_spec = active_spec(("expert", None, None))  # the experts whole, each device its own

    def local(x_bxlxD: jax.Array, idx_bxlxK: jax.Array, gate_bxlxK: jax.Array,
              w_up: jax.Array, w_gate: jax.Array | None, w_down: jax.Array) -> jax.Array:
        b, s, _ = x_bxlxD.shape
        x_TxD, idx_TxK, gate_TxK = (a.reshape(b * s, -1) for a in (x_bxlxD, idx_bxlxK,
                                                                   gate_bxlxK))
        first = 0
        if group:  # the group's tokens, in the group's order
            x_TxD, idx_TxK, gate_TxK = (jax.lax.all_gather(a, group, tiled=True)
                                        for a in (x_TxD, idx_TxK, gate_TxK))
            first = jax.lax.axis_index(group) * w_up.shape[0]
        y_TxD = expert_mlp(x_TxD, idx_TxK, gate_TxK, w_up, w_gate, w_down, first)
        if group:
            y_TxD = jax.lax.psum_scatter(y_TxD, group, tiled=True)
        return y_TxD.reshape(b, s, D)

    w_specs = tuple(None if w is None else w_spec for w in weights)
    return jax.shard_map(local, in_specs=(x_spec, k_spec, k_spec, *w_specs),
                         out_specs=x_spec, check_vma=False)(
        x_BxLxD, idx_BxLxK, gate_BxLxK, *weights)


class MoE(nnx.Module):
    """The MoE MLP: a router (D x N), N experts (GELU or SwiGLU, as ``model.mlp``; no biases),
    each ``d_ff`` wide (``dxrun.config.expert_d_ff``), stacked on a leading ``expert`` axis,
    and an optional shared expert every token passes through (``model.moe.shared_d_ff``,
    gated with ``model.moe.shared_gate``)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int):
        m = cfg.moe
        D, F, N, std = cfg.d_model, d_ff, m.n_experts, cfg.init_std
        self.top_k, self.kind, self.renormalize = m.top_k, m.router, m.renormalize
        self.scale, self.capacity = m.routed_scale, m.capacity_factor
        self.coefficients = (m.aux_loss, m.z_loss)
        self.bias_rate = m.bias_rate
        self.router = param(rngs, (D, N), ("embed", None), std)
        self.bias = zeros((N,), (None,)) if m.router == "sigmoid" else None
        self.w_up = param(rngs, (N, D, F), ("expert", "embed", "mlp"), std)
        self.w_gate = (param(rngs, (N, D, F), ("expert", "embed", "mlp"), std)
                       if cfg.mlp == "swiglu" else None)
        self.w_down = param(rngs, (N, F, D), ("expert", "mlp", "embed"),
                            std / (2 * cfg.n_layers) ** 0.5)
        shared = SimpleNamespace(d_model=D, d_ff=m.shared_d_ff, init_std=std, mlp=cfg.mlp,
                                 n_layers=cfg.n_layers, bias=False)
        self.shared = MLP(shared, rngs) if m.shared_d_ff else None  # type: ignore[arg-type]
        self.shared_gate = param(rngs, (D, 1), ("embed", None), std) if m.shared_gate else None

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        logits_BxLxN = dense(x_BxLxD, self.router[...], "bld,dn->bln", jnp.float32)
        idx_BxLxK, gate_BxLxK, stats = route(
            logits_BxLxN, self.top_k, self.kind, self.renormalize,
            None if self.bias is None else self.bias[...], self.capacity, self.scale)
        aux_coef, z_coef = self.coefficients
        stats["penalty"] = aux_coef * stats["aux_loss"] + z_coef * stats["z_loss"]
        if self.bias_rate:  # DeepSeek-V3: the bias of an expert under the mean load rises
            load_N = stats["load_N"]
            stats[BIAS_STEP] = self.bias_rate * jnp.sign(load_N.mean() - load_N)
        record(stats)
        weights = (self.w_up[...], None if self.w_gate is None else self.w_gate[...],
                   self.w_down[...])
        y_BxLxD = experts(x_BxLxD, idx_BxLxK, gate_BxLxK, weights)
        if self.shared is not None:
            s_BxLxD = self.shared(x_BxLxD)
            if self.shared_gate is not None:
                g_BxLx1 = dense(x_BxLxD, self.shared_gate[...], "bld,do->blo", jnp.float32)
                s_BxLxD = (jax.nn.sigmoid(g_BxLx1) * s_BxLxD).astype(s_BxLxD.dtype)
            y_BxLxD = y_BxLxD + s_BxLxD
        return y_BxLxD


# ------------------------------------------------------------------------------------------------
# The model: dense layers and MoE layers, scanned in groups.

class MoETransformer(Transformer):
    """``Transformer`` whose MLP is ``MoE`` (experts ``d_ff`` wide) in the layers ``kinds``
    marks (``dxrun.config.moe_layers``): the dense layers' blocks stacked as ``blocks`` (the
    first ``first_dense``, then each group's ``every - 1``), the MoE layers' as
    ``moe_blocks``. The layers run as the dense model's do,
    the first dense ones scanned (or looped), then one scan over the groups, each step its
    dense layers and its MoE layer; ``model.remat`` wraps each layer."""

    def __init__(self, cfg: ModelConfig, kinds: tuple[bool, ...], d_ff: int, *,
                 rngs: nnx.Rngs, padded_vocab: int | None = None,
                 kernel: tuple[str, bool] = KERNEL, remat: str | None = None):
        super().__init__(cfg, rngs=rngs, padded_vocab=padded_vocab, kernel=kernel, remat=remat)
        dense_n = kinds.count(False)
        self.first_dense, self.every = cfg.moe.first_dense, cfg.moe.every
        # nnx.data: the base class left `blocks` a static None
        self.blocks = nnx.data(stacked_blocks(cfg, rngs, kernel, dense_n) if dense_n else None)
        self.moe_blocks = stacked_blocks(cfg, rngs, kernel, kinds.count(True),
                                         lambda r: MoE(cfg, r, d_ff))

    def run_blocks(self, x_BxLxD: jax.Array, dropout_key: jax.Array | None,
                   dtype: Any = None) -> jax.Array:
        moe_def, moe_params = nnx.split(self.moe_blocks)
        G, d, k = jax.tree.leaves(moe_params)[0].shape[0], self.first_dense, self.every
        keys = (None if dropout_key is None or self.rate == 0 else
                jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(jnp.arange(d + G * k)))
        if self.blocks is not None:
            dense_def, dense_params = nnx.split(self.blocks)
        else:
            dense_def, dense_params = None, None

        def dense_layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, None]:
            params, key = inputs
            return nnx.merge(dense_def, params)(x, key, dtype), None

        def moe_layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, dict]:
            params, key = inputs
            with router_statistics() as found:
                x = nnx.merge(moe_def, params)(x, key, dtype)
            return x, found[0]

        if self.remat != "none":
            dense_layer, moe_layer = (jax.checkpoint(f, policy=REMAT_POLICIES[self.remat])
                                      for f in (dense_layer, moe_layer))
        at = slice_tree
        if d:
            x_BxLxD = self.over(dense_layer, x_BxLxD, (at(dense_params, slice(0, d)),
                                                       at(keys, slice(0, d))))[0]
        group_dense = jax.tree.map(lambda a: a[d:].reshape(G, k - 1, *a.shape[1:]),
                                   dense_params)
        group_keys = None if keys is None else keys[d:].reshape(G, k, *keys.shape[1:])

        def group(x: jax.Array, inputs: tuple) -> tuple[jax.Array, dict]:
            dense_p, moe_p, key = inputs
            for j in range(k - 1):
                x = dense_layer(x, (at(dense_p, j), at(key, j)))[0]
            return moe_layer(x, (moe_p, at(key, k - 1)))

        x_BxLxD, stats = self.over(group, x_BxLxD, (group_dense, moe_params, group_keys))
        record(stats)  # each statistic with a leading axis over the MoE layers
        return x_BxLxD

    def over(self, f: Any, x: jax.Array, xs: Any) -> tuple[jax.Array, Any]:
        """``jax.lax.scan(f, x, xs)``, or with ``model.scan_layers=false`` its Python loop."""
        if self.scan:
            return jax.lax.scan(f, x, xs)
        n = jax.tree.leaves(xs)[0].shape[0]
        ys = []
        for i in range(n):
            x, y = f(x, slice_tree(xs, i))
            ys.append(y)
        return x, (None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys))


def slice_tree(tree: Any, at: Any) -> Any:
    """Every array of ``tree`` indexed by ``at`` on its leading axis (None stays None)."""
    return jax.tree.map(lambda a: a[at], tree)
