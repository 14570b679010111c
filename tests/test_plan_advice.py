"""Plan mode's advice (dxrun/autotune/advice.py, dxrun/cost/): the fastest setting
that fits, ranked by the estimate; the warnings; the model's shape and TFLOP/s rows; the
device count it plans for (plan.devices) and what a preset's name becomes there."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from dxrun.autotune import (
    GROWTH,
    Setting,
    StateShapes,
    accelerator_memory,
    advice_text,
    fastest_that_fits,
    plan_report,
    plan_table,
    price,
    settings,
)
from dxrun.checks import config_warnings, validate
from dxrun.config.errors import ConfigError
from dxrun.cost import GB, usable_bytes
from dxrun.estimates import exposed_warning, fit_warning, preset_note, unsplit_warning
from dxrun.experiment import Experiment
from dxrun.fit import NoData, first_that_fits, resolve_target
from dxrun.run import accelerator_plan_note, simulated_count

# A tiny model at 64 x 512 tokens on dp8 whose activations an H100 with 0.027% of its memory
# usable (23 MB, XLA_PYTHON_CLIENT_MEM_FRACTION) cannot hold, with or without remat=dots (the
# matmul outputs are most of what its lean backward keeps): recomputing them (today's first
# candidate) fits, and so do slices of the batch, which recompute nothing.
TIGHT = ["model=tiny", "model.max_seq_len=512", "data.seq_len=512", "data.batch_size=64",
         "parallelism=dp8", "plan.target=h100", "train.precision=bf16", "logger=none"]


@pytest.mark.e2e  # plan mode's whole search
def test_the_suggestion_is_the_fastest_setting_that_fits(cfg_factory, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.00027")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    cfg = cfg_factory(*TIGHT)
    exp = Experiment.build(cfg, data=NoData())
    target, peak = resolve_target(cfg, 8)
    budget = usable_bytes(target)
    state = exp.abstract_state()
    asked = accelerator_memory(exp, target).total_bytes
    assert asked > budget  # the plan as asked does not fit
    n_params = exp.count_params(state.params)
    found = fastest_that_fits(cfg, exp, state, target, peak, {"step_time_s": 1.0},
                                      n_params, runners_up=1, max_compiles=3)
    best, (second,) = found["suggestion"], found["runners_up"]
    # each compiled from shapes and sized as plan mode sizes a plan: within the budget
    assert best["needs_gb"] * GB <= budget and second["needs_gb"] * GB <= budget
    assert best["step_time_s"] <= second["step_time_s"]  # ranked by the estimate
    assert found["compiled"] <= 3 < found["candidates"]  # most never compiled
    # Today's first that fits (recompute everything) is slower than the suggestion: even its
    # step without collectives (a lower bound of its estimate) is longer.
    legacy = first_that_fits(cfg, budget, exp.plan,
                                 need=lambda e: accelerator_memory(e, target).total_bytes)
    assert legacy == ["model.remat=full"]
    start = Setting(exp.plan.layout, exp.plan.shard_optimizer)
    (full,) = [p for p in price(
        cfg, StateShapes.of(exp, state), target, peak, n_params,
        settings(cfg, 8, exp.plan.platform, 64, 512), start, 64)
        if p.overrides == legacy]
    assert full.need_bytes <= budget and full.step_s > best["step_time_s"]
    assert "model.remat=full" not in best["overrides"]
    line = advice_text(found, 8)
    assert line.startswith(f"fastest that fits: {' '.join(best['overrides'])} (est. ")
    assert "runners-up: " + " ".join(second["overrides"]) in line
    # the asked step's 1.0 s against the suggestion's: the speed ratio it prints
    assert best["speed"] == pytest.approx(1.0 / best["step_time_s"])


def test_a_mesh_too_small_says_how_many_devices_would_do(cfg_factory, monkeypatch):
    """No layout of 8 devices fits 1.9 MB of an H100 (the memory model, nothing compiled); the
    answer names the smallest multiple of 8 on which one would, as plan.devices."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.000022")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    cfg = cfg_factory(*TIGHT)
    exp = Experiment.build(cfg, data=NoData())
    target, peak = resolve_target(cfg, 8)
    state = exp.abstract_state()
    found = fastest_that_fits(cfg, exp, state, target, peak, {"step_time_s": 1.0},
                                      exp.count_params(state.params))
    assert "suggestion" not in found and found["fit_by_model"] == 0 and found["compiled"] == 0
    larger = found["larger_mesh"]
    assert larger["devices"] in {8 * k for k in GROWTH} and larger["devices"] > 8
    assert larger["overrides"][0] == f"plan.devices={larger['devices']}"
    assert larger["needs_gb"] * GB <= usable_bytes(target)
    line = advice_text(found, 8)
    assert line.startswith(f"no layout of 8 devices fits; {larger['devices']} would: "
                           f"plan.devices={larger['devices']} ")


