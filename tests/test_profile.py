"""A traced dp4_tp2 run (one, shared): its trace opens with the profiler's reader and the table
lists the step's matmuls and all-reduces; the traced steps leave the throughput figures; the
goodput parts add up to the wall time; a memory refusal writes a breakdown that adds up. A real
TPU trace (tests/fixtures/tpu_trace: one step of GPT-2 small on a v5e chip) reads by kind, its
loops counted through."""

import copy
import json
import re
import time
from pathlib import Path

import pytest

from dxrun import profile
from dxrun.config.errors import ConfigError
from dxrun.experiment import step_bytes
from dxrun.fit import BREAKDOWN_FILE, breakdown, memory_preflight, state_bytes
from dxrun.run import Job
from dxrun.tracking.wandb_file import read_run
from dxrun.train import prepare, train
from tests.conftest import make_cfg

TPU_TRACE = Path(__file__).parent / "fixtures" / "tpu_trace"
TRACED = ["parallelism=dp4_tp2", "model=tiny", "data.seq_len=32", "train.steps=6",
          "train.log_every=2", "train.eval_every=0", "checkpoint.every=0",
          "train.profile.start=3", "train.profile.steps=2"]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced")
    cfg = make_cfg(*TRACED)
    t0 = time.time()
    prepared = prepare(cfg, run_dir)
    summary = train(cfg, run_dir, Job(started=t0), prepared)
    return run_dir, summary, time.time() - t0, cfg, prepared.exp


@pytest.mark.e2e
def test_the_trace_is_read_and_lists_matmuls_and_all_reduces(traced_run, capsys):
    run_dir = traced_run[0]
    (pb, s, sources), = profile.read_run(run_dir)
    assert pb.name.endswith(".xplane.pb") and (pb.parent / "perfetto_trace.json.gz").is_file()
    assert (s.steps, s.devices) == (2, 8)  # steps 3 and 4, on every device
    kinds = dict(s.kinds)
    assert kinds["matmul"] > 0 and kinds["all-reduce"] > 0  # tp2: the row-parallel all-reduces
    assert s.compute_ms + s.collective_ms + s.idle_ms == pytest.approx(s.step_ms)
    assert profile.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| matmul \| [\d.]+ \| [\d.]+% \|$", out, re.M)
    assert re.search(r"^\| `all-reduce[.\d]*` \| all-reduce \|", out, re.M)
    assert any("dot_general" in v for v in sources.values())  # ops named by their JAX op


@pytest.mark.e2e
def test_traced_steps_are_marked_and_left_out_of_throughput(traced_run):
    run_dir = traced_run[0]
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}
    assert rows[4]["perf/profiled"] is True  # steps 3-4 traced: the whole window
    assert "perf/step_time_s" not in rows[4]
    assert "perf/profiled" not in rows[6] and rows[6]["perf/step_time_s"] > 0


@pytest.mark.e2e
def test_goodput_parts_add_up_to_the_wall_time(traced_run):
    run_dir, summary, measured, *_ = traced_run
    g = summary["goodput_s"]
    parts = sum(v for k, v in g.items() if k.endswith("_s") and k != "wall_s")
    assert parts == pytest.approx(g["wall_s"])
    assert g["rest_s"] < 0.05 * g["wall_s"]  # the spans cover the run
    assert g["wall_s"] == pytest.approx(measured, rel=0.05)
    assert g["profile_s"] > 0 and g["productive_s"] > 0 and g["compile_s"] > 0
    assert summary["goodput"] == pytest.approx(g["productive_s"] / g["wall_s"])
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["attempts"] == 1 and saved["goodput"] == pytest.approx(summary["goodput"])
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb_summary = read_run(wandb_file)["summary"]  # the offline W&B run's summary
    assert wandb_summary["goodput"] == pytest.approx(summary["goodput"])
    assert wandb_summary["goodput/productive_s"] == pytest.approx(g["productive_s"])


@pytest.mark.e2e
def test_a_memory_refusal_writes_a_breakdown_that_adds_up(traced_run, tmp_path):
    *_, cfg, exp = traced_run
    small = copy.deepcopy(cfg)
    # Just under the step's need (8 simulated devices share it): the first smaller candidate
    # the refusal suggests fits, so one more compile, not a search.
    small.runtime.memory_gb = 0.999 * step_bytes(exp.step.compiled) * 8 / 2**30
    with pytest.raises(ConfigError, match=r"where the memory goes: .*memory_breakdown.txt$"):
        memory_preflight(small, exp, exp.step.compiled, tmp_path)
    b = breakdown(exp.step.compiled, exp.abstract_state())
    assert sum(b["parts"].values()) == b["total"] == step_bytes(exp.step.compiled)
    assert all(v >= 0 for v in b["parts"].values()) and b["parts"]["parameters"] > 0
    text = (tmp_path / BREAKDOWN_FILE).read_text()
    assert text.startswith(f"train step: {int(b['total'])} bytes")
    rows = re.findall(r"^\| [^|]+ \| (\d+) \|", text, re.M)
    assert sum(map(int, rows)) == int(b["total"])
    assert "params." in text  # the largest arguments by their tree path


