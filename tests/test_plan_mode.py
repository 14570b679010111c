"""Plan mode and the memory preflight: XLA's own numbers for the compiled step, read right."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import run_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.autotune import collective_traffic, footprint, plan_report, plan_table
from dxrun.cost import (
    GB,
    TARGETS,
    TPU_USABLE,
    USABLE_CPU,
    Target,
    cadence_text,
    checkpoint_cost,
    checkpoint_line,
    save_cadence,
    usable_bytes,
    usable_share,
)
from dxrun.estimates import Footprint, estimate
from dxrun.experiment import Experiment, step_bytes
from dxrun.fit import HOST_FILE, NoData, host_figure
from dxrun.model import sharding


def test_collective_bytes_of_a_tp_layer(cfg_factory):
    from test_sharding import _compiled_tp_layer

    traffic = collective_traffic(_compiled_tp_layer(cfg_factory, 2), 8)
    # tp2: 2 devices, each with the whole (8, 16, 64) fp32 activations. An all-reduce over a
    # 2-device group sends 2*(2-1)/2 = 1 x its buffer: one buffer each after the two
    # row-parallel projections, for the MLP input's gradient and for the attention input's
    # (q, k and v come from one matmul: one gradient, Megatron's minimum).
    assert traffic == {"all-reduce": {"count": 4, "bytes": 4 * 8 * 16 * 64 * 4}}


def test_collectives_in_a_loop_count_once_per_iteration():
    mesh = sharding.make_mesh(dp=1, tp=8)
    w = jax.device_put(jnp.ones((5, 64, 64)), NamedSharding(mesh, P(None, "tensor", None)))
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "tensor")))

    def f(x, w):  # contracting a sharded axis: one all-reduce per iteration
        def body(h, w_i):
            h = jax.lax.with_sharding_constraint(h @ w_i, NamedSharding(mesh, P(None, "tensor")))
            return h, None
        return jax.lax.scan(body, x, w)[0]

    text = jax.jit(f).lower(x, w).compile().as_text()
    traffic = collective_traffic(text, 8)
    # Exactly one all-reduce of the (4, 64) fp32 carry per iteration, 5 iterations (counted
    # twice or once would both fail); a ring all-reduce over 8 sends 2 x 7/8 of its buffer.
    assert traffic == {"all-reduce": {"count": 5, "bytes": 5 * 4 * 64 * 4 * 2 * 7 / 8}}


def _need(exp: Experiment) -> float:
    return step_bytes(exp.analyse_step())  # never run: its memory analysis only


def test_an_analysis_compile_reads_as_the_runs_compile(cfg_factory):
    """Plan mode's cost and candidate compiles (and the compile-only tests) skip LLVM's
    optimisation on CPU: the HLO, the memory and the cost analyses are the run's own."""
    from dxrun.experiment import analysis_options

    cfg = cfg_factory("model=tiny", "model.n_layers=1", "model.scan_layers=false",
                      "parallelism=fsdp8", "logger=none")
    exp = Experiment.build(cfg, data=NoData())
    real, cheap = exp.compile_step(), exp.analyse_step()
    assert exp.step.compiled is real  # the run's executable is the real compile, never this one
    assert cheap.as_text() == real.as_text()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes")
    assert [getattr(cheap.memory_analysis(), f) for f in fields] == [
        getattr(real.memory_analysis(), f) for f in fields]
    assert cheap.cost_analysis() == real.cost_analysis()
    assert analysis_options("gpu") == analysis_options("tpu") == {}  # those compile as ever


WIDE = ["model=tiny", "model.d_model=256", "model.d_ff=1024", "model.n_heads=8",
        "model.n_kv_heads=8", "logger=none"]


@pytest.fixture(scope="module")
def wide():
    """WIDE's step on dp8 (ZeRO-1 on, the default, and off) and on fsdp8, compiled once for the
    tests that read them."""
    from conftest import make_cfg

    out = {}
    for name, args in (("dp8", ["parallelism=dp8"]), ("fsdp8", ["parallelism=fsdp8"]),
                       # ZeRO-1 off: the optimizer state replicated like the parameters
                       # (tests/test_shard_optimizer.py)
                       ("dp8_replicated", ["parallelism=dp8",
                                           "parallelism.shard_optimizer=false"])):
        exp = Experiment.build(make_cfg(*WIDE, *args))
        out[name] = exp, exp.analyse_step()
    return out


