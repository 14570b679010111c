"""A compiled step's footprint and estimate: XLA's memory and cost analyses, and the memory and time
models for an accelerator target, with the kernel and the vocabulary's rows a run there would have.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import jax
from omegaconf import OmegaConf

from dxrun.autotune.hlo import collective_list, collective_traffic
from dxrun.cost import TARGETS, Target, flops_per_token, plan_platform, step_flops, target_key
from dxrun.estimates import (
    COST,
    Footprint,
    StepEstimate,
    estimate,
    estimate_memory,
    shapes,
    step_time,
    workload,
)
from dxrun.experiment import (
    Experiment,
    step_bytes,
)
from dxrun.fit import NoData
from dxrun.plan import (
    AttentionTarget,
    MeshPlan,
    kind_target,
    make_plan,
    padded_vocab,
    table_rows,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig


def _shard_bytes(tree: Any) -> float:
    total = 0.0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += x.dtype.itemsize * float(math.prod(shape))
    return total


def footprint(exp: Any, compiled: Any, xla_cost: bool = True) -> Footprint:
    """``xla_cost=False``: skip XLA's FLOPs and bytes (two more compiles of a scanned model;
    an accelerator target's time model counts its own from the shapes): reported as 0."""
    state, batch = exp.abstract_state(), exp.abstract_batch()
    m = compiled.memory_analysis()
    params = _shard_bytes(state.params)
    flops, bytes_accessed = cost_per_device(exp) if xla_cost else (0.0, 0.0)
    return Footprint(
        params_bytes=params,
        opt_state_bytes=_shard_bytes(state.opt_state),
        grads_bytes=params,
        batch_bytes=_shard_bytes(batch),
        temp_bytes=float(m.temp_size_in_bytes),
        total_bytes=step_bytes(compiled),
        flops=flops,
        bytes_accessed=bytes_accessed,
        collectives=collective_traffic(compiled.as_text(), exp.plan.n_devices),
    )


def target_vocab(cfg: RunConfig, plan: MeshPlan, target: Target) -> int:
    """The rows the vocabulary tables of ``cfg``'s model have in a run on ``target``
    (128-aligned on a GPU or TPU; the plan's own padding is for the devices it was made on:
    this CPU in plan mode), unless ``parallelism.vocab_align`` names another alignment."""
    platform = plan_platform(target_key(target), plan.platform)
    return padded_vocab(table_rows(cfg.model), plan.tp, platform, cfg.parallelism.vocab_align)


def target_plan(cfg: RunConfig, plan: MeshPlan, *, device: AttentionTarget | None = None,
                vocab: int | None = None) -> MeshPlan:
    """``plan`` made again by ``make_plan`` (every decision taken from the final inputs), its
    layout, batch, sequence length and ZeRO-1 kept, for ``device``'s attention facts or with
    ``vocab`` rows (a target's, ``target_vocab``)."""
    return make_plan(cfg, plan.n_visible, plan.platform, plan.processes,
                     plan.process_hosts or None, device or plan.attention_device,
                     layout=plan.layout, batch=plan.global_batch, seq_len=plan.seq_len,
                     vocab=vocab, zero=plan.shard_optimizer)


def kernel_on(cfg: RunConfig, plan: MeshPlan, device_kind: str) -> str:
    """The kernel a run of ``cfg`` laid out as ``plan`` runs on ``device_kind``: the plan's own
    choice where the plan was made for that device's platform, else that of the plan made for
    it (plan mode's and the layout search's estimates of another target)."""
    device = kind_target(device_kind)
    if device.platform == plan.attention_device.platform:
        return plan.attention
    return target_plan(cfg, plan, device=device).attention


def accelerator_memory(exp: Any, target: Target) -> Any:
    """The memory model's per-device estimate (``dxrun.cost``) of ``exp``'s step on
    ``target``: the state's shards read from the abstract state's shardings (of the model
    with the target's vocabulary padding), activations from the shapes, with the attention
    kernel a run on that target would use."""
    cfg, plan = exp.cfg, exp.plan
    vocab = target_vocab(cfg, plan, target)
    if vocab != exp.padded_vocab:  # shapes only: the same model with the target's rows
        exp = Experiment.build(cfg, target_plan(cfg, plan, vocab=vocab), data=NoData())
    state = exp.abstract_state()
    kernel = kernel_on(cfg, plan, target.device_kind)
    zero_dp = plan.dp if plan.shard_optimizer else 1
    mem = estimate_memory(
        shapes(cfg.model, plan, kernel, vocab),
        _shard_bytes(state.params), _shard_bytes(state.opt_state),
        _shard_bytes(exp.abstract_batch()), plan.fsdp, zero_dp)
    return replace(mem, padded_vocab=vocab)


