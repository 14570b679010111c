"""Plan mode against published GPU training runs (``python -m benchmarks --published``).

Each run below is planned from shapes alone on 8 simulated CPU devices with its published mesh,
batch, sequence length, precision, recomputation, accumulation and hardware (``plan.target``),
or the nearest dxrun setting where dxrun lacks what the run used (``nearest``). The estimated
tokens/s per GPU is held against the published one: the ratio (estimate / published) is what the
goal (0.75-1.25) is about, and the runs' order by tokens/s per GPU must be preserved. Two runs
calibrate one constant each of ``dxrun/plan/gpu_cost.py: COST`` (marked in the table); the other two
are the validation, whose worst ratio is ``gpu_cost.ESTIMATE_BASIS`` (the basis plan mode's
estimate row prints).

Memory: what plan mode reports per device (``needs_per_device_gb``), beside the published peak
where there is one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GOAL = (0.75, 1.25)
CPU_MEMORY = ("the XLA:CPU compile's memory analysis (fp32 temporaries, XLA's T x T attention "
              "scores kept for the backward), not an accelerator memory model")
MODEL_MEMORY = ("the accelerator memory model (dxrun/plan/memory_model.py: the state's shards, "
                "every layer's saved activations for the run's precision, remat and attention kernel, "
                "one layer's backward, the logits, FSDP's gathers)")
SECTION = "Plan mode vs published GPU runs"


def maxtext_tokens_per_s(tflops: float, n_params: float, n_layers: int, d_model: int,
                         seq_len: int) -> float:
    """MaxText's TFLOP/s per device as tokens/s: its convention is 6 x all parameters
    (embeddings included) + the causal half of the attention, 6 x n_layers x d_model x seq_len
    per token (MaxText's ``calculate_tflops_training_per_device``)."""
    return tflops * 1e12 / (6 * n_params + 6 * n_layers * d_model * seq_len)


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    overrides: tuple[str, ...]
    hardware: str
    layout: str
    published: str  # as published
    tokens_per_s_per_gpu: float  # the published figure per GPU
    memory_gib: float | None = None  # published peak per GPU
    nearest: str = ""  # where dxrun plans something else than the run did
    calibrates: str = ""  # the COST constant fitted on this run ("" = a validation run)
    extra: dict[str, Any] = field(default_factory=dict)


LLAMA2_7B_PARAMS = 6_738_415_616  # the released checkpoint's count (embeddings included)

RUNS: tuple[Run, ...] = (
    Run("torchtitan Llama 3.1 8B",
        "github.com/pytorch/torchtitan docs/performance.md, table 1 (FSDP, no compile)",
        ("model=llama3_8b", "plan.target=h100_96gb_500w", "parallelism=fsdp8",
         "data.seq_len=8192", "data.batch_size=16", "train.precision=bf16",
         "model.remat=dots"),
        "8x H100 96GB HBM2e, 500 W, NVLink", "FSDP 8, selective AC, bf16, 2 x 8192 per GPU",
        "table 1: 5,762 TPS/GPU", 5762.0, 82.4,
        nearest="selective (op-level) AC as model.remat=dots (torchtitan's also recomputes "
                "every other matmul); eager PyTorch (no compile: torchtitan's own compiled row "
                "is 6,667) as XLA's fused program; FSDP gathers fp32 weights (torchtitan: bf16)",
        calibrates="clock_scale of h100_96gb_500w"),
    Run("MaxText Llama 2 7B",
        "github.com/AI-Hypercomputer/maxtext, GPU benchmarks (A3 VM, 8x H100), 492 TFLOP/s",
        ("model=llama2_7b", "plan.target=h100", "parallelism=fsdp8", "data.seq_len=4096",
         "data.batch_size=32", "train.precision=bf16", "model.remat=dots"),
        "8x H100 80GB SXM (one A3 VM)",
        "FSDP 8, remat saving matmul and attention outputs, bf16, cuDNN flash, 4 x 4096 per GPU",
        "492 TFLOP/s per GPU", maxtext_tokens_per_s(492, LLAMA2_7B_PARAMS, 32, 4096, 4096),
        nearest="remat keeping matmul and attention outputs as model.remat=dots (dxrun "
                "recomputes the fused attention's forward)",
        calibrates="clock_scale of h100 (sustained clock)"),
    Run("llm.c GPT-2 124M",
        "github.com/karpathy/llm.c discussion #481 (GPT-2 124M in 90 minutes, 8x A100)",
        ("model=small", "plan.target=a100", "parallelism=dp8", "data.seq_len=1024",
         "data.batch_size=512", "train.precision=bf16", "model.remat=none"),
        "8x A100 80GB SXM", "data parallel + optimizer sharding, bf16, cuDNN flash, 64 x 1024 "
        "per GPU", "~300 ms per step (524,288 tokens)", 524_288 / 0.300 / 8,
        nearest="optimizer sharding (ZeRO-1) as parallelism.shard_optimizer (on for dp8)"),
    Run("llm.c GPT-2 1.5B",
        "github.com/karpathy/llm.c discussion #677 (GPT-2 1.5B in 24 h, 8x H100)",
        ("model=xl", "plan.target=h100", "parallelism=dp8", "data.seq_len=1024",
         "data.batch_size=1024", "train.grad_accum=8", "train.precision=bf16",
         "model.remat=none"),
        "8x H100 80GB SXM", "data parallel + optimizer sharding, bf16, 16 x 1024 per GPU x 8 "
        "micro-steps", "~2.80 s per step (1,048,576 tokens)", 1_048_576 / 2.80 / 8,
        nearest="optimizer sharding (ZeRO-1) as parallelism.shard_optimizer (on for dp8)"),
)


def plan_run(run: Run) -> dict[str, Any]:
    """Plan one run (shapes only) and hold its estimate against the published figure."""
    from benchmarks.speed import compose_cfg
    from dxrun import plan_mode
    from dxrun.autotune.fit import NoData
    from dxrun.experiment import Experiment

    cfg = compose_cfg("run.mode=plan", *run.overrides)
    t0 = time.perf_counter()
    exp = Experiment.build(cfg, data=NoData())
    report = plan_mode.plan_report(cfg, exp, suggest=False)
    seconds = time.perf_counter() - t0
    t = report["target"]
    per_gpu = t["tokens_per_s"] / exp.plan.n_devices
    ratio = per_gpu / run.tokens_per_s_per_gpu
    g = t["timing"]
    return {
        "run": run.name, "command": "python -m dxrun run.mode=plan " + " ".join(run.overrides),
        "estimated_tokens_per_s_per_gpu": per_gpu,
        "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
        "ratio": ratio, "in_goal": GOAL[0] <= ratio <= GOAL[1],
        # Plan mode's per-device need: on an accelerator target the memory model's
        # (dxrun/plan/memory_model.py), otherwise the CPU compile's memory analysis.
        "estimated_memory_gib": t["needs_per_device_gb"] * 1e9 / 2**30,
        "memory_source": MODEL_MEMORY if t.get("needs_from") == "memory model" else CPU_MEMORY,
        "published_memory_gib": run.memory_gib,
        "step_ms": 1e3 * t["step_time_s"], "mfu": t["mfu"],
        "parts_ms": {k: round(1e3 * g[k], 1) for k in ("matmul_s", "attention_s",
                                                        "elementwise_s", "exposed_collective_s")},
        "plan_s": seconds, "calibrates": run.calibrates, "nearest": run.nearest,
        "run_spec": asdict(run),
    }


def order_preserved(rows: list[dict[str, Any]]) -> bool:
    by_est = sorted(rows, key=lambda r: -r["estimated_tokens_per_s_per_gpu"])
    by_pub = sorted(rows, key=lambda r: -r["published_tokens_per_s_per_gpu"])
    return [r["run"] for r in by_est] == [r["run"] for r in by_pub]


def basis(rows: list[dict[str, Any]]) -> dict[str, int]:
    """What ``gpu_cost.ESTIMATE_BASIS`` should say after these rows."""
    import math

    val = [r for r in rows if not r["calibrates"]]
    worst = max((abs(r["ratio"] - 1) for r in val), default=0.0)
    return {"calibrated_on": len(rows) - len(val), "validated_on": len(val),
            "within_pct": math.ceil(100 * worst)}


def markdown(rows: list[dict[str, Any]], command: str, machine: dict[str, Any]) -> str:
    from benchmarks.report import markers

    begin, end = markers("published")
    b = basis(rows)
    lines = [begin, f"## {SECTION}: `{command}`", "",
             f"`{command}` on {machine['device_count']} × {machine['device_kind']} "
             f"({machine['cpu_cores']} cores), JAX {machine['jax']}, {machine['date']}. Each run "
             "is planned from shapes alone (`run.mode=plan`, 8 simulated devices) with its "
             "published mesh, batch, sequence length, precision, recomputation, accumulation "
             "and hardware; the estimate is `dxrun/plan/gpu_cost.py`'s time model. Ratio = "
             "estimated / published tokens/s per GPU; goal 0.75–1.25 and the runs' order kept. "
             f"Calibration runs fit one constant each (marked); the other {b['validated_on']} "
             f"are the validation: within ±{b['within_pct']}%. Memory: what plan mode reports "
             f"per device (`needs_per_device_gb`): "
             f"{'; '.join(sorted({r.get('memory_source', CPU_MEMORY) for r in rows}))}; the "
             "published figure is the peak reserved.", "",
             "| run | hardware | planned as | est. tokens/s/GPU | published | ratio | | "
             "est. memory | published memory | used for | dxrun's nearest setting |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        s = r["run_spec"]
        mark = "✓" if r["in_goal"] else "✗"
        pub_mem = f"{r['published_memory_gib']:.1f} GiB" if r["published_memory_gib"] else "—"
        used = f"calibration: {r['calibrates']}" if r["calibrates"] else "validation"
        lines.append(
            f"| {r['run']} ({s['source']}) | {s['hardware']} | `{' '.join(s['overrides'])}` | "
            f"{r['estimated_tokens_per_s_per_gpu']:,.0f} | "
            f"{r['published_tokens_per_s_per_gpu']:,.0f} ({s['published']}) | "
            f"{r['ratio']:.2f} | {mark} | {r['estimated_memory_gib']:.1f} GiB | {pub_mem} | "
            f"{used} | {s['nearest'] or '—'} |")
    order = "kept" if order_preserved(rows) else "NOT kept"
    parts = "; ".join(
        f"{r['run']}: step {r['step_ms']:,.0f} ms = matmuls {p['matmul_s']:,.0f} + attention "
        f"{p['attention_s']:,.0f} + elementwise {p['elementwise_s']:,.0f} + exposed collectives "
        f"{p['exposed_collective_s']:,.0f} ms, MFU {100 * r['mfu']:.0f}%, planned in "
        f"{r['plan_s']:.0f} s" for r in rows for p in [r["parts_ms"]])
    lines += ["", f"Order by tokens/s per GPU: {order}. Per GPU: {parts}.", "", end]
    return "\n".join(lines)


def run(out: Path, command: str, machine: dict[str, Any], runs: tuple[Run, ...] = RUNS
        ) -> list[dict[str, Any]]:
    """Plan every run, write the section into ``out`` (BENCHMARKS.md) and the rows beside it
    (BENCHMARKS.published.json); returns the rows."""
    import sys

    from benchmarks.report import replace_section

    rows = []
    for r in runs:
        rows.append(plan_run(r))
        print(f"{r.name}: estimated {rows[-1]['estimated_tokens_per_s_per_gpu']:,.0f} tokens/s "
              f"per GPU, published {r.tokens_per_s_per_gpu:,.0f}, ratio {rows[-1]['ratio']:.2f} "
              f"({rows[-1]['plan_s']:.0f} s)", file=sys.stderr, flush=True)
    replace_section(out, "published", markdown(rows, command, machine))
    out.with_suffix(".published.json").write_text(json.dumps(
        {"command": command, "machine": machine, "rows": rows, "basis": basis(rows),
         "order_preserved": order_preserved(rows)}, indent=2) + "\n")
    return rows
