"""The measured cause of the multi-device gap: glibc mapping the step's temporaries afresh at
every step (``runtime.reuse_freed_memory``), with and without the setting.

The setting must be made before JAX starts its threads, so each variant is its own process
(``python -m benchmarks.allocator default|reuse SHAPE_JSON LAYOUTS STEPS``, printing JSON);
the processes alternate, default and reuse, once per repetition.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.report import Figure, figure

ROOT = Path(__file__).resolve().parents[1]  # the workers import benchmarks from there

LAYOUTS = ("dp1", "dp8")


def child(mode: str, shape: list[str], layouts: list[str], steps: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    if mode == "reuse":
        from dxrun.run import reuse_freed_memory

        assert reuse_freed_memory(), "not a CPU-only glibc host"
    from benchmarks import speed
    from benchmarks.timing import interleaved
    from dxrun.experiment import Experiment

    variants = {layout: speed.runners(Experiment.build(
        speed.compose_cfg(*shape, f"parallelism={layout}")))["dxrun"] for layout in layouts}
    return {k: t.summary() for k, t in interleaved(variants, steps, 1).items()}


def figures(shape: list[str], steps: int, reps: int,
            layouts: tuple[str, ...] = LAYOUTS) -> list[Figure]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    runs: dict[str, list[dict]] = {"default": [], "reuse": []}
    for _ in range(reps):
        for mode in runs:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.allocator", mode, json.dumps(shape),
                 ",".join(layouts), str(steps)], cwd=ROOT, env=env, capture_output=True,
                text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))

    def med(mode: str, layout: str, key: str) -> float:
        return statistics.median(r[layout][key] for r in runs[mode])

    return [figure(
        "The cause: the step's temporaries mapped afresh every step",
        f"{layout}: glibc default / reuse_freed_memory tokens/s (dxrun)",
        med("default", layout, "wall_ms") / med("reuse", layout, "wall_ms"),
        {mode: {k: med(mode, layout, k) for k in ("wall_ms", "user_ms", "system_ms",
                                                  "minor_faults")} for mode in runs},
        note="one process per variant, alternating; ≥ 1 = the setting is faster. The "
             "default's minor faults and kernel time per step are its temporaries' pages "
             "mapped anew") for layout in layouts]


if __name__ == "__main__":
    mode, shape, layouts, steps = sys.argv[1:5]
    print(json.dumps(child(mode, json.loads(shape), layouts.split(","), int(steps))))
