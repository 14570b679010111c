"""Attention kernels on one TPU chip at GPT-2's shapes (head dim 64, seq 1024, bf16): forward
plus backward and forward-only ms of the einsum reference, XLA's kernel, Pallas' flash attention
and splash attention at several block sizes, each with its largest difference from the reference
(outputs and gradients). What dxrun/model/splash_attention.py's block length was chosen by.

    python benchmarks/tpu_attention.py      # writes attn.json into $OUT (or /tmp)
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from jax.experimental.pallas.ops.tpu import splash_attention as sa


def timeit(f, *a, n=20):
    jax.block_until_ready(f(*a))  # compiled and warm
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3


def ref(q, k, v):  # BLHE
    E = q.shape[-1]
    s = jnp.einsum("blhe,bshe->bhls", q, k, preferred_element_type=jnp.float32) * E**-0.5
    L = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -1e30)
    p = jax.nn.softmax(s, -1).astype(v.dtype)
    return jnp.einsum("bhls,bshe->blhe", p, v)


def splash_fn(H, L, bq, bkv, bkvc=None, fused=False, layout_t=True):
    m = sa.MultiHeadMask([sa.CausalMask((L, L))] * H)
    kw = dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc or bkv, block_q_dkv=bq,
              block_kv_dkv=bkv, block_kv_dkv_compute=bkvc or bkv)
    if fused:
        kw["use_fused_bwd_kernel"] = True
    else:
        kw.update(block_q_dq=bq, block_kv_dq=bkv)
    kern = sa.make_splash_mha_single_device(m, block_sizes=sa.BlockSizes(**kw))
    def f(q, k, v):
        E = q.shape[-1]
        t = lambda x: x.transpose(0, 2, 1, 3)
        o = jax.vmap(kern)(t(q) * E**-0.5, t(k), t(v))
        return t(o)
    return f


def flash_fn(q, k, v):
    E = q.shape[-1]
    t = lambda x: x.transpose(0, 2, 1, 3)
    return t(fa.flash_attention(t(q), t(k), t(v), causal=True, sm_scale=E**-0.5))


def xla_fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def fb(f):
    g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return jax.jit(lambda q, k, v: (f(q, k, v), g(q, k, v)))


out = {}
for (B, H, L, E) in [(8, 12, 1024, 64), (8, 16, 1024, 64), (4, 20, 1024, 64)]:
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=(B, L, H, E)), jnp.bfloat16) for _ in range(3))
    base = fb(ref)(q, k, v)
    cands = {"ref": ref, "xla": xla_fn, "flash": flash_fn,
             "splash128": splash_fn(H, L, 128, 128),
             "splash512": splash_fn(H, L, 512, 512),
             "splash512_1024": splash_fn(H, L, 512, 1024, 512),
             "splash1024": splash_fn(H, L, 1024, 1024, 512),
             "splash512_fused": splash_fn(H, L, 512, 512, fused=True),
             "splash1024_fused": splash_fn(H, L, 1024, 1024, 512, fused=True)}
    for name, f in cands.items():
        try:
            ff = fb(f)
            res = ff(q, k, v)
            err = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
                      for a, b in zip(jax.tree.leaves(res), jax.tree.leaves(base), strict=True))
            ms = timeit(ff, q, k, v)
            fl = jax.jit(f)
            msf = timeit(fl, q, k, v)
            out[f"{B}x{H}x{L}x{E} {name}"] = (round(ms, 3), round(msf, 3), err)
        except Exception as e:  # noqa
            out[f"{B}x{H}x{L}x{E} {name}"] = repr(e)[:300]
        print(f"{B}x{H}x{L}x{E} {name}", out[f"{B}x{H}x{L}x{E} {name}"], flush=True)
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/attn.json", "w"), indent=1)
