"""BENCHMARKS.md's generated sections (benchmarks/report.py), on a file in tmp_path."""

from __future__ import annotations

from benchmarks.report import markers, replace_section


def test_a_new_section_goes_before_the_first_heading_or_section_and_then_stays(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    pub = "\n".join((markers("published")[0], "## Plan mode", markers("published")[1]))
    md.write_text(f"# Benchmarks\n\nintro\n\n{pub}\n\n## Notes\n")
    replace_section(md, "torch", "\n".join((*markers("torch"), "")))
    text = md.read_text()
    assert text.index(markers("torch")[1]) < text.index(markers("published")[0])
    assert pub in text  # never split between its begin marker and its heading
    moved = text.replace("\n".join((*markers("torch"), "")) + "\n\n", "") + "\n".join(
        (markers("torch")[0], "old", markers("torch")[1])) + "\n"
    md.write_text(moved)  # a section someone moved keeps its place when rewritten
    replace_section(md, "torch", "\n".join((markers("torch")[0], "new", markers("torch")[1])))
    assert md.read_text() == moved.replace("old", "new")


def test_other_processes_cpu_share_counts_a_process_that_is_not_the_bench(tmp_path):
    """A busy process the bench has not waited for (a stranger's, as far as the bench's rusage
    goes) is counted: one core of the machine's kept busy for a second is a share of about
    1 / cores (more when the machine is busier still), not the near zero of a quiet machine."""
    import os
    import subprocess
    import sys
    import time

    from benchmarks.report import OtherLoad

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                             "while time.time() - t < 5: pass"])
    try:
        time.sleep(0.3)  # the interpreter started and spinning
        others = OtherLoad()
        time.sleep(1.0)
        share = others.share()
    finally:
        spin.kill()
        spin.wait()
    assert share is not None and share >= 0.8 / (os.cpu_count() or 1)


def test_the_tpu_report_sets_each_models_fastest_against_the_hand_written_steps_fastest():
    """``benchmarks/tpu.sh``'s summary line of a model: dxrun's fastest shape against the
    fastest the hand-written step ran, each at its own shape; none where it ran at none."""
    from benchmarks.tpu import _fastest

    records = [{"shape": "m:16:none", "tokens_per_s": 300, "hand_error": "out of HBM"},
               {"shape": "m:8:none", "tokens_per_s": 250, "hand_tokens_per_s": 200},
               {"shape": "m:4:none", "tokens_per_s": 150, "hand_tokens_per_s": 120}]
    line = _fastest("m", records)
    assert "300 tokens/s (`m:16:none`), is 1.500x" in line and "200 (`m:8:none`)" in line
    assert _fastest("m", records[:1]) == ""


def test_the_tpu_report_sets_the_sparse_model_beside_the_dense_of_its_active_flops():
    from benchmarks.tpu import _sparse

    records = [{"model": "small", "shape": "small:16:none", "tokens_per_s": 400},
               {"model": "moe_small", "shape": "moe_small:16:none", "tokens_per_s": 300,
                "mfu": 0.36},
               {"model": "moe_small", "shape": "moe_small:8:none", "tokens_per_s": 280}]
    line = _sparse("moe_small", records)
    assert "300 tokens/s (`moe_small:16:none`, MFU 36.0% on active parameters)" in line
    assert "is 0.750x small's fastest, 400 (`small:16:none`)" in line
    assert _sparse("moe_small", records[1:]) == "" and _sparse("small", records) == ""


def test_the_tpu_report_sets_each_models_defaults_run_against_its_fastest(tmp_path):
    """``benchmarks/tpu.sh``'s defaults rows: a ``default-<model>`` run's median MFU and tokens/s
    over its logged rows after the first (the compiling step's), the layout its search chose,
    and its share of the model's fastest tuned MFU; a run dir without metrics is no row."""
    import json

    from benchmarks.tpu import default_rows

    run = tmp_path / "default-large"
    run.mkdir()
    rows = [{"step": s, "perf/mfu": m, "perf/tokens_per_s": t}
            for s, m, t in [(10, 0.10, 4000.0), (20, 0.40, 15000.0), (30, 0.42, 16000.0),
                            (40, 0.41, 15500.0)]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chosen = {"mesh": "dp1", "remat": "keep_attention", "grad_accum": 8, "chosen": True}
    (run / "plan.json").write_text(json.dumps({"layout_search": {"rows": [
        {"mesh": "dp1", "remat": "none", "grad_accum": 1, "chosen": False}, chosen]}}))
    (tmp_path / "default-small").mkdir()  # a run that ended before writing metrics
    assert default_rows(str(tmp_path), {"large": 0.5}) == [
        "| model (defaults) | layout the run chose | tokens/s | MFU | of the model's best |",
        "|---|---|---:|---:|---:|",
        "| large | dp1 remat=keep_attention accum=8 | 15,500 | 41.0% | 0.82 |"]
    assert default_rows(str(tmp_path / "nothing"), {}) == []
