"""Sweeps as a researcher runs them: real Hydra multiruns as subprocesses (basic, submitit and
Optuna), the sweep report read against the jobs' own files, and every preset composing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from conftest import CONF, ROOT, run_cli

from dxrun.checks import validate
from dxrun.config.registry import PRESETS, check_keys, preset_dir
from dxrun.tracking.wandb_file import read_run

QUICK = ("train.steps=3", "train.log_every=1")
NO_SAVES = "checkpoint.every=0"  # no test of these sweeps reads a checkpoint: none to wait for


def _jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if (p / ".hydra").is_dir()),
                  key=lambda p: int(p.name))


def _csv(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "report.csv") as f:
        return list(csv.DictReader(f))


def _num(cell: str) -> float | None:
    return float(cell) if cell else None


# --- one real 2 x 2 multirun (batch 16, 32 x dp1, dp4), shared by the tests below ---

# Two layouts a batch: each batch's ranking, strong scaling over dp1 and memory per device
# falling as the batch spreads need two; a third layout (dp2) showed nothing more.
DEVICES = (1, 4)

# Eight steps logged every step, saved at 4 and 8: windows 2-8 (step 1 compiles); the save at 4
# runs after row 4's window, so row 5 records it; the last save is in no window and no row.
GRID_SAVED = (5,)  # the rows that record a save
GRID_COUNTED = (2, 3, 4, 6, 7, 8)  # the windows the report counts


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("grid")
    sweep = cwd / "sweep"
    proc = run_cli("-m", "data.batch_size=16,32", "parallelism=dp1,dp4", "train.steps=8",
                   "train.log_every=1", "train.eval_every=3", "eval.batches=1",
                   "checkpoint.every=4", f"hydra.sweep.dir={sweep}", cwd=cwd)
    return sweep, proc


def _rows(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_grid_sweep_runs_four_jobs_on_the_devices_they_asked_for(grid):
    sweep, proc = grid
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = _jobs(sweep)
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    for job, (bs, n) in zip(jobs, [(b, n) for b in (16, 32) for n in DEVICES], strict=True):
        plan = json.loads((job / "plan.json").read_text())
        assert (plan["n_devices"], plan["dp"], plan["global_batch"]) == (n, n, bs)
        status = json.loads((job / "status.json").read_text())
        assert status["status"] == "ok" and status["job"] == int(job.name)
        assert status["started"] <= status["finished"]


@pytest.mark.e2e
def test_report_rows_equal_the_jobs_files(grid):
    sweep, _ = grid
    rows = _csv(sweep)
    assert len(rows) == 4
    for row, job in zip(rows, _jobs(sweep), strict=True):
        s = json.loads((job / "summary.json").read_text())
        plan = json.loads((job / "plan.json").read_text())
        assert row["job"] == job.name and row["status"] == "ok" and not row["reason"]
        assert row["overrides"] == " ".join(yaml.safe_load((job / ".hydra/overrides.yaml")
                                                           .read_text()))
        assert int(row["devices"]) == plan["n_devices"]
        assert int(row["batch_size"]) == plan["global_batch"]
        assert _num(row["train_loss"]) == s["train/loss"]
        assert _num(row["eval_loss"]) == s["eval/loss"]
        assert _num(row["step_mem_bytes_per_device"]) == s["mem/step_bytes_per_device"] > 0
        assert row["peak_mem_bytes_per_device"] == ""  # CPU: no allocator statistics
        assert _num(row["compile_time_s"]) == s["compile_time_s"] > 0
        assert row["mfu"] == ""  # CPU: no known peak, so no MFU (never a made-up number)
    # Per-job figures are the job's own: each compiled its own step, and the memory per device
    # falls as the same batch spreads over more devices (no job sees another's peak).
    mem = {(int(r["batch_size"]), int(r["devices"])): _num(r["step_mem_bytes_per_device"])
           for r in rows}
    for bs in (16, 32):
        assert mem[(bs, 1)] > mem[(bs, 4)]
    assert mem[(32, 1)] > mem[(16, 1)]
    md = (sweep / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and "| ok |" in line]
    assert len(table) == 4
    assert f"{float(rows[3]['train_loss']):.4f}" in table[3]
    assert f"{float(rows[3]['tokens_per_s']):,.0f}" in table[3]
    assert "4 jobs: 4 ok, 0 failed" in md and "![throughput](throughput.png)" in md


@pytest.mark.e2e
def test_every_throughput_figure_is_the_rankings_median(grid):
    """Saves inside the timed windows: each job's tokens_per_s, per device, scaling efficiency
    and plotted points are the median the ranking sorts by, over the windows no save held,
    worked out here from the jobs' metrics.jsonl."""
    import statistics

    from dxrun.report import find_jobs
    from dxrun.report import plots as sweep_report

    sweep, _ = grid
    rows = _csv(sweep)
    medians, per_device = {}, {}
    for row, job in zip(rows, _jobs(sweep), strict=True):
        logged = _rows(job)
        assert [r["step"] for r in logged if "perf/checkpoint_block_s" in r] == list(GRID_SAVED)
        assert [r["step"] for r in logged if "perf/tokens_per_s" in r] == list(range(2, 9))
        windows = [r["perf/tokens_per_s"] for r in logged if r["step"] in GRID_COUNTED]
        key = (int(row["batch_size"]), int(row["devices"]))
        medians[key] = statistics.median(windows)
        per_device[key] = medians[key] / key[1]
        assert int(row["tokens_per_s_windows"]) == len(GRID_COUNTED)
        assert _num(row["tokens_per_s"]) == medians[key]
        assert _num(row["tokens_per_s_per_device"]) == pytest.approx(per_device[key], rel=1e-12)
        assert int(row["per_device_batch"]) == key[0] // key[1]
        # the global batch held fixed: strong scaling over dp1 at that batch
        assert _num(row["strong_scaling_efficiency"]) == pytest.approx(
            per_device[key] / per_device[(key[0], 1)])
        assert row["weak_scaling_efficiency"] == ""
    md = (sweep / "report.md").read_text().splitlines()
    assert "is the job's median over its post-compile timing windows (6 a job: " in md[6]
    for bs in (16, 32):  # the ranking's median column: the table's tokens_per_s
        at = md.index(f"## Layouts ranked at batch {bs}")
        ranked = {cells[2].strip("` "): cells[5].strip() for cells in
                  (line.split("|") for line in md[at + 6:at + 6 + len(DEVICES)])}
        assert ranked == {f"dp{n}": f"{medians[(bs, n)]:,.0f}" for n in DEVICES}
    jobs = find_jobs(sweep)
    (ax,) = sweep_report.throughput_figure(jobs).axes
    assert sorted(b.get_width() for b in ax.patches) == sorted(medians.values())
    (ax,) = sweep_report.scaling_figure(jobs).axes
    speedups = [list(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() == "-"]
    assert speedups == [pytest.approx([medians[(bs, n)] / medians[(bs, 1)] for n in DEVICES])
                        for bs in (16, 32)]
    (ax,) = sweep_report.efficiency_figure(jobs).axes
    assert {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()} == {
        f"dp{n} ({n} dev)": pytest.approx([per_device[(bs, n)] for bs in (16, 32)])
        for n in DEVICES}


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["throughput", "loss", "efficiency", "scaling"])
def test_plots_are_real_images(grid, name):
    import matplotlib.image as mpimg
    import numpy as np

    sweep, _ = grid
    path = sweep / f"{name}.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)
    assert pixels.shape[:2] == (420, 640)  # 6.4 x 4.2 inches at 100 dpi
    rgb = pixels[..., :3]
    # Drawn, not blank: many distinct colours, and coloured (line) pixels, not only grey text.
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50
    assert (rgb.max(axis=-1) - rgb.min(axis=-1) > 0.3).sum() > 200


