"""Context parallelism (``parallelism.cp``): the zig-zag split, what the compiled step
communicates and holds per device, plan mode's estimate at 32k tokens, the layout search's
candidates and the refusals. The losses of every cp preset against dp1 (its attention kernel's
forward and backward with them) are in tests/test_sharding.py's mesh-equivalence test, a resume
across cp sizes in test_checkpoint.py."""

from __future__ import annotations

import numpy as np
import pytest

from dxrun.autotune import accelerator_memory, collective_list
from dxrun.autotune.footprint import _shard_bytes
from dxrun.config import AXES
from dxrun.config.errors import ConfigError
from dxrun.cost import TARGETS, candidates, meshes, usable_share
from dxrun.estimates import MemoryEstimate, estimate_memory, shapes
from dxrun.experiment import Experiment, step_bytes
from dxrun.fit import NoData
from dxrun.plan import LONG_SEQ, kv_gather_bytes, make_plan, zigzag_order


def test_the_zigzag_split_gives_every_device_the_same_causal_work():
    order = zigzag_order(16, 4)
    assert sorted(order) == list(range(16))
    assert order[:4] == (0, 1, 14, 15) and order[-4:] == (6, 7, 8, 9)  # chunks i and 2cp-1-i
    # The keys each device's queries see under the causal mask: the same on every device.
    work = [sum(p + 1 for p in order[i * 4:(i + 1) * 4]) for i in range(4)]
    assert len(set(work)) == 1
    assert zigzag_order(8, 1) == tuple(range(8))


def _compiled(cfg_factory, *overrides: str) -> tuple[Experiment, object]:
    # 24 x 40 tokens: 10-position zig-zag chunks at cp=2; 12 sequences per fsdp replica.
    exp = Experiment.build(cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8",
                                       "logger=none", "data.batch_size=24", "data.seq_len=40",
                                       "train.precision=fp32", "parallelism=fsdp2_cp2_tp2",
                                       *overrides), data=NoData())
    return exp, exp.analyse_step()  # shapes only: nothing is allocated


def _model_memory(exp: Experiment) -> MemoryEstimate:
    state = exp.abstract_state()
    x = shapes(exp.cfg.model, exp.plan, exp.attention_kernel)
    return estimate_memory(x, _shard_bytes(state.params), _shard_bytes(state.opt_state),
                              _shard_bytes(exp.abstract_batch()), exp.plan.fsdp)