@pytest.mark.e2e
def test_a_run_whose_weights_alone_do_not_fit_is_refused_without_a_search(traced_run, tmp_path):
    *_, cfg, exp = traced_run
    small = copy.deepcopy(cfg)
    floor = state_bytes(exp.abstract_state()) / exp.plan.n_visible
    # Half the state's share of one device per device: no remat, accumulation, batch or FSDP
    # suggestion can fit, so the line says why instead of naming one.
    small.runtime.memory_gb = 0.5 * floor * 8 / 2**30
    with pytest.raises(ConfigError) as e:
        memory_preflight(small, exp, exp.step.compiled, tmp_path)
    line = str(e.value)
    assert f"weights and optimizer state alone need {floor / 2**30:.4f} GiB per device" in line
    assert "try a larger mesh or a smaller model" in line and "try model." not in line
    assert line.endswith("memory_breakdown.txt") and "\n" not in line


def test_a_run_without_a_trace_says_how_to_take_one(tmp_path, capsys):
    assert profile.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.profile.start=<step>" in err


def test_a_tpu_trace_is_read_by_kind_through_its_loops_and_adds_up_to_the_step(capsys):
    (pb, s, sources), = profile.read_run(TPU_TRACE, top=10_000)
    assert (s.steps, s.devices) == (1, 1)
    kinds = dict(s.kinds)
    assert {"matmul", "attention", "elementwise fusion", profile.MOVES} <= set(kinds)
    assert s.kinds[-1] == (profile.IDLE, pytest.approx(s.idle_ms))  # one op at a time: idle
    assert min(kinds["matmul"], kinds["attention"], kinds["elementwise fusion"]) > 0.1 * s.step_ms
    # the rows add up to the step, and the step is the one the device measured
    from jax.profiler import ProfileData  # the trace's own reader: an independent measure
    plane = ProfileData.from_file(str(pb)).find_plane_with_name("/device:TPU:0")
    module, = next(line.events for line in plane.lines if line.name == "XLA Modules")
    assert sum(kinds.values()) == pytest.approx(s.step_ms, rel=0.01)
    assert s.step_ms == pytest.approx(module.duration_ns / 1e6, rel=0.01)
    assert s.compute_ms + s.collective_ms + s.idle_ms == pytest.approx(s.step_ms)
    # the scans' while loops enclose their bodies' ops: counted through them, never a row
    loops = [o for o in profile.read_ops(pb, None) if o.kind == "while"]
    assert len(loops) >= 2 and max(o.dur_ns for o in loops) > 0.3 * s.step_ms * 1e6
    assert not [row for row in s.top if row[1] in profile.CONTAINERS or "while" in row[0]]
    assert max(row[4] for row in s.top) == 12  # an op of the layer scan's body: once a layer
    assert sum(row[2] for row in s.top) + s.idle_ms == pytest.approx(s.step_ms, rel=0.01)
    assert any(v.endswith("dot_general") for v in sources.values())  # the JAX op, from the trace
    assert profile.main([str(TPU_TRACE)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| attention \| [\d.]+ \| [\d.]+% \|$", out, re.M)
    assert not re.search(r"^\| (`while|while \|)|\| while \|", out, re.M)
    assert not re.search(r"^\| `%", out, re.M)  # ops by name, not by their instruction's text


@pytest.mark.parametrize("text, stats, kind", [
    ("%all-reduce.3 = f32[8]{0} all-reduce(f32[8]{0} %p), to_apply=%add",
     {"hlo_category": "all-reduce"}, "all-reduce"),
    ("%all-gather-done = f32[16]{0} all-gather-done(f32[16]{0} %all-gather-start)", {},
     "all-gather"),
    ("%reduce-scatter-start = ((f32[16]{0}), f32[8]{0}) async-start(f32[16]{0} %p), "
     "calls=%reduce-scatter.1", {"hlo_category": "async-start"}, "reduce-scatter"),
    ("%custom-call.5 = bf16[8,128]{1,0} custom-call(bf16[8,128]{1,0} %q), "
     'custom_call_target="tpu_custom_call", backend_config={"name": "splash_mha_fwd"}',
     {"hlo_category": "custom-call", "tf_op": "jit(step)/pallas_call"}, "attention"),
    ("%custom-call.6 = bf16[8,128]{1,0} custom-call(bf16[8,128]{1,0} %x), "
     'custom_call_target="tpu_custom_call"', {"hlo_category": "custom-call"}, "pallas kernel"),
    ("%fusion.2 = f32[8]{0} fusion(f32[8]{0} %p), kind=kOutput, calls=%fc",
     {"hlo_category": "convolution fusion", "tf_op": "jit(step)/dot_general:"}, "matmul"),
    ("%fusion.3 = f32[8]{0} fusion(f32[8]{0} %p), kind=kOutput, calls=%fc",  # a folder's name
     {"hlo_category": "convolution fusion", "source": "/home/attention/model.py:9"}, "matmul"),
    ("%fusion.4 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, calls=%fc",
     {"hlo_category": "loop fusion", "source": "/work/dxrun/attention.py:133"}, "attention"),
    ("%copy.1 = f32[8]{0} copy(f32[8]{0} %p)", {"hlo_category": "data formatting"},
     profile.MOVES),
    ("%while.1 = (s32[]) while((s32[]) %t), condition=%c, body=%b", {"hlo_category": "while"},
     "while"),
])
def test_tpu_op_kinds_from_the_category_the_jax_op_and_the_instruction(text, stats, kind):
    assert profile.tpu_kind(text, stats) == kind
