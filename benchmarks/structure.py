"""The structural figures, exact rather than timed (the tests assert them): the collectives of
one layer in the compiled step against the minimum of its layout, and the train state's bytes
per device against total / k.

Per layer means one iteration of the layer scan's forward and backward loops (XLA keeps them
as while loops with a known trip count of ``n_layers``); what runs once per step (embedding,
loss, the norms of the metrics) is reported beside it, not counted against the minimum.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from benchmarks.report import Figure, figure
from dxrun.autotune import collective_traffic, per_iteration
from dxrun.experiment import Experiment

COLLECTIVE_LAYOUTS = ("dp8", "dp4_tp2", "fsdp8")
STATE_LAYOUTS = ("tp2", "tp4", "dp4_tp2", "fsdp8")
TOLERANCE = 1.01  # bytes within 1% of the minimum (bookkeeping scalars ride along)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * jax.numpy.dtype(dtype).itemsize


def layer_params(exp: Experiment) -> dict[str, float]:
    """One layer's parameters: bytes per device, bytes of the weights split over ``fsdp``
    (whole) and of those every device holds whole, and how many weights are split."""
    leaves = jax.tree.leaves(exp.abstract_state().params["blocks"])
    n = exp.cfg.model.n_layers
    split = [x for x in leaves if x.sharding.spec and "fsdp" in jax.tree.leaves(
        tuple(x.sharding.spec))]
    whole = [x for x in leaves if x.sharding.shard_shape(x.shape) == x.shape]
    return {"per_device": sum(_nbytes(x.sharding.shard_shape(x.shape), x.dtype)
                              for x in leaves) / n,
            "fsdp_split": sum(_nbytes(x.shape, x.dtype) for x in split) / n,
            "replicated": sum(_nbytes(x.shape, x.dtype) for x in whole) / n,
            "n_split": len(split)}


def minimum_per_layer(dp: int, fsdp: int, tp: int, activation: float,
                      params: dict[str, float]) -> dict[tuple[str, int], dict[str, float]]:
    """The fewest collectives one layer needs, by (kind, devices in a group), with the bytes
    each device sends (ring algorithms, as ``fit._sent``): Megatron's two activation
    all-reduces forward and two backward under tp; under fsdp each split weight gathered for
    the forward and again for the backward, its gradient reduce-scattered, and one all-reduce
    of the gradients every device holds whole (norms, biases); one gradient all-reduce over
    the data replicas."""
    ring = lambda n: (n - 1) / n  # noqa: E731
    out: dict[tuple[str, int], dict[str, float]] = {}
    if tp > 1:
        out[("all-reduce", tp)] = {"count": 4, "bytes": 4 * 2 * ring(tp) * activation}
    if fsdp > 1:
        w, k = params["fsdp_split"], params["n_split"]
        out[("all-gather", fsdp)] = {"count": 2 * k, "bytes": 2 * ring(fsdp) * w}
        out[("reduce-scatter", fsdp)] = {"count": k, "bytes": ring(fsdp) * w}
        out[("all-reduce", fsdp)] = {"count": 1, "bytes": 2 * ring(fsdp) * params["replicated"]}
    if dp > 1:
        out[("all-reduce", dp)] = {"count": 1, "bytes": 2 * ring(dp) * params["per_device"]}
    return out


def _fmt(c: dict) -> dict[str, str]:
    return {f"{kind}/{n}": f"{int(v['count'])}x {v['bytes'] / 1e6:.3f} MB"
            for (kind, n), v in sorted(c.items())}


def collectives(exp: Experiment) -> Figure:
    """Measured collectives per layer of ``exp``'s compiled step against the minimum."""
    text = exp.analyse_step().as_text()  # never run: its HLO only
    plan, cfg = exp.plan, exp.cfg
    n = plan.n_devices
    measured = per_iteration(text, cfg.model.n_layers, n)
    activation = (plan.global_batch // (plan.dp * plan.fsdp) * plan.seq_len
                  * cfg.model.d_model * 4)  # fp32: XLA:CPU reduces bf16 in fp32 as well
    minimum = minimum_per_layer(plan.dp, plan.fsdp, plan.tp, activation, layer_params(exp))
    got = sum(v["bytes"] for v in measured.values())
    least = sum(v["bytes"] for v in minimum.values())
    # XLA may combine collectives into one op: fewer than the minimum is fine, more is not.
    counts_ok = all(k in minimum and v["count"] <= minimum[k]["count"]
                    for k, v in measured.items())
    ratio = got / least
    once = {k: v["count"] for k, v in collective_traffic(text, n).items()}
    missing = sorted(set(minimum) - set(measured))
    note = ("at the minimum" if counts_ok and ratio <= TOLERANCE else
            "not at the minimum: " + ", ".join(
                [f"no {k}/{g}" for k, g in missing] +
                [f"{k}/{g} {measured[(k, g)]['count']}x vs {minimum[(k, g)]['count']}x"
                 for k, g in sorted(set(measured) & set(minimum))
                 if measured[(k, g)]["count"] > minimum[(k, g)]["count"]] +
                [f"unexpected {k}/{g}" for k, g in sorted(set(measured) - set(minimum))]))
    f = figure("Collectives per layer vs the minimum", f"{exp.cfg.parallelism.name}: "
               "bytes sent per layer / minimum", ratio,
               {"measured": _fmt(measured), "minimum": _fmt(minimum),
                "whole step (counts)": once}, f"<= {TOLERANCE}", note=note)
    f.met = bool(f.met and counts_ok)
    return f


