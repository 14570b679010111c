"""What checkpointing costs the train loop, measured side by side in one run.

    python benchmarks/checkpoint_cost.py [--model small] [--every 20] [--rounds 3]

One model, one mesh (8 simulated CPU devices; fsdp8 by default: under dp8 each simulated device
holds a full copy of model=small's 1.5 GB of parameters and Adam moments, which does not fit a
small machine's memory), one compiled step. Blocks of ``--every`` steps alternate: a *saving*
block starts an asynchronous save (``dxrun.checkpointing.store.Checkpointer``, the train
loop's own) and then trains, and is timed until that save is committed; a *plain* block only
trains. Counting the commit wait in the saving block is conservative: in a run the write may
overlap more steps, but it must be done before the next save. Prints steps/s of both, their
ratio, the checkpoint's size, and the time to restore it into the mesh's shardings.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from dxrun.run import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from dxrun.checkpointing import (  # noqa: E402
    Checkpointer,  # noqa: E402
    Resume,
    restore,
)
from dxrun.config.registry import register  # noqa: E402
from dxrun.experiment import Experiment  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--parallelism", default="fsdp8")
    ap.add_argument("--every", type=int, default=20, help="steps per block = save interval")
    ap.add_argument("--rounds", type=int, default=3, help="saving + plain block pairs")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    args = ap.parse_args()
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[
            f"model={args.model}", f"parallelism={args.parallelism}", "logger=none",
            f"data.batch_size={args.batch_size}", f"data.seq_len={args.seq_len}"])
    exp = Experiment.build(cfg)
    state = exp.init_state()
    batches = exp.data.train_iterator()
    root = Path(args.dir or tempfile.mkdtemp(prefix="dxrun-ckpt-bench-"))
    saver = Checkpointer(root / "checkpoints", keep=2)

    def steps(n: int):
        nonlocal state
        for _ in range(n):
            state, _ = exp.step(state, exp.global_batch(next(batches)))
        jax.block_until_ready(state)

    steps(2)  # compile and settle
    t0 = time.perf_counter()
    saver.save(0, state, {"step": 0})  # the first save also sets Orbax up: not timed below
    saver.wait()
    first_save = time.perf_counter() - t0
    timed = {"saving": 0.0, "plain": 0.0, "blocking": 0.0}
    step = 0
    for _ in range(args.rounds):
        t = time.perf_counter()
        step += 1
        saver.save(step, state, {"step": step})
        timed["blocking"] += time.perf_counter() - t  # the loop waits this long; then it trains
        steps(args.every)
        saver.wait()
        timed["saving"] += time.perf_counter() - t
        t = time.perf_counter()
        steps(args.every)
        timed["plain"] += time.perf_counter() - t
    saver.close()
    n = args.rounds * args.every
    size = sum(f.stat().st_size for f in (root / "checkpoints" / str(step)).rglob("*")
               if f.is_file())
    t = time.perf_counter()
    restored, _, _ = restore(
        Resume(root / "checkpoints", step, in_place=False), exp.abstract_state())
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t
    plain, saving = n / timed["plain"], n / timed["saving"]
    print(f"model={args.model} {args.parallelism} on {jax.device_count()} CPU devices, batch "
          f"{args.batch_size} x {args.seq_len}, {args.rounds} x {args.every} steps per arm")
    print(f"never saves               {plain:8.3f} steps/s")
    print(f"saves every {args.every:<3d} steps     {saving:8.3f} steps/s")
    print(f"ratio                     {saving / plain:8.3f}")
    print(f"save, loop blocked        {timed['blocking'] / args.rounds:8.2f} s per save")
    print(f"checkpoint size           {size / 1e9:8.2f} GB (params + optimizer state)")
    print(f"first save (Orbax setup)  {first_save:8.2f} s")
    print(f"restore ({args.parallelism} shards)    {restore_s:8.2f} s")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
