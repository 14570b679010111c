"""Which Hugging Face tensor becomes which dxrun weight, and how: the one table import, export
and the guide read (``dxrun.hf``'s face re-exports it; the comment below says how to read a
``Weight``). Pure: numpy in, numpy out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dxrun.config import LLAMA_LIKE, head_dim_of
from dxrun.config.schema import moe_layers

# Which Hugging Face tensor becomes which dxrun weight, and how: the one table import, export
# and the guide read (``docs/guide/huggingface.md`` prints ``TABLES``); and a HF directory's
# weights read lazily by it (the last section).
#
# A ``Weight`` ties a dxrun parameter (its path in the params tree; ``blocks/...`` are stacked,
# layer ``i`` at index ``i`` of their leading axis) to a HF tensor (``{i}``: its layer). ``same``:
# the HF tensor holds the numbers in dxrun's order, only grouped differently (GPT-2's Conv1D keeps
# (in, out), as dxrun's ``D x ...`` weights do); ``transposed``: a ``torch.nn.Linear`` weight,
# (out, in), transposed first (Llama). ``part=(j, sizes)``: block j of the HF tensor's output
# axis (its last as stored, its first transposed), cut in blocks of ``sizes`` (GPT-2's fused
# ``c_attn``: q, k, v side by side; Phi-3's ``qkv_proj`` and ``gate_up_proj``). HF shapes are
# written in the model's dimensions (D d_model, H heads, K kv heads, E head dim, F d_ff, V
# vocab, P positions; "a*b": a product, "a+b": a sum). Rotary: both sides rotate halves (HF's
# checkpoints are stored permuted for its ``rotate_half``, and dxrun's ``rope`` is that
# convention), so q and k need no permutation. Pure: numpy in, numpy out.

SAME, TRANSPOSED = "same", "transposed"


@dataclass(frozen=True)
class Weight:
    dxrun: str  # the parameter's path, "/"-joined
    hf: str  # the HF tensor's name; "{i}": the layer
    kind: str  # SAME or TRANSPOSED
    hf_shape: tuple[str, ...]  # in the model's dimensions ("3*D": a product)
    part: tuple[int, tuple[str, ...]] | None = None  # (j, the blocks' sizes) of the output axis
    # the HF layer of each index of a stacked weight's leading axis (None: index i, layer i;
    # an MoE model's dense and MoE layers are two stacks, ``blocks`` and ``moe_blocks``)
    layers: tuple[int, ...] | None = None

    def span(self, d: dict[str, int]) -> tuple[int, int]:
        """(start, stop) of ``part`` on the HF tensor's output axis, for the dimensions ``d``."""
        j, sizes = self.part
        at = shape_of(sizes, d)
        return sum(at[:j]), sum(at[:j + 1])

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        """An expert's tensor (``{j}``: the expert): the stacked weight's second axis."""
        return "{j}" in self.hf

    def instances(self, m: Any) -> list[tuple[int | None, int | None, tuple[int, ...]]]:
        """(HF layer, expert, index of the stacked weight's leading axes) of each HF tensor
        this weight is, for the model section ``m``."""
        if not self.per_layer:
            return [(None, None, ())]
        layers = range(m.n_layers) if self.layers is None else self.layers
        if not self.per_expert:
            return [(i, None, (k,)) for k, i in enumerate(layers)]
        return [(i, j, (k, j)) for k, i in enumerate(layers) for j in range(m.moe.n_experts)]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.dxrun.split("/"))


def _gpt2() -> list[Weight]:
    h = "transformer.h.{i}."
    out = [Weight("wte", "transformer.wte.weight", SAME, ("V", "D")),
           Weight("wpe", "transformer.wpe.weight", SAME, ("P", "D")),
           Weight("blocks/ln1/scale", h + "ln_1.weight", SAME, ("D",)),
           Weight("blocks/ln1/bias", h + "ln_1.bias", SAME, ("D",))]
    for j, name in enumerate("qkv"):
        out += [Weight(f"blocks/attn/w{name}", h + "attn.c_attn.weight", SAME, ("D", "3*D"),
                       (j, ("D",) * 3)),
                Weight(f"blocks/attn/b{name}", h + "attn.c_attn.bias", SAME, ("3*D",),
                       (j, ("D",) * 3))]
    return out + [
        Weight("blocks/attn/wo", h + "attn.c_proj.weight", SAME, ("D", "D")),
        Weight("blocks/attn/bo", h + "attn.c_proj.bias", SAME, ("D",)),
        Weight("blocks/ln2/scale", h + "ln_2.weight", SAME, ("D",)),
        Weight("blocks/ln2/bias", h + "ln_2.bias", SAME, ("D",)),
        Weight("blocks/mlp/w_up", h + "mlp.c_fc.weight", SAME, ("D", "F")),
        Weight("blocks/mlp/b_up", h + "mlp.c_fc.bias", SAME, ("F",)),
        Weight("blocks/mlp/w_down", h + "mlp.c_proj.weight", SAME, ("F", "D")),
        Weight("blocks/mlp/b_down", h + "mlp.c_proj.bias", SAME, ("D",)),
        Weight("ln_f/scale", "transformer.ln_f.weight", SAME, ("D",)),
        Weight("ln_f/bias", "transformer.ln_f.bias", SAME, ("D",)),
    ]


