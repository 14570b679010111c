"""The devices an attention kernel is chosen for (``model.attention=dot_product``): the rule,
``dxrun.plan.attention.attention_implementation``, takes their platform, compute capability and
cuDNN version from here.

JAX 0.10.2's default (``implementation=None``) is always XLA's: scores ``[B, H, L, L]`` built in
full and the probabilities kept for the backward pass. cuDNN's fused flash attention never
materialises them, but JAX raises rather than falls back outside its limits, so dxrun asks for
it explicitly exactly where the installed JAX's own checks
(``jax/_src/cudnn/fused_attention_stablehlo.py``: ``check_layout``,
``check_is_flash_attention``) accept it, and for XLA everywhere else.

The device comes from the mesh the step is built for (``Experiment.build``), never from the
default backend: plan mode compiles on CPU devices for a GPU target, and must lower there.
"""

from __future__ import annotations

from typing import Any, NamedTuple


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

