"""dxrun's one-device step against a step someone writes by hand, measured as issue 49 item 9
describes: one process, 8 simulated CPU devices (the CLI's allocator settings), the variants
interleaved, each step timed from handing the host batch over (``Experiment.global_batch`` for
dxrun, ``jax.device_put`` by hand) to ``block_until_ready`` on the loss, after 5 warm-up steps.

The hand-written step is nanoGPT's layout in plain ``jax.numpy``: a Python loop over per-layer
parameter dicts, one fused ``c_attn`` projection (d x 3d, with bias), ``jax.nn.
dot_product_attention``, 2-D weights everywhere, ``optax`` clipping + AdamW (the same
hyperparameters, schedule and decay set as dxrun's), the state donated. Its parameters are
dxrun's seeded init rearranged, so both start from the same loss. ``benchmarks/reference.py``
(dxrun's own stacked layout under a scan) is timed beside it, and, where the package is
installed (``pip install --no-deps dantinox==0.4.14``: its model only, not a dxrun dependency),
dantinox's Flax NNX GPT (fused q/k/v without bias, its own init) in the same bare step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import reference
from benchmarks.report import Figure, figure
from benchmarks.speed import _rows, compose_cfg
from benchmarks.timing import interleaved
from dxrun.experiment import Experiment

WARMUP = 5


def nanogpt_params(params: dict, n_heads: int, vocab: int) -> dict:
    """dxrun's parameters (a host copy) in nanoGPT's layout: ``h`` a list of per-layer dicts,
    q/k/v fused into ``c_attn``; the vocabulary's padding rows dropped."""
    b, D = params["blocks"], params["wte"].shape[1]
    a, m = b["attn"], b["mlp"]
    layers = []
    for i in range(b["ln1"]["scale"].shape[0]):
        layer = {
            "ln_1": {"w": b["ln1"]["scale"][i], "b": b["ln1"]["bias"][i]},
            "c_attn": {"w": np.concatenate([a[k][i].reshape(D, -1) for k in ("wq", "wk", "wv")],
                                           1),
                       "b": np.concatenate([a[k][i].reshape(-1) for k in ("bq", "bk", "bv")])},
            "c_proj": {"w": a["wo"][i].reshape(-1, D), "b": a["bo"][i]},
            "ln_2": {"w": b["ln2"]["scale"][i], "b": b["ln2"]["bias"][i]},
            "c_fc": {"w": m["w_up"][i], "b": m["b_up"][i]},
            "mlp_proj": {"w": m["w_down"][i], "b": m["b_down"][i]}}
        layers.append(layer)
    out = {"wte": params["wte"][:vocab], "wpe": params["wpe"], "h": layers,
           "ln_f": {"w": params["ln_f"]["scale"], "b": params["ln_f"]["bias"]}}
    if "lm_head" in params:
        out["lm_head"] = params["lm_head"][:, :vocab]
    return out


def _layernorm(x: jax.Array, p: dict) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["w"] + p["b"]


def nanogpt_loss(params: dict, tokens_BxT: jax.Array, n_heads: int) -> jax.Array:
    inputs, targets = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
    B, L = inputs.shape
    x = params["wte"][inputs] + params["wpe"][:L]
    for p in params["h"]:
        h = _layernorm(x, p["ln_1"]) @ p["c_attn"]["w"] + p["c_attn"]["b"]
        q, k, v = (t.reshape(B, L, n_heads, -1) for t in jnp.split(h, 3, axis=-1))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + o.reshape(B, L, -1) @ p["c_proj"]["w"] + p["c_proj"]["b"]
        h = jax.nn.gelu(_layernorm(x, p["ln_2"]) @ p["c_fc"]["w"] + p["c_fc"]["b"])
        x = x + h @ p["mlp_proj"]["w"] + p["mlp_proj"]["b"]
    x = _layernorm(x, params["ln_f"])
    logits = x @ params["lm_head"] if "lm_head" in params else x @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def nanogpt_optimizer(exp: Experiment, params: dict) -> optax.GradientTransformation:
    """dxrun's optimizer settings for nanoGPT's tree: decay on the 2-D weights but the tables."""
    o = exp.cfg.optimizer
    mask = jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim == 2 and str(getattr(path[0], "key", "")) not in ("wte", "wpe"),
        params)
    tx = optax.adamw(exp.schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                     mask=mask)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), tx) if o.clip_norm > 0 else tx


def _loop(step: Callable, box: dict, rows: list, place: Callable) -> Callable[[], Any]:
    def run() -> Any:
        tokens = place(rows[box["i"] % len(rows)])
        box["p"], box["o"], loss = step(box["p"], box["o"], tokens)
        box["i"] += 1
        return jax.block_until_ready(loss)
    return run