def test_footprint_is_per_device_and_follows_the_mesh(wide):
    dp = wide["dp8_replicated"][0]
    a, b = (footprint(e, compiled)
            for e, compiled in (wide["dp8_replicated"], wide["fsdp8"]))
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(dp.seeded.params)))
    assert a.params_bytes == 4 * n_params  # replicated on every device
    assert b.params_bytes < a.params_bytes / 6  # all but norms and biases split 8 ways
    assert a.opt_state_bytes == pytest.approx(2 * a.params_bytes, rel=1e-3)  # adam: mu, nu
    assert b.total_bytes < a.total_bytes
    assert a.flops > 0 and "all-reduce" in a.collectives and "all-gather" in b.collectives


@pytest.mark.e2e  # plan mode's whole search for a setting that fits
def test_a_plan_that_does_not_fit_suggests_one_that_fits(cfg_factory, wide):
    need_dp, need_fsdp = (step_bytes(wide[mesh][1]) for mesh in ("dp8", "fsdp8"))
    assert need_fsdp < need_dp
    # A CPU "machine" whose 8 devices get (80% of) a budget between the two needs.
    per_device = (need_dp + need_fsdp) / 2
    memory_gb = per_device * 8 / USABLE_CPU / 2**30
    cfg = cfg_factory(*WIDE, "parallelism=dp8", "plan.target=cpu",
                      f"runtime.memory_gb={memory_gb}", "runtime.peak_tflops=1")
    report = plan_report(cfg, Experiment.build(cfg))
    assert report["target"]["fits"] is False
    suggestion = report["suggestion"]
    assert suggestion  # the nearest first: recomputing activations, then FSDP, accumulation
    from omegaconf import OmegaConf

    fixed = OmegaConf.merge(cfg, OmegaConf.from_dotlist(suggestion))
    assert _need(Experiment.build(fixed)) <= per_device  # the suggestion really fits
    table = plan_table(report)
    assert "NO" in table and " ".join(suggestion) in table


@pytest.mark.e2e
def test_plan_mode_trains_nothing_and_writes_the_estimate(tmp_path):
    proc = run_cli("run.mode=plan", "parallelism=dp4_tp2", "plan.target=h200",
                   "model.n_heads=8", "model.n_kv_heads=8", "logger=none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/plan.json")]
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "wandb").exists()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mesh_shape"] == [4, 1, 1, 1, 2]
    pm = plan["plan_mode"]
    t = pm["target"]
    # train.precision=auto plans the target's run: bf16 over fp32 masters on an accelerator
    assert plan["precision"] == "bf16" and plan["precision_auto"] is True
    assert t["target"].startswith("H200") and t["fits"] is True and t["peak_tflops"] == 989.0
    # the accelerator time model (dxrun/estimates/time_model.py): kernels one after another, the
    # collectives' exposed part after them (issue 21; was max(compute, memory) + collectives)
    assert t["step_time_s"] == pytest.approx(t["compute_s"] + t["memory_s"] + t["collective_s"])
    assert t["estimate"].startswith("roofline calibrated on 2 runs")
    assert pm["n_params"] > 0 and pm["per_device"]["total_bytes"] > pm["per_device"]["params_bytes"]
    assert pm["collectives"]["all-reduce"]["count"] > 0
    log = (run_dir / "dxrun.log").read_text()
    assert "fits         yes" in log and "estimate" in log


# Hand-counted (vocabulary 16 for the tiny models, from data=markov; 50304 for GPT-2's):
# GPT-2 block 12 D^2 + 13 D (qkv 3D^2+3D, out D^2+D, MLP 8D^2+5D, two layernorms 4D), plus the
# token and position tables and the final layernorm (2D); tied but for tiny's separate head.
#   tiny: 2 x 49,984 + 16x64 (wte) + 64x16 (head) + 128x64 (wpe) + 128 = 110,336
#   tiny_llama (no biases, kv 2 of 4 heads, SwiGLU 3 x 64x192, RMSNorm, RoPE): 2 x (4096 + 2 x
#   2048 + 4096 + 36,864 + 128) + 2 x 16x64 + 64 = 100,672
#   small: 12 x (12 x 768^2 + 13 x 768) + 50304 x 768 + 1024 x 768 + 2 x 768 = 124,475,904
PARAMS = {"tiny": 110_336, "tiny_llama": 100_672, "small": 124_475_904,
          "medium": 354_871_296, "large": 774_090_240, "xl": 1_557_686_400}


def _gpt2_params(n_layers: int, d: int, vocab: int = 50304, positions: int = 1024) -> int:
    return n_layers * (12 * d * d + 13 * d) + vocab * d + positions * d + 2 * d