# The blocks' norms' names by model.norm_position: dxrun's ln1, ln2 (and ln1_out, ln2_out).
NORM_NAMES = {"pre": dict(ln1="input_layernorm", ln2="post_attention_layernorm"),
              "post": dict(ln1="post_attention_layernorm", ln2="post_feedforward_layernorm"),
              "sandwich": dict(ln1="input_layernorm", ln1_out="post_attention_layernorm",
                               ln2="pre_feedforward_layernorm",
                               ln2_out="post_feedforward_layernorm")}


def _llama(tied: bool, qkv_bias: bool = False, qk_norm: str = "none",
           norm_position: str = "pre", fused: bool = False) -> list[Weight]:
    """Llama's tensors, and those of the pieces a Llama-shaped family adds (``LLAMA_LIKE``):
    q, k, v biases (Qwen2), per-head or whole-projection q and k norms (Qwen3, OLMo 2, Gemma
    3), the norms after attention and the MLP (OLMo 2's in place of Llama's, Gemma 2/3's
    besides), q, k, v and gate, up each joined in one tensor (Phi-3: ``fused``)."""
    h = "model.layers.{i}."
    pieces = [Weight(f"blocks/attn/b{x}", h + f"self_attn.{x}_proj.bias", SAME, (f"{n}*E",))
              for x, n in (("q", "H"), ("k", "K"), ("v", "K")) if qkv_bias]
    if qk_norm != "none":
        pieces += [Weight(f"blocks/attn/{x}_norm/scale", h + f"self_attn.{x}_norm.weight", SAME,
                          ("E",) if qk_norm == "head" else (f"{n}*E",))
                   for x, n in (("q", "H"), ("k", "K"))]
    norms = [Weight(f"blocks/{ln}/scale", h + f"{name}.weight", SAME, ("D",))
             for ln, name in NORM_NAMES[norm_position].items()]
    if fused:
        qkv, sizes = "self_attn.qkv_proj.weight", ("H*E", "K*E", "K*E")
        attn = [Weight(f"blocks/attn/w{x}", h + qkv, TRANSPOSED, ("H*E+K*E+K*E", "D"),
                       (j, sizes)) for j, x in enumerate("qkv")]
        mlp = [Weight(f"blocks/mlp/w_{x}", h + "mlp.gate_up_proj.weight", TRANSPOSED,
                      ("2*F", "D"), (j, ("F", "F"))) for j, x in enumerate(("gate", "up"))]
    else:
        attn = [Weight(f"blocks/attn/w{x}", h + f"self_attn.{x}_proj.weight", TRANSPOSED,
                       (f"{n}*E", "D")) for x, n in (("q", "H"), ("k", "K"), ("v", "K"))]
        mlp = [Weight(f"blocks/mlp/w_{x}", h + f"mlp.{x}_proj.weight", TRANSPOSED, ("F", "D"))
               for x in ("gate", "up")]
    out = [*pieces, Weight("wte", "model.embed_tokens.weight", SAME, ("V", "D")), *norms,
           *attn, Weight("blocks/attn/wo", h + "self_attn.o_proj.weight", TRANSPOSED,
                         ("D", "H*E")),
           *mlp, Weight("blocks/mlp/w_down", h + "mlp.down_proj.weight", TRANSPOSED, ("D", "F")),
           Weight("ln_f/scale", "model.norm.weight", SAME, ("D",))]
    if not tied:
        out.append(Weight("lm_head", "lm_head.weight", TRANSPOSED, ("V", "D")))
    return out