@pytest.mark.e2e
def test_jobs_share_one_wandb_group_and_the_report_is_uploaded_to_it(grid):
    sweep, _ = grid
    runs = [read_run(next(job.glob("wandb/offline-run-*/run-*.wandb"))) for job in _jobs(sweep)]
    groups = {r["group"] for r in runs}
    assert groups == {f"sweep-{sweep.parent.name}_sweep"}
    assert {r["job_type"] for r in runs} == {"sweep"}
    assert [r["name"] for r in runs][:2] == [
        f"tiny-dp{n}-bs16-steps8-log_every1-eval_every3-batches1-every4" for n in DEVICES]
    (path,) = sweep.glob("wandb/offline-run-*/run-*.wandb")
    report = read_run(path)
    assert report["group"] in groups and report["job_type"] == "sweep-report"
    (row,) = report["history"]  # one log call; the reader flattens nested keys with "/"
    for name in ("throughput", "loss", "efficiency"):
        assert row[f"report/{name}/_type"] == "image-file"
        uploaded = path.parent / "files" / row[f"report/{name}/path"]
        assert uploaded.read_bytes() == (sweep / f"{name}.png").read_bytes()
    assert row["report/jobs/_type"] == "table-file" and row["report/jobs/nrows"] == 4


@pytest.mark.e2e
def test_report_cli_rewrites_the_same_report(grid):
    from dxrun.report.__main__ import main

    sweep, _ = grid
    before = (sweep / "report.csv").read_text()
    (sweep / "report.csv").unlink()
    assert main([str(sweep)]) == 0
    assert (sweep / "report.csv").read_text() == before


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["empty", "missing"])
def test_report_cli_refuses_a_dir_without_jobs(tmp_path, where):
    import subprocess
    import sys

    target = tmp_path / "sweep"
    if where == "empty":
        (target / "0").mkdir(parents=True)  # a dir, but no job ever claimed it (.hydra/)
    proc = subprocess.run([sys.executable, "-m", "dxrun.report", str(target)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"dxrun.report: error: {target} ")
    assert ("holds no jobs" if where == "empty" else "is not a directory") in line
    assert "multirun/<date>/<time>" in line


# --- failures: a refused job and a job that fails at run time, in one sweep ---


@pytest.mark.e2e
def test_failed_jobs_are_reported_and_the_others_finish(tmp_path):
    """Job 0 trains; job 1 is refused (range check); job 2 fails while training (the test-only
    DXRUN_TEST_ERROR_AT_STEP after step 3, which job 0's two steps never reach; the same on
    every host)."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "train.steps=2,-1,4", "train.eval_every=0", "logger=none", NO_SAVES,
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                   env={"DXRUN_TEST_ERROR_AT_STEP": "3"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # 1: a job crashed
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("dxrun: error: 2 sweep job(s) failed: #1 (train.steps=-1 ")
    assert "#2 (train.steps=4 " in last
    ok, refused, crashed = _csv(sweep)
    assert ok["status"] == "ok" and _num(ok["train_loss"]) == json.loads(
        (sweep / "0" / "summary.json").read_text())["train/loss"]
    assert refused["status"] == "failed (refused)" and refused["log"] == ""
    assert refused["reason"].startswith("train.steps=-1 is outside its range (0, 2^31)")
    assert crashed["status"] == "failed (crashed)"
    assert crashed["reason"].startswith("RuntimeError: injected failure after step 3")
    assert "Traceback (most recent call last)" in Path(crashed["log"]).read_text()
    assert crashed["log"] == str(sweep / "2" / "dxrun.log")
    md = (sweep / "report.md").read_text()
    assert "3 jobs: 1 ok, 2 failed" in md and "- job 1 (refused): train.steps=-1" in md
    assert "- job 2 (crashed): RuntimeError: injected failure after step 3" in md


# --- one process per job: submitit_local ---


@pytest.mark.e2e
def test_submitit_local_runs_each_job_with_its_own_device_count(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "hydra/launcher=submitit_local", "runtime.cpu_devices=2,4",
                   "train.steps=2", "train.eval_every=0", "logger=none", NO_SAVES,
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, n in zip(_jobs(sweep), (2, 4), strict=True):
        plan = json.loads((job / "plan.json").read_text())
        assert plan["n_visible"] == n and plan["n_devices"] == n  # parallelism=dp (the default): all
        assert f"simulating {n} CPU devices" in (job / "dxrun.log").read_text()
    assert list(sweep.glob(".submitit/*"))  # really submitit: its job folders
    assert [r["status"] for r in _csv(sweep)] == ["ok", "ok"]


# --- Optuna ---


@pytest.mark.e2e
def test_optuna_sweep_reports_a_failed_trial_as_failed(tmp_path):
    """sweep=lr_optuna as shipped plus a batch size choice in which 30 cannot split over dp8:
    the seeded TPE start samples batch 8, 30, 16, so the second trial is refused. Optuna is
    told it failed (not given a number), and the best value is the better finished trial's
    eval/loss."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "sweep=lr_optuna", "hydra.sweeper.sampler.seed=6",
                   "hydra.sweeper.n_trials=3", "data.batch_size=choice(8,16,30)",
                   "parallelism=dp8", "train.steps=4", "train.log_every=2", "train.eval_every=2",
                   "eval.batches=1", "logger=none", NO_SAVES, f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]  # 2: the only failure was refused
    out = proc.stdout + proc.stderr
    assert out.count("Failed experiment: Return value must be float-castable. Got 'None'") == 1
    rows = _csv(sweep)
    assert [r["status"] for r in rows] == ["ok", "failed (refused)", "ok"]
    assert [r["batch_size"] for r in rows] == ["8", "30", "16"]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    losses = {int(r["job"]): _num(r["eval_loss"]) for r in rows if r["status"] == "ok"}
    best = min(losses, key=losses.get)
    assert results["best_value"] == losses[best]
    assert results["best_params"]["data.batch_size"] == int(rows[best]["batch_size"])
    assert set(results["best_params"]) == {"optimizer.lr", "optimizer.warmup_steps",
                                           "data.batch_size"}
    assert "Optuna best:" in (sweep / "report.md").read_text()


