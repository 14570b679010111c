"""glibc's malloc arenas under ``runtime.reuse_freed_memory``: how many arenas the compile and the
step of 8 simulated CPU devices run best with. Each variant is its own process (a thread keeps
the arena it started with), the variants alternating, ``--reps`` times; each compiles the step of
every layout (timed: the XLA compile of ``Experiment.compile_step``) and times ``--steps`` steps
after two untimed ones (median), with the minor page faults per step.

    python -m benchmarks.malloc_arenas --shape tiny --layouts dp1,dp8 --reps 2
    python -m benchmarks.malloc_arenas --shape mid --layouts dp1,dp8 --reps 2
    python -m benchmarks.malloc_arenas --shape small --layouts fsdp8 --variants a1,a2 --steps 5

A variant is ``none`` (glibc's defaults) or ``aN``: no mmap, a 1 GiB trim threshold and at most
N arenas (``a1`` is what ``reuse_freed_memory`` sets).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"tiny": [],  # the default run's: 2 layers, d_model 64, batch 32 x 64
          # the suite's SHAPE (BENCHMARKS.md, "The multi-device gap")
          "mid": ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
                  "data.vocab_size=256", "data.seq_len=128", "data.batch_size=16"],
          # benchmarks/checkpoint_cost.py's: GPT-2 124M at batch 8 x 16
          "small": ["model=small", "data.batch_size=8", "data.seq_len=16"]}


def child(variant: str, shape: str, layouts: list[str], steps: int) -> dict:
    if variant != "none":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD
        libc.mallopt(-8, int(variant[1:]))  # M_ARENA_MAX
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from benchmarks.speed import compose_cfg
    from dxrun.experiment import Experiment

    out = {}
    for layout in layouts:
        exp = Experiment.build(compose_cfg(*SHAPES[shape], f"parallelism={layout}"))
        t0 = time.perf_counter()
        exp.compile_step()
        compile_s = time.perf_counter() - t0
        state, batches = exp.init_state(), [exp.batch(k) for k in range(2)]
        for i in range(2):
            state, m = exp.step(state, batches[i % 2])
            jax.block_until_ready(m)
        faults0, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
        for i in range(steps):
            t0 = time.perf_counter()
            state, m = exp.step(state, batches[i % 2])
            jax.block_until_ready((state, m))
            times.append(time.perf_counter() - t0)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / steps
        out[layout] = {"compile_s": compile_s, "step_ms": 1e3 * statistics.median(times),
                       "faults": faults}
        del state
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layouts", default="dp1,dp8")
    ap.add_argument("--variants", default="a1,a2,none")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    layouts = a.layouts.split(",")
    if a.child:
        print(json.dumps(child(a.child, a.shape, layouts, a.steps)))
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    runs: dict[str, list[dict]] = {v: [] for v in a.variants.split(",")}
    for _ in range(a.reps):
        for variant in runs:
            out = subprocess.run([sys.executable, "-m", "benchmarks.malloc_arenas", "--child",
                                  variant, "--shape", a.shape, "--layouts", a.layouts,
                                  "--steps", str(a.steps)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    print(f"| {a.shape} | " + " | ".join(f"{x} compile s | {x} step ms | {x} faults/step"
                                          for x in layouts) + " |")
    print("|---" * (1 + 3 * len(layouts)) + "|")
    for variant, rs in runs.items():
        cells = []
        for x in layouts:
            med = {k: statistics.median(r[x][k] for r in rs)
                   for k in ("compile_s", "step_ms", "faults")}
            cells += [f"{med['compile_s']:.2f}", f"{med['step_ms']:.1f}", f"{med['faults']:.0f}"]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
