"""Weak and strong scaling: the presets compose into the grids they promise, and a real
weak-scaling multirun (per-device batch fixed, dp1 -> dp8, lr scaled by sqrt) whose report has
the weak-scaling column and plot, and whose jobs logged the scaled learning rate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_cli
from test_sweep import _compose, _csv, _jobs, _num, _sweep_jobs, _validated

from dxrun.plan import RunPlan, make_plan, resolved_config
from dxrun.report import JobRecord, scaling_efficiency


@pytest.mark.parametrize("preset, extra, want", [
    # weak: the per-device batch fixed, the global batch grows with the devices
    ("weak_scaling", [], {1: 32, 2: 64, 4: 128, 8: 256}),
    ("weak_scaling", ["data.per_device_batch_size=16"], {1: 16, 2: 32, 4: 64, 8: 128}),
    # strong: the global batch fixed, split over the devices
    ("strong_scaling", [], {1: 64, 2: 64, 4: 64, 8: 64}),
    ("strong_scaling", ["data.batch_size=256"], {1: 256, 2: 256, 4: 256, 8: 256}),
])
def test_scaling_presets_plan_the_batches_they_hold(preset, extra, want):
    cfg = _compose(f"sweep={preset}", *extra, hydra=True)
    jobs = _sweep_jobs(cfg.hydra.sweeper.params)
    assert [j[0] for j in jobs] == [f"parallelism=dp{n}" for n in (1, 2, 4, 8)]
    got, lrs = {}, {}
    for job in jobs:
        run = _validated(f"sweep={preset}", *extra, *job)
        plan = make_plan(run, 8, "cpu")
        got[plan.n_devices], lrs[plan.n_devices] = plan.global_batch, plan.peak_lr
    assert got == want
    # weak_scaling scales the lr by sqrt(global / optimizer.base_batch_size = 32)
    scale = {n: math.sqrt(b / 32) if preset == "weak_scaling" else 1.0 for n, b in want.items()}
    assert lrs == pytest.approx({n: 0.01 * s for n, s in scale.items()})


@pytest.fixture(scope="module")
def weak(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("weak")
    sweep = cwd / "sweep"
    # Per-device batch 4 on dp1 and dp8 (global 4 and 32); base batch 4, so dp_n's lr is
    # 0.01 x sqrt(n), constant (no warmup) so every logged train/lr is the peak. Two of the
    # preset's four layouts (the command line's list wins; the preset's own grid is
    # test_scaling_presets_plan_the_batches_they_hold's): the fewest and the most devices are
    # what the efficiency, the plot and the scaled lr need.
    proc = run_cli("-m", "sweep=weak_scaling", "parallelism=dp1,dp8",
                   "data.per_device_batch_size=4",
                   "optimizer.base_batch_size=4", "optimizer.lr=0.01",
                   "optimizer.schedule=constant", "optimizer.warmup_steps=0",
                   "train.steps=3", "train.log_every=1", "logger=none",
                   "checkpoint.every=0",  # no test reads a checkpoint: no saves to wait for
                   f"hydra.sweep.dir={sweep}", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.mark.e2e
def test_weak_scaling_report_has_the_weak_column_and_plot(weak: Path):
    rows = _csv(weak)
    assert [(int(r["devices"]), int(r["batch_size"]), int(r["per_device_batch"])) for r in rows] \
        == [(1, 4, 4), (8, 32, 4)]
    tpd = {int(r["devices"]): _num(r["tokens_per_s_per_device"]) for r in rows}
    for r in rows:  # tokens/s per device at n over dp1's, with the same per-device batch
        n = int(r["devices"])
        assert _num(r["weak_scaling_efficiency"]) == pytest.approx(tpd[n] / tpd[1])
        assert r["strong_scaling_efficiency"] == ""
    assert _num(rows[0]["weak_scaling_efficiency"]) == 1.0
    md = (weak / "report.md").read_text()
    assert "weak_scaling_efficiency" in md.splitlines()[next(
        i for i, line in enumerate(md.splitlines()) if line.startswith("| job"))]
    assert "simulated CPU devices, which share this host's cores" in md
    assert "![scaling](scaling.png)" in md
    import matplotlib.image as mpimg

    pixels = mpimg.imread(weak / "scaling.png")
    assert pixels.shape[:2] == (420, 640)  # one panel: only weak scaling in this sweep
    rgb = pixels[..., :3]
    assert (rgb.max(axis=-1) - rgb.min(axis=-1) > 0.3).sum() > 200  # coloured lines drawn


@pytest.mark.e2e
def test_lr_after_sqrt_scaling_is_in_metrics(weak: Path):
    for job in _jobs(weak):
        plan = json.loads((job / "plan.json").read_text())
        n = plan["n_devices"]
        want = 0.01 * math.sqrt(n)  # global 4n over base 4
        assert plan["peak_lr"] == pytest.approx(want)
        assert plan["batch_set_by"] == "data.per_device_batch_size"
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        lrs = [r["train/lr"] for r in rows if "train/lr" in r]
        assert len(lrs) == 3 and lrs == pytest.approx([want] * 3, rel=1e-6)
    # The dp8 job's saved config holds the global batch the mesh gave.
    cfg = (_jobs(weak)[-1] / ".hydra" / "config.yaml").read_text()
    assert "batch_size: 32" in cfg and "per_device_batch_size: 4" in cfg


def _job(mesh: str, n: int, batch: int, tokens_per_s: float, fixed: str) -> JobRecord:
    """A finished job as the report reads it back: overrides, plan.json and its timing windows
    (metrics.jsonl rows), all at ``tokens_per_s``."""
    window = {"perf/tokens_per_s": tokens_per_s, "perf/tokens_per_s_per_device": tokens_per_s / n}
    return JobRecord(dir=Path(f"{mesh}_b{batch}"), num=None, status="ok",
                     overrides=[f"parallelism={mesh}", fixed],
                     plan={"n_devices": n, "global_batch": batch,
                           "per_device_batch_size": batch // n},
                     _rows=[window, window])


def test_scaling_efficiency_by_hand():
    """Efficiencies of made-up throughputs, worked out by hand: weak is tokens/s per device
    over the fewest devices'; strong is the speed-up over the device ratio; with two meshes at
    the fewest devices the faster one is the base."""
    # weak: 4 a device; 1000 tokens/s on 1 device; per device 950, 800, 500 on 2, 4 and 8
    weak = [_job(f"dp{n}", n, 4 * n, t, "data.per_device_batch_size=4")
            for n, t in [(1, 1000), (2, 1900), (4, 3200), (8, 4000)]]
    # strong: 64 in all, on 2 devices two ways (dp2 1800 tokens/s, tp2 1200), then 4 and 8:
    # tp2 1200/1800; dp4 (3000/1800) / 2; dp8 (4000/1800) / 4.
    strong = [_job(mesh, n, 64, t, "data.batch_size=64")
              for mesh, n, t in [("dp2", 2, 1800), ("tp2", 2, 1200), ("dp4", 4, 3000),
                                 ("dp8", 8, 4000)]]
    got = {str(p): (kind, round(e, 6)) for p, (kind, e) in scaling_efficiency(weak + strong).items()}
    assert got == {"dp1_b4": ("weak", 1.0), "dp2_b8": ("weak", 0.95), "dp4_b16": ("weak", 0.8),
                   "dp8_b32": ("weak", 0.5),
                   "dp2_b64": ("strong", 1.0), "tp2_b64": ("strong", 0.666667),
                   "dp4_b64": ("strong", 0.833333), "dp8_b64": ("strong", 0.555556)}


def test_resolved_config_plans_again_on_another_mesh():
    """A config whose batch was written back (a run's saved config) follows the per-device
    batch when planned on another mesh, never the stale global batch."""
    run = _validated("sweep=weak_scaling", "parallelism=dp2")
    run = resolved_config(run, RunPlan(make_plan(run, 8, "cpu")))
    assert run.data.batch_size == 64
    run.parallelism = _validated("parallelism=dp8").parallelism
    assert make_plan(run, 8, "cpu").global_batch == 256