@pytest.mark.e2e
def test_optuna_study_without_a_finished_trial_ends_in_one_line(tmp_path):
    """Every trial refused: Optuna has no best value. One line per failure and the report, no
    traceback (hydra_plugins.dxrun_sweeper)."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "sweep=lr_optuna", "hydra.sweeper.n_trials=1", "data.batch_size=30",
                   "parallelism=dp8", "logger=none", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "Optuna: no trial finished" in proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("dxrun: error: 1 sweep job(s) failed: #0 (")
    assert [r["status"] for r in _csv(sweep)] == ["failed (refused)"]
    assert not (sweep / "optimization_results.yaml").exists()


# --- presets compose (no subprocess) ---


def _compose(*overrides: str, hydra: bool = False):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="dxrun"):
        return compose(config_name="config", overrides=list(overrides),
                       return_hydra_config=hydra)


def _validated(*overrides: str):
    from omegaconf import open_dict

    from dxrun.config.hf_model import apply_hf_model

    cfg = _compose(*overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    check_keys(cfg)
    apply_hf_model(cfg, list(overrides))  # as python -m dxrun does: the HF dir's model shape
    validate(cfg)
    return cfg


def _sweep_jobs(params: dict) -> list[list[str]]:
    """Every job of a basic sweeper's grid (``key: a,b,c`` values)."""
    import itertools

    axes = [[f"{k}={v}" for v in str(vals).split(",")] for k, vals in params.items()]
    return [list(job) for job in itertools.product(*axes)]


