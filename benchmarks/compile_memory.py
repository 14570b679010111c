"""Compile time and step memory of the big-model features, measured side by side in one run.

    python benchmarks/compile_memory.py [--skip-cache]

* compile time of the train step, xl (48 layers) vs small (12 layers), with the layer scan and
  with the Python loop over layers (shapes only: nothing is allocated);
* the compiled step's per-device temporaries with model.remat=none / dots / full, and with
  train.grad_accum=1 vs 4 (XLA's memory analysis: exact, not timed);
* a cold vs a warm persistent compilation cache: two `python -m dxrun` launches of the same
  config, the second reusing the first's cache (perf/compile_time_s of each).

Ratios, not absolute numbers, are the result: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    from dxrun.config.registry import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="b"):
        return compose(config_name="config", overrides=["logger=none", *overrides])


def compile_seconds(*overrides: str) -> float:
    from dxrun.experiment import Experiment

    exp = Experiment.build(_cfg(*overrides))
    t = time.perf_counter()
    exp.compile_step()
    return time.perf_counter() - t


def step_memory(*overrides: str) -> tuple[float, float]:
    """(temporaries, whole step) bytes per device of the compiled step."""
    from dxrun.experiment import Experiment, step_bytes

    compiled = Experiment.build(_cfg(*overrides)).compile_step()
    return float(compiled.memory_analysis().temp_size_in_bytes), step_bytes(compiled)


def cache_start(cache: str, cwd: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-m", "dxrun", "train.steps=1", "train.eval_every=0",
                    "logger=none", "model=small", "data.vocab_size=50304",
                    "runtime.skip_memory_check=true", f"runtime.compile_cache={cache}"],
                   cwd=cwd, env=env, check=True,
                   capture_output=True)
    rows = sorted(Path(cwd).glob("outputs/*/*/metrics.jsonl"), key=os.path.getmtime)
    return json.loads(rows[-1].read_text().splitlines()[0])["perf/compile_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-cache", action="store_true")
    args = ap.parse_args()
    from dxrun.run import simulate_cpu_devices

    simulate_cpu_devices(8)
    gpt = ["data.vocab_size=50304", "data.seq_len=256", "data.batch_size=32",
           "parallelism=fsdp8"]
    rows = []

    def show(name: str, detail: str, ratio: float) -> None:
        rows.append((name, detail, ratio))
        print(f"{name:<36}  {ratio:6.2f}   ({detail})", flush=True)

    for scan in ("true", "false"):
        small = compile_seconds("model=small", f"model.scan_layers={scan}", *gpt)
        xl = compile_seconds("model=xl", f"model.scan_layers={scan}", *gpt)
        show(f"compile xl / small, scan_layers={scan}", f"{xl:.1f} s / {small:.1f} s", xl / small)
    none, _ = step_memory("model=small", *gpt)
    for policy in ("dots", "full"):
        temp, _ = step_memory("model=small", f"model.remat={policy}", *gpt)
        show(f"temporaries remat={policy} / none",
             f"{temp / 2**20:.0f} / {none / 2**20:.0f} MiB", temp / none)
    four, _ = step_memory("model=small", "train.grad_accum=4", *gpt)
    show("temporaries grad_accum=4 / 1", f"{four / 2**20:.0f} / {none / 2**20:.0f} MiB",
         four / none)
    if not args.skip_cache:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cwd:
            cold = cache_start(cache, cwd)
            warm = cache_start(cache, cwd)
        show("compile cache warm / cold", f"{warm:.1f} s / {cold:.1f} s", warm / cold)


if __name__ == "__main__":
    main()
