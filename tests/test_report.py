"""The sweep report read from job dirs written here by hand (the files a job leaves: .hydra/,
status.json, plan.json, summary.json, metrics.jsonl): the layout ranking and its first line,
the plots chosen by what the sweep varied (labels read from the figures, PNGs read back), a
job killed from outside, and a W&B upload that fails. No training but one killed run."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
from conftest import subprocess_env

from dxrun.report import (
    LayoutRun,
    find_jobs,
    job_throughput,
    rank_layouts,
    ranking_table,
    verdict,
    write_report,
)
from dxrun.report import plots as sweep_report

PNG = b"\x89PNG\r\n\x1a\n"


def _mesh(name: str) -> dict[str, int]:
    axes = {"dp": 1, "fsdp": 1, "tp": 1}
    axes.update({k: int(n) for k, n in re.findall(r"([a-z]+?)(\d+)", name)})
    return axes


def _job(sweep: Path, num: int, overrides: list[str], windows: list[float], *, mesh: str = "dp8",
         batch: int = 64, loss: float = 2.0, eval_loss: float | None = None,
         held: tuple[int, ...] = (), logger: dict | None = None) -> Path:
    """A finished job: ``windows`` are its logged tokens/s (one row every 10 steps after the
    compiling step); the rows at positions ``held`` record a checkpoint save inside their window
    (as a run logs it); the loss falls the same way on every mesh (it is the same workload)."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / ".hydra" / "config.yaml").write_text(json.dumps({"logger": logger or {"name": "none"}}))
    m = _mesh(mesh)
    n = m["dp"] * m["fsdp"] * m["tp"]
    (job / "plan.json").write_text(json.dumps({**m, "n_devices": n, "global_batch": batch,
                                               "per_device_batch_size": batch // (m["dp"] * m["fsdp"]),
                                               "platform": "cpu"}))
    rows = []
    for k, t in enumerate(windows):
        row = {"step": 10 * (k + 1), "train/loss": loss + 0.5 / (k + 1),
               "data/tokens_seen": 10.0 * (k + 1) * batch * 32, "perf/tokens_per_s": t,
               "perf/tokens_per_s_per_device": t / n}
        if k in held:
            row["perf/checkpoint_block_s"] = 2.0
        rows.append(row)
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"train/loss": loss, "tokens_per_s": windows[-1],
               "perf/tokens_per_s_per_device": windows[-1] / n,
               "mem/step_bytes_per_device": 2.0**20 * batch / n}
    if eval_loss is not None:
        summary["eval/loss"] = eval_loss
    (job / "summary.json").write_text(json.dumps(summary))
    # one after another: the report would otherwise warn that their throughputs shared the host
    (job / "status.json").write_text(json.dumps({"status": "ok", "job": num, "started": num * 10.0,
                                                 "finished": num * 10.0 + 5}))
    return job


# batch 32: dp8 and dp4_tp2 overlap; batch 64: dp4_tp2 beats dp8 beyond the spread (by hand:
# medians 1120 and 1000, quartiles 1110-1130 and 996.25-1003.75; dp8's fourth row records a save
# held inside its window (300): left out).
LAYOUTS = {
    (32, "dp8"): [800, 900, 700, 850, 750],
    (32, "dp4_tp2"): [770, 790, 780, 800, 760],
    (32, "tp2"): [400, 410, 405, 395, 390],
    (64, "dp8"): [1000, 990, 1010, 300, 1005, 995, 1000],
    (64, "dp4_tp2"): [1100, 1120, 1150, 1130, 1110],
    (64, "tp2"): [500, 505, 510, 495, 490],
}


@pytest.fixture
def layout_sweep(tmp_path) -> Path:
    sweep = tmp_path / "sweep"
    for num, ((batch, mesh), windows) in enumerate(LAYOUTS.items()):
        _job(sweep, num, [f"data.batch_size={batch}", f"parallelism={mesh}"], windows,
             mesh=mesh, batch=batch, held=(3,) if 300 in windows else ())
    return sweep