def test_every_preset_is_a_global_package():
    assert {p.name for p in (ROOT / "sweeps" / "wandb").glob("*.yaml")} == {
        "lr.yaml", "batch_devices.yaml"}  # the W&B sweep definitions the next tests read
    for group in PRESETS:
        files = sorted(preset_dir(group).glob("*.yaml"))
        assert files, group
        for path in files:
            assert path.read_text().startswith("# @package _global_\n"), path


@pytest.mark.parametrize("name", sorted(p.stem for p in preset_dir("experiment").glob("*.yaml")))
def test_every_experiment_composes_and_plans(name):
    from dxrun.plan import make_plan

    # finetune_hf: the published Llama 3.1 8B config.json (shapes only: nothing is loaded)
    extra = {"gpt2_small_text": ["data.path=corpus.txt"],
             "finetune_hf": [f"model.init_from=hf:{ROOT / 'tests/fixtures/llama-3.1-8b'}",
                             "data.path=corpus.txt"]}.get(name, [])
    cfg = _compose(f"experiment={name}", *extra, hydra=True)
    params = cfg.hydra.sweeper.get("params") or {}
    for job in _sweep_jobs(params) or [[]]:
        run = _validated(f"experiment={name}", *extra, *job)
        make_plan(run, 8, "cpu")  # raises ConfigError for a mesh the model cannot take
    expected = {"markov_convergence": ("tiny", "markov"), "tp_scaling": ("tiny", "markov"),
                "gpt2_small_text": ("small", "text"), "llama_fsdp": ("tiny_llama", "markov"),
                "finetune_hf": ("hf-llama-3.1-8b", "text"),
                "long_context_llama": ("llama2_7b_32k", "markov"),
                "moe_expert_parallel": ("moe_tiny", "markov")}
    assert (run.model.name, run.data.name) == expected[name]
    if name == "tp_scaling":
        assert [j[0] for j in _sweep_jobs(params)] == [f"parallelism={p}" for p in
                                                      ("dp1", "tp2", "tp4", "tp8")]
    if name == "llama_fsdp":
        assert run.parallelism.fsdp == 8 and run.model.norm == "rmsnorm"
    if name == "long_context_llama":  # 32k tokens, each sequence split over 2 devices
        assert (run.parallelism.cp, run.data.seq_len, run.model.max_seq_len) == (2, 32768, 32768)
    if name == "finetune_hf":  # the shape is config.json's, the lr the preset's
        assert (run.model.n_layers, run.model.d_model, run.model.n_kv_heads) == (32, 4096, 8)
        assert run.optimizer.lr == 3e-5 and run.train.precision == "bf16"


