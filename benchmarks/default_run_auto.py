"""The default run, ``python -m dxrun`` (``parallelism=auto``), against the same run with no layout
search (``parallelism=dp``), side by side: each a ``python -m dxrun`` process of its own, the
two alternating, ``--reps`` times; wall seconds from the launch to the exit. ``cold``: each run
with a fresh ``XDG_CACHE_HOME`` (no compile and no decision cached: a first run); ``warm``: one
``XDG_CACHE_HOME`` for the series, its compiles cached by an untimed run of each first (a
relaunch; a run that does not search caches no decision, so each decides afresh). What it
answers: what the default run pays for deciding whether to search, against naming a layout.

    python benchmarks/default_run_auto.py --reps 2

Extra arguments after ``--`` go to both runs (``-- model=small train.steps=50``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"auto": [], "dp": ["parallelism=dp"]}


def one(variant: str, cache: str | None, extra: list[str], out: str) -> float:
    """Wall seconds of one run; ``cache``: its XDG_CACHE_HOME (None: a fresh one)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dxrun-default-run-") as fresh:
        env["XDG_CACHE_HOME"] = cache or fresh
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dxrun", "logger=none",
                               f"hydra.run.dir={out}", *VARIANTS[variant], *extra],
                              env=env, capture_output=True, text=True)
        took = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{variant}: {proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dxrun-default-runs-") as runs:
        for cache in args.caches.split(","):
            shared = None
            if cache == "warm":
                shared = f"{runs}/xdg"
                for v in VARIANTS:  # the compiles cached, untimed
                    one(v, shared, args.extra, f"{runs}/prime_{v}")
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for i in range(args.reps):
                for v in VARIANTS:
                    took = one(v, shared, args.extra, f"{runs}/{cache}_{v}_{i}")
                    times[v].append(took)
                    print(f"{cache} {v} rep {i + 1}: {took:.1f} s", flush=True)
            med = {v: statistics.median(t) for v, t in times.items()}
            print(f"{cache}: auto {med['auto']:.1f} s, dp {med['dp']:.1f} s (medians of "
                  f"{args.reps}): auto / dp = {med['auto'] / med['dp']:.2f}", flush=True)


if __name__ == "__main__":
    main()
