"""What a plan costs on an accelerator (pure: no JAX): the targets a plan is made for and the
share of their memory a run gets; model FLOPs, device peaks and MFU; the accelerator time model
(``COST``: one train step on a GPU or TPU target); the memory model (one step's per-device
bytes); the fit and speed of a step on a target; and what plan mode says beside its figures.
Each section's own account follows, in that order.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dxrun.config import AXES, ConfigError, expert_d_ff, head_dim_of, moe_layers
from dxrun.config.registry import model_changes
from dxrun.plan.run_plan import BLOCK, KERNELS, kv_gather_bytes, padded_vocab, table_rows

if TYPE_CHECKING:
    from dxrun.config import ModelConfig, RunConfig
    from dxrun.plan.run_plan import MeshPlan


# ------------------------------------------------------------------------------------------------
# The accelerators a plan can be made for, per device, and the share of a device's memory a
# run gets: pure, no JAX (the config check reads the names before JAX starts).

GB = 1e9
GiB = 2**30
USABLE = 0.9  # of a GPU's memory without a pool; the rest is the CUDA context's and libraries'
# Of a TPU's memory: the share XLA's compile lets a program use (its refusals name the chip's
# available HBM; BENCHMARKS.md, the defaults on the chip), the rest the runtime's own.
TPU_USABLE = 15.75 / 16
USABLE_CPU = 0.8  # of the host's RAM: the OS, Python and the data pipeline need the rest


# JAX's GPU client pools this fraction of each GPU's memory (the BFC allocator's bytes_limit,
# which the preflight reads), preallocated or not: jaxlib's xla_client.py and JAX's "GPU memory
# allocation" page.
JAX_GPU_FRACTION = 0.75
MEM_FRACTION_KEYS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


@dataclass(frozen=True)
class Target:
    """One accelerator, per device. The peak comes from flops.PEAK_TFLOPS by ``device_kind``
    (one table of peaks); memory is the driver's total, bandwidths the vendors' datasheets'."""

    name: str
    device_kind: str
    memory_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # interconnect, per device, one direction


# Sources: NVIDIA H100/H200/A100/L40S datasheets (HBM3 3.35 TB/s, HBM3e 4.8 TB/s, HBM2e
# 2.04 TB/s, GDDR6 864 GB/s; NVLink 4: 900 GB/s, NVLink 3: 600 GB/s both directions together;
# L40S has no NVLink: PCIe 4.0 x16, 32 GB/s); Google Cloud TPU v5e/v5p system docs (16 GB at
# 819 GB/s with 1,600 Gbps ICI; 95 GB at 2,765 GB/s with 4,800 Gbps ICI). The v5e's "16 GB" is
# 16 GiB on the chip (binary units, as XLA counts it).
# A GPU's memory is the total its driver reports (nvidia-smi's MiB, each in the table below),
# not the datasheet's rounded GB: JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION) is a fraction of
# that total, so a plan against the rounded figure refuses runs that fit. The Grand Teton H100's
# is torchtitan's docs/performance.md figure.
MiB = 2**20
TARGETS: dict[str, Target] = {
    "h100": Target("H100 SXM 80GB", "NVIDIA H100 80GB HBM3", 81_559 * MiB, 3.35e12, 450 * GB),
    "h200": Target("H200 141GB", "NVIDIA H200", 143_771 * MiB, 4.8e12, 450 * GB),
    "a100": Target("A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 81_920 * MiB, 2.039e12, 300 * GB),
    # Meta's Grand Teton H100 (torchtitan docs/performance.md: 96 GB HBM2e at 2.4 TB/s, NVLink,
    # run at a 500 W power limit): the SXM die (flops.PEAK_TFLOPS), its clock at 500 W in
    # gpu_cost.COST.
    "h100_96gb_500w": Target("H100 96GB HBM2e 500W", "NVIDIA H100 96GB HBM2e", 95 * GiB, 2.4e12,
                             450 * GB),
    "l40s": Target("L40S 48GB", "NVIDIA L40S", 46_068 * MiB, 0.864e12, 32 * GB),
    "v5e": Target("TPU v5e", "TPU v5 lite", 16 * GiB, 0.819e12, 200 * GB),
    "v5p": Target("TPU v5p", "TPU v5", 95 * GB, 2.765e12, 600 * GB),
    "cpu": Target("this machine (CPU)", "cpu", 0.0, 0.0, 0.0),  # measured: see cpu_target
}


@dataclass(frozen=True)
class Usable:
    """The share of a device's memory a run gets, and where that figure comes from."""

    fraction: float
    source: str


def gpu_memory_fraction(env: Any) -> Usable:
    """The share of each GPU's memory JAX's allocator will give a run started with ``env`` (the
    process environment): the fraction it pools (``XLA_CLIENT_MEM_FRACTION``, or the deprecated
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``; 75% unset). ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    grows the pool on demand up to the same limit, so it changes nothing here;
    ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool (cudaMalloc per buffer): the device's
    memory less what the CUDA context and libraries keep (``USABLE``)."""
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() == "platform":
        return Usable(USABLE, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool, the rest is the "
                              "CUDA context's")
    given = [k for k in MEM_FRACTION_KEYS if env.get(k)]
    if len(given) == 2:  # jaxlib refuses the pair when the client starts
        raise ConfigError(f"{given[0]} and {given[1]} are both set (JAX refuses that); unset "
                          f"{given[1]}, the deprecated name")
    if not given:
        return Usable(JAX_GPU_FRACTION, "JAX's default; raise it with "
                                        "XLA_PYTHON_CLIENT_MEM_FRACTION=.9")
    key, value = given[0], env[given[0]]
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ConfigError(f"{key}={value} is not a fraction of the GPU's memory; set it in "
                          "(0, 1], e.g. .9, or unset it for JAX's 0.75")
    return Usable(fraction, f"{key}={value}")


def usable_share(target: Target, env: Any = None) -> Usable:
    """The share of ``target``'s memory a plan may use: JAX's pool on a GPU (from ``env``,
    default this process's environment), ``TPU_USABLE`` on a TPU, ``USABLE_CPU`` of a host's
    RAM."""
    if target.device_kind == "cpu":
        return Usable(USABLE_CPU, "of the host's available RAM")
    if target.device_kind.startswith("NVIDIA"):
        return gpu_memory_fraction(os.environ if env is None else env)
    return Usable(TPU_USABLE, "XLA's share of a TPU's memory (its bytes_limit)")


def usable_bytes(target: Target, env: Any = None) -> float:
    """What a plan may use of one device's memory."""
    return target.memory_bytes * usable_share(target, env).fraction


def target_key(target: Target) -> str | None:
    """The TARGETS name of ``target`` (None for a measured CPU target)."""
    return next((k for k, t in TARGETS.items() if t == target), None)


def plan_platform(target: str | None, backend: str) -> str:
    """The platform a plan is for: ``plan.target``'s (a named GPU or TPU, or cpu), else the
    backend this process runs on. What ``data.seq_len=null`` resolves by."""
    if target is None:
        return backend
    kind = TARGETS[target].device_kind
    return "cpu" if kind == "cpu" else "gpu" if kind.startswith("NVIDIA") else "tpu"


def gb_text(nbytes: float) -> str:
    """Bytes in a table: GB, or MiB below a hundredth of one."""
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.01 * GB else f"{nbytes / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# Model FLOPs, device peaks and MFU: pure functions (no JAX import).
#
# FLOPs per token of one training step (forward + backward = 3 x forward):
#
#     flops/token = 6 * N + 12 * n_layers * d_model * seq_len
#
# * ``N``: the matmul weights: all parameters but the embedding lookups (``wte``, ``wpe``); a
#   tied table is also the output projection, so it is counted once, as that matmul.
# * ``12 * n_layers * d_model * seq_len``: the attention scores ``Q K^T`` and the weighted sum
#   ``P V``, forward and backward, over the full ``seq_len x seq_len`` score matrix the device
#   computes under the causal mask (no recomputation counted).
#
# MFU = achieved model FLOP/s per device / the device's dense peak for the run's precision.

# Dense (no sparsity) peak TFLOP/s per device: (bf16, fp32). The fp32 column is the TF32 tensor
# core peak on NVIDIA GPUs, which is what XLA uses for fp32 matmuls by default there.
# Keyed by JAX's ``device_kind`` exactly, after ``normalize_kind`` (lower case; runs of spaces,
# '-' and '_' become one space): a name is never matched as a substring, so "NVIDIA L4" is not
# "NVIDIA L40" and the H100 PCIe / NVL are not the SXM part.
# Sources (datasheets, dense = half the "with sparsity" figure):
#   H100 SXM/PCIe/NVL, H200 SXM/NVL, H800, H20: NVIDIA H100/H200 datasheets, H800/H20 product
#   briefs (H800 SXM has H100 SXM's tensor cores; H20: 148 bf16, 74 TF32); GH200: the H100 SXM
#   die; B200: HGX B200 (2.25 PF bf16, 1.1 PF TF32 per GPU); GB200: GB200 NVL72 (2.5 PF bf16,
#   1.25 PF TF32 per GPU); A100 SXM and PCIe: A100 datasheet; L40S/L40/L4: ADA datasheets;
#   V100: fp16 tensor cores (no bf16); TPUs: Google Cloud TPU system architecture docs.
_H100_SXM = (989.0, 494.0)
_H100_PCIE = (756.0, 378.0)
_NVL = (835.0, 417.0)  # H100 NVL and H200 NVL (PCIe cards)
_A100 = (312.0, 156.0)
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "NVIDIA B200": (2250.0, 1100.0),
    "NVIDIA GB200": (2500.0, 1250.0),
    "NVIDIA GH200 480GB": _H100_SXM,
    "NVIDIA GH200 144G HBM3e": _H100_SXM,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _NVL,
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 SXM5 80GB": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _NVL,
    # Meta's Grand Teton H100 (96 GB HBM2e; torchtitan docs/performance.md): the SXM die. Its
    # 500 W limit is a clock, not a datasheet peak: dxrun/plan/cost.py's clock_scale.
    "NVIDIA H100 96GB HBM2e": _H100_SXM,
    "NVIDIA H800": _H100_SXM,
    "NVIDIA H800 PCIe": _H100_PCIE,
    "NVIDIA H20": (148.0, 74.0),
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": (362.0, 183.0),
    "NVIDIA L40": (181.0, 90.5),
    "NVIDIA L4": (121.0, 60.0),
    "Tesla V100-SXM2-16GB": (125.0, 15.7),
    "Tesla V100-SXM2-32GB": (125.0, 15.7),
    "Tesla V100-PCIE-16GB": (112.0, 14.0),
    "Tesla V100-PCIE-32GB": (112.0, 14.0),
    "TPU v4": (275.0, 275.0),
    "TPU v5 lite": (197.0, 197.0),  # v5e
    "TPU v5e": (197.0, 197.0),
    "TPU v5": (459.0, 459.0),  # v5p
    "TPU v5p": (459.0, 459.0),
    "TPU v6 lite": (918.0, 918.0),  # v6e (Trillium)
    "TPU v6e": (918.0, 918.0),
}