def test_batch_devices_sweep_composes_every_job_and_the_command_line_wins():
    from dxrun.plan import make_plan

    cfg = _compose("sweep=batch_devices", hydra=True)
    jobs = _sweep_jobs(cfg.hydra.sweeper.params)
    assert len(jobs) == 3 * 7
    sizes = set()
    for job in jobs:
        plan = make_plan(_validated("sweep=batch_devices", *job), 8, "cpu")
        sizes.add(plan.n_devices)
    assert sizes == {1, 2, 4, 8}
    # A key given on the command line replaces the preset's values (Hydra's basic sweeper
    # merges hydra.sweeper.params first, then the command line, one list per key).
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    parsed = OverridesParser.create().parse_overrides([*params, "data.batch_size=32,64"])
    (batches,) = BasicSweeper.split_arguments(parsed, None)
    assert len(batches) == 2 * 7 and {j[0] for j in batches} == {"data.batch_size=32",
                                                                "data.batch_size=64"}


@pytest.mark.parametrize("preset", ["sweep=batch_devices", "sweep=strong_scaling",
                                    "sweep=weak_scaling", "experiment=tp_scaling"])
def test_throughput_presets_log_enough_windows_to_rank(preset):
    """The rows each throughput preset's jobs log on CPU, as the loop writes them (a row every
    train.log_every steps and at the last; the compiling first step in no window; a save's
    block in the next row, whose window it held; the final save in no row: the grid sweep above
    checks this on real jobs), leave the report's statistic at least ranking.STEADY_WINDOWS
    windows a job."""
    from dxrun.cost import save_cadence
    from dxrun.report import job_throughput
    from dxrun.report.ranking import STEADY_WINDOWS

    cfg = _validated(preset)
    steps, every = cfg.train.steps, cfg.train.log_every
    save_every, save_minutes = save_cadence(cfg.checkpoint.every, cfg.checkpoint.every_minutes,
                                            "cpu", 0.0, 1.0)
    rows, unlogged = [], False
    for done in range(1, steps + 1):
        if done % every == 0 or done == steps:
            row = {"step": done, "perf/tokens_per_s": 1000.0 + done} if done > 1 else {}
            rows.append({**row, **({"perf/checkpoint_block_s": 0.1} if unlogged else {})})
            unlogged = False
        # the save point after step ``done`` comes after its row: the next row records it
        unlogged |= bool(save_every and done % save_every == 0)
    assert save_minutes == 0  # no save by the clock, whose steps no test could know
    assert len(job_throughput(rows).windows) >= STEADY_WINDOWS == 5


