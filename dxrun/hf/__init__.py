"""Hugging Face checkpoints in and out (``model.init_from=hf:<dir>``, ``python -m dxrun.export``):
the one table of which HF tensor becomes which dxrun weight, and how (import, export and the
guide read it: ``docs/guide/huggingface.md`` prints ``TABLES``), a HF directory's weights read
lazily by it, and a run's parameters written as a HF directory. The ``config.json`` side is the
config family's (``dxrun.config.hf_model``); the weights placed into a run's shards are the
experiment's (``dxrun.experiment.import_params``). No JAX: numpy in, numpy out, so the export
command imports it before JAX starts.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dxrun.config import LLAMA_LIKE, ConfigError, config_json, head_dim_of, model_type_of

# ------------------------------------------------------------------------------------------------
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

    def span(self, d: dict[str, int]) -> tuple[int, int]:
        """(start, stop) of ``part`` on the HF tensor's output axis, for the dimensions ``d``."""
        j, sizes = self.part
        at = shape_of(sizes, d)
        return sum(at[:j]), sum(at[:j + 1])

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

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
              ("phi3", dict(fused=True)))}}
# What a HF directory may hold beside the weights, ignored on import: GPT-2's causal-mask
# buffers (older checkpoints), Llama's rotary frequencies, a tied lm_head written anyway.
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def weights(model_type: str, m: Any) -> list[Weight]:
    """The table of a model: ``model_type`` gpt2 or a Llama-shaped family, ``m`` its model
    section (tied embeddings, the pieces its family has)."""
    if model_type == "gpt2":
        return _gpt2()
    return _llama(m.tie_embeddings, getattr(m, "qkv_bias", False), getattr(m, "qk_norm", "none"),
                  getattr(m, "norm_position", "pre"), LLAMA_LIKE[model_type].fused)


def dims(m: Any) -> dict[str, int]:
    """The dimensions HF shapes are written in, of a model section ``m``."""
    E = head_dim_of(m)
    return {"D": m.d_model, "H": m.n_heads, "K": m.n_kv_heads, "E": E, "F": m.d_ff,
            "V": m.vocab_size, "P": m.max_seq_len}


def shape_of(spec: tuple[str, ...], d: dict[str, int]) -> tuple[int, ...]:
    return tuple(sum(math.prod(int(f) if f.isdigit() else d[f] for f in term.split("*"))
                     for term in s.split("+")) for s in spec)


def hf_name(w: Weight, layer: int | None, prefixed: bool = True) -> str:
    name = w.hf.format(i=layer)
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


# ------------------------------------------------------------------------------------------------
# A Hugging Face directory's weights, read lazily: ``model.safetensors``, or the shards
# ``model-0000N-of-0000M.safetensors`` its ``model.safetensors.index.json`` lists, as PyTorch's
# classes save them or as the Flax classes do (``kernel``: the weight transposed, ``embedding``,
# ``scale``): a Flax tensor is read under its PyTorch name, in PyTorch's layout.
#
# Opening reads the headers only (names, shapes, dtypes); ``HFWeights.read`` reads one tensor,
# through safetensors' memory-mapped reader, and nothing else stays in memory. ``check`` compares
# the headers with what the model section expects (``dxrun.hf``): a missing, extra or
# misshapen tensor, a truncated or unreadable file is a ConfigError naming the file. No JAX.

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# The files of layouts dxrun does not read, and how to get one it does.
OTHER_LAYOUTS = {"flax_model.msgpack": "Flax's msgpack", "pytorch_model.bin": "PyTorch's pickle",
                 "tf_model.h5": "TensorFlow's h5"}
# A Flax name's last part, for PyTorch's "weight": whether the tensor is transposed.
FLAX = {".kernel": True, ".embedding": False, ".scale": False}


