"""A Hugging Face directory's ``config.json`` as dxrun's model section, and back.

``model.init_from=hf:<dir>``: the model's shape is the checkpoint's, so the model section is
filled from ``config.json`` before the config is validated (as a preset would fill it), and a
``model.*`` override that contradicts it is refused in one line. GPT-2 (``model_type: gpt2``) and
the Llama-shaped families (``LLAMA_LIKE``: Llama, Mistral, Qwen2/2.5, Qwen3, OLMo 2, Gemma 1-3,
Phi-3: grouped-query attention, a gated MLP, untied or tied embeddings, ``rope_theta``, Llama
3.1's ``rope_scaling``, each with the pieces its row names; the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE, their MoE fields ``dxrun.config.hf_moe``'s) are read; anything dxrun's
model cannot compute exactly is refused, naming the field. No JAX: plan mode plans a fine-tune
from ``config.json`` alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dxrun.config.errors import ConfigError
from dxrun.config.hf_moe import (
    DENSE,
    MoEFields,
    moe_fields,
    moe_json,
    moe_misses,
)
from dxrun.config.hf_moe import need as _need
from dxrun.config.hf_moe import refuse_unless as _refuse_unless
from dxrun.config.hf_moe import show as _show

if TYPE_CHECKING:
    from omegaconf import DictConfig

HF_PREFIX = "hf:"
KEY = "model.init_from"
# The model keys a checkpoint fixes (the rest: dropout, remat, scan_layers... are the run's).
SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
              "max_seq_len", "bias", "norm", "norm_eps", "mlp", "pos", "tie_embeddings",
              "rope_theta", "rope_scaling", "head_dim", "qkv_bias", "qk_norm", "sliding_window",
              "norm_position", "gelu", "norm_plus_one", "embed_scale", "global_every",
              "rope_local_theta", "attn_softcap", "logit_softcap", "attn_scalar", "hf_type",
              *(f"moe.{k}" for k in ("n_experts", "top_k", "d_ff", "every", "first_dense",
                                     "shared_d_ff", "shared_gate", "router", "renormalize",
                                     "routed_scale", "bias_rate")))
# The MoE keys a checkpoint suggests but the run may set otherwise (its training's, not its
# model's): the load-balancing loss's coefficient (config.json's router_aux_loss_coef).
RUN_KEYS = ("moe.aux_loss",)
GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # GELU's tanh form, as dxrun's MLP computes it
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")


@dataclass(frozen=True)
class Family:
    """A Llama-shaped family: Llama's config.json fields and tensor names, plus ``pieces`` (the
    model keys it always has), ``window``: how its config.json gives a sliding window
    (``sliding_window``: Mistral's one number; ``layer_types``: the per-layer kinds, Qwen's
    with ``use_sliding_window`` and ``max_window_layers``, Gemma 2/3's alternating; None: it has
    none), ``reads``: the config.json fields of its own it reads into model keys (each
    ``READS`` row), ``act``: the field naming its MLP's activation and that field's default,
    ``fused``: its checkpoint joins q, k, v and gate, up in one tensor each (Phi-3's), and
    ``defaults``: its transformers config class's defaults where they are not Llama's, which a
    config.json leaves out (``save_pretrained`` writes only what differs from them;
    ``sliding_window_pattern``: the layer kinds when ``layer_types`` is left out), ``moe``: a
    mixture of experts' config.json fields (``MoEFields``; None: a dense family)."""

    architecture: str
    pieces: dict[str, Any] = field(default_factory=dict)
    window: str | None = None
    reads: tuple[str, ...] = ()
    act: tuple[str, str] = ("hidden_act", "silu")
    fused: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    moe: MoEFields | None = None




# A family's own config.json field -> the model key it fills (whose null is the field's
# absence; a family that does not read the field refuses it: ``UNREAD``).
READS = {"attn_logit_softcapping": "attn_softcap", "final_logit_softcapping": "logit_softcap",
         "query_pre_attn_scalar": "attn_scalar", "rope_local_base_freq": "rope_local_theta"}
# The pieces' "off" values: what a family without them has (GPT-2, Llama).
_PLAIN = dict(qkv_bias=False, qk_norm="none", norm_position="pre", norm_plus_one=False,
              embed_scale=False, global_every=None, rope_local_theta=None, attn_softcap=None,
              logit_softcap=None, attn_scalar=None)
_GEMMA = dict(norm_plus_one=True, embed_scale=True)
_GEMMA2 = dict(_GEMMA, norm_position="sandwich")
_TANH = ("hidden_activation", "gelu_pytorch_tanh")
_GEMMA_DEFAULTS = dict(tie_word_embeddings=True, head_dim=256)
_GEMMA2_DEFAULTS = dict(_GEMMA_DEFAULTS, sliding_window=4096, query_pre_attn_scalar=256)
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")
# model_type -> its row: a family of Llama's shape is one row here (its tensors: dxrun.hf).
LLAMA_LIKE = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", window="sliding_window",
                      defaults=dict(sliding_window=4096)),
    "qwen2": Family("Qwen2ForCausalLM", dict(qkv_bias=True), window="layer_types"),
    "qwen3": Family("Qwen3ForCausalLM", dict(qk_norm="head"), window="layer_types",
                    defaults=dict(head_dim=128)),
    "olmo2": Family("Olmo2ForCausalLM", dict(qk_norm="proj", norm_position="post"),
                    defaults=dict(rms_norm_eps=1e-5)),
    # transformers 4.57's GemmaMLP reads hidden_act (a published Gemma's "gelu": exact GELU)
    "gemma": Family("GemmaForCausalLM", _GEMMA, act=("hidden_act", "gelu_pytorch_tanh"),
                    defaults=_GEMMA_DEFAULTS),
    "gemma2": Family("Gemma2ForCausalLM", _GEMMA2, "layer_types", _CAPS, _TANH,
                     defaults=dict(_GEMMA2_DEFAULTS, attn_logit_softcapping=50.0,
                                   final_logit_softcapping=30.0, sliding_window_pattern=2)),
    "gemma3_text": Family("Gemma3ForCausalLM", dict(_GEMMA2, qk_norm="head"), "layer_types",
                          (*_CAPS, "rope_local_base_freq"), _TANH,
                          defaults=dict(_GEMMA2_DEFAULTS, rope_theta=1e6,
                                        rope_local_base_freq=1e4, sliding_window_pattern=6)),
    "phi3": Family("Phi3ForCausalLM", window="sliding_window", fused=True,
                   defaults=dict(rms_norm_eps=1e-5)),
    # the mixtures of experts: softmax routers, top k of the softmax (Mixtral's renormalised)
    "mixtral": Family("MixtralForCausalLM", window="sliding_window",
                      defaults=dict(rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8,
                                    num_experts_per_tok=2, router_aux_loss_coef=0.001),
                      moe=MoEFields("num_local_experts", None, None, "block_sparse_moe",
                                    ("w1", "w3", "w2"))),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", dict(qkv_bias=True),
                        defaults=dict(num_experts=60, num_experts_per_tok=4,
                                      moe_intermediate_size=1408, norm_topk_prob=False,
                                      decoder_sparse_step=1, router_aux_loss_coef=0.001,
                                      shared_expert_intermediate_size=5632),
                        moe=MoEFields("num_experts", "moe_intermediate_size", "norm_topk_prob",
                                      "mlp", ("gate_proj", "up_proj", "down_proj"),
                                      "shared_expert_intermediate_size")),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", dict(qk_norm="head"), window="use_sliding_window",
                        defaults=dict(num_experts=128, num_experts_per_tok=8,
                                      moe_intermediate_size=768, norm_topk_prob=False,
                                      decoder_sparse_step=1, router_aux_loss_coef=0.001,
                                      sliding_window=4096),
                        moe=MoEFields("num_experts", "moe_intermediate_size", "norm_topk_prob",
                                      "mlp", ("gate_proj", "up_proj", "down_proj"))),
}
# The MLP an activation makes of a Llama-shaped family's gated unit (``hidden_act``).
ACTS = {"silu": dict(mlp="swiglu", gelu="tanh"),
        "gelu_pytorch_tanh": dict(mlp="geglu", gelu="tanh"),
        "gelu": dict(mlp="geglu", gelu="exact")}
