"""The attention kernels as one table, and the one rule that picks a run's (``model.attention``).

An entry: the kernel's name, its platforms, whether it keeps the ``L x L`` scores (the memory
model's count; a kernel that does not is fused: the causal half, the scores recomputed in its
backward, as the FLOP count and the time model count it), the inputs it accepts (else why not)
and the module that applies it. ``choose`` decides once, when the mesh plan is made, into
``MeshPlan.attention``: the model applies it, the memory and time models and the logs read it
there. ``dot_product`` (the default) takes the first of ``AUTO`` that accepts the devices and
shapes: splash on a TPU, cuDNN's on an NVIDIA GPU, XLA's elsewhere; a name forces a kernel or
is refused in one line. A new kernel is one entry here and one module. Pure (no JAX): the
device facts come in as ``AttentionTarget`` (``attention_target``, ``kind_target``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from dxrun.config import (
    ConfigError,
    ModelConfig,
    head_dim_of,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig


class AttentionTarget(NamedTuple):
    """What the choice needs to know of the devices the model runs on (hashable)."""

    platform: str = "cpu"  # jax Device.platform: "cpu", "gpu" (CUDA), "rocm", "tpu"
    compute_capability: str | None = None  # "9.0" on an H100/H200; NVIDIA GPUs only
    cudnn_version: int | None = None  # e.g. 91000 for 9.10; None: JAX found no cuDNN


CPU_TARGET = AttentionTarget()


class Inputs(NamedTuple):
    """The attention a run computes, as a kernel's ``accepts`` reads it."""

    device: AttentionTarget
    dtype: str  # the compute dtype's name: "bfloat16" | "float32" | "float16"
    head_dim: int
    seq_len: int  # per device (a context axis splits it; the blockwise kernel takes those)
    causal: bool  # model.objective=ar; masked diffusion (mdlm) attends both ways
    window: int | None = None  # model.sliding_window: keys a query sees (None: all before it)
    softcap: float | None = None  # model.attn_softcap: the scores' soft cap (None: none)
    scalar: float | None = None  # model.attn_scalar: scores scaled by its ^-1/2 (None: E's)


@dataclass(frozen=True)
class Kernel:
    name: str
    native: tuple[str, ...]  # platforms it runs on as compiled code ("*": any)
    keeps_scores: bool  # materialises the L x L scores and keeps the probabilities for backward
    accepts: Callable[[Inputs], str | None]  # None, or why these inputs are refused
    module: str  # the module whose ``attend(q, k, v, causal, interpret)`` applies it
    interpretable: bool = False  # runs on CPU, interpreted (Pallas), when forced by name
    # its forward's residuals (output, softmax statistics) carry the checkpoint name RESIDUALS,
    # so model.remat=keep_attention can keep them
    names_residuals: bool = False
    doc: str = ""

    @property
    def fused(self) -> bool:
        """Never materialises the scores: the causal half only, the scores recomputed in the
        backward (the FLOP count's and the time model's fused attention)."""
        return not self.keeps_scores


_HALF = ("float16", "bfloat16")
# cuDNN's fused flash attention is documented for Ampere (8.0) and later; earlier GPUs get XLA.
_MIN_CAPABILITY = (8, 0)
# Splash attention's blocks: a multiple of the TPU's 128 lanes, at most SPLASH_BLOCK long.
SPLASH_LANES = 128
# The checkpoint name of what a kernel's backward reads of its forward (``names_residuals``).
RESIDUALS = "attention_residuals"


def _capability(cc: str | None) -> tuple[int, int]:
    if not cc:
        return (0, 0)
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def _cudnn(x: Inputs) -> str | None:
    """JAX's own limits (``jax/_src/cudnn/fused_attention_stablehlo.py``: ``check_layout``,
    ``check_is_flash_attention``): an NVIDIA GPU of compute capability >= 8.0 with cuDNN
    loaded, fp16/bf16, a head dim that is a multiple of 8 and at most 256 on Hopper (9.0) and
    later, 128 before; 10.3 needs cuDNN 9.11. JAX raises rather than falls back outside them."""
    d = x.device
    if d.platform not in ("gpu", "cuda") or d.cudnn_version is None:
        return "needs an NVIDIA GPU with cuDNN"
    if x.dtype not in _HALF:
        return "needs bf16 or fp16 compute (train.precision=bf16)"
    if x.softcap is not None:
        return _no_softcap(x)
    cc = _capability(d.compute_capability)
    if cc < _MIN_CAPABILITY or (cc == (10, 3) and d.cudnn_version < 91100):
        return f"needs compute capability >= 8.0 (this GPU: {d.compute_capability})"
    limit = 256 if cc >= (9, 0) else 128
    if x.head_dim % 8 or x.head_dim > limit:
        return f"needs a head dim that is a multiple of 8 and at most {limit}, not {x.head_dim}"
    return None


