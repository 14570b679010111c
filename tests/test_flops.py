"""The MFU formula against XLA's own count of the compiled step, and the peak table."""

from __future__ import annotations

import jax
import pytest

from dxrun.autotune import collectives, cost_per_device
from dxrun.cost import attention_flops, block_matmul_flops, flops_per_token, matmul_params, peak_tflops
from dxrun.experiment import Experiment
from dxrun.fit import matmul_probe, measure_peak_tflops, resolve_peak


# The README's bounds, per model: XLA also counts the elementwise work (norms, softmax, GELU,
# the optimizer), a larger share of a tiny model's step (measured: tiny +4.2%, tiny_llama +3.6%,
# small +0.9%).
@pytest.mark.parametrize("model, extra, bound", [
    ("tiny", [], 0.05),
    ("tiny_llama", [], 0.04),
    ("small", ["data.seq_len=1024", "data.batch_size=1"], 0.01),
])
def test_formula_matches_compiled_flops(cfg_factory, model, extra, bound):
    cfg = cfg_factory(f"model={model}", "parallelism=dp1", "logger=none", *extra)
    exp = Experiment.build(cfg)
    # Shapes only (GPT-2 small is never materialised); the layers are scanned, so XLA's count
    # is of the unrolled 1- and 2-layer steps, extrapolated in depth (plan_mode).
    xla, _ = cost_per_device(exp)
    state = exp.abstract_state()
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    formula = flops_per_token(cfg.model, n_params, cfg.data.seq_len) * (
        cfg.data.batch_size * cfg.data.seq_len)
    print(f"{model}: formula {formula:.4g} FLOPs/step, XLA {xla:.4g} ({xla / formula - 1:+.1%})")
    assert 0 <= xla / formula - 1 < bound  # XLA counts the formula's matmuls and a little more


def test_flops_per_token_by_hand(cfg_factory):
    """6 N + 12 L D T, counted by hand (N: the matmul weights; T: the sequence length)."""
    # tiny (110,336 params, untied, learned positions): N = 110,336 - 16x64 (wte) - 128x64 (wpe)
    # = 101,120; 6 N = 606,720; attention 12 x 2 x 64 x 64 = 98,304.
    tiny = cfg_factory("model=tiny").model
    assert flops_per_token(tiny, 110_336, 64) == 705_024
    # tiny_llama (100,672, RoPE: no position table): N = 100,672 - 1,024 = 99,648.
    llama = cfg_factory("model=tiny_llama").model
    assert flops_per_token(llama, 100_672, 64) == 6 * 99_648 + 98_304 == 696_192
    # GPT-2 small (124,475,904, tied: the table is the head's matmul): N = all but wpe
    # (1024 x 768) = 123,689,472; 6 N = 742,136,832; attention 12 x 12 x 768 x 1024 = 113,246,208.
    small = cfg_factory("model=small").model
    assert flops_per_token(small, 124_475_904, 1024) == 855_383_040


def test_matmul_params_counts_tied_head_once(cfg_factory):
    small = cfg_factory("model=small").model  # tied: the table is also the output matmul
    n = 124_000_000
    assert matmul_params(small, n) == n - 1024 * 768  # only the position table drops
    tiny = cfg_factory("model=tiny").model
    assert matmul_params(tiny, 110_336) == 110_336 - 16 * 64 - 128 * 64


@pytest.mark.parametrize("kind, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989),  # SXM
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H100 NVL", "bf16", 835),
    ("NVIDIA H200", "bf16", 989),
    ("NVIDIA H200 NVL", "bf16", 835),
    ("NVIDIA GH200 480GB", "bf16", 989),
    ("NVIDIA H800", "bf16", 989),
    ("NVIDIA H20", "bf16", 148),
    ("NVIDIA B200", "bf16", 2250),
    ("NVIDIA B200", "fp32", 1100),
    ("NVIDIA GB200", "bf16", 2500),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "bf16", 312),
    ("NVIDIA A100-SXM4-40GB", "fp32", 156),
    ("nvidia a100 sxm4 40gb", "fp32", 156),  # the documented normalisation
    ("NVIDIA L40S", "bf16", 362),
    ("NVIDIA L40", "bf16", 181),
    ("NVIDIA L4", "bf16", 121),
    ("Tesla V100-SXM2-16GB", "bf16", 125),
    ("TPU v4", "bf16", 275),
    ("TPU v5 lite", "bf16", 197),
    ("TPU v5", "bf16", 459),
    ("TPU v5p", "bf16", 459),
    ("TPU v6 lite", "bf16", 918),
    # Unknown kinds, including near-misses a substring match would have taken.
    ("cpu", "bf16", None),
    ("NVIDIA H100", "bf16", None),
    ("NVIDIA L4000", "bf16", None),
    ("NVIDIA GeForce RTX 4090", "bf16", None),
])
def test_peak_table_matches_device_kinds_exactly(kind, precision, peak):
    assert peak_tflops(kind, precision) == peak