def test_lr_optuna_sweep_composes():
    cfg = _compose("sweep=lr_optuna", hydra=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert cfg.hydra.sweeper.direction == "minimize" and cfg.train.objective == "eval/loss"
    assert set(cfg.hydra.sweeper.params) == {"optimizer.lr", "optimizer.warmup_steps"}
    assert cfg.train.eval_every > 0
    _validated("sweep=lr_optuna", "optimizer.lr=0.001", "optimizer.warmup_steps=100")


def test_objective_needs_evaluation():
    from dxrun.config.errors import ConfigError

    with pytest.raises(ConfigError, match="train.objective=eval/loss needs evaluation"):
        _validated("sweep=lr_optuna", "train.eval_every=0")


def test_slurm_launcher_composes_with_nodes_gpus_time_partition():
    cfg = _compose("hydra/launcher=submitit_slurm", "hydra.launcher.nodes=1",
                   "hydra.launcher.gpus_per_node=8", "hydra.launcher.timeout_min=240",
                   "hydra.launcher.partition=gpu", hydra=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.timeout_min,
            launcher.partition) == (1, 8, 240, "gpu")


def test_multinode_slurm_preset_runs_one_task_per_node_over_several_nodes():
    launcher = _compose("hydra/launcher=slurm_multinode", "hydra.launcher.nodes=4",
                        "hydra.launcher.partition=gpu", hydra=True).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node,
            launcher.partition, launcher.timeout_min) == (4, 1, 8, "gpu", 240)


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps" / "wandb").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_wandb_sweep_definitions_compose(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["command"][-4:] == ["python", "-m", "dxrun", "${args_no_hyphens}"][-4:]
    assert spec["metric"]["name"] in ("eval/loss", "perf/tokens_per_s")
    for key, p in spec["parameters"].items():
        values = p.get("values") or ([p["value"]] if "value" in p else [p["min"], p["max"]])
        for v in values:
            _validated(f"{key}={v}")  # the agent runs `python -m dxrun key=value ...`


def test_a_users_own_experiment_from_hydra_searchpath(tmp_path):
    """How the README says to add an experiment without touching dxrun: a dir of one's own
    with experiment/NAME.yaml, put on Hydra's search path."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny_llama\ntrain:\n  steps: 7\n")
    cfg = _validated(f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine")
    assert cfg.model.name == "tiny_llama" and cfg.train.steps == 7


# --- a sweep read back after kills and stops, from the files jobs leave (no training) ---


def _job(sweep: Path, num: int, status: dict, metrics: str = "") -> Path:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr=0.0{num + 1}\n")
    (job / "status.json").write_text(json.dumps({"job": num, **status}))
    (job / "metrics.jsonl").write_text(metrics)
    return job


def test_report_and_exit_code_of_a_sweep_with_a_stopped_job_and_a_torn_line(tmp_path, capsys,
                                                                            caplog):
    """A job killed mid-write left ``{"step": 3, "train/lo``; another was stopped by SIGTERM
    after committing its checkpoint: the report is written (one warning for the torn line),
    the stopped job is listed as resumable, not failed, and the sweep exits 0 (130 once a job
    was stopped by SIGINT)."""
    import logging

    from dxrun.report import exit_for_failed_jobs as _exit_for_failed_jobs
    from dxrun.report import write_report

    sweep = tmp_path / "sweep"
    rows = "".join(json.dumps({"step": s, "train/loss": 3.0 - s, "data/tokens_seen": 64.0 * s})
                   + "\n" for s in (1, 2))
    ok = _job(sweep, 0, {"status": "ok"}, rows + '{"step": 3, "train/lo')
    (ok / "summary.json").write_text(json.dumps({"step": 2, "train/loss": 1.0}))
    resume = f"python -m dxrun optimizer.lr=0.02 hydra.run.dir={sweep / '1'}"
    stopped = {"status": "stopped", "signal": "SIGTERM", "step": 40,
               "checkpoint": str(sweep / "1" / "checkpoints" / "40"), "relaunch": resume}
    _job(sweep, 1, stopped, rows)
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        jobs = write_report(sweep)
    assert [r.message for r in caplog.records] == [
        f"{ok / 'metrics.jsonl'}: skipped 1 line(s) cut short or damaged (a killed job?): "
        '{"step": 3, "train/lo']
    assert [j.status for j in jobs] == ["ok", "stopped"]
    report = (sweep / "report.md").read_text()
    assert "2 jobs: 1 ok, 1 stopped, 0 failed." in report and "## Failed jobs" not in report
    line = (f"- job 1: stopped by SIGTERM at step 40, checkpoint {sweep / '1' / 'checkpoints'}"
            f"/40 committed; resume with: {resume}")
    assert line in report.splitlines()
    _exit_for_failed_jobs(sweep)  # SIGTERM: a requeue point, exit 0
    assert capsys.readouterr().err == f"dxrun: job #1 {line.partition(': ')[2]}\n"
    (sweep / "1" / "status.json").write_text(json.dumps({**stopped, "signal": "SIGINT"}))
    with pytest.raises(SystemExit) as e:
        _exit_for_failed_jobs(sweep)
    assert e.value.code == 130
