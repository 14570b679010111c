"""Gradient numerics and communication under bf16 compute, read from the HLO right after XLA's
SPMD partitioner (where the collectives are inserted, in the dtypes a GPU communicates them in;
XLA:CPU widens bf16 all-reduces to f32 only afterwards)."""

from __future__ import annotations

import math
import re

import jax

from dxrun.autotune import collective_lines, dots, instances, partitioned
from dxrun.experiment import Experiment
from dxrun.model.sharding import in_mesh_context


def _partitioned_step(cfg_factory, *overrides: str) -> str:
    exp = Experiment.build(cfg_factory("model=tiny", "model.d_model=32", "logger=none",
                                       "data.seq_len=16", *overrides))
    with in_mesh_context(exp.mesh, exp.plan.rules):
        lowered = exp.step.jitted.lower(exp.abstract_state(), exp.abstract_batch())
    return partitioned(lowered)


def _reduced(text: str) -> dict[str, set[str]]:
    """Result shape -> dtypes of the all-reduces of that shape."""
    out: dict[str, set[str]] = {}
    for line in collective_lines(text, "all-reduce"):
        dtype, shape = re.search(r"=\s*(\w+)\[([\d,]*)\]", line).groups()
        out.setdefault(shape, set()).add(dtype)
    return out


def test_gradients_all_reduced_in_fp32_and_head_backward_in_bf16(cfg_factory):
    """train.precision=bf16 on dp8: by default (train.grad_reduce_dtype=fp32) every all-reduce,
    each weight gradient's included, is f32; with grad_reduce_dtype=bf16 the block weights'
    gradients are all-reduced in bf16 (half the traffic). Either way the LM head's backward
    matmuls take bf16 operands and accumulate in f32 (its incoming gradient is the fp32
    logits')."""
    D, F = 32, 256  # model.d_model, tiny's d_ff: w_up is D x F, w_down F x D
    for reduce in ("fp32", "bf16"):
        text = _partitioned_step(cfg_factory, "parallelism=dp8", "train.precision=bf16",
                                 f"train.grad_reduce_dtype={reduce}")
        reduced = _reduced(text)
        if reduce == "fp32":
            assert set().union(*reduced.values()) == {"f32"}, reduced
        else:
            assert reduced[f"{D},{F}"] == reduced[f"{F},{D}"] == {"bf16"}, reduced
        head_bwd = [d for d in dots(text) if d[0].endswith(("(blv,dv->bld))/dot_general",
                                                             "(bld,blv->dv))/dot_general"))]
        assert len(head_bwd) == 2, dots(text)
        assert all(out == "f32" and ops == ("bf16", "bf16") for _, out, ops in head_bwd), head_bwd


def test_accumulated_gradients_reduced_over_data_once(cfg_factory):
    """train.grad_accum=2 on dp4_tp2: no all-reduce over the 4 data replicas inside any loop
    (the micro-batch scan, the layer scan); after the loop one reduction of exactly one
    gradient's bytes per device (and the loss and accuracy). The tensor-parallel activation
    all-reduces (groups of 2) stay inside, as they must. Equal updates to grad_accum=1:
    tests/test_model.py."""
    exp = Experiment.build(cfg_factory("model=tiny", "model.d_model=32", "logger=none",
                                       "data.seq_len=16", "parallelism=dp4_tp2",
                                       "train.grad_accum=2",
                                       # the whole gradient reduced (ZeRO-1's split update:
                                       # tests/test_shard_optimizer.py)
                                       "parallelism.shard_optimizer=false"))
    found = instances(exp.analyse_step().as_text(), "all-reduce", 8)  # never run
    over_data = [(runs, size) for runs, group, size in found if group == 4]
    assert {runs for runs, _ in over_data} == {1}, found
    assert any(runs > 1 and group == 2 for runs, group, _ in found), found
    state = exp.abstract_state()
    grad_bytes = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
                     for s in jax.tree.leaves(state.params))
    assert sum(size for _, size in over_data) == grad_bytes + 2 * 4  # + loss, accuracy sums