HF_TYPES = ("gpt2", *LLAMA_LIKE)  # the model_types dxrun reads and writes
# config.json fields that change what a model computes and that no family dxrun reads has: set
# to anything but their "off" value, refused (never silently dropped). A family's own
# (``Family.reads``) are read instead.
UNREAD = {"attn_logit_softcapping": None, "final_logit_softcapping": None,
          "partial_rotary_factor": 1.0, "attention_bias": False, "mlp_bias": False,
          "qk_layernorm": False, "use_qk_norm": False}


def hf_dir(init_from: str | None) -> Path | None:
    """The directory ``model.init_from`` names, or None when it names none."""
    if not init_from:
        return None
    if not init_from.startswith(HF_PREFIX) or not init_from[len(HF_PREFIX):]:
        raise ConfigError(f"{KEY}={init_from}: give hf:<dir>, a local Hugging Face directory "
                          "(config.json and model.safetensors)")
    return Path(init_from[len(HF_PREFIX):]).expanduser().absolute()


def read_config(d: Path) -> dict[str, Any]:
    path = d / "config.json"
    if not d.is_dir():
        raise ConfigError(f"{KEY}: {d} is not a directory; give hf:<a Hugging Face directory>")
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json; a Hugging Face directory holds config.json "
                          "and model.safetensors")
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return out




