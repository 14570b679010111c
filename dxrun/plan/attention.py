"""Which kernel ``jax.nn.dot_product_attention`` runs on a platform (pure: the rule alone, read
by the run's model, the memory model and the time model alike). cuDNN's fused flash attention
never materialises the scores but exists only on NVIDIA GPUs, for fp16/bf16 inputs and some
head dims, and JAX raises rather than falls back outside those limits: so dxrun asks for it
exactly where the installed JAX's own checks accept it (``dxrun.attention_kernel``), and for
XLA everywhere else."""

from __future__ import annotations

from typing import Any

import numpy as np

CUDNN, XLA = "cudnn", "xla"
_HALF = ("float16", "bfloat16")
# cuDNN's fused flash attention is documented for Ampere (8.0) and later; earlier GPUs get XLA.
_MIN_CAPABILITY = (8, 0)


def _capability(cc: str | None) -> tuple[int, int]:
    if not cc:
        return (0, 0)
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def attention_implementation(platform: str, dtype: Any, head_dim: int,
                             compute_capability: str | None = None,
                             cudnn_version: int | None = None) -> str:
    """``"cudnn"`` where cuDNN's fused flash attention takes these inputs, else ``"xla"``.

    cuDNN: an NVIDIA GPU (platform "gpu"/"cuda") of compute capability >= 8.0 with cuDNN loaded,
    fp16 or bf16 q/k/v (``train.precision=bf16``), and a head dim that is a multiple of 8 and at
    most 256 on Hopper (9.0) and later, 128 before (JAX's limits). Compute capability 10.3 needs
    cuDNN 9.11. Everything else (fp32, CPU, TPU, ROCm, plan mode's CPU compile): XLA. The
    BTNH layout and grouped-query heads (fewer kv heads) are what the kernel takes as they are.
    """
    if platform not in ("gpu", "cuda") or cudnn_version is None:
        return XLA
    if np.dtype(dtype).name not in _HALF:
        return XLA
    cc = _capability(compute_capability)
    if cc < _MIN_CAPABILITY or (cc == (10, 3) and cudnn_version < 91100):
        return XLA
    limit = 256 if cc >= (9, 0) else 128
    if head_dim % 8 or head_dim > limit:
        return XLA
    return CUDNN