def test_the_roofline_step_time_by_hand():
    """``estimate`` without a GPU time model: max(compute, memory) + collectives, each a
    hand-computed number (not the code's formula again). 2e12 FLOPs at 100 TFLOP/s = 20 ms;
    3e10 bytes at 1 TB/s = 30 ms; 4.5e9 collective bytes at 450 GB/s = 10 ms: 30 + 10 = 40 ms
    a step, memory-bound; 8,192 tokens in 40 ms = 204,800 tokens/s;
    MFU = 1.6e13 model FLOPs / 8 devices / 40 ms / 100 TFLOP/s = 0.5."""
    target = Target("hand", "TPU hand", 16e9, 1.0e12, 450e9)
    fp = Footprint(params_bytes=1e9, opt_state_bytes=2e9, grads_bytes=1e9,
                             batch_bytes=0.0, temp_bytes=3e9, total_bytes=6e9, flops=2e12,
                             bytes_accessed=3e10, collectives={
                                 "all-reduce": {"bytes": 4e9}, "all-gather": {"bytes": 0.5e9}})
    out = estimate(fp, target, peak_tflops=100.0, model_flops=1.6e13, tokens=8192,
                             n_devices=8, precision="bf16")
    assert out["compute_s"] == pytest.approx(0.020)
    assert out["memory_s"] == pytest.approx(0.030)
    assert out["collective_s"] == pytest.approx(0.010)
    assert out["step_time_s"] == pytest.approx(0.040) and out["bound"] == "memory"
    assert out["tokens_per_s"] == pytest.approx(204_800)
    assert out["mfu"] == pytest.approx(0.5)
    usable = 16e9 * TPU_USABLE  # a TPU's share; 6 GB needed
    assert out["fits"] and out["headroom_gb"] == pytest.approx((usable - 6e9) / GB)


def test_hand_counted_gpt2_sizes():
    """The table above from the block's formula (the GPT-2 paper's 117M/345M/762M/1542M count a
    50257 vocabulary; the presets pad it to 50304)."""
    assert [_gpt2_params(n, d) for n, d in [(12, 768), (24, 1024), (36, 1280), (48, 1600)]] == [
        PARAMS[m] for m in ("small", "medium", "large", "xl")]


@pytest.mark.e2e
def test_every_model_plans_on_fsdp8_without_allocating(cfg_factory):
    """Plan mode for every model preset, xl included: shapes only (no array is left behind, and
    the process's peak memory grows by less than xl's 6.2 GB of fp32 weights, so none was ever
    materialised), the per-device parameter bytes are the FSDP shards, and all fit an H200."""
    import resource

    from dxrun.config.errors import ConfigError

    live_before = {id(x) for x in jax.live_arrays()}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    for model, n in PARAMS.items():
        cfg = cfg_factory(f"model={model}", "parallelism=fsdp8", "plan.target=h200",
                          "logger=none")
        report = plan_report(cfg, Experiment.build(cfg, data=NoData()))
        assert report["n_params"] == n, model
        per_device = report["per_device"]
        # fp32 weights split 8 ways; norms and biases stay replicated (a rounding error from
        # GPT-2 small up, a tenth of the tiny models).
        rel = 0.15 if n < 1e6 else 0.02
        assert per_device["params_bytes"] == pytest.approx(4 * report["n_params"] / 8, rel=rel)
        assert report["target"]["fits"] and report["target"]["tokens_per_s"] > 0, model
    assert {id(x) for x in jax.live_arrays()} <= live_before, "plan mode left arrays behind"
    peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert peak_growth < 4 * PARAMS["xl"], f"peak memory grew {peak_growth / 1e9:.1f} GB"
    with pytest.raises(ConfigError, match="model.n_heads=25 is not divisible by parallelism.tp=2"):
        Experiment.build(cfg_factory("model=xl", "parallelism=dp4_tp2", "logger=none"))


def test_suggestions_under_a_per_device_batch_keep_the_users_key(cfg_factory):
    """The preflight's candidates name data.per_device_batch_size when the user gave it (a
    data.batch_size beside it would be refused), and accumulation keeps the update's size."""
    from omegaconf import OmegaConf

    from dxrun.checks import validate
    from dxrun.fit import overrides_to_try
    from dxrun.plan import make_plan

    cfg = cfg_factory("parallelism=dp8", "data.per_device_batch_size=8")
    update = make_plan(cfg, 8).global_batch
    sizes = {}
    for overrides in overrides_to_try(cfg):
        assert not any(o.startswith("data.batch_size=") for o in overrides), overrides
        trial = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        validate(trial)
        sizes[" ".join(o for o in overrides if "batch" in o or "accum" in o)] = (
            make_plan(trial, 8).global_batch)
    assert sizes["train.grad_accum=2 data.per_device_batch_size=4"] == update == 64
    assert sizes["train.grad_accum=8 data.per_device_batch_size=1"] == update
    assert sizes["data.per_device_batch_size=4"] == 32 and sizes["data.per_device_batch_size=2"] == 16