def model_fields(hf: dict, path: Path) -> dict[str, Any]:
    """The model section's shape keys for the checkpoint ``config.json`` (``hf``, at ``path``)
    describes; refuses what dxrun cannot compute exactly."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        _refuse_unless(act in GPT2_ACTS, path, f"activation_function={act}")
        for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("tie_word_embeddings", True)):
            _refuse_unless(hf.get(name, want) == want, path, f"{name}={hf.get(name)}")
        eps = hf.get("layer_norm_epsilon", 1e-5)
        D, H = _need(hf, path, "n_embd"), _need(hf, path, "n_head")
        out = dict(n_layers=_need(hf, path, "n_layer"), d_model=D, n_heads=H, n_kv_heads=H,
                   d_ff=hf.get("n_inner") or 4 * D, vocab_size=_need(hf, path, "vocab_size"),
                   max_seq_len=_need(hf, path, "n_positions"), bias=True, norm="layernorm",
                   norm_eps=float(eps), mlp="gelu", pos="learned", tie_embeddings=True,
                   rope_theta=10000.0, rope_scaling=None, gelu="tanh", head_dim=None,
                   sliding_window=None, hf_type=kind, **_PLAIN, **DENSE)
    elif kind in LLAMA_LIKE:
        out = _llama_fields(hf, path, kind)
        eps = out["norm_eps"]
    else:
        raise ConfigError(f"{path}: model_type={kind} is not one dxrun reads; it reads "
                          f"{', '.join(['gpt2', *LLAMA_LIKE])} (docs/guide/huggingface.md)")
    _refuse_unless(isinstance(eps, (int, float)) and eps > 0, path, f"norm epsilon {eps}")
    return out


def _llama_fields(hf: dict, path: Path, kind: str) -> dict[str, Any]:
    """The shape keys of a Llama-shaped family's ``config.json`` (its ``LLAMA_LIKE`` row)."""
    family = LLAMA_LIKE[kind]
    hf = {**family.defaults, **hf}
    act_field, act_default = family.act
    act = hf.get(act_field) or act_default
    _refuse_unless(act in ACTS, path, f"{act_field}={act} (dxrun's gated MLPs: "
                   f"{', '.join(ACTS)})")
    for name, off in UNREAD.items():
        _refuse_unless(name in family.reads or hf.get(name) in (None, off), path,
                       f"{name}={json.dumps(hf.get(name))} (model_type={kind})")
    D, H = _need(hf, path, "hidden_size"), _need(hf, path, "num_attention_heads")
    n_layers = _need(hf, path, "num_hidden_layers")
    head_dim = hf.get("head_dim") or D // H
    window, every = _window(hf, path, kind, n_layers)
    own = {READS[name]: (None if hf.get(name) is None else float(hf[name]))
           for name in family.reads}
    if own.get("attn_scalar") == head_dim:  # the scores' usual scale: no key needed
        own["attn_scalar"] = None
    if every is None or own.get("rope_local_theta") == float(hf.get("rope_theta", 1e4)):
        own["rope_local_theta"] = None
    _refuse_unless(not (kind == "gemma3_text" and hf.get("rope_scaling")), path,
                   f"rope_scaling={json.dumps(hf.get('rope_scaling'))} (Gemma 3's, on its "
                   "global layers only; dxrun scales none)")
    return {**_PLAIN, **moe_fields(hf, path, LLAMA_LIKE[kind].moe, n_layers), **dict(
        n_layers=n_layers, d_model=D, n_heads=H,
                             n_kv_heads=hf.get("num_key_value_heads") or H,
                             d_ff=_need(hf, path, "intermediate_size"),
                             vocab_size=_need(hf, path, "vocab_size"),
                             max_seq_len=_need(hf, path, "max_position_embeddings"),
                             bias=False, norm="rmsnorm",
                             norm_eps=float(hf.get("rms_norm_eps", 1e-6)), pos="rope",
                             tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                             rope_theta=float(hf.get("rope_theta", 10000.0)),
                             rope_scaling=rope_scaling(hf.get("rope_scaling"), path),
                             head_dim=None if head_dim * H == D else head_dim, **ACTS[act],
                             sliding_window=window, global_every=every, hf_type=kind),
            **own, **family.pieces}