def _moe(f: Any) -> list[Weight]:
    """A mixture of experts' own tensors (``f``: its ``LLAMA_LIKE`` row's ``moe``): the
    router, each expert's gate, up and down projections (dxrun stacks the experts on the
    weights' ``expert`` axis, expert j at index j), in the MoE layers' ``moe_blocks``; the
    shared expert and its gate (Qwen2-MoE's)."""
    h = f"model.layers.{{i}}.{f.block}."
    out = [Weight("moe_blocks/mlp/router", h + "gate.weight", TRANSPOSED, ("N", "D")),
           *(Weight(f"moe_blocks/mlp/w_{x}", h + f"experts.{{j}}.{name}.weight", TRANSPOSED,
                    ("X", "D") if x != "down" else ("D", "X"))
             for x, name in zip(("gate", "up", "down"), f.names, strict=True))]
    if f.shared:
        out += [*(Weight(f"moe_blocks/mlp/shared/w_{x}", h + f"shared_expert.{x}_proj.weight",
                         TRANSPOSED, ("S", "D") if x != "down" else ("D", "S"))
                  for x in ("gate", "up", "down")),
                Weight("moe_blocks/mlp/shared_gate", h + "shared_expert_gate.weight",
                       TRANSPOSED, ("1", "D"))]
    return out


def _named_otherwise(table: list[Weight]) -> list[Weight]:
    """The tensors of ``table`` that Llama's has not (the guide prints these for a family)."""
    llama = {(w.dxrun, w.hf) for w in _llama(tied=False)}
    return [w for w in table if (w.dxrun, w.hf) not in llama]


# The tables the guide prints: GPT-2 (embeddings tied, no lm_head tensor), Llama (untied; Mistral
# and Gemma the same), and the tensors the other families add to Llama's or name otherwise.
TABLES = {"gpt2": _gpt2(), "llama": _llama(tied=False),
          **{kind: _named_otherwise(_llama(True, **args)) for kind, args in (
              ("qwen2", dict(qkv_bias=True)), ("qwen3", dict(qk_norm="head")),
              ("olmo2", dict(qk_norm="proj", norm_position="post")),
              ("gemma2", dict(norm_position="sandwich")),
              ("gemma3_text", dict(qk_norm="head", norm_position="sandwich")),
              ("phi3", dict(fused=True)))},
          **{kind: _moe(f.moe) for kind, f in LLAMA_LIKE.items() if f.moe}}
# What a HF directory may hold beside the weights, ignored on import: GPT-2's causal-mask
# buffers (older checkpoints), Llama's rotary frequencies, a tied lm_head written anyway.
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def weights(model_type: str, m: Any) -> list[Weight]:
    """The table of a model: ``model_type`` gpt2 or a Llama-shaped family, ``m`` its model
    section (tied embeddings, the pieces its family has)."""
    if model_type == "gpt2":
        return _gpt2()
    table = _llama(m.tie_embeddings, getattr(m, "qkv_bias", False),
                   getattr(m, "qk_norm", "none"), getattr(m, "norm_position", "pre"),
                   LLAMA_LIKE[model_type].fused)
    f = LLAMA_LIKE[model_type].moe
    if f is None:
        return table
    # an MoE model: the dense layers' blocks and the MoE layers' (without their dense MLP)
    kinds = moe_layers(m.n_layers, m.moe)
    dense = tuple(i for i, k in enumerate(kinds) if not k)
    sparse = tuple(i for i, k in enumerate(kinds) if k)
    out = [w for w in table if not w.per_layer]
    for w in (w for w in table if w.per_layer):
        if dense:
            out.append(replace(w, layers=dense))
        if not w.dxrun.startswith("blocks/mlp/"):
            out.append(replace(w, dxrun="moe_" + w.dxrun, layers=sparse))
    return out + [replace(w, layers=sparse) for w in _moe(f)]


def dims(m: Any) -> dict[str, int]:
    """The dimensions HF shapes are written in, of a model section ``m``."""
    E = head_dim_of(m)
    moe = getattr(m, "moe", None)
    return {"D": m.d_model, "H": m.n_heads, "K": m.n_kv_heads, "E": E, "F": m.d_ff,
            "V": m.vocab_size, "P": m.max_seq_len,
            "N": moe.n_experts if moe else 0, "X": (moe.d_ff if moe else None) or m.d_ff,
            "S": getattr(moe, "shared_d_ff", 0) if moe else 0}


def shape_of(spec: tuple[str, ...], d: dict[str, int]) -> tuple[int, ...]:
    return tuple(sum(math.prod(int(f) if f.isdigit() else d[f] for f in term.split("*"))
                     for term in s.split("+")) for s in spec)


def hf_name(w: Weight, layer: int | None, prefixed: bool = True,
            expert: int | None = None) -> str:
    name = w.hf.format(i=layer, j=expert)
    return name if prefixed else name.partition(".")[2]


