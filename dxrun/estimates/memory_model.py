"""Per-device memory of one train step on an accelerator, from the shapes (plan mode's model).

XLA:CPU's temporaries describe a CPU program (bf16 through fp32 temporaries, broadcasts
materialised), so for an accelerator target this module counts what the step keeps instead:
the state (read from the abstract state's shardings by the caller), every layer's saved
activations for the precision, ``model.remat`` and attention kernel (the per-layer accounting
of Korthikanti et al. 2022, recounted for dxrun's block), one layer's backward working set,
the logits and FSDP's gathers. Everything is per device and in bytes; the accounting, term by
term, is in the guide (docs/guide/large-models.md, "The memory model's accounting") and is
cross-checked against XLA:CPU's memory analysis in ``tests/test_memory_model.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dxrun.config import head_dim_of
from dxrun.cost import GATED, gb_text
from dxrun.plan import BLOCK, KERNELS

if TYPE_CHECKING:
    from dxrun.config import ModelConfig
    from dxrun.plan import MeshPlan



FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# s·b·f tensors the MLP keeps, see ``layer_none``
MLP_TENSORS = {"gelu": 2, "swiglu": 3, "geglu": 3}
REMAT = ("none", "dots", "full")


@dataclass(frozen=True)
class Shapes:
    """What one device computes on for one micro-batch, from the config and the mesh."""

    b: int  # sequences per device per micro-batch
    s: int  # tokens per sequence on the device (seq_len / cp: the context axis splits it)
    h: int  # d_model (the residual stream, replicated over tp)
    f: int  # d_ff / tp
    heads: int  # heads / tp
    kv_heads: int  # kv heads / tp
    head_dim: int
    vocab: int  # padded vocabulary / tp
    n_layers: int
    c: int  # compute dtype bytes
    mlp: str  # gelu | swiglu | geglu
    bias: bool
    remat: str  # none | dots | keep_attention | full
    kernel: str  # the run plan's attention kernel (attention_kernel.KERNELS)
    residual: int  # bytes of the residual stream between layers
    accum: int = 1  # train.grad_accum: micro-batches per step
    loss_chunk: int = 0  # model.loss_chunk resolved: positions per loss chunk (0 = whole)
    norm: str = "layernorm"  # layernorm | rmsnorm
    rope: bool = False  # model.pos=rope
    keys: int = 0  # the whole sequence each query attends over when cp > 1 (0: s, no context axis)
    stream_split: int = 1  # tp with parallelism.sequence_parallel: the norms' and stream's split
    norms: int = 2  # the block's norms: 4 with model.norm_position=sandwich (Gemma 2/3)
    softcap: bool = False  # model.attn_softcap: the scores capped (a kernel keeping them: 2 more)

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def scores(self) -> int:
        """Elements of one score tensor (a·s²·b), 0 when the kernel never materialises it; the
        blockwise kernel's one block of keys at a time (a·s·C·b, C = ``block_len``'s)."""
        if self.kernel == "blockwise":
            return self.heads * self.s * min(BLOCK, self.s // 2) * self.b
        return self.heads * self.s * self.s * self.b if KERNELS[self.kernel].keeps_scores else 0

    @property
    def fused(self) -> bool:
        """A kernel that keeps no score tensor: the log-sum-exp per row only."""
        return KERNELS[self.kernel].fused

    @property
    def gathered_kv(self) -> int:
        """Elements of one layer's keys and values gathered over the context axis (0 without)."""
        return 2 * self.b * self.keys * self.kv_heads * self.head_dim if self.keys else 0