def _window(hf: dict, path: Path, kind: str, n_layers: int) -> tuple[int | None, int | None]:
    """``model.sliding_window`` and ``model.global_every`` of a Llama-shaped family's
    ``config.json``, as its row's ``window`` says they are given; a window in a family without
    one, or windowed and full layers in an order dxrun does not build (every k-th layer
    full, the rest windowed), refused."""
    style, types = LLAMA_LIKE[kind].window, hf.get("layer_types")
    if style == "use_sliding_window":  # Qwen3-MoE's: every layer, when switched on
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        _refuse_unless(window is None or (isinstance(window, int) and window > 0), path,
                       f"sliding_window={json.dumps(window)}")
        return window, None
    if types is None and "sliding_window_pattern" in hf:  # Gemma 2/3's default kinds
        types = [("sliding_attention" if (i + 1) % hf["sliding_window_pattern"]
                  else "full_attention") for i in range(n_layers)]
    if types is None and "use_sliding_window" in hf:  # Qwen's before layer_types
        cut = hf.get("max_window_layers") or 0
        types = [("sliding_attention" if hf["use_sliding_window"] and i >= cut
                  else "full_attention") for i in range(n_layers)]
    every = None
    if types is not None:
        kinds = set(types)
        every = _global_every(types)
        _refuse_unless(kinds <= {"full_attention", "sliding_attention"} and every != 0,
                       path, f"layer_types={json.dumps(types)} (windowed and full attention "
                       "layers in an order dxrun does not build: every k-th layer full, the "
                       "others windowed)")
        window = hf.get("sliding_window") if "sliding_attention" in kinds else None
    else:
        window = hf.get("sliding_window")
    _refuse_unless(window is None or (style is not None and isinstance(window, int)
                                      and window > 0), path,
                   f"sliding_window={json.dumps(window)} (model_type={kind} attends to every "
                   "earlier position; relabelled from another family?)")
    return window, (None if window is None else every)


def _global_every(types: list[str]) -> int | None:
    """k where layer i is full exactly when (i + 1) % k == 0 (Gemma 2's 2, Gemma 3's 6), None
    when every layer is alike, 0 when no k gives ``types``."""
    if len(set(types)) <= 1:
        return None
    for k in range(2, len(types) + 1):
        if all((t == "full_attention") == ((i + 1) % k == 0) for i, t in enumerate(types)):
            return k
    return 0


