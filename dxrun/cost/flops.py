"""Model FLOPs, device peaks and MFU: pure functions (no JAX import).

FLOPs per token of one training step (forward + backward = 3 x forward):

    flops/token = 6 * N + 12 * n_layers * d_model * seq_len

* ``N``: the matmul weights: all parameters but the embedding lookups (``wte``, ``wpe``); a
  tied table is also the output projection, so it is counted once, as that matmul.
* ``12 * n_layers * d_model * seq_len``: the attention scores ``Q K^T`` and the weighted sum
  ``P V``, forward and backward, over the full ``seq_len x seq_len`` score matrix the device
  computes under the causal mask (no recomputation counted).

MFU = achieved model FLOP/s per device / the device's dense peak for the run's precision.
"""

from __future__ import annotations

import re
from typing import Any

from dxrun.config import expert_d_ff, head_dim_of, moe_layers

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
    # 500 W limit is a clock, not a datasheet peak: dxrun/estimates/time_model.py's clock_scale.
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
GATED = ("swiglu", "geglu")  # the MLPs with a gate projection beside the up one


def block_matmul_flops(model: Any) -> float:
    """Forward FLOPs per token of one block's weight matmuls: q/k/v, the output projection and
    the MLP (two matmuls for GELU, three for SwiGLU)."""
    D, H, K, F = model.d_model, model.n_heads, model.n_kv_heads, active_d_ff(model)
    E = head_dim_of(model)
    qkv = 2 * D * (H + 2 * K) * E
    out = 2 * H * E * D
    mlp = 2 * D * F * (3 if model.mlp in GATED else 2)
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
        windowed = full * (w / seq_len - w * w / (2 * seq_len**2))
        every = getattr(model, "global_every", None)
        if every is None:
            return windowed
        # model.global_every: n // every layers attend to the whole causal prefix
        n = model.n_layers
        return ((n - n // every) * windowed + (n // every) * full / 2) / n
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