def _rows(tokens_per_s: dict[int, float], saves: tuple[int, ...] = (), n: int = 4,
          mfu: bool = False) -> list[dict]:
    """Metrics rows as a run logs them: step 1's row has no window (the compiling step), the
    others their tokens/s; a step in ``saves`` records a save inside its window (a run logs a
    save made at a step in the next row)."""
    rows = [{"step": 1, "train/loss": 3.0}]
    for step, t in tokens_per_s.items():
        row = {"step": step, "perf/tokens_per_s": t, "perf/tokens_per_s_per_device": t / n}
        if mfu:
            row["perf/mfu"] = t / 1e4
        rows.append(row)
    for row in rows:
        if row["step"] in saves:
            row["perf/checkpoint_block_s"] = 0.5
    return rows


def test_job_throughput_by_hand():
    """The one statistic every figure of the report reads: the median over the timing windows,
    leaving out the rows that record a save (it held their window)."""
    t = {2: 100.0, 3: 120.0, 4: 110.0, 5: 40.0, 6: 130.0, 7: 90.0, 8: 105.0}
    # saves made at steps 4 and 7: recorded in rows 5 and 8, the windows they held, left out
    got = job_throughput(_rows(t, saves=(5, 8), mfu=True))
    assert got.windows == (100.0, 120.0, 110.0, 130.0, 90.0)
    assert got.median == 110.0
    assert got.per_device == 27.5  # the same windows over 4 devices
    assert got.mfu == pytest.approx(0.011)
    # no save: all seven, median 105; no perf/mfu logged (no known peak): no MFU
    got = job_throughput(_rows(t))
    assert (len(got.windows), got.median, got.per_device, got.mfu) == (7, 105.0, 26.25, None)
    # a save recorded in an evaluation's row (no window of its own: the evaluation started a
    # new one) held no window that is timed, so every window counts
    rows = _rows({2: 100.0, 4: 10.0, 5: 120.0})
    rows.insert(2, {"step": 3, "eval/loss": 2.0, "perf/checkpoint_block_s": 0.5})
    assert job_throughput(rows).windows == (100.0, 10.0, 120.0)
    # every window may have held a save: all of them count (there is nothing cleaner)
    assert job_throughput(_rows({2: 100.0, 3: 50.0}, saves=(2, 3))).windows == (100.0, 50.0)
    assert job_throughput(_rows({})) is None
    # the ranking sorts a job by the same number
    (ranked,) = rank_layouts([LayoutRun("dp4", job_throughput(_rows(t, saves=(5, 8))).windows)])
    assert ranked.median == 110.0


def test_rank_layouts_by_hand():
    ranked = rank_layouts([LayoutRun("dp8", (1000.0, 990.0, 1010.0, 1005.0, 995.0), 8),
                           LayoutRun("fsdp8", (), 8, excluded="does not fit: 31.2 of 18.3 GiB"),
                           LayoutRun("dp4_tp2", (1100.0, 1120.0, 1150.0, 1130.0, 1110.0), 8),
                           LayoutRun("dp2_tp4", (1090.0, 1135.0, 1200.0), 8),
                           LayoutRun("tp8", (600.0,), 8),
                           LayoutRun("fsdp4_tp2", (), 8, estimated_ms=450.0)])
    # unmeasured last, by their estimate (none: after those with one)
    assert [(r.layout, r.rank) for r in ranked] == [("dp2_tp4", 1), ("dp4_tp2", 2), ("dp8", 3),
                                                   ("tp8", 4), ("fsdp4_tp2", None),
                                                   ("fsdp8", None)]
    best, _, dp8, tp8, _, _ = ranked
    assert (best.q1, best.median, best.q3) == (1112.5, 1135.0, 1167.5)
    assert (dp8.q1, dp8.median, dp8.q3) == (995.0, 1000.0, 1005.0)
    assert (tp8.q1, tp8.median, tp8.q3) == (600.0, 600.0, 600.0)
    assert dp8.vs_best == pytest.approx(1.135) and best.vs_best == 1.0
    assert [r.why for r in ranked] == [
        "fastest", "within the spread of dp2_tp4 (1.01×)",
        "slower: 1.14× behind dp2_tp4, beyond the spread",
        "within the spread of dp2_tp4 (1.89×)",  # one window: no spread, never told apart
        "not measured", "does not fit: 31.2 of 18.3 GiB"]
    assert verdict(ranked, "at batch 64") == (
        "at batch 64: not distinguishable: dp2_tp4 1.01× dp4_tp2, spreads overlap")
    assert verdict(ranked[1:3], "at batch 64") == (
        "fastest at batch 64: dp4_tp2, 1.12× dp8, beyond the spread")
    assert verdict(rank_layouts([LayoutRun("a", (2.0,)), LayoutRun("b", (1.0, 1.0))]), "here") \
        == "here: not distinguishable: a 2.00× b, a timed in one window only"
    # The table auto shares: its estimate and measured ms (64 x 128 tokens a step) when given.
    lines = ranking_table(rank_layouts([LayoutRun("dp4_tp2", (8192.0, 8192.0), 8, 2.0**21, 900.0),
                                        LayoutRun("fsdp8", (), 8, 2.0**30, 700.0, "does not fit")]),
                          tokens_per_step=64 * 128)
    assert lines[0] == ("| rank | layout | devices | memory/device | estimated ms | median tokens/s "
                        "| spread (IQR) | windows | measured ms | × best |  | why |")
    assert lines[2] == ("| 1 | `dp4_tp2` | 8 | 2.0 MiB | 900.0 | 8,192 | 8,192–8,192 | 2 | 1,000.0 "
                        "| 1.00 | ✓ | fastest |")
    assert lines[3] == "| – | `fsdp8` | 8 | 1,024.0 MiB | 700.0 | – | – | 0 | – | – |  | does not fit |"