def rope_scaling(scaling: Any, path: Path) -> dict[str, float] | None:
    """Llama 3.1's ``rope_scaling`` (``rope_type: llama3``) as dxrun's ``model.rope_scaling``;
    None for none; any other kind refused."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    _refuse_unless(kind == "llama3" and all(k in scaling for k in LLAMA3_SCALING), path,
                   f"rope_scaling={json.dumps(scaling)} (dxrun reads rope_type llama3)")
    return {k: float(scaling[k]) for k in LLAMA3_SCALING}


def given_model_keys(overrides: list[str]) -> dict[str, str]:
    """The ``model.<key>=value`` overrides of a command line, by key."""
    out = {}
    for o in overrides:
        k, eq, v = o.lstrip("+~").partition("=")
        if eq and k.startswith("model."):
            out[k[len("model."):]] = v
    return out


def apply_hf_model(cfg: DictConfig, overrides: list[str]) -> Path | None:
    """Fill ``cfg.model`` (a composed DictConfig, not yet validated) from the directory
    ``model.init_from`` names, refusing a given ``model.*`` override that contradicts it, and
    name the directory's ``tokenizer.json`` as ``data.tokenizer`` for text data that names
    none. Returns the directory (None: a run from its own init)."""
    d = hf_dir(cfg.model.init_from)
    if d is None:
        return None
    path = d / "config.json"
    fields = model_fields(read_config(d), path)
    given = given_model_keys(overrides)
    for k, want in fields.items():
        if k in RUN_KEYS:  # the checkpoint's, unless the run sets its own
            if k not in given:
                OmegaConf.update(cfg, f"model.{k}", want)
            continue
        if k in given and OmegaConf.select(cfg, f"model.{k}") != want:
            raise ConfigError(f"model.{k}={given[k]} contradicts {path} ({k}={want}); drop the "
                              f"override: {KEY}={cfg.model.init_from} takes the model's shape "
                              "from the checkpoint")
    for k, want in fields.items():
        if k not in RUN_KEYS:
            OmegaConf.update(cfg, f"model.{k}", want)
    if "name" not in given:
        cfg.model.name = f"hf-{d.name}"
    tokenizer = d / "tokenizer.json"
    if (cfg.data.name == "text" and tokenizer.is_file()
            and OmegaConf.select(cfg, "data.tokenizer") is None):
        cfg.data.tokenizer = str(tokenizer)
    return d


def check_rope_scaling(value: Any) -> None:
    """``model.rope_scaling``: null or Llama 3.1's four numbers."""
    if value is None:
        return
    keys = set(value) if hasattr(value, "keys") else set()
    if keys != set(LLAMA3_SCALING) or not all(
            isinstance(value[k], (int, float)) and value[k] > 0 for k in keys):
        raise ConfigError(f"model.rope_scaling={value}: give null or positive "
                          f"{', '.join(LLAMA3_SCALING)} (Llama 3.1's rope_scaling)")


# The families dxrun writes and the keys that make them (export: which HF architecture a run
# is; the first that computes the model: a Llama-shaped one without a window is Llama). A
# Llama-shaped family's MLP is any gated one (its hidden_act says which).
FAMILIES = {
    "gpt2": dict(bias=True, norm="layernorm", mlp="gelu", gelu="tanh", pos="learned",
                 tie_embeddings=True, head_dim=None, sliding_window=None, **_PLAIN),
    **{kind: {**dict(bias=False, norm="rmsnorm", pos="rope"),
              **{k: v for k, v in _PLAIN.items()
                 if k not in {READS[r] for r in f.reads}
                 and not (k == "global_every" and f.window == "layer_types")},
              **f.pieces, **({} if f.window else dict(sliding_window=None))}
       for kind, f in LLAMA_LIKE.items()},
}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel",
                 **{kind: f.architecture for kind, f in LLAMA_LIKE.items()}}


