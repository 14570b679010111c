"""A traced dp4_tp2 run (one, shared): its trace opens with the profiler's reader and the table
lists the step's matmuls and all-reduces; the traced steps leave the throughput figures; the
goodput parts add up to the wall time; a memory refusal writes a breakdown that adds up."""

import copy
import json
import re
import time

import pytest

from dxrun import profile
from dxrun.autotune import fit, memory_report
from dxrun.autotune.preflight import memory_preflight
from dxrun.errors import ConfigError
from dxrun.job import Job
from dxrun.prepare import prepare
from dxrun.step import step_bytes
from dxrun.tracking.wandb_file import read_run
from dxrun.train import train
from tests.conftest import make_cfg

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
    return run_dir, summary, time.time() - t0, cfg, prepared[0]


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
    b = memory_report.breakdown(exp.step.compiled, exp.abstract_state())
    assert sum(b["parts"].values()) == b["total"] == step_bytes(exp.step.compiled)
    assert all(v >= 0 for v in b["parts"].values()) and b["parts"]["parameters"] > 0
    text = (tmp_path / memory_report.FILE).read_text()
    assert text.startswith(f"train step: {int(b['total'])} bytes")
    rows = re.findall(r"^\| [^|]+ \| (\d+) \|", text, re.M)
    assert sum(map(int, rows)) == int(b["total"])
    assert "params." in text  # the largest arguments by their tree path


@pytest.mark.e2e
def test_a_run_whose_weights_alone_do_not_fit_is_refused_without_a_search(traced_run, tmp_path):
    *_, cfg, exp = traced_run
    small = copy.deepcopy(cfg)
    floor = fit.state_bytes(exp.abstract_state()) / exp.plan.n_visible
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