def weight_files(d: Path) -> dict[str, Path]:
    """Each tensor's file: from the index when there is one, else ``model.safetensors``'s."""
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
            return {name: d / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{d / INDEX}: not a safetensors index ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no weight_map'})") from None
    if (d / SINGLE).is_file():
        return {}
    found = next((f"{f} ({kind} layout)" for f, kind in OTHER_LAYOUTS.items()
                  if (d / f).is_file()), None)
    if found:
        raise ConfigError(f"{d}: holds {found}, not {SINGLE} (safetensors); save it with "
                          "save_pretrained(dir, safe_serialization=True), which dxrun reads")
    raise ConfigError(f"{d}: no {SINGLE} or {INDEX}; a Hugging Face directory holds its "
                      "weights as safetensors")


class HFWeights:
    """The tensors of a HF directory, by name; a context manager (the files stay open)."""

    def __init__(self, d: Path):
        self.dir = d
        self._stack = ExitStack()
        self._files: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        listed = weight_files(d)
        for path in sorted(set(listed.values())) or [d / SINGLE]:
            handle = self._open(path)
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                self.file_of[name] = path
        missing = {n: p for n, p in listed.items() if n not in self.file_of}
        if missing:
            name, path = next(iter(missing.items()))
            raise ConfigError(f"{path}: holds no tensor {name} ({d / INDEX} lists it there)")
        # PyTorch's name -> (Flax's, transposed), for a directory the Flax classes saved
        self.flax: dict[str, tuple[str, bool]] = {}
        if any(n.endswith((".kernel", ".embedding")) for n in self.file_of):
            for name in list(self.file_of):
                end = next((e for e in FLAX if name.endswith(e)), None)
                if end is not None:
                    torch = name.removesuffix(end) + ".weight"
                    self.flax[torch] = (name, FLAX[end])
                    self.file_of[torch] = self.file_of.pop(name)
        self.layout = "Flax" if self.flax else "PyTorch"

    def _open(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._files:
            if not path.is_file():
                raise ConfigError(f"{path}: no such file ({INDEX} names it)")
            try:
                self._files[path] = self._stack.enter_context(safe_open(str(path), "numpy"))
            except Exception as e:  # noqa: BLE001 - safetensors' own errors: one line
                raise ConfigError(f"{path}: not a readable safetensors file (truncated or "
                                  f"damaged: {first(e)})") from None
        return self._files[path]

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def shape(self, name: str) -> tuple[int, ...]:
        stored, transposed = self.flax.get(name, (name, False))
        shape = tuple(self._open(self.file_of[name]).get_slice(stored).get_shape())
        return shape[::-1] if transposed else shape

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> np.ndarray:
        """One tensor, or its ``region`` (only those bytes are read), as float32 (bf16 and
        fp16 checkpoints widen exactly)."""
        path = self.file_of[name]
        stored, transposed = self.flax.get(name, (name, False))
        try:
            handle = self._open(path)
            if region is None:
                x = handle.get_tensor(stored)
            else:
                x = handle.get_slice(stored)[region[::-1] if transposed else region]
            return np.asarray(x.T if transposed else x, dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors: one line
            raise ConfigError(f"{path}: tensor {name} is unreadable ({first(e)})") from None

    def name_for(self, w: Weight, layer: int | None) -> str:
        """The name ``w`` has in this directory: GPT-2 checkpoints from the hub leave out the
        ``transformer.`` prefix that ``save_pretrained`` writes."""
        name = hf_name(w, layer)
        bare = hf_name(w, layer, prefixed=False)
        return bare if name not in self.file_of and w.hf.startswith("transformer.") and (
            bare in self.file_of) else name

    def check(self, table: list[Weight], m: Any) -> None:
        """Every tensor the table expects for the model section ``m``, at its shape; no other
        (buffers aside)."""
        d, expected = dims(m), set()
        for w in table:
            for layer in range(m.n_layers) if w.per_layer else [None]:
                name = self.name_for(w, layer)
                expected.add(name)
                if name not in self.file_of and not any(
                        self.name_for(v, i) in self.file_of for v in table
                        for i in (range(m.n_layers) if v.per_layer else [None])):
                    first = sorted(self.file_of)[0] if self.file_of else "none"
                    raise ConfigError(
                        f"{self.dir}: no tensor is named as transformers saves this model "
                        f"(e.g. {name}, in PyTorch's layout, or Flax's: kernel, embedding, "
                        f"scale); its tensors are named like {first}")
                if name not in self.file_of:
                    raise ConfigError(f"{self.dir}: tensor {name} is missing ({len(expected)} "
                                      f"found of the model's, {self.layout} layout); it holds "
                                      f"dxrun's {w.dxrun}")
                want, have = shape_of(w.hf_shape, d), self.shape(name)
                if have != want:
                    raise ConfigError(
                        f"{self.file_of[name]}: tensor {name} has shape {list(have)}, but "
                        f"config.json makes it {list(want)} ({', '.join(w.hf_shape)})")
        extra = sorted(n for n in self.file_of if n not in expected
                       and not n.endswith(BUFFERS) and not (n == "lm_head.weight" and m.tie_embeddings))
        if extra:
            raise ConfigError(f"{self.file_of[extra[0]]}: tensor {extra[0]} is not one of the "
                              f"model's ({len(extra)} such); config.json describes another model")


def first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# ------------------------------------------------------------------------------------------------
# A run's parameters written as a Hugging Face directory (``python -m dxrun.export``).
#
# ``config.json`` from the model section (``dxrun.config.hf_model.config_json``), the tensors
# under the names ``save_pretrained`` writes (``transformer.`` / ``model.`` prefixed) in
# safetensors files of at most ``max_shard_bytes`` (``model.safetensors``, or
# ``model-0000N-of-0000M.safetensors`` and their index), the vocabulary cut back to the model's
# (the mesh's padding rows dropped), and the run's ``tokenizer.json`` when it has one. Each HF
# tensor is gathered from the parameters' shards on its own (a stacked weight layer by layer),
# and a file's tensors are written together, so the host holds one file's worth at most.
# Everything is written into a new dir beside the target, renamed into place at the end: a
# failure leaves nothing.

MAX_SHARD_BYTES = 5 * 10**9  # the hub's default


def _leaf(params: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        params = params[p]
    return params


def hf_tensors(params: dict, axes: dict, m: Any) -> list[tuple[str, Any]]:
    """(HF name, a function that gathers that tensor to the host as numpy), in the table's
    order: nothing is gathered until called."""
    table = weights(model_type_of(m), m)
    d = dims(m)
    groups: dict[str, list[Weight]] = {}
    for w in table:
        for layer in range(m.n_layers) if w.per_layer else [None]:
            groups.setdefault(hf_name(w, layer), []).append(w)

    def gather(w: Weight, layer: int | None) -> np.ndarray:
        x, names = _leaf(params, w.path), list(_leaf(axes, w.path))
        if layer is not None:
            x, names = x[layer], names[1:]
        x = np.asarray(x, dtype=np.float32)  # gathered from its shards (a jax.Array)
        if "vocab" in names:  # the mesh's padding rows dropped
            x = np.take(x, np.arange(m.vocab_size), axis=names.index("vocab"))
        return to_hf(w, x, shape_of(w.hf_shape, d), d)

    def tensor(name: str) -> np.ndarray:
        parts = groups[name]
        layer = int(name.split(".")[2]) if parts[0].per_layer else None
        pieces = [gather(w, layer) for w in sorted(parts, key=lambda w: w.part or (0, ()))]
        return (pieces[0] if len(pieces) == 1
                else np.concatenate(pieces, axis=output_axis(parts[0])))

    return [(name, lambda name=name: tensor(name)) for name in groups]


def plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The tensors' files, in order, each at most ``max_bytes`` (a larger tensor alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if files[-1] and used + n > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += n
    return files


def save_hf(params: dict, axes: dict, m: Any, to: Path, tokenizer: Path | None = None,
            extra_config: dict | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the HF directory ``to`` (new, or empty) of ``params`` (model section ``m``)."""
    from safetensors.numpy import save_file

    tensors = hf_tensors(params, axes, m)  # refuses a model with no HF equivalent first
    d = dims(m)
    table = {hf_name(w, i): w for w in weights(model_type_of(m), m)
             for i in (range(m.n_layers) if w.per_layer else [None])}
    sizes = [(n, 4 * int(np.prod(shape_of(table[n].hf_shape, d)))) for n, _ in tensors]
    files = plan_files(sizes, max_shard_bytes)
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", dir=to.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config_json(m, extra_config), indent=2))
        get = dict(tensors)
        names = [SINGLE] if len(files) == 1 else [
            f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
        for file, members in zip(names, files, strict=True):
            save_file({n: get[n]() for n in members}, str(tmp / file), metadata={"format": "pt"})
        if len(files) > 1:
            (tmp / INDEX).write_text(json.dumps({
                "metadata": {"total_size": sum(n for _, n in sizes)},
                "weight_map": {n: f for f, ms in zip(names, files, strict=True) for n in ms}},
                indent=2))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if to.exists():
            to.rmdir()  # empty (the caller checked)
        tmp.rename(to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to