def test_a_tiny_plan_warns_and_shows_its_shape(cfg_factory, monkeypatch):
    """One plan, each warning it deserves: it does not fit; model.n_heads changed without
    model.n_kv_heads (grouped-query attention by accident); a toy shape; tensor-parallel
    collectives a tiny step cannot hide. The table shows the model's shape and TFLOP/s."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.00005")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "parallelism=tp4", "plan.target=h100",
                      "train.precision=bf16", "logger=none")
    report = plan_report(cfg, Experiment.build(cfg, data=NoData()),
                                   suggest=False)
    fits, kv, toy, exposed = report["warnings"]
    assert fits.startswith("the plan does not fit H100 SXM 80GB: it needs ")
    assert "model.n_heads=8 was set but model.n_kv_heads stayed at the tiny preset's 4" in kv
    assert "set model.n_kv_heads=8" in kv
    assert toy.startswith("planning 2,048 tokens per step")
    g, t = report["target"]["timing"], report["target"]
    assert g["tensor_collective_s"] > 0.1 * t["step_time_s"]  # tp4 on a 64-wide model
    assert exposed.startswith(f"exposed collectives take {1e3 * g['exposed_collective_s']:.1f} ms")
    assert report["model"] == ("tiny: 2 layers, d_model 64, 8 heads / 4 kv heads (grouped-query) "
                               "of 8, d_ff 256 (gelu), vocab 16, 54,848 parameters"
                               .replace("54,848", f"{report['n_params']:,}"))
    tflops = report["model_flops_per_step"] / report["n_devices"] / t["step_time_s"] / 1e12
    assert report["tflops_per_device"] == pytest.approx(tflops)
    assert report["tflops_per_device"] == pytest.approx(t["mfu"] * t["peak_tflops"])
    table = plan_table(report)
    assert f"  model        {report['model']}" in table
    assert f"TFLOP/s      {tflops:.1f} per device" in table
    assert table.count("\n  warning      ") == 4
    # the same model with its kv heads given, fitting: no warning but the toy shape
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    cfg = cfg_factory("model=tiny", "model.n_heads=8", "model.n_kv_heads=8", "parallelism=dp8",
                      "plan.target=h100", "logger=none")
    report = plan_report(cfg, Experiment.build(cfg, data=NoData()))
    assert len(report["warnings"]) == 1 and report["warnings"][0].startswith("planning 2,048")
    assert "advice" not in report and "8 heads / 8 kv heads of 8" in report["model"]


def test_warnings_from_figures():
    """The warnings that a tiny plan cannot show today, from the figures they read."""
    assert unsplit_warning(True, 53.91e9, 53.91e9, 48).startswith(
        "parallelism.shard_optimizer is on but 53.91 GB of the 53.91 GB optimizer state per "
        "device is not split over the 48 data replicas")
    assert unsplit_warning(True, 53.91e9, 1e3, 48) is None  # counters: not worth a word
    assert unsplit_warning(False, 53.91e9, 53.91e9, 48) is None  # not asked
    step = {"step_time_s": 1.0, "timing": {"exposed_collective_s": 0.1,
                                           "tensor_collective_s": 0.0}}
    assert exposed_warning(step) is None  # 10%: not above it
    step["timing"]["exposed_collective_s"] = 0.3
    line = exposed_warning(step)
    assert "(30%: data-parallel beyond the compute 300.0 ms); more tokens per device" in line
    assert "parallelism.tp" not in line  # no tensor parallelism to cut
    step["timing"]["tensor_collective_s"] = 0.3
    assert exposed_warning(step).endswith(
        "(30%: tensor-parallel (never hidden) 300.0 ms); fewer tensor-parallel devices "
        "(parallelism.tp) hide more of them")
    fits = {"fits": True}
    assert fit_warning(fits, "x") is None


def test_preset_names_on_other_device_counts():
    assert preset_note("dp4_tp2", (48, 1, 1, 1, 2)) == (
        "parallelism=dp4_tp2 names a layout of 8 devices; on 96 it is data 48 x tensor 2")
    assert preset_note("fsdp8", (2, 8, 1, 1, 1)).endswith("on 16 it is data 2 x fsdp 8")
    assert preset_note("dp4_tp2", (4, 1, 1, 1, 2)) is None  # the name is the mesh
    assert preset_note("dp", (96, 1, 1, 1, 1)) is None  # names no size
    assert preset_note("auto", (8, 1, 1, 1, 1)) is None
    assert preset_note("cp2_tp4", (2, 1, 1, 2, 4)) == (
        "parallelism=cp2_tp4 names a layout of 8 devices; on 16 it is data 2 x context 2 x "
        "tensor 4")
    assert preset_note("dp2_ep4", (4, 1, 4, 1, 1)).endswith("on 16 it is data 4 x expert 4")

def test_plan_devices_sets_the_plans_count_and_runs_keep_cpu_devices():
    assert simulated_count("train", 16, 4) == (4, None)  # a run: runtime.cpu_devices
    assert simulated_count("plan", 16, 8) == (16, None)
    assert simulated_count("plan", 8, 8) == (8, None)
    n, note = simulated_count("plan", 8, 48)  # the older spelling, plan.devices left at 8
    assert n == 48 and "plan.devices=48 is its key" in note
    n, note = simulated_count("plan", 16, 4)  # both given: the plan's key wins
    assert n == 16 and "runtime.cpu_devices=4 is a run's" in note
    # JAX on a GPU plans the GPUs it sees (only the CPU platform simulates): said, with the fix
    assert accelerator_plan_note("gpu", 1, 16, "h100") == (
        "plan.devices=16 not simulated: JAX runs on gpu with 1 devices, which the plan is for; "
        "JAX_PLATFORMS=cpu plans 16 simulated devices")
    assert accelerator_plan_note("cpu", 16, 16, "h100") is None
    assert accelerator_plan_note("gpu", 8, 8, "h100") is None
    assert accelerator_plan_note("gpu", 1, 8, None) is None  # no target: the visible devices


def test_plan_devices_is_validated(cfg_factory):
    """plan.devices=0: one line naming the key, the value and the fix (the CLI's exit 2)."""
    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("run.mode=plan", "plan.devices=0"))
    assert str(e.value) == "plan.devices=0 is outside its range > 0; set plan.devices > 0"