def _cost(compiled: Any) -> tuple[float, float]:
    analysis = compiled.cost_analysis() or {}
    if isinstance(analysis, list):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0))


def cost_per_device(exp: Any) -> tuple[float, float]:
    """FLOPs and bytes accessed per device for one step. XLA's cost analysis counts a loop body
    once, so a scanned model is measured as the unrolled 1- and 2-layer steps of the same
    config and extrapolated in depth (every layer is the same): cost(n) = c1 + (n-1)(c2 - c1)."""
    cfg = exp.cfg
    if not cfg.model.scan_layers or cfg.model._target_:  # a user model: its own layers
        return _cost(exp.compile_step())
    costs = []
    for n in (1, 2):
        small = OmegaConf.merge(cfg, {"model": {"n_layers": n, "scan_layers": False}})
        costs.append(_cost(Experiment.build(small, exp.plan, data=NoData()).analyse_step()))
    (f1, b1), (f2, b2) = costs
    n = cfg.model.n_layers
    return f1 + (n - 1) * (f2 - f1), b1 + (n - 1) * (b2 - b1)

def step_estimate(cfg: RunConfig, exp: Any, compiled: Any, target: Target,
                  peak: float | None, xla_cost: bool = True) -> StepEstimate:
    """Fit and speed of ``exp``'s compiled step on ``target`` (plan mode, and the layout
    search's ranking): the accelerator time model on a GPU/TPU target, else the roofline of
    XLA's counts. ``xla_cost=False`` (the layout search: one compile per candidate, not three):
    on a CPU target the FLOPs are counted from the shapes and the bytes are the compile's own
    count (a scanned layer loop counted once)."""
    key = target_key(target)
    # A user model (model._target_): XLA's counts of its compile; the memory and time models
    # know dxrun's own block only.
    own = not cfg.model._target_
    accelerator = key in COST and own
    fp = footprint(exp, compiled, xla_cost=xla_cost and not accelerator)
    state = exp.abstract_state()
    n_params = exp.count_params(state.params)  # the real vocabulary, without padding
    plan = exp.plan  # the layout, batch and sequence length: the run plan's, not the config's
    tokens = plan.global_batch * plan.seq_len
    model_flops = flops_per_token(cfg.model, n_params, plan.seq_len) * tokens
    timing = None
    if accelerator and peak:
        w = workload(cfg, exp.plan, n_params, fp.params_bytes / 4,
                              target_vocab(cfg, plan, target),
                              kernel_on(cfg, plan, target.device_kind))
        t = TARGETS[key]
        timing = step_time(w, COST[key], peak, t.hbm_bytes_per_s,
                                    t.link_bytes_per_s,
                                    collective_list(compiled.as_text(), exp.plan.n_devices))
        parts = step_flops(cfg.model, tokens, plan.seq_len, w.vocab, plan.remat,
                                 timing["fused_attention"])
    else:
        parts = step_flops(cfg.model, tokens, plan.seq_len, plan.padded_vocab,
                                 plan.remat)
        if cfg.model._target_:  # a user model: no block of dxrun's to count by parts
            parts = {"model": model_flops, "hardware": model_flops}
        if not xla_cost:
            # The bytes: the compile's own count (free). A scanned model's layer loop is
            # counted once, on every candidate alike: a ranking of layouts more than a time
            # (on simulated devices the bytes decide it).
            fp = replace(fp, flops=parts["hardware"] / exp.plan.n_devices,
                         bytes_accessed=_cost(compiled)[1])
    # An accelerator's need comes from the memory model: XLA:CPU's temporaries describe a CPU
    # program (bf16 through fp32 temporaries); the compile's figure is kept beside it.
    mem = accelerator_memory(exp, target) if target.device_kind != "cpu" and own else None
    est = estimate(fp, target, peak, model_flops, tokens, exp.plan.n_devices,
                   plan.precision, timing, None if mem is None else mem.total_bytes)
    if mem is not None:  # plan.json: the rows a run there has, beside the plan's (this CPU's)
        est["padded_vocab"] = mem.padded_vocab
    return StepEstimate(fp, mem, est, parts, model_flops, n_params)