def state_bytes(exp: Experiment) -> Figure:
    """The train state's (parameters + optimizer state) bytes on the fullest device against
    total / k, k = tp x fsdp (the ways each replica is split)."""
    leaves = jax.tree.leaves(exp.abstract_state())
    total = sum(_nbytes(x.shape, x.dtype) for x in leaves)
    per_device = sum(_nbytes(x.sharding.shard_shape(x.shape), x.dtype) for x in leaves)
    whole = sum(_nbytes(x.shape, x.dtype) for x in leaves
                if x.sharding.shard_shape(x.shape) == x.shape)
    k = exp.plan.tp * exp.plan.fsdp
    return figure("State bytes per device vs total / k", f"{exp.cfg.parallelism.name}: "
                  f"per device / (total / {k})", per_device / (total / k),
                  {"per_device_MB": round(per_device / 1e6, 3), "total_MB": round(total / 1e6, 3),
                   "replicated_MB": round(whole / 1e6, 3)}, "<= 1.03",
                  note=f"replicated on every device: {100 * whole / total:.2f}% of the state "
                       "(tp: positions, norms, row biases; fsdp: norms, biases): the ratio is "
                       "1 + (k-1) x that")


def optimizer_bytes(zero: Experiment, one: Experiment) -> Figure:
    """ZeRO-1 (``parallelism.shard_optimizer``, on by default for dp8): the optimizer state's
    bytes on the fullest device of ``zero``'s mesh against one device's whole state (``one``,
    dp1), goal 1/dp x 1.03 (what the data axis cannot split stays whole)."""
    def fullest(exp: Experiment) -> int:
        return sum(_nbytes(x.sharding.shard_shape(x.shape), x.dtype)
                   for x in jax.tree.leaves(exp.abstract_state().opt_state))

    dp = zero.plan.dp
    per_device, whole = fullest(zero), fullest(one)
    return figure("Optimizer state per device over the data replicas (ZeRO-1)",
                  f"{zero.cfg.parallelism.name} / {one.cfg.parallelism.name}: optimizer bytes "
                  "per device", per_device / whole,
                  {"per_device_MB": round(per_device / 1e6, 3), "dp1_MB": round(whole / 1e6, 3)},
                  f"<= {1.03 / dp:.4f}",
                  note="parallelism.shard_optimizer: each moment split over `data` along one "
                       "axis dp divides; the rest (counters) stays whole")
