"""Which kernel ``jax.nn.dot_product_attention`` runs (``model.attention=dot_product``).

JAX 0.10.2's default (``implementation=None``) is always XLA's: scores ``[B, H, L, L]`` built in
full and the probabilities kept for the backward pass. cuDNN's fused flash attention never
materialises them (O(L) activation memory, one kernel per direction), but it exists only on
NVIDIA GPUs, only for fp16/bf16 inputs and only for some head dims, and JAX raises rather than
falls back when asked for it outside those limits. So dxrun asks for it explicitly exactly where
the installed JAX's own checks (``jax/_src/cudnn/fused_attention_stablehlo.py``:
``check_layout``, ``check_is_flash_attention``) accept it, and for XLA everywhere else.

The device comes from the mesh the step is built for (``Experiment.build``), never from the
default backend: plan mode compiles on CPU devices for a GPU target, and must lower there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

CUDNN, XLA = "cudnn", "xla"
_HALF = ("float16", "bfloat16")
# cuDNN's fused flash attention is documented for Ampere (8.0) and later; earlier GPUs get XLA.
_MIN_CAPABILITY = (8, 0)


class AttentionTarget(NamedTuple):
    """What the selection needs to know of the devices the model runs on (hashable: it is a
    static attribute of the module, part of its graph definition)."""

    platform: str = "cpu"  # jax Device.platform: "cpu", "gpu" (CUDA), "rocm", "tpu"
    compute_capability: str | None = None  # "9.0" on an H100/H200; NVIDIA GPUs only
    cudnn_version: int | None = None  # e.g. 91000 for 9.10; None: JAX found no cuDNN


CPU_TARGET = AttentionTarget()  # what a model built without a mesh runs on (tests, tools)


def attention_target(device: Any) -> AttentionTarget:
    """The target of ``device`` (one of the mesh's): its platform, and on an NVIDIA GPU its
    compute capability and the cuDNN version JAX loaded."""
    platform = device.platform
    if platform not in ("gpu", "cuda"):
        return AttentionTarget(platform)
    # JAX's own record of the loaded cuDNN, as its fused-attention checks read it.
    from jax._src.lib import cuda_versions

    version = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    return AttentionTarget(platform, getattr(device, "compute_capability", None), version)


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
