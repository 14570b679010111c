"""The published-runs planner (``python -m benchmarks --published``) on its smallest row."""

from __future__ import annotations

import pytest

from benchmarks import published


def test_the_gpt2_124m_row_plans_and_gives_its_ratio(tmp_path):
    """llm.c's GPT-2 124M on 8x A100 planned from shapes (dp8, 64 x 1024 per GPU, bf16): an
    estimate in tokens/s per GPU held against the published ~218k, a ratio inside the goal,
    and the section written with its command and row."""
    run = next(r for r in published.RUNS if "124M" in r.name)
    machine = {"device_count": 8, "device_kind": "cpu", "cpu_cores": 2, "jax": "x",
               "date": "today"}
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    rows = published.run(out, "python -m benchmarks --published --only 124M", machine, (run,))
    r = rows[0]
    assert r["published_tokens_per_s_per_gpu"] == 524_288 / 0.3 / 8
    assert r["ratio"] == r["estimated_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"]
    assert published.GOAL[0] <= r["ratio"] <= published.GOAL[1], r
    assert r["estimated_memory_gib"] > 0 and not r["calibrates"]
    # llm.c's memory is not published: the fit only, in the pool a JAX run there gets
    assert r["fits"] and r["memory_ratio"] is None and r["memory_in_goal"]
    assert r["usable_gib"] == pytest.approx(0.9 * 81_920 / 1024)  # A100 80GB: 81,920 MiB
    text = out.read_text()
    assert "kept" in text and published.SECTION in text and "| llm.c GPT-2 124M" in text
    assert f"| {r['ratio']:.2f} | ✓ | {r['estimated_memory_gib']:.1f} GiB | — | — | yes (" in text
    assert out.with_suffix(".published.json").is_file()


def test_maxtext_tflops_convert_to_tokens_with_its_convention():
    # 492 TFLOP/s of Llama 2 7B at 4096 tokens: 6 N (embeddings included) + 6 L d T per token
    per_token = 6 * published.LLAMA2_7B_PARAMS + 6 * 32 * 4096 * 4096
    assert published.maxtext_tokens_per_s(492, published.LLAMA2_7B_PARAMS, 32, 4096, 4096) == (
        492e12 / per_token)
    assert 11_200 < 492e12 / per_token < 11_350  # the issue's ~11.3k


def test_the_estimate_basis_is_the_last_published_benchmarks():
    """Plan mode's estimate row quotes gpu_cost.ESTIMATE_BASIS: it is what the committed
    BENCHMARKS.published.json says (2 calibration runs, the rest validation), whose every
    ratio is in the goal with the runs' order kept."""
    import json
    from pathlib import Path

    from dxrun.estimates import ESTIMATE_BASIS

    data = json.loads((Path(__file__).parents[1] / "BENCHMARKS.published.json").read_text())
    assert data["basis"] == ESTIMATE_BASIS
    assert data["basis"]["calibrated_on"] <= 2 and data["order_preserved"]
    assert {r["run"] for r in data["rows"]} == {r.name for r in published.RUNS}
    assert all(published.GOAL[0] <= r["ratio"] <= published.GOAL[1] for r in data["rows"])


def test_every_published_run_fits_its_gpu_and_its_published_peak():
    """The memory model on each published run's shapes (nothing compiled): it fits the
    published GPU in the pool a JAX run there gets, and where the run published its peak
    (torchtitan on 8 and on 128 GPUs) the estimate is within 10% of it. The committed table
    says the same."""
    import json
    from pathlib import Path

    for run in published.RUNS:  # one on 128 devices: planned in a process of its own
        need, usable = published.memory_need(run)
        assert need <= usable, (run.name, need / 2**30, usable / 2**30)
        if run.memory_gib:
            ratio = need / 2**30 / run.memory_gib
            assert abs(ratio - 1) <= published.MEMORY_GOAL, (run.name, ratio)
    assert sum(bool(r.memory_gib) for r in published.RUNS) >= 2
    # llm.c trains without recompute (-r 0): planned with its own setting, not a nearer one
    assert all("model.remat=none" in r.overrides for r in published.RUNS
               if r.name.startswith("llm.c"))
    assert any("tp2" in " ".join(r.overrides) for r in published.RUNS)  # a TP validation row
    data = json.loads((Path(__file__).parents[1] / "BENCHMARKS.published.json").read_text())
    assert all(r["fits"] and r["memory_in_goal"] for r in data["rows"])


def test_multi_chip_tpu_runs_plan_within_15_percent_of_their_speed_and_fit():
    """MaxText's published multi-chip TPU runs (v5e-256 and v5p-256, issue 78): the committed
    table holds each within 0.85-1.15 of its published speed and fitting its chip, and the
    parameter count its TFLOP/s are converted to tokens with is the one dxrun plans."""
    import json
    from pathlib import Path

    tpu = published.TPU_RUNS
    targets = {o for r in tpu for o in r.overrides if o.startswith("plan.target=")}
    assert len(tpu) >= 3 and targets == {"plan.target=v5e", "plan.target=v5p"}
    assert all(published.devices(r) >= 64 for r in tpu)
    assert all(r in published.RUNS for r in tpu)
    data = json.loads((Path(__file__).parents[1] / "BENCHMARKS.published.json").read_text())
    rows = {r["run"]: r for r in data["rows"]}
    lo, hi = published.TPU_GOAL
    assert (lo, hi) == (0.85, 1.15)
    params = {"16B": published.MAXTEXT_16B_PARAMS, "32B": published.MAXTEXT_32B_PARAMS,
              "128B": published.MAXTEXT_128B_PARAMS}
    for r in tpu:
        row = rows[r.name]
        assert lo <= row["ratio"] <= hi and row["in_goal"] and row["fits"], row
        assert row["n_params"] == params[r.name.split()[1]], (r.name, row["n_params"])
        assert row["published_tokens_per_s_per_gpu"] == r.tokens_per_s_per_gpu