def test_plan_mode_has_no_warmup_warning(cfg_factory):
    """A plan trains nothing: a Llama preset's 2,000 warmup steps against the default 600 steps
    warn a run, never a plan."""
    assert len(config_warnings(cfg_factory("model=llama2_7b"))) == 1
    assert config_warnings(cfg_factory("model=llama2_7b", "run.mode=plan")) == []


@pytest.mark.e2e
def test_plan_devices_on_the_command_line(tmp_path):
    """plan.devices=16: the plan's mesh is 16 devices, the preset's name says what it became,
    the table has the model's shape and TFLOP/s rows."""
    proc = run_cli("run.mode=plan", "plan.devices=16", "parallelism=dp4_tp2", "plan.target=h100",
                   "model.n_heads=8", "model.n_kv_heads=8", "logger=none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("outputs/*/*/plan.json")
    plan = json.loads(path.read_text())
    assert plan["mesh_shape"] == [8, 1, 1, 1, 2] and plan["n_devices"] == 16
    pm = plan["plan_mode"]
    assert pm["preset"] == ("parallelism=dp4_tp2 names a layout of 8 devices; on 16 it is "
                            "data 8 x tensor 2")
    log = (path.parent / "dxrun.log").read_text()
    assert "simulating 16 CPU devices (plan.devices)" in log
    assert f"  preset       {pm['preset']}" in log and f"  model        {pm['model']}" in log
    assert f"  TFLOP/s      {pm['tflops_per_device']:.1f} per device" in log
    assert pm["warnings"] and all(f"  warning      {w}" in log for w in pm["warnings"])

