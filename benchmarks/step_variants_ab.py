"""dxrun's one-device step (``benchmarks.eager.SHAPE``) under variants, each in its own process
(XLA_FLAGS are read when JAX starts), alternating rounds; optionally the PyTorch reference
alongside. A variant is an XLA_FLAGS string, or ``{"flags": ..., "overrides": [...]}`` with
config overrides added to the shape. Prints ms and CPU ms per step per variant (median over
rounds) and the losses of each round (the same in every variant that computes the same).

    python -m benchmarks.step_variants_ab \
        '{"scan": "", "loop": {"overrides": ["model.scan_layers=false"]}}'
    python -m benchmarks.step_variants_ab \
        '{"base": "", "no_ynn": "--xla_cpu_experimental_ynn_fusion_type="}' \
        --steps 50 --rounds 3 [--torch /work/torch-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.eager import SHAPE, Worker, rounds, torch_argv
from benchmarks.speed import compose_cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", help='JSON: {"name": "XLA_FLAGS" or {"flags", "overrides"}}')
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch", default=None, help="a Python with torch: adds the reference")
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    workers = {}
    for name, v in json.loads(a.variants).items():
        v = {"flags": v} if isinstance(v, str) else v
        workers[name] = Worker([sys.executable, "-m", "benchmarks.eager", "1",
                                json.dumps(SHAPE + v.get("overrides", [])), "10"],
                               dict(env, XLA_FLAGS=v.get("flags", "")))
    if a.torch:
        workers["torch"] = Worker([a.torch, *torch_argv(compose_cfg(*SHAPE)), "--warmup=10"], env)
    try:
        out = rounds(workers, a.steps, a.rounds)
    finally:
        for w in workers.values():
            w.close()
    for name, xs in out.items():
        ms = statistics.median(x["ms_per_step"] for x in xs)
        cpu = statistics.median(x["cpu_ms_per_step"] for x in xs)
        print(f"{name:>12} ms {ms:8.2f} cpu_ms {cpu:8.2f} per round "
              f"{[round(x['ms_per_step'], 1) for x in xs]} losses {[x['loss'] for x in xs]}")


if __name__ == "__main__":
    main()