def test_the_step_gathers_keys_and_values_once_a_layer_and_holds_1_over_cp(cfg_factory):
    """fsdp2_cp2_tp2 against the same fsdp x tensor mesh without the context axis (4 devices),
    at the same global batch. Communication: per layer one all-gather of K and V over each
    context pair (and its reduce-scatter backward); every other all-gather (FSDP's weights,
    the vocabulary's argmax) the mesh without cp has too, none larger; no permutes. Memory:
    XLA's temporaries per device (activations, most of them) about 1/cp of the other's, as
    plan mode's memory model says."""
    exp, compiled = _compiled(cfg_factory)
    plain_exp, plain = _compiled(cfg_factory, "parallelism.cp=1", "parallelism.n_devices=4")
    colls = collective_list(compiled.as_text(), 8)
    ids = np.arange(8).reshape(exp.plan.shape)
    cp_axis = [a.key for a in AXES].index("cp")  # the context axis's place in the mesh
    context = sorted(np.moveaxis(ids, cp_axis, -1).reshape(-1, 2).tolist())
    layers, per_replica = exp.cfg.model.n_layers, 24 // 2
    kv = 2 * per_replica * 40 * (8 // 2) * (64 // 8) * 4  # K and V of a replica's rows, fp32
    assert kv_gather_bytes(batch_per_replica=per_replica, seq_len=40, n_kv_heads=8,
                           head_dim=8, n_layers=layers, cp=2, tp=2, dtype_bytes=4) == (
        2 * layers * kv / 2)
    on_context = [(c["kind"], c["runs"], c["bytes"]) for c in colls  # (and the weights'
                  if sorted(c["groups"]) == context and c["kind"] != "all-reduce"]  # gradients)
    assert sorted(on_context) == [("all-gather", layers, kv / 2), ("reduce-scatter", layers, kv / 2)]
    assert not [c for c in colls if c["kind"] in ("collective-permute", "all-to-all")]

    def others(cs: list[dict]) -> list[tuple[int, float]]:
        return sorted((c["runs"], c["bytes"]) for c in cs if c["kind"] == "all-gather")

    rest = others([c for c in colls if sorted(c["groups"]) != context])
    without = others(collective_list(plain.as_text(), 4))
    in_loop = [x for x in rest if x[0] == layers]
    assert in_loop and in_loop == [x for x in without if x[0] == layers]  # FSDP's, per layer
    assert len(rest) == len(without)
    assert all(a <= b for (_, a), (_, b) in zip(rest, without, strict=True))

    temp = compiled.memory_analysis().temp_size_in_bytes
    assert 0.3 < temp / plain.memory_analysis().temp_size_in_bytes < 0.6  # 1/cp = 0.5
    model, plain_model = _model_memory(exp), _model_memory(plain_exp)
    assert 0.3 < model.total_bytes / plain_model.total_bytes < 0.6
    assert model.total_bytes == pytest.approx(step_bytes(compiled), rel=0.25)


def test_the_long_context_preset_fits_8_h100s_where_dp8_does_not(cfg_factory):
    """experiments/long_context_llama.yaml (Llama-2-7B shape, 32k tokens, cp2_tp4, remat=full,
    bf16) on 8 x H100 by plan mode's memory model (shapes only: no 32k compile): it fits; dp8
    at the same settings does not; and the context axis halves the activations of the same
    4-way tensor-parallel model without it."""
    h100 = TARGETS["h100"]
    usable = h100.memory_bytes * usable_share(h100).fraction

    def need(*overrides: str, devices: int = 8) -> MemoryEstimate:
        cfg = cfg_factory("experiment=long_context_llama", "logger=none", *overrides)
        exp = Experiment.build(cfg, make_plan(cfg, devices, "cpu"), data=NoData())
        return accelerator_memory(exp, h100)

    preset, dp8 = need(), need("parallelism=dp8", "train.grad_accum=1")
    assert (preset.total_bytes < usable < dp8.total_bytes), (preset.total_bytes, dp8.total_bytes)
    assert "blockwise" in preset.basis and "micro-batch 1x16384" in preset.basis
    tp4 = need("parallelism.cp=1", "parallelism.n_devices=4", devices=4)
    assert preset.activations_bytes == pytest.approx(tp4.activations_bytes / 2, rel=0.01)


def test_parallelism_auto_tries_context_layouts_for_long_sequences_only(cfg_factory):
    """The layout search's candidates (pure: the plan's checks, no compile): a context axis
    from dxrun.plan.run_plan.LONG_SEQ tokens on, where 2*cp divides the sequence."""
    assert LONG_SEQ == 8192
    assert {m["cp"] for m in meshes(8, 4096)} == {1}
    assert {m["cp"] for m in meshes(8, 8192)} == {1, 2, 4, 8}
    assert {m["cp"] for m in meshes(8, 8196)} == {1, 2}  # 8196 = 4 x 2049
    cfg = cfg_factory("parallelism=auto", "model.max_seq_len=8192", "data.seq_len=8192",
                      "data.batch_size=8")
    ok, _ = candidates(cfg, 8, "cpu")
    assert {x.mesh for x in ok} >= {"dp8", "dp2_cp4", "cp2_tp4", "fsdp2_cp2_tp2", "cp8"}
    short, _ = candidates(cfg_factory("parallelism=auto", "data.batch_size=8"), 8, "cpu")
    assert all(x.cp == 1 for x in short) and len(short) < len(ok)


def test_a_context_axis_refuses_what_it_does_not_split_in_one_line(cfg_factory):
    cfg = cfg_factory("parallelism=cp2_tp4", "model.n_heads=8", "model.n_kv_heads=8")
    with pytest.raises(ConfigError, match=r"^parallelism.cp=2 runs in one process") as err:
        make_plan(cfg, 8, "gpu", processes=2)
    chunked = cfg_factory("parallelism=cp2_tp4", "model.n_heads=8", "model.n_kv_heads=8",
                          "model.loss_chunk=8")
    with pytest.raises(ConfigError, match=r"^model.loss_chunk=8 does not run with "
                                          r"parallelism.cp=2") as err2:
        make_plan(chunked, 8)  # the plan decides the loss chunk
    assert "\n" not in str(err.value) + str(err2.value)
    assert make_plan(cfg, 8).loss_chunk == 0  # the logits are split already
    # The context kernel masks causally: masked diffusion's bidirectional attention is refused.
    mdlm = cfg_factory("parallelism=cp2_tp4", "model.n_heads=8", "model.n_kv_heads=8",
                       "model.objective=mdlm")
    with pytest.raises(ConfigError, match=r"^parallelism.cp=2 trains model.objective=ar only "
                                          r"\(its attention is causal\), not "
                                          r"model.objective=mdlm; set parallelism.cp=1$"):
        make_plan(mdlm, 8)