def _splash(x: Inputs) -> str | None:
    """Pallas' splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``): its
    blocks tile the sequence in multiples of the TPU's 128 lanes."""
    if x.seq_len % SPLASH_LANES:
        return f"needs a sequence length that is a multiple of {SPLASH_LANES}, not {x.seq_len}"
    if x.dtype not in ("bfloat16", "float32"):
        return f"needs bf16 or fp32 compute, not {x.dtype}"
    return None  # its local masks take a window, its soft cap model.attn_softcap


def _blockwise(x: Inputs) -> str | None:
    """The context axis's blockwise kernel: causal attention scaled by E^-1/2, no more."""
    for key, value in (("sliding_window", x.window), ("attn_softcap", x.softcap),
                       ("attn_scalar", x.scalar)):
        if value is not None:
            return f"has no model.{key} in dxrun (model.{key}={value})"
    return None


def _no_softcap(x: Inputs) -> str | None:
    """jax.nn.dot_product_attention (XLA's, cuDNN's) has no soft cap: ``dot_product`` then
    takes splash's on a TPU, the reference elsewhere."""
    return (f"has no soft cap of the scores (model.attn_softcap={x.softcap})"
            if x.softcap is not None else None)


def _any(x: Inputs) -> str | None:
    return None


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("splash", ("tpu",), False, _splash, "dxrun.model.splash_attention", interpretable=True,
           names_residuals=True,
           doc="Pallas' splash attention (TPU): flash attention in blocks, causal blocks "
               "skipped, grouped-query heads native; interpreted on CPU when forced"),
    Kernel("cudnn", ("gpu", "cuda"), False, _cudnn, "dxrun.model.attention",
           doc="cuDNN's fused flash attention through jax.nn.dot_product_attention (NVIDIA)"),
    Kernel("xla", ("*",), True, _no_softcap, "dxrun.model.attention",
           doc="jax.nn.dot_product_attention's XLA kernel: the scores built in full"),
    Kernel("reference", ("*",), True, _any, "dxrun.model.attention",
           doc="the plain einsum and softmax (what every kernel is tested against)"),
    # A context axis's own: keys and values gathered, one block of keys at a time
    # (dxrun.model.context_parallel.flash); chosen whenever parallelism.cp > 1.
    Kernel("blockwise", ("*",), False, _blockwise, "dxrun.model.context_parallel"),
)}
# model.attention=dot_product: the first that accepts (the reference: what no other takes, a
# soft cap off a TPU)
AUTO = ("splash", "cudnn", "xla", "reference")


def choose(setting: str, x: Inputs, cp: int = 1) -> str:
    """The kernel a run of ``model.attention=setting`` runs on ``x.device``: with a context axis
    (cp > 1) its blockwise kernel; ``dot_product``, the first of ``AUTO`` that accepts ``x``;
    a kernel's name, that kernel, or a ConfigError in one line where it cannot run."""
    if cp > 1:
        why = KERNELS["blockwise"].accepts(x)
        if why is not None:
            raise ConfigError(f"parallelism.cp={cp} attends with its blockwise kernel, which {why}; "
                              f"set parallelism.cp=1 or {why.split('(')[-1].split('=')[0]}=null")
        return "blockwise"
    if setting == "dot_product":
        return next(k for k in AUTO if KERNELS[k].accepts(x) is None
                    and _runs_on(KERNELS[k], x.device.platform))
    kernel = KERNELS[setting]
    interpreted = kernel.interpretable and x.device.platform == "cpu"
    why = kernel.accepts(x) or (None if _runs_on(kernel, x.device.platform) or interpreted
                                else f"runs on {'/'.join(kernel.native)} only")
    if why is not None:
        raise ConfigError(
            f"model.attention={setting} cannot run here: it {why} ({x.device.platform}, "
            f"{x.dtype}, head dim {x.head_dim}, seq_len {x.seq_len}); use "
            f"model.attention=dot_product (the fastest kernel that runs here)")
    return setting


