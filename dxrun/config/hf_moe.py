"""A mixture-of-experts family's ``config.json`` (Mixtral, Qwen3-MoE: ``LLAMA_LIKE`` rows with
``moe``) as ``model.moe``'s keys, and back; ``dxrun.config.hf_model`` reads the rest of the
file (and takes its one-line refusals from here: ``need``, ``refuse_unless``). No JAX.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dxrun.config.errors import ConfigError
from dxrun.config.schema import moe_layers

DENSE = {"moe.n_experts": 0}  # a dense family's MoE keys


@dataclass(frozen=True)
class MoEFields:
    """A mixture-of-experts family's config.json fields and tensor names: ``experts`` (the
    count's field), ``d_ff`` (the experts' width's field; None: ``intermediate_size``, every
    layer an MoE layer: Mixtral), ``renormalize`` (the field of the top k weights' division by
    their sum; None: always), ``block`` (the MoE MLP's module name), ``names`` (an expert's
    gate, up and down projections' names), ``shared``: the field of the width of a shared
    expert every token passes through, gated by a sigmoid of the token (Qwen2-MoE's; None:
    none)."""

    experts: str
    d_ff: str | None
    renormalize: str | None
    block: str
    names: tuple[str, str, str]
    shared: str | None = None


def refuse_unless(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {what}; dxrun's model has no equivalent")


def need(hf: dict, path: Path, name: str) -> Any:
    if hf.get(name) is None:
        raise ConfigError(f"{path}: {name} is missing")
    return hf[name]


def moe_fields(hf: dict, path: Path, f: MoEFields | None, n_layers: int) -> dict[str, Any]:
    """The ``model.moe`` keys (dotted) of a Llama-shaped family's ``config.json`` (``f``: its
    row's ``moe``): a dense family's ``DENSE``; a mixture of experts' counts, widths and its
    MoE layers (Qwen-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` as ``first_dense``
    and ``every``), its ``router_aux_loss_coef`` as ``moe.aux_loss`` (transformers'
    load-balancing loss is top_k times dxrun's, so the coefficient times top_k; a run may set
    its own)."""
    if f is None:
        return dict(DENSE)
    refuse_unless(not hf.get("router_jitter_noise"), path,
                   f"router_jitter_noise={hf.get('router_jitter_noise')} (noise on the router's "
                   "input while training); set it to 0.0")
    act = hf.get("hidden_act") or "silu"
    refuse_unless(act == "silu", path, f"hidden_act={act} (dxrun's experts are SwiGLU: silu)")
    n, top_k = need(hf, path, f.experts), need(hf, path, "num_experts_per_tok")
    only, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step") or 1
    kinds = tuple(i not in only and n > 0 and (i + 1) % step == 0 for i in range(n_layers))
    found = next(((d, k) for d in range(n_layers) for k in range(1, n_layers + 1)
                  if (n_layers - d) % k == 0 and moe_layers(
                      n_layers, SimpleNamespace(n_experts=n, first_dense=d, every=k)) == kinds),
                 None)
    refuse_unless(found is not None, path,
                   f"mlp_only_layers={json.dumps(only)}, decoder_sparse_step={step} (MoE and "
                   "dense layers in an order dxrun does not build: after the first dense "
                   "ones, the last of every k layers an MoE layer)")
    renormalize = True if f.renormalize is None else bool(hf.get(f.renormalize))
    shared = need(hf, path, f.shared) if f.shared else 0
    refuse_unless(not f.shared or hf.get("qkv_bias", True), path,
                   "qkv_bias=false (Qwen2-MoE's attention without its q, k, v biases)")
    return {"moe.n_experts": n, "moe.top_k": top_k,
            "moe.d_ff": None if f.d_ff is None else need(hf, path, f.d_ff),
            "moe.first_dense": found[0], "moe.every": found[1], "moe.shared_d_ff": shared,
            "moe.shared_gate": bool(shared), "moe.router": "softmax", "moe.renormalize": renormalize,
            "moe.routed_scale": 1.0, "moe.bias_rate": 0.0,
            "moe.aux_loss": float(hf.get("router_aux_loss_coef") or 0.0) * top_k}


def show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def moe_misses(m: Any, kind: str, f: MoEFields | None) -> list[str]:
    """What of ``m``'s mixture of experts (or its absence) the family ``kind`` (``f``: its
    row's ``moe``) has not."""
    moe = getattr(m, "moe", None)
    n = moe.n_experts if moe is not None else 0
    if not n:
        return [] if f is None else ["model.moe.n_experts=0 (a dense model)"]
    if f is None:
        return [f"model.moe.n_experts={n} (a mixture of experts; {kind} is dense)"]
    want = dict(router="softmax", routed_scale=1.0)
    if f.shared is None:
        want["shared_d_ff"] = 0
    else:  # Qwen2-MoE's: a gated shared expert
        want |= dict(shared_d_ff=getattr(moe, "shared_d_ff", 0) or "> 0", shared_gate=True)
    if f.d_ff is None:  # Mixtral's: every layer an MoE layer, the experts intermediate_size
        want |= dict(every=1, first_dense=0, d_ff=getattr(moe, "d_ff", None) and m.d_ff)
    if f.renormalize is None:
        want["renormalize"] = True
    out = [f"model.moe.{k}={show(getattr(moe, k))}" for k, v in want.items()
           if getattr(moe, k) != v]
    return out + ([] if m.mlp == "swiglu" else [f"model.mlp={m.mlp} (its experts are SwiGLU)"])


def moe_json(m: Any, f: MoEFields | None) -> dict[str, Any]:
    """A mixture of experts' config.json fields (none for a dense family): the inverse of
    ``moe_fields``, the MoE layers as Qwen-MoE's ``decoder_sparse_step`` (no dense first
    layers) or ``mlp_only_layers``."""
    if f is None:
        return {}
    moe = m.moe
    out = {f.experts: moe.n_experts, "num_experts_per_tok": moe.top_k,
           "router_aux_loss_coef": moe.aux_loss / moe.top_k, "output_router_logits": False}
    if f.renormalize is not None:
        out[f.renormalize] = moe.renormalize
    if f.shared is not None:
        out |= {f.shared: moe.shared_d_ff, "qkv_bias": True}
    if f.d_ff is None:
        return dict(out, router_jitter_noise=0.0)
    kinds = moe_layers(m.n_layers, moe)
    step = moe.every if not moe.first_dense else 1
    only = [] if not moe.first_dense else [i for i, k in enumerate(kinds) if not k]
    return dict(out, **{f.d_ff: moe.d_ff or m.d_ff}, decoder_sparse_step=step,
                mlp_only_layers=only)