def to_dxrun(w: Weight, x: np.ndarray, shape: tuple[int, ...],
             d: dict[str, int] | None = None) -> np.ndarray:
    """The HF tensor ``x`` (one layer's) as dxrun's weight of ``shape`` (one layer's, the
    real vocabulary: padding is the loader's); ``d``: the dimensions (a ``part``'s span)."""
    if w.kind == TRANSPOSED:
        x = x.T
    if w.part is not None:  # the output axis: last in dxrun's order
        a, b = w.span(d)
        x = x[..., a:b]
    return np.ascontiguousarray(x).reshape(shape)


def _part_shape(w: Weight, hf_shape: tuple[int, ...], d: dict[str, int] | None
                ) -> tuple[int, ...]:
    """The HF shape of ``w``'s own block of its tensor (the whole tensor's without a part)."""
    if w.part is None:
        return hf_shape
    a, b = w.span(d)
    return (b - a, *hf_shape[1:]) if w.kind == TRANSPOSED else (*hf_shape[:-1], b - a)


def to_hf(w: Weight, x: np.ndarray, hf_shape: tuple[int, ...],
          d: dict[str, int] | None = None) -> np.ndarray:
    """dxrun's weight ``x`` (one layer's, the real vocabulary) as the HF tensor of
    ``hf_shape``, or as its part (``w.part``: the caller joins the parts on the output
    axis, ``output_axis``)."""
    hf_shape = _part_shape(w, hf_shape, d)
    if w.kind == TRANSPOSED:
        return np.ascontiguousarray(x.reshape(hf_shape[::-1]).T)
    return x.reshape(hf_shape)


def output_axis(w: Weight) -> int:
    """The HF tensor's output axis, where a fused tensor's parts sit side by side."""
    return 0 if w.kind == TRANSPOSED else -1


def _range(sizes: tuple[int, ...], index: tuple[tuple[int, int], ...]) -> tuple[int, int, bool]:
    """The flat range of row-major axes ``sizes`` that the block ``index`` ((start, stop) per
    axis) lies in, and whether the block is exactly that range: the axes after the last sliced
    one are whole and those before it are one index each (how a mesh splits heads, not head
    dims). Otherwise the whole range, to be sliced after reading."""
    cut = [i for i, (n, (a, b)) in enumerate(zip(sizes, index, strict=True)) if (a, b) != (0, n)]
    if not cut:
        return 0, math.prod(sizes), True
    j = cut[-1]
    if any(b - a != 1 for a, b in index[:j]):
        return 0, math.prod(sizes), False
    lo = int(np.ravel_multi_index(tuple(a for a, _ in index), sizes))
    return lo, lo + (index[j][1] - index[j][0]) * math.prod(sizes[j + 1:]), True


def dxrun_block(w: Weight, real: tuple[int, ...], index: tuple[tuple[int, int], ...],
                hf_shape: tuple[int, ...],
                read: Callable[[tuple[slice, ...]], np.ndarray],
                d: dict[str, int] | None = None) -> np.ndarray:
    """``to_dxrun(w, x, real, d)[index]`` ((start, stop) per axis, within ``real``) from only
    the region of the HF tensor ``x`` (of ``hf_shape``) it needs: ``read(slices)`` reads it."""
    hf_shape = _part_shape(w, hf_shape, d)
    m_shape = hf_shape[::-1] if w.kind == TRANSPOSED else hf_shape  # the matrix in dxrun's order
    if len(m_shape) == 1:
        groups = [len(real)]
    else:
        k = next(k for k in range(len(real) + 1) if math.prod(real[:k]) == m_shape[0])
        groups = [k, len(real) - k]
    plan, at = [], 0  # per group: its range of the matrix's axis, its shape read, the rest
    for g in groups:
        sizes, block = real[at:at + g], index[at:at + g]
        lo, hi, exact = _range(sizes, block)
        plan.append((slice(lo, hi), [b - a for a, b in block] if exact else list(sizes),
                     [slice(None)] * g if exact else [slice(a, b) for a, b in block]))
        at += g
    slices = [r for r, _, _ in plan]
    if w.part is not None:  # the output axis: last in dxrun's order
        off = w.span(d)[0]
        slices[-1] = slice(slices[-1].start + off, slices[-1].stop + off)
    if w.kind == TRANSPOSED:
        slices = slices[::-1]
    x = read(tuple(slices))
    if w.kind == TRANSPOSED:
        x = x.T
    shape = [n for _, read_shape, _ in plan for n in read_shape]
    rest = tuple(i for _, _, after in plan for i in after)
    return np.ascontiguousarray(x).reshape(shape)[rest]