def test_unknown_accelerator_warns_once_a_cpu_says_nothing_and_override_wins(cfg_factory,
                                                                              caplog):
    cfg = cfg_factory()
    with caplog.at_level("WARNING", logger="dxrun"):
        # A CPU has no peak in any table: perf/mfu is simply not logged, and every CPU run
        # would print the same warning (issue 62).
        assert resolve_peak(cfg.runtime, cfg.train, "cpu") is None
        assert caplog.records == []
        assert resolve_peak(cfg.runtime, cfg.train, "NVIDIA GeForce RTX 4090") is None
    (msg,) = [r.message for r in caplog.records]
    assert "'NVIDIA GeForce RTX 4090'" in msg and "runtime.peak_tflops" in msg
    given = cfg_factory("runtime.peak_tflops=12.5")
    assert resolve_peak(given.runtime, given.train, "cpu") == 12.5
    measured = cfg_factory("runtime.peak_tflops=measure")
    assert resolve_peak(measured.runtime, measured.train, "cpu") > 0


@pytest.mark.e2e  # a training
def test_mfu_logged_when_peak_known(cfg_factory, tmp_path):
    from dxrun.train import train

    s = train(cfg_factory("logger=none", "train.steps=4", "train.log_every=2",
                          "runtime.peak_tflops=0.5"), tmp_path)
    # By hand: the default run (tiny, 110,336 params, markov 32 x 64 tokens a step, dp8) does
    # 705,024 FLOPs a token (test above) x 2,048 tokens = 1,443,889,152 FLOPs a step.
    step_s = s["perf/step_time_s"]
    assert s["perf/tokens_per_s"] == pytest.approx(2048 / step_s)
    assert s["perf/tokens_per_s_per_device"] == pytest.approx(256 / step_s)
    assert s["perf/tflops_per_device"] == pytest.approx(1_443_889_152 / step_s / 8 / 1e12)
    assert s["perf/mfu"] == pytest.approx(1_443_889_152 / step_s / 8 / 0.5e12)
    assert s["perf/compile_time_s"] > 0 and s["mem/step_bytes_per_device"] > 0
    assert "mem/peak_bytes_per_device" not in s  # CPU: the allocator keeps no statistics


def test_measured_peak_runs_the_probe_on_every_device_at_once():
    devices = jax.devices()
    compiled, x = matmul_probe(devices, n=64)
    # One 64 x 64 matrix on each of the 8 devices, each multiplied where it lives.
    assert {s.device for s in x.addressable_shards} == set(devices)
    assert {s.data.shape for s in x.addressable_shards} == {(1, 64, 64)}
    assert compiled.input_shardings[0][0].num_devices == 8
    text = compiled.as_text()
    assert "f32[1,64,64]" in text and "f32[8,64,64]" not in text
    assert collectives(text) == {}
    assert measure_peak_tflops(devices, n=64, repeats=2) > 0


def test_attention_flops_of_windowed_and_full_layers_alternating(cfg_factory):
    """model.global_every: n // every layers attend to the whole causal prefix (T (T + 1) / 2
    keys a sequence, counted as T^2 / 2), the others to the window w (T w - w^2 / 2); GeGLU's
    gate counts as SwiGLU's."""
    m = cfg_factory("model=tiny_llama", "model.n_layers=6", "model.sliding_window=16",
                    "model.global_every=3", "model.mlp=geglu").model
    T, full = 64, 2 * 2 * 64 * m.n_heads * 16  # head dim 64 / 4 heads = 16
    windowed = full * (16 / T - 16**2 / (2 * T**2))
    assert attention_flops(m, T, causal=True) == (4 * windowed + 2 * full / 2) / 6
    m.global_every = None
    assert attention_flops(m, T, causal=True) == windowed
    swiglu = cfg_factory("model=tiny_llama", "model.mlp=swiglu").model
    assert block_matmul_flops(m) == block_matmul_flops(swiglu)