def check_remat(remat: str, kernel: str) -> None:
    """``model.remat=keep_attention`` keeps what the attention kernel names as its residuals: a
    ConfigError in one line where the run's kernel names none."""
    if remat == "keep_attention" and not KERNELS[kernel].names_residuals:
        names = ", ".join(k.name for k in KERNELS.values() if k.names_residuals)
        raise ConfigError(
            f"model.remat=keep_attention keeps what the attention kernel saves for its backward, "
            f"and this run's kernel ({kernel}) names none; use model.remat=full, or a kernel "
            f"that does ({names}: model.attention=dot_product on a TPU)")


def _runs_on(kernel: Kernel, platform: str) -> bool:
    return "*" in kernel.native or platform in kernel.native


def compiled_kernel(chosen: str, setting: str, platform: str) -> tuple[str, bool]:
    """(the kernel a step compiled on ``platform`` devices applies, whether interpreted). The
    plan's choice where it runs there; forced by name off its platform, interpreted where it
    can be (Pallas on CPU: the suite's check); else XLA's stands in (plan mode compiles on CPU
    for an accelerator target, whose kernel does not lower here)."""
    kernel = KERNELS[chosen]
    if _runs_on(kernel, platform):
        return chosen, False
    if setting == chosen and kernel.interpretable and platform == "cpu":
        return chosen, True
    return "xla", False


def attention_target(device: Any) -> AttentionTarget:
    """The facts of ``device`` (one of the mesh's): its platform, and on an NVIDIA GPU its
    compute capability and the cuDNN version JAX loaded."""
    platform = device.platform
    if platform not in ("gpu", "cuda"):
        return AttentionTarget(platform)
    # JAX's own record of the loaded cuDNN, as its fused-attention checks read it.
    from jax._src.lib import cuda_versions

    version = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    return AttentionTarget(platform, getattr(device, "compute_capability", None), version)


# The compute capability of each NVIDIA plan target (cost.TARGETS' device kinds).
CAPABILITY = {"NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H100 96GB HBM2e": "9.0",
              "NVIDIA H200": "9.0", "NVIDIA A100-SXM4-80GB": "8.0", "NVIDIA L40S": "8.9"}
ASSUMED_CUDNN = 91000  # a CUDA 12 jaxlib's cuDNN 9 (JAX's own wheels ship one)


def kind_target(device_kind: str) -> AttentionTarget:
    """The facts of a plan target's device kind (no device at hand): its platform, and for a
    named NVIDIA GPU its compute capability and the cuDNN JAX's CUDA wheels ship."""
    if device_kind.startswith("NVIDIA"):
        return AttentionTarget("gpu", CAPABILITY.get(device_kind), ASSUMED_CUDNN)
    return AttentionTarget("tpu" if device_kind.startswith("TPU") else "cpu")


def run_inputs(model: ModelConfig, dtype: str, seq_len: int, cp: int,
               device: AttentionTarget) -> Inputs:
    """``Inputs`` of a run of ``model`` (its config) computing in ``dtype`` (its name) on
    ``device``."""
    return Inputs(device, dtype, head_dim_of(model), seq_len // cp,
                  model.get("objective", "ar") != "mdlm", model.get("sliding_window"),
                  model.get("attn_softcap"), model.get("attn_scalar"))


def plan_kernel(cfg: RunConfig, seq_len: int, cp: int, device: AttentionTarget,
                dtype: str) -> str:
    """``choose`` for a run of ``cfg`` computing in ``dtype``: ``make_plan``'s, the one place
    a kernel is chosen (another target's too: ``autotune.footprint.kernel_on``); a user's model
    (``model._target_``) attends its own way: recorded as XLA's."""
    if cfg.model.get("_target_"):
        return "xla"
    return choose(cfg.model.attention, run_inputs(cfg.model, dtype, seq_len, cp, device), cp)