def test_processes_on_one_host_split_its_ram():
    """dxrun.launch --nproc 2 on one host: each process sees the whole MemAvailable, and gets
    half of it for its devices."""
    from dxrun.cost import USABLE_CPU
    from dxrun.fit import cpu_device_budget

    gib = 2**30
    assert cpu_device_budget(64 * gib, 8, 1) == 64 * gib * USABLE_CPU / 8
    assert cpu_device_budget(64 * gib, 4, 2) == 64 * gib * USABLE_CPU / 8


def test_usable_gpu_memory_is_what_jax_will_pool():
    """JAX's GPU client pools 75% of each GPU unless told otherwise; preallocating or not keeps
    that limit; the platform allocator has no pool."""
    from dxrun.config.errors import ConfigError
    from dxrun.cost import TARGETS, USABLE, USABLE_CPU, Usable, gpu_memory_fraction

    assert gpu_memory_fraction({}).fraction == 0.75
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in gpu_memory_fraction({}).source  # how to raise it
    assert gpu_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"}) == Usable(
        0.9, "XLA_PYTHON_CLIENT_MEM_FRACTION=.9")
    assert gpu_memory_fraction({"XLA_CLIENT_MEM_FRACTION": "0.5"}).fraction == 0.5
    assert gpu_memory_fraction({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}).fraction == 0.75
    assert gpu_memory_fraction({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
                                "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}).fraction == USABLE
    for env, says in [({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"}, "=1.5 is not a fraction"),
                      ({"XLA_CLIENT_MEM_FRACTION": "most"}, "=most is not a fraction"),
                      ({"XLA_CLIENT_MEM_FRACTION": ".8", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".8"},
                       "unset XLA_PYTHON_CLIENT_MEM_FRACTION")]:
        with pytest.raises(ConfigError, match=says):
            gpu_memory_fraction(env)
    assert usable_share(TARGETS["v5p"], {}).fraction == TPU_USABLE  # XLA's
    # a v5e's program may use what its compile allows (bytes_limit: 15.75 GiB of 16)
    assert usable_bytes(TARGETS["v5e"]) == 15.75 * 2**30
    cpu = Target("cpu", "cpu", 1e9, 1.0, 1.0)
    assert usable_share(cpu, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}).fraction == (
        USABLE_CPU)


def test_a_gpu_plans_usable_memory_and_checkpoint_cost(cfg_factory, monkeypatch):
    """One plan for an H200: the usable figure follows XLA_PYTHON_CLIENT_MEM_FRACTION and says
    where it comes from; the checkpoint row costs the whole state at plan.write_gb_per_s."""
    for key in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    # One device, one unscanned layer: a single compile serves the footprint and the cost.
    cfg = cfg_factory("model=tiny", "model.n_layers=1", "model.scan_layers=false",
                      "parallelism=dp1", "plan.target=h200", "logger=none",
                      "plan.write_gb_per_s=2")
    exp = Experiment.build(cfg, data=NoData())
    report = plan_report(cfg, exp)
    t = report["target"]
    h200_gb = TARGETS["h200"].memory_bytes / 1e9  # 143,771 MiB as the driver reports
    assert t["usable_per_device_gb"] == pytest.approx(h200_gb * 0.9)
    assert "usable 90% = 135.7 GB (XLA_PYTHON_CLIENT_MEM_FRACTION=.9)" in plan_table(
        report)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's default: 75%
    pd = {k: v for k, v in report["per_device"].items() if k != "activations_bytes"}
    fp = Footprint(**pd, collectives=report["collectives"])
    default = estimate(fp, TARGETS["h200"], t["peak_tflops"], 1.0, 1, 1,
                                 "fp32", need_bytes=report["memory_model"]["total_bytes"])
    assert default["usable_per_device_gb"] == pytest.approx(h200_gb * 0.75)
    assert default["headroom_gb"] == pytest.approx(t["headroom_gb"] - h200_gb * 0.15)
    c = report["checkpoint"]
    # fp32 parameters and AdamW's two moments (and a few counters): 3 x 4 bytes a parameter.
    n_padded = sum(x.size for x in jax.tree.leaves(exp.abstract_state().params))
    assert c["state_bytes"] == pytest.approx(12 * n_padded, rel=1e-3)
    assert c["save_s"] == pytest.approx(c["state_bytes"] / 2e9)
    # checkpoint.every=null on a GPU: a wall-clock cadence, at least 10 minutes for a small state
    assert (c["every_steps"], c["every_minutes"], c["interval_s"]) == (0, 10.0, 600.0)
    assert "every 10 min = a save every 600.0 s" in plan_table(report)


def test_the_default_save_cadence_follows_the_platform_and_the_state():
    """checkpoint.every=null: 100 steps on CPU; on an accelerator no step cadence and the
    wall-clock one whose saves cost <= 2% (at least 10 minutes); a given value is kept."""
    cadence, text = save_cadence, cadence_text
    assert cadence(None, 0.0, "cpu", 9.3e9, 1e9) == (100, 0.0)
    assert cadence(None, 5.0, "cpu", 9.3e9, 1e9) == (100, 5.0)
    assert cadence(None, 0.0, "gpu", 1e6, 1e9) == (0, 10.0)  # tiny state: the floor
    assert cadence(None, 0.0, "gpu", 9.3e9, 1e9) == (0, 10.0)  # 9.3 s / 2% = 7.75 -> 8 < 10
    assert cadence(None, 0.0, "tpu", 30e9, 1e9) == (0, 25.0)  # 30 s / 2% = 25 min
    assert cadence(None, 3.0, "gpu", 30e9, 1e9) == (0, 3.0)  # every_minutes given
    assert cadence(100, 0.0, "gpu", 30e9, 1e9) == (100, 0.0)  # every given
    assert cadence(0, 0.0, "gpu", 30e9, 1e9) == (0, 0.0)  # never
    for every, minutes in [(None, 0.0), (100, 0.0), (0, 0.0)]:  # CPU: what a run saves by
        steps, mins = cadence(every, minutes, "cpu", 1e6, 1e9)
        assert (steps, mins) == ((100 if every is None else every), 0.0)
    assert text(0, 10.0) == "every 10 min"
    assert text(100, 2.5) == "every 100 steps and every 2.5 min"
    assert text(0, 0.0) == "never"


def test_checkpoint_cost_at_the_configured_cadence():
    """model=large's state (9.3 GB) every 100 steps of 50 ms at 1 GB/s: 186% of the run; a
    wall-clock cadence of the suggested 8 minutes brings it under 2%."""
    cost = checkpoint_cost
    c = cost(9.3e9, 1e9, 100, 0.0, 0.05)
    assert c["save_s"] == pytest.approx(9.3) and c["interval_s"] == pytest.approx(5.0)
    assert c["overhead"] == pytest.approx(1.86) and c["too_costly"]
    assert c["suggest_every_minutes"] == 8  # 9.3 s / 2% = 465 s
    assert "checkpoint.every=0 checkpoint.every_minutes=8" in checkpoint_line(c)
    ok = cost(9.3e9, 1e9, 0, 8.0, 0.05)
    assert ok["interval_s"] == 480 and ok["overhead"] < 0.02 and not ok["too_costly"]
    assert "checkpoint.every_minutes" not in checkpoint_line(ok)
    assert cost(9.3e9, 1e9, 100, 8.0, 0.05)["interval_s"] == pytest.approx(5.0)  # first wins
    assert cost(9.3e9, 1e9, 100, 0.0, None)["overhead"] is None  # no step time: no share


def test_a_host_figure_is_measured_once_per_machine(tmp_path, monkeypatch):
    """host.json in dxrun's cache dir keeps each machine's measured figures: a second read
    measures nothing; a damaged or implausible file is measured again and rewritten."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure() -> float:
        calls.append(1)
        return 2.5

    assert host_figure("peak_tflops", measure) == 2.5
    assert host_figure("peak_tflops", measure) == 2.5 and len(calls) == 1
    path = tmp_path / "dxrun" / HOST_FILE
    (key, figures), = json.loads(path.read_text()).items()
    assert figures == {"peak_tflops": 2.5} and "jax" in key
    for damage in ("{not json", json.dumps({key: {"peak_tflops": -1.0}}), "[]"):
        path.write_text(damage)
        assert host_figure("peak_tflops", measure) == 2.5
    assert len(calls) == 4 and json.loads(path.read_text()) == {key: {"peak_tflops": 2.5}}
