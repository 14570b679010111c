"""``python -m benchmarks``: run the suite, write its section of BENCHMARKS.md and the JSON.

The full suite takes tens of minutes on a small CPU host (its time: BENCHMARKS.md);
``--quick`` (CI runs it) times a smaller model with fewer steps, and skips
the allocator figure, the plan-mode roofline and the existing compile and checkpoint
benchmarks, whose figures stay in the file as they are. ``--gpu`` runs the GPU figures only
(on a machine with an NVIDIA GPU).
``--auto`` times ``parallelism=auto``'s choice against every layout that fits (the "auto vs
best" section; ``--auto --quick``: one 1-layer case). ``--published`` plans the published GPU and TPU
runs of ``benchmarks/published.py`` (shapes only) and writes the "Plan
mode vs published GPU and TPU runs" section. ``--torch PYTHON`` times dxrun's one-device step against a
PyTorch eager loop of the same model run by ``PYTHON`` (a Python with torch: the "One CPU device"
section; ``benchmarks/eager.py``). ``--one-device`` times dxrun's one-device step against
hand-written ``jax.jit`` steps as issue 49 item 9 does (``benchmarks/one_device.py``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dxrun.run import collect_cycles_rarely, simulate_cpu_devices

ROOT = Path(__file__).resolve().parents[1]
# The suite's shape: 4 layers, d_model 256, 4 heads, d_ff 1024, vocab 256, seq 128, global batch
# 16, fp32, AdamW lr 3e-4 wd 0.1 clip 1.0, GPT-2 block, learned positions, tied embeddings.
SHAPE = ["model=tiny", "model.n_layers=4", "model.d_model=256", "model.d_ff=1024",
         "model.tie_embeddings=true", "data.vocab_size=256", "data.seq_len=128",
         "data.batch_size=16", "optimizer.lr=3e-4"]
QUICK_SHAPE = ["model=tiny", "model.tie_embeddings=true", "data.seq_len=64", "data.batch_size=16",
               "data.vocab_size=64"]  # the vocabulary BENCHMARKS.md's figures were taken at
# The benchmarks of benchmarks/, run as they are (their own commands) in the full suite.
EXTERNAL = {
    "Compile time and step memory (benchmarks/compile_memory.py)":
        ["benchmarks/compile_memory.py", "--skip-cache"],
    "Checkpoint cost (benchmarks/checkpoint_cost.py)":
        ["benchmarks/checkpoint_cost.py", "--rounds", "2", "--every", "20", "--seq-len", "16"],
}


def external(section: str, argv: list[str]):
    """Run one of benchmarks/*.py and keep each printed ratio line as a figure."""
    from benchmarks.report import figure

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    command = "python " + " ".join(argv)
    figs = []
    for line in out.splitlines():
        if m := re.match(r"^(.*?\S)\s{2,}([\d.]+)\s+\((.*)\)$", line):  # compile_memory rows
            figs.append(figure(section, m.group(1), float(m.group(2)), {"raw": m.group(3)},
                               command=command))
        elif m := re.match(r"^ratio\s+([\d.]+)$", line):  # checkpoint_cost's ratio line
            figs.append(figure(section, "saves every 20 steps / never, steps/s",
                               float(m.group(1)), {"output": " / ".join(
                                   x.strip() for x in out.splitlines() if x.strip())},
                               ">= 0.95", command=command))
    return figs


def main(argv: list[str] | None = None) -> None:
    collect_cycles_rarely()  # as in dxrun's commands: the steps are timed as a run takes them
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="CI's run: under two minutes")
    ap.add_argument("--gpu", action="store_true", help="the GPU figures (needs an NVIDIA GPU)")
    ap.add_argument("--published", action="store_true",
                    help="plan mode against published GPU and TPU runs (shapes only)")
    ap.add_argument("--auto", action="store_true",
                    help="parallelism=auto's choice against every layout measured (minutes)")
    ap.add_argument("--torch", default=None, metavar="PYTHON",
                    help="dxrun's one-device step against a PyTorch eager loop run by PYTHON "
                    "(a Python with torch installed)")
    ap.add_argument("--one-device", action="store_true",
                    help="dxrun's one-device step against hand-written jax.jit steps, as issue "
                    "49 item 9 measures it (benchmarks/one_device.py)")
    ap.add_argument("--steps", type=int, default=100, help="with --torch: steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="with --torch: rounds per variant")
    ap.add_argument("--only", default=None,
                    help="with --published: the runs whose name contains this (e.g. 124M); "
                    "with --auto: the models (e.g. tiny)")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args(argv)
    simulate_cpu_devices(8)  # before JAX starts; also reuses freed memory (dxrun/run/process.py)
    import jax

    from dxrun.run import enable_compile_cache

    # One fresh compilation cache for the suite: its sections build the same programs again
    # (dp8's fp32 step is timed by three of them) and each compiles once. Figures time steps
    # after the compiling one, so the cache changes no figure.
    enable_compile_cache(tempfile.mkdtemp(prefix="dxrun-bench-cache-"))

    from benchmarks import allocator, gpu, one_device, speed, structure
    from benchmarks.report import OtherLoad, Report, load_average, write
    from dxrun.experiment import Experiment

    command = "python -m benchmarks" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    machine = {"device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
               "platform": jax.default_backend(), "jax": jax.__version__,
               "cpu_cores": os.cpu_count(), "load_before": load_average(),
               "date": datetime.date.today().isoformat()}
    others = OtherLoad()
    if args.published:
        from benchmarks import published

        runs = tuple(r for r in published.RUNS if not args.only or args.only in r.name)
        rows = published.run(Path(args.out), command, machine, runs)
        for r in rows:
            print(f"{r['run']:<28} estimated {r['estimated_tokens_per_s_per_gpu']:>10,.0f} "
                  f"published {r['published_tokens_per_s_per_gpu']:>10,.0f} ratio "
                  f"{r['ratio']:.2f} {'met' if r['in_goal'] else 'NOT met'}")
        print(f"basis {published.basis(rows)}; order "
              f"{'kept' if published.order_preserved(rows) else 'NOT kept'}; wrote {args.out}")
        return
    key = ("gpu" if args.gpu else "auto" if args.auto else "torch" if args.torch
           else "onedev" if args.one_device else "suite")
    report = Report(command, machine, key=key)
    t_start = time.perf_counter()

    def add(figs: list) -> None:
        report.figures.extend(figs)
        print(f"[{time.perf_counter() - t_start:6.1f} s] {figs[0].section}", file=sys.stderr,
              flush=True)

    if args.gpu:
        add(gpu.measured())
    elif args.torch:
        from benchmarks import eager

        add(eager.figures(args.torch, args.steps, args.rounds))
    elif args.one_device:
        add(one_device.figures(QUICK_SHAPE if args.quick else SHAPE, *(
            (2, 1) if args.quick else (30, 2))))
    elif args.auto:
        from benchmarks import auto

        add(auto.figures(args.quick, command, only=args.only))
    else:
        shape = QUICK_SHAPE if args.quick else SHAPE
        steps, reps = (2, 1) if args.quick else (30, 3)  # quick: a smoke run, few steps
        if not args.quick:
            add(allocator.figures(shape, 10, reps))
        # quick: one device and one layout of every axis the hand step shards (tensor and
        # data); the suite's run, whose dp8 and fsdp8 programs the structural figures compile
        add(speed.step_vs_hand(shape, steps, reps, ("dp1", "dp4_tp2") if args.quick
                               else speed.LAYOUTS))
        if not args.quick:  # the hand-written steps' losses are tests/test_bench_one_device.py's
            add(one_device.figures(shape, steps, 2))  # item 9: 2 repetitions
        add(speed.loop_vs_step(shape, 10 if args.quick else 40, 1 if args.quick else reps,
                               logger="none" if args.quick else "wandb"))
        add(speed.precision(shape, steps, reps))
        for layout in structure.COLLECTIVE_LAYOUTS:
            add([structure.collectives(Experiment.build(
                speed.compose_cfg(*SHAPE, f"parallelism={layout}")))])
        for layout in structure.STATE_LAYOUTS:  # the tp/fsdp split alone: no ZeRO-1
            add([structure.state_bytes(Experiment.build(speed.compose_cfg(
                *SHAPE, f"parallelism={layout}", "parallelism.shard_optimizer=false")))])
        add([structure.optimizer_bytes(
            Experiment.build(speed.compose_cfg(*SHAPE, "parallelism=dp8")),
            Experiment.build(speed.compose_cfg(*SHAPE, "parallelism=dp1")))])
        if not args.quick:
            add(gpu.roofline())
            for section, cmd in EXTERNAL.items():
                add(external(section, cmd))
    machine["load_after"] = load_average()
    machine["others_cpu_share"] = others.share()
    json_path = write(report, Path(args.out))
    for f in report.figures:
        ratio = "" if f.ratio is None else f"{f.ratio:8.3f}"
        mark = {True: "met", False: "NOT met", None: ""}[f.met]
        print(f"{f.name:<60} {ratio} {f.goal:>8} {mark}", flush=True)
    print(f"wrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