def normalize_kind(device_kind: str) -> str:
    """``device_kind`` as the table compares it: lower case, separators folded to one space
    (drivers and JAX versions differ in "A100-SXM4-80GB" vs "A100 SXM4 80GB")."""
    return re.sub(r"[\s_-]+", " ", device_kind.lower()).strip()


_BY_KIND = {normalize_kind(k): v for k, v in PEAK_TFLOPS.items()}


def peak_tflops(device_kind: str, precision: str) -> float | None:
    """The table's dense peak for exactly this ``device_kind`` (normalised), or None."""
    peaks = _BY_KIND.get(normalize_kind(device_kind))
    if peaks is None:
        return None
    return peaks[0] if precision == "bf16" else peaks[1]


def matmul_params(model: Any, n_params: int) -> int:
    embed = model.vocab_size * model.d_model
    pos = model.max_seq_len * model.d_model if model.pos == "learned" else 0
    head = embed if model.tie_embeddings else 0
    return n_params - embed - pos + head


def flops_per_token(model: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (see the module docstring for the formula); for a user model
    (``model._target_``, whose block's shape is its own) 6 per parameter."""
    if getattr(model, "_target_", None):
        return 6.0 * n_params
    attention = 12 * model.n_layers * model.d_model * seq_len
    return 6.0 * matmul_params(model, active_params(model, n_params)) + attention


def active_params(model: Any, n_params: int) -> int:
    """The parameters one token's forward pass uses: ``n_params`` less, in every MoE layer
    (``model.moe``), the routed experts it is not sent to (n_experts - top_k of them);
    ``n_params`` for a dense model. MFU and TFLOP/s count these (a sparse model's convention)."""
    moe = getattr(model, "moe", None)
    if getattr(model, "_target_", None) or not moe or not moe.n_experts:
        return n_params
    per_expert = model.d_model * expert_d_ff(model) * (3 if model.mlp == "swiglu" else 2)
    skipped = sum(moe_layers(model.n_layers, moe)) * (moe.n_experts - moe.top_k) * per_expert
    return n_params - skipped


def active_d_ff(model: Any) -> float:
    """The MLP width a token passes through, averaged over the layers: ``model.d_ff``, or in an
    MoE layer (``model.moe``) its top k experts' and the shared expert's widths together. The
    time model and the hardware FLOPs count a block's MLP at this width (the router's small
    matmul aside)."""
    moe = getattr(model, "moe", None)
    if not moe or not moe.n_experts:
        return float(model.d_ff)
    sparse = sum(moe_layers(model.n_layers, moe))
    routed = moe.top_k * expert_d_ff(model) + moe.shared_d_ff
    return ((model.n_layers - sparse) * model.d_ff + sparse * routed) / model.n_layers


def mfu(tflops_per_device: float, peak: float) -> float:
    return tflops_per_device / peak


# --- the FLOPs of one step, counted from the model's shapes ----------------------------------
#
# Conventions (2 FLOPs per multiply-add; per step, all devices together; divide by the device
# count for one device's share, which every layout splits evenly):
#
# * ``model``: what MFU's numerator is (``flops_per_token`` above, unchanged): every matmul of
#   the forward pass three times (forward, input gradient, weight gradient) and the attention
#   scores and weighted sum over the full ``seq_len x seq_len`` square, no recomputation.
# * ``attention_causal``: the same attention with the causal half only, the convention of
#   MaxText's and FlashAttention's TFLOP/s figures (a fused kernel skips the masked blocks);
#   masked diffusion (``model.objective=mdlm``) attends both ways: its is the full square.
# * ``hardware``: what the device executes: ``model`` with the attention a fused kernel runs
#   (causal half; its backward recomputes the scores: 2.5 x the forward, FlashAttention-2 paper
#   section 3.1) or XLA's (the full square, 3 x), plus what ``model.remat`` recomputes in the
#   backward pass (``full``: the blocks' forward but the MLP's down projection, whose output
#   no gradient needs, so XLA drops it from the recomputation (its count agrees);
#   ``keep_attention``: the same but the attention kernel, whose residuals are kept; ``dots``: a
#   fused attention's forward, the one thing the policy does not keep, since the kernel is a
#   custom call, not a dot).

# The model.remat levels whose backward pass runs the blocks' matmuls again.
RECOMPUTE_MATMULS = ("full", "keep_attention")


def block_matmul_flops(model: Any) -> float:
    """Forward FLOPs per token of one block's weight matmuls: q/k/v, the output projection and
    the MLP (two matmuls for GELU, three for SwiGLU)."""
    D, H, K, F = model.d_model, model.n_heads, model.n_kv_heads, active_d_ff(model)
    E = head_dim_of(model)
    qkv = 2 * D * (H + 2 * K) * E
    out = 2 * H * E * D
    mlp = 2 * D * F * (3 if model.mlp == "swiglu" else 2)
    return float(qkv + out + mlp)


def is_causal(model: Any) -> bool:
    """Whether the model's attention is causal: all but masked diffusion's (``model.objective=
    mdlm``), whose every query sees every key, so no kernel skips half of the square."""
    return getattr(model, "objective", "ar") != "mdlm"


def attention_flops(model: Any, seq_len: int, causal: bool) -> float:
    """Forward FLOPs per token of one block's scores ``Q K^T`` and weighted sum ``P V``: the
    full square, or its causal half."""
    full = 2 * 2 * seq_len * model.n_heads * head_dim_of(model)
    w = getattr(model, "sliding_window", None)
    if causal and w and w < seq_len:  # a query sees min(its position + 1, w) keys
        return full * (w / seq_len - w * w / (2 * seq_len**2))
    return full / 2 if causal else float(full)


def step_flops(model: Any, tokens: int, seq_len: int, vocab: int, remat: str = "none",
               fused_attention: bool = False) -> dict[str, float]:
    """One training step's FLOPs by part (see the conventions above). ``vocab``: the output
    layer's columns as computed (the padded vocabulary)."""
    L, causal = model.n_layers, is_causal(model)
    blocks = 3 * L * block_matmul_flops(model) * tokens
    attn_full = 3 * L * attention_flops(model, seq_len, causal=False) * tokens
    attn_causal = attn_full / 2 if causal else attn_full
    head = 3 * 2 * model.d_model * vocab * tokens
    if fused_attention:
        attn_fwd = L * attention_flops(model, seq_len, causal=causal) * tokens
        attn_hw = 3.5 * attn_fwd
    else:
        attn_fwd = L * attention_flops(model, seq_len, causal=False) * tokens
        attn_hw = 3 * attn_fwd
    down = L * 2 * active_d_ff(model) * model.d_model * tokens  # not recomputed (see above)
    recompute = {"none": 0.0, "full": blocks / 3 - down + attn_fwd,
                 "keep_attention": blocks / 3 - down,
                 "dots": attn_fwd if fused_attention else 0.0}[remat]
    return {
        "block_matmuls": blocks,
        "attention_full": attn_full,
        "attention_causal": attn_causal,
        "output_layer": head,
        "model": blocks + attn_full + head,
        "model_causal": blocks + attn_causal + head,
        "recompute": recompute,
        "hardware": blocks + attn_hw + head + recompute,
    }


# ------------------------------------------------------------------------------------------------
# The accelerator time model: one train step's time on a GPU or TPU target, from the model's
# shapes, the mesh and the collectives of the compiled step (pure functions; no JAX).
#
# XLA:CPU's program is not the GPU's, so only what the CPU compile is faithful about (the
# shardings, the collectives and their groups) is read from it; the rest is counted from the
# shapes, kernel by kernel class: matmuls (each a roofline at a shape-dependent efficiency),
# fused attention, elementwise work as HBM traffic under XLA:GPU's fusion, and collectives over
# the target's links. The data replicas' collectives overlap compute, the tensor-parallel ones
# do not. Every constant is in ``COST``, one row per target, each with its source; the model,
# term by term, is in the guide (docs/guide/large-models.md, "The time model").

@dataclass(frozen=True)
class Cost:
    """A target's cost-model constants (beside its datasheet row, ``plan.targets.TARGETS``, and its
    peak, ``PEAK_TFLOPS``). ``sources``: where each number comes from."""

    matmul_efficiency: float  # best-shape achieved / dense peak (bf16 GEMM)
    matmul_half_dim: float  # smallest matmul dim at which the efficiency is half the best
    attention_efficiency: float  # fused attention, forward + backward, of the bf16 peak
    hbm_efficiency: float  # achieved / datasheet HBM bandwidth of a streaming kernel
    link_efficiency: float  # collective bus bandwidth / datasheet link bandwidth (one way)
    devices_per_node: int  # devices behind one NVLink / ICI domain
    network_bytes_per_s: float  # per device, across nodes, one way
    clock_scale: float = 1.0  # sustained / boost clock (a power limit below the datasheet's)
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # the share of the modelled elementwise traffic left as passes of their own (XLA:TPU fuses
    # norms, activations and residual adds into the matmuls that read or write them)
    elementwise_share: float = 1.0
    # a scanned layer stack (model.scan_layers) copies each layer's saved activations out of
    # the scan's stacked buffers in the backward (a read and a write of each): priced where
    # measured (``scan_traffic``)
    scan_copies: bool = False


_MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (bf16 torch.matmul, best shape)")
_FA = ("FlashAttention-2 paper (Dao 2023) fig. 7 (A100, fwd+bwd, causal, head dim 128: 50-60% "
       "of peak); FlashAttention-3 paper (Shah et al. 2024) figs. 5-6 (H100 cuDNN/FA2 "
       "fwd+bwd, causal: 40-55% of the 989 TFLOP/s peak)")
_STREAM = ("BabelStream/nvbandwidth device-to-device copies: ~90% of the HBM datasheet figure "
           "on A100/H100 (NVIDIA's 'CUDA C++ Best Practices', effective bandwidth); 0.85 kept "
           "for XLA's multi-operand fusions")
_NCCL = ("nccl-tests all_reduce_perf bus bandwidth on 8-GPU NVLink nodes: ~230 GB/s A100 "
         "(of 300), ~360 GB/s H100 without NVLS (of 450); NVIDIA NCCL docs/blog")
_NET = ("400 Gb/s InfiniBand NDR / RoCE per GPU (DGX H100, Grand Teton), 200 Gb/s HDR (DGX "
        "A100); A3 VMs 200 Gb/s per GPU")
_HALF_DIM = ("assumed, not fitted: cuBLAS/CUTLASS tiles are 128 (or 256) wide, so a matmul "
             "whose smallest dim is under a tile leaves most of a tile idle")
_SUSTAINED = ("calibrated: fitted on MaxText's Llama 2 7B run (BENCHMARKS.md, 'Plan mode vs "
              "published GPU runs'); H100 SXM boards hold ~1.6 GHz of their 1.98 GHz boost "
              "through a long run (the peak and MAMF assume the boost)")

_V5E_FIT = ("calibrated: fitted on dxrun's GPT-2 small/medium/large steps on one v5e chip "
            "(bf16, splash attention, remat none and full, layers unrolled; BENCHMARKS.md, "
            "'TPU'); the attention fraction is what splash's kernels reach in their profile at "
            "head dim 64")
_V5E_SCAN = ("measured: the same steps with the layers scanned run slower on a v5e by the "
             "backward's dynamic-slice copies of the stacked activations (BENCHMARKS.md, 'TPU')")


def _gpu(**own: str) -> dict[str, str]:
    """An NVIDIA target's sources: the shared ones, with ``own`` in place."""
    return {"matmul_half_dim": _HALF_DIM, "attention_efficiency": _FA,
            "hbm_efficiency": _STREAM, "link_efficiency": _NCCL,
            "devices_per_node": "8 GPUs per NVLink node (HGX/DGX, Grand Teton, A3)",
            "network_bytes_per_s": _NET, "elementwise_share": "1.0: the traffic as modelled",
            "scan_copies": "not priced: not measured on a GPU"} | own


def _tpu(**own: str) -> dict[str, str]:
    """A TPU target's sources: the shared ones, with ``own`` in place."""
    return {"matmul_half_dim": "MXU 128 x 128 (Cloud TPU system architecture)",
            "hbm_efficiency": "assumed as GPUs'", "link_efficiency": "assumed",
            "network_bytes_per_s": "DCN, assumed", "clock_scale": "1.0, not calibrated"} | own


COST: dict[str, Cost] = {
    "h100": Cost(0.803, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.79, _gpu(
        matmul_efficiency=_MAMF + ": H100 SXM 794.5 of 989", clock_scale=_SUSTAINED)),
    "h100_96gb_500w": Cost(0.803, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.51, _gpu(
        matmul_efficiency=_MAMF + ": H100 SXM 794.5 of 989",
        network_bytes_per_s="torchtitan docs/performance.md: 400 Gb/s RDMA per GPU",
        clock_scale="calibrated: fitted on torchtitan's Llama 3.1 8B run (BENCHMARKS.md). It "
                    "stands for the 500 W limit of 700 W-TDP parts (torchtitan "
                    "docs/performance.md) and also absorbs what that run does and dxrun would "
                    "not: eager PyTorch (its compiled row is 16% faster) and op-level AC "
                    "recomputing every other matmul; 0.51 is not a clock measurement")),
    "h200": Cost(0.836, 96, 0.45, 0.85, 0.80, 8, 50 * GB, 0.79, _gpu(
        matmul_efficiency=_MAMF + ": GH200 828.6 of 989 (the H200's HBM3e die)",
        clock_scale="assumed as the H100's (calibrated there)")),
    "a100": Cost(0.869, 96, 0.55, 0.85, 0.77, 8, 25 * GB, 1.0, _gpu(
        matmul_efficiency=_MAMF + ": A100 SXM 271.2 of 312",
        clock_scale="1.0, not calibrated: no A100 run calibrates (the A100 row validates)")),
    "l40s": Cost(0.80, 96, 0.45, 0.85, 0.80, 8, 25 * GB, 0.79, _gpu(
        matmul_efficiency="assumed as the H100's (no MAMF published)",
        clock_scale="assumed as the H100's", link_efficiency="PCIe 4.0 x16, assumed 80%",
        devices_per_node="8 PCIe cards per server, assumed",
        network_bytes_per_s="200 Gb/s per GPU, assumed")),
    # TPUs: Pallas' splash attention (dxrun/model/splash_attention.py). The v5e's matmul and
    # attention fractions are fitted on dxrun's own steps on one chip (BENCHMARKS.md, "TPU");
    # the v5p's matmul fraction is MaxText's published MFU (README "Runtime Performance
    # Results": 55-65% on dense Llama-class models; the matmuls alone do better).
    "v5e": Cost(0.85, 128, 0.20, 0.85, 0.80, 256, 25 * GB, 1.0, _tpu(
        matmul_efficiency=_V5E_FIT, attention_efficiency=_V5E_FIT, elementwise_share=_V5E_FIT,
        scan_copies=_V5E_SCAN, devices_per_node="a v5e pod slice (256 chips on ICI)"),
        elementwise_share=0.45, scan_copies=True),
    "v5p": Cost(0.80, 128, 0.20, 0.85, 0.80, 8960, 25 * GB, 1.0, _tpu(
        matmul_efficiency="MaxText README v5p results (~60% MFU end to end)",
        attention_efficiency="assumed as the v5e's", elementwise_share="assumed as the v5e's",
        scan_copies="assumed as the v5e's", devices_per_node="a v5p pod (8,960 chips on ICI)"),
        elementwise_share=0.45, scan_copies=True),
}

# What the estimate row says of its basis: set from the last `python -m benchmarks
# --published` (BENCHMARKS.md, "Plan mode vs published GPU runs").
ESTIMATE_BASIS = {"calibrated_on": 2, "validated_on": 4, "within_pct": 19}


def basis_text(basis: dict[str, int] = ESTIMATE_BASIS) -> str:
    return (f"roofline calibrated on {basis['calibrated_on']} runs, validated within "
            f"±{basis['within_pct']}% on {basis['validated_on']} published runs (BENCHMARKS.md)")


@dataclass(frozen=True)
class Workload:
    """One device's share of one train step, as the time model reads it."""

    model: Any  # the model config (n_layers, d_model, n_heads, n_kv_heads, d_ff, mlp, pos, ...)
    seq_len: int
    rows: int  # sequences per device per micro-batch (the tensor group shares them)
    micro_steps: int  # train.grad_accum
    vocab: int  # the output layer's columns (padded vocabulary)
    tp: int
    n_devices: int
    params: float  # all parameters (the model's, padded)
    params_per_device: float  # this device's shard (the optimizer updates these)
    precision: str  # fp32 | bf16
    grad_reduce_dtype: str = "fp32"
    # ZeRO-1 (parallelism.shard_optimizer): the parameters this device's optimizer updates
    # (its shard of params_per_device, 1/dp of it); None = params_per_device
    updated_per_device: float | None = None
    # model.loss_chunk resolved: with the vocabulary split over tensor (tp > 1) the chunks'
    # backward redoes the head's forward; on one shard their forward made the gradient
    loss_chunk: int = 0
    remat: str = "none"  # the run plan's model.remat
    cp: int = 1  # the context axis: a device holds seq_len / cp positions of each row
    kernel: str = "xla"  # the run plan's attention kernel (attention_kernel.KERNELS)

    @property
    def tokens(self) -> int:
        """Tokens one device computes per micro-batch."""
        return self.rows * self.seq_len // self.cp


def fused_attention(w: Workload) -> bool:
    """Whether the run's kernel (the plan's, ``attention_kernel.KERNELS``) is a fused flash
    attention: cuDNN's or splash. A context axis's blockwise kernel is priced as XLA's
    attention matmuls (its blocks are einsums)."""
    return w.kernel != "blockwise" and KERNELS[w.kernel].fused


def _matmul_s(m: float, n: float, k: float, peak: float, hbm: float, cost: Cost,
              in_bytes: int, out_bytes: int) -> float:
    """One ``m x k`` by ``k x n`` matmul: the slower of its compute and its operands' traffic."""
    s = min(m, n, k)
    eff = cost.matmul_efficiency * s / (s + cost.matmul_half_dim)
    compute = 2 * m * n * k / (peak * eff)
    memory = (in_bytes * (m * k + k * n) + out_bytes * m * n) / hbm
    return max(compute, memory)


def _block_matmuls(w: Workload) -> list[tuple[float, float]]:
    """(input width, output width) of one block's weight matmuls on one device (tp-split)."""
    m = w.model
    E, tp = head_dim_of(m), w.tp
    F = active_d_ff(m)
    mlp_in = [(m.d_model, F / tp)] * (2 if m.mlp == "swiglu" else 1)
    return [(m.d_model, (m.n_heads + 2 * m.n_kv_heads) * E / tp), (m.n_heads * E / tp, m.d_model),
            *mlp_in, (F / tp, m.d_model)]


def matmul_time(w: Workload, peak: float, hbm: float, cost: Cost, fused: bool) -> dict:
    """Seconds of one device's matmuls per step: the blocks' (forward, input gradient, weight
    gradient; plus the forward again under model.remat=full or keep_attention), the output
    layer's, and XLA's
    attention matmuls when the attention is not fused."""
    m, t = w.model, w.tokens
    a = 2 if w.precision == "bf16" else 4  # operand bytes; weight gradients accumulate in fp32
    fwd = bwd = 0.0
    shapes = _block_matmuls(w)
    for k_in, n_out in shapes:
        fwd += _matmul_s(t, n_out, k_in, peak, hbm, cost, a, a)
        bwd += _matmul_s(t, k_in, n_out, peak, hbm, cost, a, a)  # input gradient
        bwd += _matmul_s(k_in, n_out, t, peak, hbm, cost, a, 4)  # weight gradient (fp32)
    # remat=full (and keep_attention) recomputes the forward but its last matmul (the MLP's down
    # projection: no gradient needs its output; step_flops)
    k_in, n_out = shapes[-1]
    redo = (fwd - _matmul_s(t, n_out, k_in, peak, hbm, cost, a, a)
            if w.remat in RECOMPUTE_MATMULS else 0.0)
    L = m.n_layers
    blocks = L * (fwd + bwd + redo)
    D, V = m.d_model, w.vocab / w.tp
    head = (_matmul_s(t, V, D, peak, hbm, cost, a, 4) * (2 if w.loss_chunk and w.tp > 1 else 1)
            + _matmul_s(t, D, V, peak, hbm, cost, a, a) + _matmul_s(D, V, t, peak, hbm, cost, a, 4))
    attn = 0.0
    if not fused:  # XLA's: per (sequence, head) a T x E by E x T and a T x T by T x E matmul
        H, E, T = m.n_heads / w.tp, head_dim_of(m), w.seq_len
        Q = T // w.cp  # a context axis: this device's queries against every key
        one = (_matmul_s(Q, T, E, peak, hbm, cost, a, 4)  # scores, fp32
               + _matmul_s(Q, E, T, peak, hbm, cost, a, a))  # weighted sum
        # backward: four matmuls of the same sizes (2 x); remat=full: the forward again
        attn = one * (3 + (w.remat == "full")) * H * w.rows * L
    return {"blocks": blocks * w.micro_steps, "output_layer": head * w.micro_steps,
            "attention": attn * w.micro_steps}


def elementwise_bytes(w: Workload, fused: bool) -> dict[str, float]:
    """HBM bytes of one device's non-matmul work per step, under XLA:GPU's fusion (each fused
    kernel reads its inputs and writes its outputs once). Per token and layer, forward: the two
    norms (read the residual, write the normed input), rotary embedding (q and k), the MLP's
    activation, the two residual adds; the backward reads twice what the forward did and writes
    as much (2 x), remat recomputes the forward (+1 x). Per step: the cross-entropy over the
    logits (two fp32 reads, a compute-dtype gradient write), the weights' casts to bf16 at each
    use (after the FSDP gather: whole tp shards), the gradient accumulation across micro-batches,
    and AdamW on this device's shard (reads weight, gradient, two moments; writes three)."""
    m, t = w.model, w.tokens
    a = 2 if w.precision == "bf16" else 4
    r = 4 if m.residual_dtype == "fp32" else a
    D, E, tp = m.d_model, head_dim_of(m), w.tp
    H, K, F = m.n_heads / tp, m.n_kv_heads / tp, m.d_ff / tp
    norms = 2 * (r * D + a * D)
    residual = 2 * (2 * r * D + a * D)
    rope = 2 * a * (H + K) * E if m.pos == "rope" else 0.0
    act = (3 if m.mlp == "swiglu" else 2) * a * F
    softmax = 0.0 if fused else H * w.seq_len * (4 + a)  # read fp32 scores, write probabilities
    fwd = norms + residual + rope + act + softmax
    passes = 3 + (1 if w.remat != "none" else 0)  # forward, backward (2 x), recomputation
    layers = m.n_layers * fwd * passes * t
    V = w.vocab / tp
    loss = (8 + a) * V * t
    per_micro = layers + loss
    uses = 3 if w.remat in RECOMPUTE_MATMULS else 2  # forward, input gradient (+ recomputed)
    casts = (6 * w.params / tp) * uses if w.precision == "bf16" else 0.0
    accumulate = 8 * w.params_per_device if w.micro_steps > 1 else 0.0
    updated = w.params_per_device if w.updated_per_device is None else w.updated_per_device
    optimizer = 7 * 4 * updated + 4 * updated  # AdamW + clip norm, on this device's shard
    return {"activations": per_micro * w.micro_steps,
            "weights": (casts + accumulate) * w.micro_steps, "optimizer": optimizer}


def _is_tensor_group(groups: list[list[int]], tp: int) -> bool:
    """A group of consecutive devices of size tp: the innermost mesh axis, ``tensor``."""
    return tp > 1 and all(len(g) == tp and sorted(g) == list(range(min(g), min(g) + tp))
                          and min(g) % tp == 0 for g in groups)


def _is_context_group(groups: list[list[int]], cp: int, tp: int) -> bool:
    """Groups of cp devices tp apart: the ``context`` axis, just outside ``tensor``."""
    return cp > 1 and all(len(g) == cp and sorted(g) == list(range(min(g), min(g) + cp * tp, tp))
                          for g in groups)


def collective_time(colls: list[dict], w: Workload, link: float, cost: Cost) -> dict:
    """Seconds of the step's collectives: (tensor-parallel and context, over data replicas).
    The context axis's key/value gathers are on the attention's path, not overlapped, as the
    tensor-parallel ones. bf16 halves what the GPU program sends in bf16 (see the module
    docstring)."""
    out = {"tensor": 0.0, "data": 0.0, "tensor_bytes": 0.0, "data_bytes": 0.0}
    per_node = cost.devices_per_node
    for c in colls:
        tensor = (_is_tensor_group(c["groups"], w.tp)
                  or _is_context_group(c["groups"], w.cp, w.tp))
        n = max(len(g) for g in c["groups"])
        if n <= 1:
            continue
        nbytes = c["bytes"] * c["runs"]
        if w.precision == "bf16" and "f32" in c["dtypes"] and (
                tensor or (w.grad_reduce_dtype == "bf16" and c["kind"] != "all-gather")):
            nbytes /= 2
        spans = any(len({d // per_node for d in g}) > 1 for g in c["groups"])
        bw = cost.network_bytes_per_s if spans else link * cost.link_efficiency
        key = "tensor" if tensor else "data"
        out[key] += nbytes / bw
        out[f"{key}_bytes"] += nbytes
    return out


def scan_traffic(w: Workload) -> float:
    """HBM bytes a scanned layer stack adds to one device's step: the backward copies each
    layer's saved activations out of the scan's stacked buffers (a read and a write). Saved
    per token: under remat ``none`` the residual stream twice, the two norms' outputs, q, k, v,
    the attention output and the MLP's hidden activations; ``full`` the layer's input;
    ``keep_attention`` the input, the attention output and its fp32 log-sum-exp per head;
    ``dots`` the input and the matmul outputs."""
    m = w.model
    a = 2 if w.precision == "bf16" else 4
    r = 4 if m.residual_dtype == "fp32" else a
    D, E, tp = m.d_model, head_dim_of(m), w.tp
    qkv, F = (m.n_heads + 2 * m.n_kv_heads) / tp * E, m.d_ff / tp
    ups = 2 if m.mlp == "swiglu" else 1
    saved = {"none": 2 * r * D + 2 * a * D + a * qkv + a * D + (ups + 1) * a * F,
             "full": r * D, "keep_attention": r * D + a * D + 4 * m.n_heads / tp,
             "dots": r * D + a * qkv + a * D + ups * a * F}[w.remat]
    return 2 * saved * m.n_layers * w.tokens * w.micro_steps


def step_time(w: Workload, cost: Cost, peak_tflops: float, hbm_bytes_per_s: float,
              link_bytes_per_s: float, collectives: list[dict]) -> dict[str, Any]:
    """One device's step: the parts (seconds) and their sum under the overlap assumption."""
    peak = peak_tflops * 1e12 * cost.clock_scale
    hbm = hbm_bytes_per_s * cost.hbm_efficiency
    fused = fused_attention(w)
    mm = matmul_time(w, peak, hbm, cost, fused)
    attention = 0.0
    if fused:
        # The tensor group shares its rows and splits their heads: a device runs 1/tp of the
        # heads of every row it holds (w.tokens: the group's rows).
        per_token = attention_flops(w.model, w.seq_len, is_causal(w.model)) / w.tp
        fwd = w.model.n_layers * per_token * w.tokens * w.micro_steps
        recompute = fwd if w.remat in ("full", "dots") else 0.0
        attention = (3.5 * fwd + recompute) / (peak * cost.attention_efficiency)
    eb = elementwise_bytes(w, fused)
    elementwise = cost.elementwise_share * sum(eb.values()) / hbm
    if cost.scan_copies and w.model.scan_layers:  # copies: nothing to fuse them into
        eb["scan"] = scan_traffic(w)
        elementwise += eb["scan"] / hbm
    comm = collective_time(collectives, w, link_bytes_per_s, cost)
    if not collectives and w.cp > 1:  # no compiled step: the context axis's gathers counted
        comm["tensor_bytes"] = kv_gather_bytes(
            batch_per_replica=w.rows * w.micro_steps, seq_len=w.seq_len,
            n_kv_heads=w.model.n_kv_heads, head_dim=head_dim_of(w.model),
            n_layers=w.model.n_layers, cp=w.cp, tp=w.tp, dtype_bytes=2 if w.precision == "bf16" else 4)
        comm["tensor"] = comm["tensor_bytes"] / (link_bytes_per_s * cost.link_efficiency)
    compute = sum(mm.values()) + attention + elementwise
    step = compute + comm["tensor"] + max(0.0, comm["data"] - compute)
    return {
        "model": "accelerator cost model (dxrun/plan/cost.py)",
        "fused_attention": fused,
        "matmul_s": mm["blocks"] + mm["output_layer"], "matmul_parts_s": mm,
        "attention_s": attention + mm["attention"],
        "elementwise_s": elementwise, "elementwise_bytes": eb,
        "compute_s": compute,
        "tensor_collective_s": comm["tensor"], "data_collective_s": comm["data"],
        "collective_bytes": comm["tensor_bytes"] + comm["data_bytes"],
        "exposed_collective_s": comm["tensor"] + max(0.0, comm["data"] - compute),
        "step_time_s": step,
    }


def workload(cfg: RunConfig, plan: MeshPlan, n_params: float, params_per_device: float,
             vocab: int = 0, kernel: str | None = None) -> Workload:
    """The time model's view of a run config and its mesh plan. ``vocab``: the target's padded
    vocabulary (``autotune.fit.target_vocab``, what the memory model counts too); 0: padded as
    a GPU run pads it, whatever the CPU compile did. ``kernel``: the attention kernel of a run
    on the target (``autotune.fit.kernel_on``); None: the plan's."""
    replicas = plan.replicas
    accum = plan.grad_accum
    return Workload(
        model=cfg.model, seq_len=plan.seq_len,
        rows=plan.global_batch // replicas // accum, micro_steps=accum,
        vocab=vocab or padded_vocab(table_rows(cfg.model), plan.tp, "gpu",
                                    cfg.parallelism.vocab_align),
        tp=plan.tp, n_devices=plan.n_devices, params=n_params,
        params_per_device=params_per_device, precision=plan.precision,
        grad_reduce_dtype=plan.grad_reduce_dtype,
        updated_per_device=params_per_device / plan.dp if plan.shard_optimizer else None,
        loss_chunk=plan.loss_chunk, remat=plan.remat, cp=plan.cp,
        kernel=kernel or plan.attention)


# ------------------------------------------------------------------------------------------------
# Per-device memory of one train step on an accelerator, from the shapes (plan mode's model).
#
# XLA:CPU's temporaries describe a CPU program (bf16 through fp32 temporaries, broadcasts
# materialised), so for an accelerator target this module counts what the step keeps instead:
# the state (read from the abstract state's shardings by the caller), every layer's saved
# activations for the precision, ``model.remat`` and attention kernel (the per-layer accounting
# of Korthikanti et al. 2022, recounted for dxrun's block), one layer's backward working set,
# the logits and FSDP's gathers. Everything is per device and in bytes; the accounting, term by
# term, is in the guide (docs/guide/large-models.md, "The memory model's accounting") and is
# cross-checked against XLA:CPU's memory analysis in ``tests/test_memory_model.py``.

FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
MLP_TENSORS = {"gelu": 2, "swiglu": 3}  # s·b·f tensors the MLP keeps, see ``layer_none``
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
    mlp: str  # gelu | swiglu
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
        stream_split=plan.tp if getattr(plan, "sequence_parallel", False) else 1)


def norm_bytes(x: Shapes) -> float:
    """What one norm keeps (``dxrun.model.transformer.norm``'s custom VJP): its input (the residual
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
    core = ((FP32 + c) * x.scores + 2 * FP32 * rows if x.scores
            else FP32 * rows)  # a fused kernel: the log-sum-exp only
    if x.kernel == "blockwise":  # as a fused kernel's: the log-sum-exp only
        core = FP32 * rows
    rope = 4 * FP32 * x.s * (x.head_dim // 2) if x.rope else 0
    return {
        "norms": 2 * norm_bytes(x),
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
    ups = 2 if x.mlp == "swiglu" else 1
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
    ups = 2 if x.mlp == "swiglu" else 1
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
    its backward recomputes them, ``dxrun.model.objectives``)."""
    logit_tokens = x.b * x.loss_chunk if x.loss_chunk else x.tokens
    return norm_bytes(x) + 2 * FP32 * logit_tokens * x.vocab


def gather_bytes(x: Shapes, fsdp: int) -> float:
    """FSDP: one layer's weights gathered (in the compute dtype) for the forward and one for
    the backward pass; TP-split weights are never gathered."""
    if fsdp == 1:
        return 0.0
    ups = 2 if x.mlp == "swiglu" else 1
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


# ------------------------------------------------------------------------------------------------
# Fit and speed of one step on one target, from figures already counted (pure): the
# per-device footprint against the target's usable memory, the step time (the accelerator time
# model's, or a roofline of XLA's counts), and the settings to try when it does not fit.

@dataclass
class Footprint:
    """What one device holds and does for one train step, from the compiled executable."""

    params_bytes: float
    opt_state_bytes: float
    grads_bytes: float  # inside the temporaries: one fp32 gradient per parameter shard
    batch_bytes: float
    temp_bytes: float  # XLA's temporaries: gradients, activations, workspace
    total_bytes: float  # arguments + outputs - donated + temporaries: the device's peak need
    flops: float  # XLA's count for this device
    bytes_accessed: float
    collectives: dict[str, dict[str, float]]

    @property
    def activations_bytes(self) -> float:
        return max(0.0, self.temp_bytes - self.grads_bytes)


def estimate(fp: Footprint, target: Target, peak_tflops: float | None, model_flops: float,
             tokens: int, n_devices: int, precision: str,
             timing: dict[str, Any] | None = None,
             need_bytes: float | None = None) -> dict[str, Any]:
    """Fit and speed for one target (per device; labelled as an estimate). ``timing``: the
    accelerator time model's step (``gpu_cost.step_time``); None: the roofline of XLA's counts
    (``plan.target=cpu``). ``need_bytes``: the per-device need when it does not come from the
    compile (an accelerator target's memory model, ``dxrun.plan.cost``)."""
    share = usable_share(target)
    usable = target.memory_bytes * share.fraction
    need = fp.total_bytes if need_bytes is None else need_bytes
    out: dict[str, Any] = {
        "target": target.name,
        "memory_per_device_gb": target.memory_bytes / GB,
        "usable_per_device_gb": usable / GB,
        "usable_fraction": share.fraction,
        "usable_source": share.source,
        "needs_per_device_gb": need / GB,
        "needs_from": "XLA:CPU compile" if need_bytes is None else "memory model",
        "fits": need <= usable,
        "headroom_gb": (usable - need) / GB,
        "peak_tflops": peak_tflops,
        "precision": precision,
    }
    if not peak_tflops or not target.hbm_bytes_per_s or (timing is None and not fp.flops):
        return out  # no peak, or an accelerator footprint without XLA's counts and no timing
    if timing is not None:
        step = timing["step_time_s"]
        parts = {"compute": timing["matmul_s"] + timing["attention_s"],
                 "memory": timing["elementwise_s"], "collectives": timing["exposed_collective_s"]}
        out.update({
            "estimate": basis_text(), "timing": timing,
            "compute_s": parts["compute"], "memory_s": parts["memory"],
            "collective_s": parts["collectives"], "step_time_s": step,
            "bound": max((v, k) for k, v in parts.items())[1],
            "tokens_per_s": tokens / step,
            "mfu": model_flops / n_devices / step / (peak_tflops * 1e12),
        })
        return out
    compute = fp.flops / (peak_tflops * 1e12)
    memory = fp.bytes_accessed / target.hbm_bytes_per_s
    comm = sum(c["bytes"] for c in fp.collectives.values()) / max(target.link_bytes_per_s, 1.0)
    step = max(compute, memory) + comm
    out.update({
        "estimate": "roofline: max(compute, memory) + collectives, no overlap assumed",
        "compute_s": compute, "memory_s": memory, "collective_s": comm, "step_time_s": step,
        "bound": max((compute, "compute"), (memory, "memory"), (comm, "collectives"))[1],
        "tokens_per_s": tokens / step,
        "mfu": model_flops / n_devices / step / (peak_tflops * 1e12),
    })
    return out


def candidates(cfg: RunConfig) -> list[list[str]]:
    """Overrides to try, nearest first: recompute activations (same mesh, same batch), shard
    the weights and optimizer state over the data replicas (FSDP), accumulate gradients over
    micro-batches, then a smaller batch."""
    par = cfg.parallelism
    out: list[list[str]] = []
    remat = [] if cfg.model.remat == "full" else ["model.remat=full"]
    if remat:
        out.append(remat)
    if par.fsdp == 1 and par.dp != 1:
        fsdp = ["parallelism.dp=1", "parallelism.fsdp=-1", f"parallelism.tp={par.tp}"]
        out += [fsdp, fsdp + remat] if remat else [fsdp]
    # The same update in micro-batches (train.grad_accum), then a smaller update.
    a, per = cfg.train.grad_accum, cfg.data.per_device_batch_size
    if per is None:
        out += [[f"train.grad_accum={a * k}", *remat] for k in (2, 4, 8)]
        b = cfg.data.batch_size
        out += [[f"data.batch_size={b // k}", *remat] for k in (2, 4)]
        return out
    # The user gave the per-device batch (the global batch is refused beside it): the same
    # update is k times the micro-batches at 1/k of the per-device batch.
    out += [[f"train.grad_accum={a * k}", f"data.per_device_batch_size={per // k}", *remat]
            for k in (2, 4, 8) if per % k == 0]
    out += [[f"data.per_device_batch_size={per // k}", *remat] for k in (2, 4) if per // k]
    return out


TYPICAL_STEP = ("a typical pretraining step uses the model's full context and 0.5M-4M tokens "
                "(GPT-3 125M: 0.5M, Llama 2: 4M)")


MIN_TOKENS_PER_STEP = 65_536


def shape_warning(platform: str, seq_len: int, max_seq_len: int, tokens: int) -> str | None:
    """One line when a plan for an accelerator is for a toy shape (shorter sequences than the
    model's context, or under 64k tokens per step): its memory and speed say little about a
    real run. None when the shape is a real one, or the target is this CPU."""
    if platform == "cpu" or (seq_len >= max_seq_len and tokens >= MIN_TOKENS_PER_STEP):
        return None
    return (f"planning {tokens:,} tokens per step (data.batch_size x data.seq_len={seq_len}, "
            f"model.max_seq_len={max_seq_len}): {TYPICAL_STEP}; set data.seq_len and "
            f"data.batch_size to the run's")


@dataclass
class StepEstimate:
    """Plan mode's figures for one compiled step: footprint, the accelerator memory model's
    need (None on a CPU target), the fit-and-speed estimate, FLOPs counted from the shapes."""

    fp: Footprint
    mem: Any
    est: dict[str, Any]
    parts: dict[str, float]
    model_flops: float
    n_params: int


# ------------------------------------------------------------------------------------------------
# What plan mode says beside its figures (pure: values in, lines out): the model's shape, the
# throughput per device, what a preset's name becomes on another device count, and the warnings:
# a plan that does not fit, a setting the user probably meant that is missing, optimizer state
# that ZeRO-1 was asked to split and did not, collectives the step does not hide.

EXPOSED_SHARE = 0.10  # exposed collectives above this share of the step: a warning
UNSPLIT_SHARE = 0.10  # ZeRO-1: optimizer state left whole above this share of it: a warning
AXIS_WORDS = {a.key: a.mesh for a in AXES}  # dp: data, ..., tp: tensor


def shape_line(model: Any, n_params: int) -> str:
    """The model row: what a missing key would have changed is visible at a glance."""
    m = model
    kv = (f"{m.n_kv_heads} kv heads" if m.n_kv_heads == m.n_heads
          else f"{m.n_kv_heads} kv heads (grouped-query)")
    moe, active = getattr(m, "moe", None), active_params(m, n_params)
    experts = (f", {sum(moe_layers(m.n_layers, moe))} MoE layers of {moe.n_experts} experts "
               f"(d_ff {expert_d_ff(m)}, top {moe.top_k})" if active != n_params else "")
    return (f"{m.name}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads / {kv} "
            f"of {head_dim_of(m)}, d_ff {m.d_ff} ({m.mlp}){experts}, vocab {m.vocab_size:,}, "
            f"{n_params:,} parameters" + (f", {active:,} active" if active != n_params else ""))


def tflops_per_device(model_flops: float, n_devices: int, step_s: float | None) -> float | None:
    """Model FLOPs per device over the estimated step, in TFLOP/s (None: no estimate)."""
    return model_flops / n_devices / step_s / 1e12 if step_s else None


def preset_note(name: str, shape: tuple[int, ...]) -> str | None:
    """A preset named for its 8-device layout (``dp4_tp2``) on another device count: what it
    lays out there (``data 48 x tensor 2``). None when the name is the mesh, or no layout."""
    token = rf"(?:{'|'.join(AXIS_WORDS)})\d+"
    if re.fullmatch(rf"{token}(?:_{token})*", name or "") is None:
        return None
    named = dict.fromkeys(AXIS_WORDS, 1)
    for part in name.split("_"):
        axis, size = re.fullmatch(rf"({'|'.join(AXIS_WORDS)})(\d+)", part).groups()
        named[axis] = int(size)
    have = dict(zip(AXIS_WORDS, shape, strict=True))
    if have == named:
        return None
    n, was = math.prod(shape), math.prod(named.values())
    mesh = " x ".join(f"{AXIS_WORDS[k]} {v}" for k, v in have.items() if v > 1) or "data 1"
    return f"parallelism={name} names a layout of {was} devices; on {n} it is {mesh}"


def kv_heads_warning(model: Any) -> str | None:
    """``model.n_heads`` changed from the preset's while ``model.n_kv_heads`` kept the preset's
    value below it: grouped-query attention the user probably did not ask for."""
    if model.n_kv_heads >= model.n_heads:
        return None
    changed = {c.partition("=")[0] for c in model_changes(model, model.name)}
    if "n_heads" not in changed or "n_kv_heads" in changed:
        return None
    return (f"model.n_heads={model.n_heads} was set but model.n_kv_heads stayed at the "
            f"{model.name} preset's {model.n_kv_heads}: this plans grouped-query attention "
            f"({model.n_heads} query heads sharing {model.n_kv_heads} kv heads); set "
            f"model.n_kv_heads={model.n_heads} for multi-head attention")


def fit_warning(est: dict[str, Any], suggestion: str | None) -> str | None:
    if est["fits"]:
        return None
    fix = f"; {suggestion}" if suggestion else ""
    return (f"the plan does not fit {est['target']}: it needs "
            f"{gb_text(est['needs_per_device_gb'] * GB)} per device of "
            f"{gb_text(est['usable_per_device_gb'] * GB)} usable{fix}")


def unsplit_warning(zero: bool, opt_bytes: float, unsplit_bytes: float, dp: int) -> str | None:
    """ZeRO-1 on, and more than ``UNSPLIT_SHARE`` of each device's optimizer state is held
    whole by every data replica."""
    if not zero or not opt_bytes or unsplit_bytes <= UNSPLIT_SHARE * opt_bytes:
        return None
    return (f"parallelism.shard_optimizer is on but {gb_text(unsplit_bytes)} of the "
            f"{gb_text(opt_bytes)} optimizer state per device is not split over the {dp} data "
            "replicas (no dimension of those tensors divides by it): each replica holds it "
            "whole; a data-parallel size that divides the model's dimensions, or FSDP "
            "(parallelism.fsdp), splits it")


def exposed_warning(est: dict[str, Any]) -> str | None:
    """The accelerator time model's exposed collectives above ``EXPOSED_SHARE`` of the step."""
    g, step = est.get("timing"), est.get("step_time_s")
    if not g or not step or g["exposed_collective_s"] <= EXPOSED_SHARE * step:
        return None
    exposed = g["exposed_collective_s"]
    parts = {"tensor-parallel (never hidden)": g["tensor_collective_s"],
             "data-parallel beyond the compute": exposed - g["tensor_collective_s"]}
    named = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in parts.items() if v > 0)
    # each part's own remedy: tensor-parallel collectives sit on the critical path whatever the
    # tokens; the data-parallel ones hide behind more compute per device
    fixes = {"tensor-parallel (never hidden)": "fewer tensor-parallel devices (parallelism.tp)",
             "data-parallel beyond the compute": "more tokens per device (data.batch_size, "
                                                 "data.seq_len)"}
    fix = " or ".join(fixes[k] for k, v in parts.items() if v > 0)
    return (f"exposed collectives take {1e3 * exposed:.1f} ms of the {1e3 * step:.1f} ms "
            f"step ({100 * exposed / step:.0f}%: {named}); {fix} hide more of them")


# ------------------------------------------------------------------------------------------------
# When a run saves: the save cadence (``checkpoint.every``, ``checkpoint.every_minutes``, or
# for null the platform's and the state's own) and what a save costs at that cadence (pure:
# values in, values out; the run plan carries the cadence decided).

MAX_CHECKPOINT_OVERHEAD = 0.02  # of the run's time: above it plan mode and the run warn


def checkpoint_interval_s(every_steps: int, every_minutes: float,
                          step_time_s: float | None) -> float | None:
    """Seconds between two saves: the step cadence at ``step_time_s`` or the wall-clock one,
    whichever comes first; None when neither is known (no cadence, or no step time)."""
    options = [60.0 * every_minutes] if every_minutes > 0 else []
    if every_steps > 0 and step_time_s:
        options.append(every_steps * step_time_s)
    return min(options) if options else None


def minutes_for_overhead(save_s: float, overhead: float = MAX_CHECKPOINT_OVERHEAD) -> int:
    """The shortest whole-minute wall-clock cadence at which a save of ``save_s`` seconds costs
    at most ``overhead`` of the run."""
    return max(1, math.ceil(save_s / overhead / 60))


CPU_EVERY_STEPS = 100  # checkpoint.every=null on CPU: a save every 100 steps
MIN_AUTO_MINUTES = 10  # the automatic wall-clock cadence is never shorter (work a crash loses)


def save_cadence(every: int | None, every_minutes: float, platform: str, state_bytes: float,
                 write_bytes_per_s: float) -> tuple[int, float]:
    """(steps, minutes) between saves, 0 = that cadence off. ``checkpoint.every`` as given,
    except null (the default): on CPU every 100 steps; on an accelerator no step cadence and a
    wall-clock one, ``checkpoint.every_minutes`` if set, else the shortest whole minute at which
    a save of the state (at ``plan.write_gb_per_s``) costs at most 2% of the run, and at least
    10 minutes. A step count cannot be right for every step time: a large state saved every
    hundred short steps makes a write-bound loop."""
    if every is not None:
        return every, every_minutes
    if platform == "cpu":
        return CPU_EVERY_STEPS, every_minutes
    if every_minutes > 0:
        return 0, every_minutes
    save_s = state_bytes / write_bytes_per_s
    return 0, float(max(MIN_AUTO_MINUTES, minutes_for_overhead(save_s)))


def cadence_text(every_steps: int, every_minutes: float) -> str:
    """``every 100 steps``, ``every 10 min``, both with ``and``, or ``never``."""
    parts = [f"every {every_steps} steps" if every_steps else "",
             f"every {every_minutes:g} min" if every_minutes else ""]
    return " and ".join(filter(None, parts)) or "never"


def checkpoint_cost(state_bytes: float, write_bytes_per_s: float, every_steps: int,
                    every_minutes: float, step_time_s: float | None) -> dict[str, Any]:
    """What a save of the whole train state costs at the assumed write bandwidth, and its
    share of the run at the configured cadence. Counted as if the whole write blocked the loop:
    Orbax's copy to host does, and the background write does too whenever the next save comes
    before it finished, so this errs high, like the roofline."""
    save_s = state_bytes / write_bytes_per_s
    interval = checkpoint_interval_s(every_steps, every_minutes, step_time_s)
    overhead = save_s / interval if interval else None
    return {
        "every_steps": every_steps, "every_minutes": every_minutes,
        "state_bytes": state_bytes, "write_bytes_per_s": write_bytes_per_s, "save_s": save_s,
        "interval_s": interval, "overhead": overhead,
        "too_costly": overhead is not None and overhead > MAX_CHECKPOINT_OVERHEAD,
        "suggest_every_minutes": minutes_for_overhead(save_s),
    }


def checkpoint_line(c: dict[str, Any]) -> str:
    """The plan table's checkpoint row: the save's cost and, when too costly, the fix."""
    every_steps, every_minutes = c["every_steps"], c["every_minutes"]
    head = (f"{gb_text(c['state_bytes'])} per save, ~{c['save_s']:.1f} s at "
            f"{c['write_bytes_per_s'] / GB:g} GB/s (plan.write_gb_per_s)")
    cadence = cadence_text(every_steps, every_minutes)
    if c["overhead"] is None:
        return f"{head}; {'no cadence (checkpoint.every=0)' if cadence == 'never' else cadence}"
    text = (f"{head}; {cadence} = a save every {c['interval_s']:.1f} s: "
            f"{100 * c['overhead']:.1f}% of the run")
    if c["too_costly"]:
        text += (f", above {100 * MAX_CHECKPOINT_OVERHEAD:.0f}%: set checkpoint.every=0 "
                 f"checkpoint.every_minutes={c['suggest_every_minutes']}")
    return text
