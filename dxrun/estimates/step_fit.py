"""Fit and speed of one step on one target, from figures already counted (pure): the
per-device footprint against the target's usable memory, the step time (the accelerator time
model's, or a roofline of XLA's counts), and the warning a step's shape deserves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dxrun.cost import GB, Target, usable_share
from dxrun.estimates.time_model import basis_text

if TYPE_CHECKING:
    pass


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
    compile (an accelerator target's memory model, ``dxrun.estimates.memory_model``)."""
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
