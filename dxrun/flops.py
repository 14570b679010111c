"""Model FLOPs, device peaks and MFU: pure functions (no JAX import), except the CPU probe.

FLOPs per token of one training step (forward + backward = 3 x forward):

    flops/token = 6 * N + 12 * n_layers * d_model * seq_len

* ``N``: the parameters that are matmul weights: all parameters but the embedding lookups
  (``wte``, ``wpe``); with tied embeddings the table is also the output projection, so it is
  counted once, as that matmul.
* ``12 * n_layers * d_model * seq_len``: the attention scores ``Q K^T`` and the weighted sum
  ``P V``, 2 FLOPs per multiply-add, each ``seq_len x d_model`` per token per layer, forward
  and backward. The causal mask is applied to a full ``seq_len x seq_len`` score matrix, which
  is the work the device does, so it is counted in full and once (no recomputation counted).

MFU = achieved model FLOP/s per device / the device's dense peak for the run's precision.
"""

from __future__ import annotations

from typing import Any

# Dense (no sparsity) peak TFLOP/s per device: (bf16, fp32). The fp32 column is the TF32 tensor
# core peak on NVIDIA GPUs, which is what XLA uses for fp32 matmuls by default there.
# Sources: NVIDIA H100/H200/A100/L4/L40S/V100 datasheets, Google Cloud TPU system docs.
PEAK_TFLOPS: list[tuple[str, tuple[float, float]]] = [
    ("GH200", (989.0, 494.0)),
    ("H200", (989.0, 494.0)),
    ("H100 PCIe", (756.0, 378.0)),
    ("H100", (989.0, 494.0)),  # SXM
    ("A100", (312.0, 156.0)),
    ("L40S", (362.0, 183.0)),
    ("L4", (121.0, 60.0)),
    ("V100", (125.0, 15.7)),  # fp16 tensor cores; no bf16
    ("TPU v6 lite", (918.0, 918.0)),
    ("TPU v5 lite", (197.0, 197.0)),
    ("TPU v5", (459.0, 459.0)),
    ("TPU v4", (275.0, 275.0)),
]


def peak_tflops(device_kind: str, precision: str) -> float | None:
    """The table's peak for ``device_kind`` (first matching name), or None if unknown."""
    for name, (bf16, fp32) in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return bf16 if precision == "bf16" else fp32
    return None


def matmul_params(model: Any, n_params: int) -> int:
    embed = model.vocab_size * model.d_model
    pos = model.max_seq_len * model.d_model if model.pos == "learned" else 0
    head = embed if model.tie_embeddings else 0
    return n_params - embed - pos + head


def flops_per_token(model: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (see the module docstring for the formula)."""
    attention = 12 * model.n_layers * model.d_model * seq_len
    return 6.0 * matmul_params(model, n_params) + attention


def mfu(tflops_per_device: float, peak: float) -> float:
    return tflops_per_device / peak


def measure_peak_tflops(n: int = 1024, repeats: int = 10) -> float:
    """Achieved TFLOP/s of one device on a square fp32 matmul: a stand-in peak for CPUs."""
    import time

    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12