def shapes(model: ModelConfig, plan: MeshPlan, kernel: str, vocab: int = 0) -> Shapes:
    """The per-device shapes of ``model`` on ``plan``'s mesh (dp, fsdp, cp, tp), at its
    precision and loss chunk. ``vocab``: the padded vocabulary of the target (0: the plan's,
    padded for the devices it was made on)."""
    m = model
    tp, replicas, cp = plan.tp, plan.replicas, getattr(plan, "cp", 1)
    accum = plan.grad_accum
    c = DTYPE_BYTES[plan.precision]
    return Shapes(
        b=max(1, plan.global_batch // (replicas * accum)), s=plan.seq_len // cp, h=m.d_model,
        f=m.d_ff // tp, heads=m.n_heads // tp, kv_heads=max(1, m.n_kv_heads // tp),
        head_dim=head_dim_of(m),
        vocab=(vocab or plan.padded_vocab or m.vocab_size) // tp, n_layers=m.n_layers, c=c,
        mlp=m.mlp, bias=bool(m.bias), remat=plan.remat,
        kernel="blockwise" if cp > 1 else kernel,
        residual=FP32 if m.residual_dtype == "fp32" else c, accum=accum,
        loss_chunk=plan.loss_chunk, norm=m.norm, rope=m.pos == "rope",
        keys=plan.seq_len if cp > 1 else 0,
        stream_split=plan.tp if getattr(plan, "sequence_parallel", False) else 1,
        norms=4 if getattr(m, "norm_position", "pre") == "sandwich" else 2,
        softcap=getattr(m, "attn_softcap", None) is not None)


def norm_bytes(x: Shapes) -> float:
    """What one norm keeps (``dxrun.model.layers.norm``'s custom VJP): its input (the residual
    stream), its output in the compute dtype and its fp32 statistics per token (LayerNorm's
    mean and reciprocal deviation, RMSNorm's reciprocal deviation). With sequence parallelism
    the input and statistics are of the device's part of the sequence, the output (what the
    matmuls after it keep) gathered whole."""
    stats = 2 if x.norm == "layernorm" else 1
    split = (x.residual * x.tokens * x.h + stats * FP32 * x.tokens) / x.stream_split
    return split + x.c * x.tokens * x.h


def layer_none(x: Shapes) -> dict[str, float]:
    """Bytes one layer keeps for its backward pass without recompute, by part: what JAX saves
    for dxrun's block (``jax.ad_checkpoint.saved_residuals``; ``tests/test_memory_model.py``
    holds the two equal). The norms and GELU are custom VJPs that keep their inputs (llm.c's
    choice); q, k, v (and the keys and values gathered over a context axis) and the heads'
    output in the compute dtype (the joined qkv weight is
    joined again in the backward pass, ``layers.dense``); XLA's attention core (and the
    reference's) the exponentials in fp32 and the probabilities, with two fp32 row statistics
    (JAX also saves the causal mask and the masked scores, which XLA's compile of the step
    drops: its stacked residuals hold the two); cuDNN's the fp32 log-sum-exp only; rotary
    positions their fp32 angles' cosines and sines; the MLP its up projection and GELU's
    output (SwiGLU, a custom VJP too: the up and gate outputs and their product)."""
    t, c = x.tokens, x.c
    rows = x.heads * x.s * x.b
    # a soft cap on kept scores: its tanh and the capped scores, fp32, beside them
    capped = 2 * FP32 * x.scores if x.softcap else 0
    core = ((FP32 + c) * x.scores + 2 * FP32 * rows + capped if x.scores
            else FP32 * rows)  # a fused kernel: the log-sum-exp only
    if x.kernel == "blockwise":  # as a fused kernel's: the log-sum-exp only
        core = FP32 * rows
    rope = 4 * FP32 * x.s * (x.head_dim // 2) if x.rope else 0
    return {
        "norms": x.norms * norm_bytes(x),
        "attention": c * t * (x.qkv + x.heads * x.head_dim) + c * x.gathered_kv + rope,
        "scores": core,
        "mlp": MLP_TENSORS[x.mlp] * c * t * x.f,
    }


def layer_saved(x: Shapes) -> float:
    """Bytes one layer keeps between its forward and backward pass under ``x.remat``."""
    t, c = x.tokens, x.c
    if x.remat == "none":
        return sum(layer_none(x).values())
    layer_input = x.residual * t * x.h / x.stream_split
    if x.remat == "full":
        return layer_input
    if x.remat == "keep_attention":  # the kernel's residuals: its output and log-sum-exp
        return layer_input + c * t * x.heads * x.head_dim + FP32 * x.heads * t
    # dots: the outputs of the matmuls the policy sees
    core = (0.0 if x.fused
            else FP32 * x.scores + c * t * x.heads * x.head_dim)
    ups = 2 if x.mlp in GATED else 1
    weights = c * t * (x.qkv + x.h) + ups * c * t * x.f  # qkv, attention out, MLP up(s)
    return layer_input + core + weights


def recomputed(x: Shapes) -> dict[str, float]:
    """What one layer's recomputation (remat) materialises for its backward pass: as
    ``layer_none`` except the MLP, whose elementwise chain is recomputed inside the fusions
    of its backward: its matmul outputs, the activation's output and its derivative. Under
    ``dots`` what the layer saved is read, not recomputed: the qkv, attention-output and MLP
    matmul outputs (and with XLA's attention the heads' output); the qkv weight's use, the
    attention core's softmax (XLA's: the exponentials and probabilities from the saved
    scores; cuDNN's forward: the heads' output and the log-sum-exp), the norms and the
    activation are recomputed."""
    parts = layer_none(x)
    ups = 2 if x.mlp in GATED else 1
    t, c = x.tokens, x.c
    if x.remat != "dots":
        parts["mlp"] = (ups + 2) * c * t * x.f
        return parts
    fused = x.fused
    parts["attention"] = c * x.h * x.qkv + (c * t * x.heads * x.head_dim if fused else 0.0)
    parts["mlp"] = 2 * c * t * x.f
    return parts


def working_set(x: Shapes) -> float:
    """One layer's backward pass beyond what is saved: the gradients flowing through it and,
    under remat, its recomputed residuals. The MLP's backward runs first (the gradient of its
    hidden layer and of its output); the attention core's then materialises dP and dS (two
    fp32 score-sized tensors where the kernel materialises scores) and the gradients of q, k,
    v and the heads' output. Without remat the layers' saved tensors are the scan's stacked
    buffers, freed only after the loop, so the gradients come on top of all of them; with
    remat the recomputed MLP residuals (and the second norm's) are dead before the attention
    core's backward starts."""
    t, c = x.tokens, x.c
    grads_mlp = c * t * (x.f + x.h)
    grads_core = 2 * FP32 * x.scores + c * t * (x.qkv + x.h)
    if x.remat == "none":
        return max(grads_mlp, grads_core)
    parts = recomputed(x)
    alive = sum(parts.values())
    norm2 = norm_bytes(x)
    return max(alive + grads_mlp, alive - parts["mlp"] - norm2 + grads_core)


def head_bytes(x: Shapes) -> float:
    """The final norm's residuals and the fp32 logits with their gradient: of the whole
    micro-batch, or with ``model.loss_chunk`` of one chunk (``b`` x ``loss_chunk`` tokens;
    its backward recomputes them, ``dxrun.model.losses``)."""
    logit_tokens = x.b * x.loss_chunk if x.loss_chunk else x.tokens
    return norm_bytes(x) + 2 * FP32 * logit_tokens * x.vocab


def gather_bytes(x: Shapes, fsdp: int) -> float:
    """FSDP: one layer's weights gathered (in the compute dtype) for the forward and one for
    the backward pass; TP-split weights are never gathered."""
    if fsdp == 1:
        return 0.0
    ups = 2 if x.mlp in GATED else 1
    per_layer = x.h * x.qkv + x.heads * x.head_dim * x.h + (ups + 1) * x.h * x.f
    return 2 * x.c * per_layer


@dataclass
class MemoryEstimate:
    """Per-device bytes of one train step on the accelerator, by part."""

    params_bytes: float
    opt_state_bytes: float
    grads_bytes: float
    batch_bytes: float
    gathers_bytes: float
    activations_bytes: float  # every layer's saved tensors, one micro-batch
    working_bytes: float  # one layer's backward pass (and recompute)
    head_bytes: float  # final norm and fp32 logits with their gradient
    total_bytes: float
    basis: str
    padded_vocab: int = 0  # the target's (the time model's too), not the CPU compile's
    # Where dxrun's step keeps more than a leaner program of the same settings would
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def program_notes(x: Shapes, params: float, grads: float, zero_dp: int) -> list[str]:
    """What dxrun's step keeps beyond a leaner program with the same settings (llm.c's fused
    kernels, Megatron's distributed optimizer), in bytes per device: said, not hidden.
    ``zero_dp``: the data replicas ZeRO-1 splits the optimizer state over (1: off)."""
    notes = []
    if zero_dp > 1:
        lean = params / 2 + params / zero_dp
        notes.append(f"ZeRO-1 splits the optimizer state over {zero_dp} replicas, not the "
                     f"weights: every device keeps all fp32 master weights "
                     f"({gb_text(params)}) and a whole fp32 gradient; bf16 weights with the "
                     f"fp32 master split (llm.c, Megatron's distributed optimizer) would keep "
                     f"{gb_text(lean)}")
    if x.accum > 1:
        notes.append(f"train.grad_accum={x.accum}: the summed gradient and the micro-batch's, "
                     f"two fp32 gradients ({gb_text(grads)}); accumulating in place keeps one")
    return notes + (activation_notes(x) if x.remat == "none" else [])


def activation_notes(x: Shapes) -> list[str]:
    """Where a layer without remat keeps more than llm.c's hand-written backward (the norms'
    and the MLP's inputs and outputs, q, k, v, the heads' output and per-token statistics:
    what dxrun keeps with cuDNN's attention): XLA's attention keeps its T x T tensors."""
    if not x.scores or x.kernel == "blockwise":
        return []
    parts = layer_none(x)
    per = sum(parts.values()) / (x.tokens * x.h)
    return [f"model.remat=none keeps {per:.0f} x d_model bytes a token and layer, of them the "
            f"attention's T x T tensors ({gb_text(x.n_layers * parts['scores'])}): attention "
            f"{x.kernel} keeps the exponentials and probabilities, where a fused flash "
            f"attention (splash on a TPU, cuDNN's on an NVIDIA GPU, bf16) keeps a log-sum-exp "
            "per row"]


def estimate_memory(x: Shapes, params: float, opt_state: float, batch: float,
                    fsdp: int, zero_dp: int = 1) -> MemoryEstimate:
    """The step's per-device peak: the state, one fp32 gradient per parameter shard, the
    batch, every layer's saved activations, one layer's backward working set, the head and
    the FSDP gathers, all alive at the start of the backward pass. ``zero_dp``: the replicas
    ZeRO-1 splits the optimizer state over (for ``program_notes``)."""
    acts = x.n_layers * layer_saved(x)
    work, head, gathers = working_set(x), head_bytes(x), gather_bytes(x, fsdp)
    # Accumulating: the scan's carry of summed gradients beside the micro-batch's own.
    grads = params * (2 if x.accum > 1 else 1)
    total = params + opt_state + grads + batch + gathers + acts + work + head
    basis = (f"memory model: remat={x.remat}, attention {x.kernel}, "
             f"{'fp32' if x.c == FP32 else 'bf16'} activations, micro-batch {x.b}x{x.s}")
    return MemoryEstimate(params, opt_state, grads, batch, gathers, acts, work, head, total,
                          basis, notes=program_notes(x, params, grads, zero_dp))


def disagreement(model_bytes: float, xla_bytes: float) -> float:
    """|model - XLA| / XLA: how far the model is from the CPU compile's figure."""
    return abs(model_bytes - xla_bytes) / xla_bytes if xla_bytes else 0.0