def test_report_names_the_fastest_layout_per_batch_in_its_first_line(layout_sweep):
    write_report(layout_sweep)
    md = (layout_sweep / "report.md").read_text().splitlines()
    assert md[0] == ("# at batch 32: not distinguishable: dp8 1.03× dp4_tp2, spreads overlap; "
                     "fastest at batch 64: dp4_tp2, 1.12× dp8, beyond the spread")
    at64 = md.index("## Layouts ranked at batch 64")
    assert md[at64 + 2] == "fastest at batch 64: dp4_tp2, 1.12× dp8, beyond the spread."
    assert md[at64 + 6] == ("| 1 | `dp4_tp2` | 8 | 8.0 MiB | 1,120 | 1,110–1,130 | 5 | 1.00 | ✓ "
                            "| fastest |")
    # dp8: six of its seven windows, the one a save held (300) left out
    assert md[at64 + 7] == ("| 2 | `dp8` | 8 | 8.0 MiB | 1,000 | 996–1,004 | 6 | 1.12 |  "
                            "| slower: 1.12× behind dp4_tp2, beyond the spread |")
    assert md[at64 + 8].startswith("| 3 | `tp2` | 2 | 32.0 MiB | 500 | 495–505 | 5 | 2.24 |")
    assert md[6] == ("Every throughput figure in this report (the ranking, tokens_per_s, "
                     "tokens_per_s_per_device, mfu, the scaling efficiencies and the plots) is "
                     "the job's median over its post-compile timing windows (5–6 a job: "
                     "tokens_per_s_windows; one every train.log_every steps), leaving out the "
                     "windows a checkpoint save held (perf/checkpoint_block_s).")
    with open(layout_sweep / "report.csv") as f:
        rows = {(r["batch_size"], r["mesh"]): r for r in csv.DictReader(f)}
    # the table's throughput is the ranking's median, never the last window (1,000 here too,
    # but dp4_tp2's last is 1,110 against its median of 1,120)
    assert float(rows[("64", "dp8")]["tokens_per_s"]) == 1000.0
    assert rows[("64", "dp8")]["tokens_per_s_windows"] == "6"
    assert float(rows[("64", "dp8")]["tokens_per_s_per_device"]) == 125.0
    assert float(rows[("64", "dp4_tp2")]["tokens_per_s"]) == 1120.0
    assert float(rows[("64", "tp2")]["tokens_per_s_per_device"]) == 250.0