def runners(exp: Experiment) -> dict[str, Callable[[], Any]]:
    """dxrun's step, the nanoGPT-style step and the reference step, from one seeded init."""
    state = jax.device_get(exp.init_state())
    rows, dev = _rows(exp), exp.mesh.devices.flat[0]
    box = {"state": jax.device_put(state, exp.state_shardings), "i": 0}

    def dxrun() -> Any:
        tokens = exp.global_batch(rows[box["i"] % len(rows)])
        box["state"], metrics = exp.step(box["state"], tokens)
        box["i"] += 1
        return jax.block_until_ready(metrics["train/loss"])

    m = exp.cfg.model
    params = jax.device_put(nanogpt_params(state.params, m.n_heads, m.vocab_size), dev)
    tx = nanogpt_optimizer(exp, params)

    def step(p: dict, o: Any, t: jax.Array) -> tuple:
        value, grads = jax.value_and_grad(nanogpt_loss)(p, t, m.n_heads)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    nano = _loop(jax.jit(step, donate_argnums=(0, 1)), {"p": params, "o": tx.init(params),
                                                          "i": 0}, rows,
                 lambda r: jax.device_put(r, dev))
    placed = jax.device_put(state, exp.state_shardings)
    ref = _loop(reference.make_step(exp.tx), {"p": placed.params, "o": placed.opt_state, "i": 0},
                rows, lambda r: jax.device_put(r, exp.batch_sharding))
    out = {"dxrun": dxrun, "nanogpt": nano, "reference": ref}
    if (other := dantinox_runner(exp, rows, dev)) is not None:
        out["dantinox"] = other
    return out


def dantinox_runner(exp: Experiment, rows: list, dev: Any) -> Callable[[], Any] | None:
    """dantinox's GPT of the same shape (GELU, LayerNorm, learned positions; no q/k/v bias)
    in the bare step above; None where dantinox is not installed."""
    try:
        from dantinox.core.config import ModelConfig
        from dantinox.core.model import Transformer
    except ImportError:
        return None
    from flax import nnx

    m = exp.cfg.model
    model = Transformer(ModelConfig(
        dim=m.d_model, n_heads=m.n_heads, num_blocks=m.n_layers, vocab_size=m.vocab_size,
        max_context=m.max_seq_len, norm="layernorm", pos_encoding="learned", use_swiglu=False,
        activation="gelu", weight_tying=m.tie_embeddings, use_flash=True,
        expansion=m.d_ff // m.d_model), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(nnx.to_pure_dict(params), dev)
    tx = optax.chain(optax.clip_by_global_norm(exp.cfg.optimizer.clip_norm),
                     optax.adamw(exp.schedule, weight_decay=exp.cfg.optimizer.weight_decay))

    def loss(p: dict, t: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, p, rest)(t[:, :-1], deterministic=True).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    def step(p: dict, o: Any, t: jax.Array) -> tuple:
        value, grads = jax.value_and_grad(loss)(p, t)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    return _loop(jax.jit(step, donate_argnums=(0, 1)), {"p": params, "o": tx.init(params),
                                                         "i": 0}, rows,
                 lambda r: jax.device_put(r, dev))


def figures(shape: list[str], steps: int, reps: int) -> list[Figure]:
    """dxrun's one-device step / each hand-written step, tokens/s, interleaved."""
    exp = Experiment.build(compose_cfg(*shape, "parallelism=dp1"))
    variants = runners(exp)
    first = {k: float(run()) for k, run in variants.items()}  # the same model, the same loss
    for run in variants.values():
        for _ in range(WARMUP - 1):
            run()
    t = interleaved(variants, steps, reps)
    dx = t["dxrun"]
    section = "One device: dxrun vs hand-written jax.jit steps (issue 49 item 9)"
    notes = {"nanogpt": "nanoGPT's layout in plain jax.numpy: a Python loop over per-layer "
                        "dicts, fused c_attn, jax.nn.dot_product_attention, optax, donated",
             "reference": "benchmarks/reference.py: dxrun's stacked layout under lax.scan",
             "dantinox": "dantinox 0.4.14's Flax NNX GPT in the same bare step (its own init: "
                         "another first loss)"}
    return [figure(section, f"dp1: dxrun / {name} tokens/s", t[name].median_s / dx.median_s,
                   {"dxrun": dx.summary(), name: t[name].summary(),
                    "cpu_ratio": round(t[name].cpu_s / dx.cpu_s, 3),
                    "first_loss": {"dxrun": first["dxrun"], name: first[name]}}, ">= 1.0",
                   note=notes[name] + f"; 8 simulated devices, {WARMUP} warm-up steps, timed "
                   "from the host batch to the loss ready")
            for name in variants if name != "dxrun"]