def model_type_of(m: Any) -> str:
    """The HF ``model_type`` of dxrun's model section ``m``: ``model.hf_type`` (a checkpoint's
    own, a preset's: Phi-3 computes what Mistral does, its tensors are fused), else the first
    family that computes it; ConfigError naming what differs when that family (or any) does
    not."""
    misses = {kind: [f"model.{k}={_show(getattr(m, k, None))}" for k, v in want.items()
                     if getattr(m, k, None) != v]
              + moe_misses(m, kind, LLAMA_LIKE[kind].moe if kind in LLAMA_LIKE else None)
              for kind, want in FAMILIES.items()}
    if m.pos == "learned" and m.n_kv_heads != m.n_heads:
        misses["gpt2"].append(f"model.n_kv_heads={m.n_kv_heads} (GPT-2 has no grouped-query "
                              "attention)")
    if m.mlp == "gelu":
        for kind in LLAMA_LIKE:
            misses[kind].append("model.mlp=gelu (its MLP is gated: swiglu or geglu)")
    sparse = bool(getattr(getattr(m, "moe", None), "n_experts", 0))  # nearest: of its kind
    kind = getattr(m, "hf_type", None) or min(misses, key=lambda k: (
        (k in LLAMA_LIKE and LLAMA_LIKE[k].moe is not None) != sparse, len(misses[k])))
    if misses[kind]:
        want = ", ".join(f"{k}={_show(v)}" for k, v in FAMILIES[kind].items())
        raise ConfigError(f"the model has no Hugging Face equivalent: nearest is {kind} "
                          f"({ARCHITECTURES[kind]}: {want}), but {'; '.join(misses[kind])}")
    return kind



def config_json(m: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` transformers reads for dxrun's model section ``m``: the inverse of
    ``model_fields`` (``model_fields(config_json(m))`` gives back ``m``'s shape keys)."""
    kind = model_type_of(m)
    common = dict(architectures=[ARCHITECTURES[kind]], model_type=kind, vocab_size=m.vocab_size,
                  torch_dtype="float32", use_cache=True, **(extra or {}))
    if kind == "gpt2":
        return dict(common, n_embd=m.d_model, n_layer=m.n_layers, n_head=m.n_heads,
                    n_positions=m.max_seq_len, n_ctx=m.max_seq_len,
                    n_inner=None if m.d_ff == 4 * m.d_model else m.d_ff,
                    activation_function="gelu_new", layer_norm_epsilon=m.norm_eps,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_weights=True,
                    tie_word_embeddings=True)
    scaling = (None if not m.rope_scaling
               else dict(rope_type="llama3", **{k: m.rope_scaling[k] for k in LLAMA3_SCALING}))
    family, head_dim = LLAMA_LIKE[kind], m.head_dim or m.d_model // m.n_heads
    act = next(a for a, keys in ACTS.items()
               if all(getattr(m, k, "tanh") == v for k, v in keys.items()))
    own = {name: getattr(m, READS[name]) for name in family.reads}
    if "query_pre_attn_scalar" in own:
        own["query_pre_attn_scalar"] = own["query_pre_attn_scalar"] or head_dim
    if "rope_local_base_freq" in own:
        own["rope_local_base_freq"] = own["rope_local_base_freq"] or m.rope_theta
    return dict(common, hidden_size=m.d_model, intermediate_size=m.d_ff,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                num_key_value_heads=m.n_kv_heads, head_dim=head_dim,
                max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                rope_theta=m.rope_theta, rope_scaling=scaling,
                tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False,
                **{"hidden_act": act, family.act[0]: act}, **own, **_windowed(m, family),
                **moe_json(m, family.moe))


def _windowed(m: Any, family: Family) -> dict[str, Any]:
    """The window as the family's config.json gives it: Mistral's one number; the per-layer
    kinds (Gemma 2/3's alternating; Qwen's, besides, as every layer from the first)."""
    window = getattr(m, "sliding_window", None)
    if family.window is None:
        return {}
    if family.window == "sliding_window":
        return dict(sliding_window=window)
    if family.window == "use_sliding_window":
        return dict(use_sliding_window=window is not None, sliding_window=window)
    every = getattr(m, "global_every", None)
    types = ["sliding_attention" if window and (every is None or (i + 1) % every)
             else "full_attention" for i in range(m.n_layers)]
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=0 if window else m.n_layers, layer_types=types)