def test_throughput_plot_labels_every_layout_once_without_overlap(layout_sweep):
    jobs = find_jobs(layout_sweep)
    fig = sweep_report.throughput_figure(jobs)
    (ax,) = fig.axes
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == ["dp8 (8 dev)", "dp4_tp2 (8 dev)", "tp2 (2 dev)",  # batch 32, fastest first
                     "dp4_tp2 (8 dev)", "dp8 (8 dev)", "tp2 (2 dev)"]  # batch 64
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["batch 32", "batch 64"]
    assert [round(b.get_width()) for b in ax.patches] == [800, 780, 400, 1120, 1000, 500]
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.get_yticklabels() + ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    made = sweep_report.write_plots(layout_sweep, jobs)
    assert [p.name for p in made] == ["throughput.png", "loss.png", "efficiency.png",
                                      "scaling.png"]
    assert all(p.read_bytes()[:8] == PNG for p in made)


def test_scaling_and_efficiency_plots_draw_the_jobs_medians(layout_sweep):
    """Both plots read the statistic the ranking sorts by (dp4_tp2 at batch 64: its median 1,120
    tokens/s, 140 a device; its last window, 1,110, is drawn nowhere)."""
    jobs = find_jobs(layout_sweep)
    (ax,) = sweep_report.efficiency_figure(jobs).axes
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert drawn == {"tp2 (2 dev)": [200.0, 250.0], "dp4_tp2 (8 dev)": [97.5, 140.0],
                     "dp8 (8 dev)": [100.0, 125.0]}  # tokens/s per device at batch 32, 64
    (ax,) = sweep_report.scaling_figure(jobs).axes
    measured = [list(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() == "-"]
    # strong scaling over tp2: the fastest 8-device mesh's tokens/s over tp2's
    assert measured == [[1.0, 800 / 400], [1.0, 1120 / 500]]


def test_loss_legend_has_one_entry_per_workload(layout_sweep):
    fig = sweep_report.loss_figure(find_jobs(layout_sweep))
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 6  # every job's curve is drawn (two visible: the same
    # workload draws the same curve on every mesh) ...
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [  # ... named once a workload
        "data.batch_size=32 (3 jobs: dp8, dp4_tp2, tp2)",
        "data.batch_size=64 (3 jobs: dp8, dp4_tp2, tp2)"]


def test_lr_sweep_plots_final_loss_against_lr_and_names_the_lowest(tmp_path):
    sweep = tmp_path / "sweep"
    for num, (lr, loss) in enumerate([(0.0001, 3.1), (0.001, 2.4), (0.01, 2.2), (0.1, 2.9)]):
        _job(sweep, num, [f"optimizer.lr={lr}", "train.steps=40"], [900.0, 910.0],
             loss=loss + 0.05, eval_loss=loss)
    jobs = write_report(sweep)
    assert (sweep / "report.md").read_text().splitlines()[0] == (
        "# lowest final eval/loss: optimizer.lr=0.01 (2.2000)")
    assert sorted(p.name for p in sweep.glob("*.png")) == ["final_loss.png", "loss.png"]
    assert (sweep / "final_loss.png").read_bytes()[:8] == PNG
    fig = sweep_report.final_loss_figure(jobs)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer.lr" and ax.get_xscale() == "log"
    points, best = ax.collections
    assert points.get_offsets().tolist() == [[0.0001, 3.1], [0.001, 2.4], [0.01, 2.2], [0.1, 2.9]]
    assert best.get_offsets().tolist() == [[0.01, 2.2]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lowest: optimizer.lr=0.01"]
    (ax,) = sweep_report.loss_figure(jobs).axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        f"optimizer.lr={lr}" for lr in (0.0001, 0.001, 0.01, 0.1)]


@pytest.mark.parametrize("left", ["running", "nothing"])
def test_a_job_that_never_finished_reads_as_unfinished(tmp_path, left):
    """What a killed job leaves: status.json still "running" (written as the run starts), or
    not even that and no summary.json (killed before it wrote its status)."""
    sweep = tmp_path / "sweep"
    job = _job(sweep, 0, ["optimizer.lr=0.01"], [900.0, 910.0])
    (job / "summary.json").unlink()
    if left == "running":
        (job / "status.json").write_text(json.dumps({"status": "running", "job": 0}))
    else:
        (job / "status.json").unlink()
    (job / "dxrun.log").write_text("step 10\n")
    (j,) = write_report(sweep)
    assert (j.status, j.kind, j.log) == ("failed", "unfinished", str(job / "dxrun.log"))
    reason = ("did not finish (killed, timed out, or still running)" if left == "running"
              else "no summary.json: the job never finished")
    md = (sweep / "report.md").read_text()
    assert "1 job: 0 ok, 1 failed." in md
    assert f"- job 0 (unfinished): {reason} — log: `{job / 'dxrun.log'}`" in md.splitlines()


@pytest.mark.e2e
def test_a_run_killed_from_outside_is_reported_unfinished(tmp_path):
    """A real run SIGKILLed (as the OOM killer or a SLURM timeout does) once it has started:
    nothing of dxrun runs after the kill, and the report still calls it unfinished."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-m", "dxrun", "train.steps=1000000",
                             "parallelism=dp",  # a run this long would search its layout
                             "train.eval_every=0", "logger=none", f"hydra.run.dir={run}"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # killed as soon as the run has said it runs: the cheapest point that is past dxrun's start
        while not ((run / "status.json").is_file() and (run / "dxrun.log").is_file()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert json.loads((run / "status.json").read_text())["status"] == "running"
    (j,) = write_report(run)
    assert (j.status, j.kind) == ("failed", "unfinished")
    assert j.reason == "did not finish (killed, timed out, or still running)"
    assert j.log == str(run / "dxrun.log")
    assert "1 job: 0 ok, 1 failed." in (run / "report.md").read_text()


def test_a_failed_wandb_upload_is_a_warning(tmp_path, caplog):
    """The jobs logged to W&B, but W&B cannot write its run (a file where its dir must go): the
    report is written all the same, the failure is one warning, and the CLI exits 0."""
    from dxrun.report.__main__ import main

    sweep = tmp_path / "sweep"
    for num, lr in enumerate((0.001, 0.01)):
        _job(sweep, num, [f"optimizer.lr={lr}"], [900.0, 910.0],
             logger={"name": "wandb", "project": "dxrun-test", "mode": "offline"})
    (sweep / "wandb").write_text("not a dir\n")
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        write_report(sweep, upload=True)
        assert main([str(sweep), "--wandb"]) == 0
    # dxrun's own: pytest's caplog also holds the records of every logger that does not
    # propagate, W&B's once an earlier test in this process used W&B (its "error in
    # wandb.init()", which never reaches a user's terminal): 4 records, not 2.
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "dxrun" and r.levelno >= logging.WARNING]
    assert len(warnings) == 2  # one each time
    assert all(w.startswith("W&B upload of the sweep report failed (") and
               w.endswith(f"); the report is in {sweep}") for w in warnings)
    assert "Not a directory" in warnings[0]
    assert (sweep / "report.md").read_text().startswith("# lowest final train/loss: ")
    assert (sweep / "report.csv").is_file() and (sweep / "loss.png").read_bytes()[:8] == PNG


# (file, what is written there, is the job left out): each damage the report must survive.
# The JSON files are written atomically and the YAML ones by Hydra, so any damage to them makes
# the job unreadable; metrics.jsonl is written a row at a time, so a bad line costs that line.
DAMAGE = {
    "summary-cut-short": ("summary.json", b'{"train/loss": 2.0, "tok', True),
    "summary-a-list": ("summary.json", b"[2.0, 1000.0]", True),
    "summary-string-loss": ("summary.json", b'{"train/loss": "low"}', True),
    "summary-a-dir": ("summary.json", None, True),
    "status-cut-short": ("status.json", b'{"status": "ok", "star', True),
    "status-not-utf8": ("status.json", b'{"status": "ok\xff"}', True),
    "status-string-time": ("status.json", b'{"status": "ok", "job": 2, "started": "noon"}', True),
    "plan-empty": ("plan.json", b"", True),
    "plan-string-axis": ("plan.json", b'{"dp": "8", "fsdp": 1, "tp": 1}', True),
    "config-invalid": (".hydra/config.yaml", b"data: [batch_size: 64\n", True),
    "config-a-list": (".hydra/config.yaml", b"- data\n", True),
    "overrides-a-mapping": (".hydra/overrides.yaml", b"optimizer.lr: 0.1\n", True),
    "metrics-a-dir": ("metrics.jsonl", None, True),
    "metrics-not-utf8": ("metrics.jsonl", b'{"step": 15, "train/loss": 2.\xff}\n', False),
    "metrics-cut-short": ("metrics.jsonl", b'{"step": 15, "train/lo', False),
    "metrics-not-an-object": ("metrics.jsonl", b"[15, 2.0]\n", False),
    "metrics-string-value": ("metrics.jsonl", b'{"step": 15, "perf/tokens_per_s": "fast"}\n',
                             False),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_job_file_costs_that_job_only(tmp_path, caplog, damage):
    """One job of three has a damaged file: ``python -m dxrun.report`` still writes the report
    with the other two, names the damaged job in one warning and in report.md, and exits 0 (the
    report was written; the failed job is in it, as a failed job is)."""
    from dxrun.report.__main__ import main

    file, written, left_out = DAMAGE[damage]
    sweep = tmp_path / "sweep"
    for num in range(3):
        _job(sweep, num, [f"optimizer.lr=0.0{num + 1}"], [900.0, 910.0, 905.0])
    path = sweep / "2" / file
    if written is None:
        path.unlink()
        path.mkdir()
    elif file == "metrics.jsonl":  # a bad line between good ones
        rows = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(rows[0] + written.rstrip(b"\n") + b"\n" + b"".join(rows[1:]))
    else:
        path.write_bytes(written)
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        assert main([str(sweep)]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    md = (sweep / "report.md").read_text().splitlines()
    with open(sweep / "report.csv") as f:
        table = {r["job"]: r for r in csv.DictReader(f)}
    for good in ("0", "1"):  # the others are reported in full
        assert table[good]["status"] == "ok" and float(table[good]["tokens_per_s"]) == 905.0
    if left_out:
        assert warning.startswith(f"{sweep / '2'}: {file} unreadable: ")
        assert "3 jobs: 2 ok, 1 failed." in md
        assert table["2"]["status"] == "failed (unreadable)" and not table["2"]["tokens_per_s"]
        (line,) = [x for x in md if x.startswith("- job 2 (unreadable): ")]
        assert line == f"- job 2 (unreadable): {warning.partition(': ')[2]}"
    else:  # the line is left out, the job reported from its other rows
        assert warning.startswith(f"{path}: skipped 1 line(s) cut short or damaged")
        assert "3 jobs: 3 ok, 0 failed." in md and float(table["2"]["tokens_per_s"]) == 905.0
        assert md[md.index("## Lines left out") + 2] == (
            "- job 2: 1 line(s) of metrics.jsonl cut short or damaged (a killed job?); its other "
            "rows are reported")


# A single run of ``python -m dxrun`` in a fresh process, then the callbacks Hydra builds from
# conf/config.yaml in each mode: the sweep report's only in a multirun.
_SINGLE_RUN = """
import runpy, sys
from hydra import compose, initialize_config_dir
from hydra._internal.callbacks import Callbacks

sys.argv = ["dxrun", "model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
            "logger=none", "train.steps=2", "train.eval_every=0", "checkpoint.every=0",
            "hydra.run.dir=run"]
try:
    runpy.run_module("dxrun", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
print("loaded", sorted(m for m in sys.modules if m.startswith("dxrun.report")))
with initialize_config_dir(config_dir=sys.argv_conf, version_base="1.3", job_name="dxrun"):
    for mode in ("RUN", "MULTIRUN"):
        cfg = compose("config", overrides=[f"hydra.mode={mode}"], return_hydra_config=True)
        print(mode, [type(c).__module__ + "." + type(c).__name__
                     for c in Callbacks(cfg).callbacks])
"""


@pytest.mark.e2e  # a subprocess run
def test_a_single_run_loads_nothing_of_the_report_and_a_multirun_builds_its_callback(tmp_path):
    import subprocess
    import sys

    from conftest import CONF

    code = _SINGLE_RUN.replace("sys.argv_conf", repr(str(CONF)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert "loaded []" in out
    assert "RUN ['hydra.experimental.callback.Callback']" in out
    assert "MULTIRUN ['dxrun.report.write.SweepReport']" in out
    assert (tmp_path / "run" / "summary.json").exists()
