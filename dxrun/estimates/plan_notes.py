"""What plan mode says beside its figures (pure: values in, lines out): the model's shape, the
throughput per device, what a preset's name becomes on another device count, and the warnings:
a plan that does not fit, a setting the user probably meant that is missing, optimizer state
that ZeRO-1 was asked to split and did not, collectives the step does not hide.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dxrun.config import AXES, expert_d_ff, head_dim_of, moe_layers
from dxrun.config.registry import model_changes
from dxrun.cost import GB, active_params, gb_text

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
