"""Data pipeline throughput vs what the train step consumes, measured side by side in one run.

    python benchmarks/data_pipeline.py [--corpus PATH] [--workers N]

Prints the pipeline's tokens/s alone (Grain: windows -> shuffle -> batch -> prefetch), the tiny
model's train-step tokens/s on the simulated CPU mesh (compile excluded), their ratio, and
``perf/data_wait_frac`` from a real training run on the same corpus.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from dxrun.run import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from dxrun.config.registry import register  # noqa: E402
from dxrun.data import Data  # noqa: E402
from dxrun.experiment import Experiment  # noqa: E402
from dxrun.train import train  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def make_corpus(path: Path, n_bytes: int = 4_000_000) -> Path:
    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
             for _ in range(2000)]
    with path.open("w") as f:
        size = 0
        while size < n_bytes:
            line = " ".join(rng.choice(words) for _ in range(14)) + ".\n"
            f.write(line)
            size += len(line)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    corpus = Path(args.corpus) if args.corpus else make_corpus(tmp / "corpus.txt")
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[
            "data=text", f"data.path={corpus}", f"data.workers={args.workers}", "logger=none",
            f"train.steps={args.steps}", f"train.log_every={args.steps // 2}",
            "train.eval_every=0"])
    tokens_per_batch = cfg.data.batch_size * cfg.data.seq_len

    data = Data(cfg)
    it = data.train_iterator()
    next(it)  # start the prefetch threads / workers
    t = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    pipeline = args.batches * tokens_per_batch / (time.perf_counter() - t)

    exp = Experiment.build(cfg, data=data)
    state = exp.init_state()
    batches = [exp.batch(k) for k in range(8)]
    state, m = exp.step(state, batches[0])
    jax.block_until_ready(m)
    t = time.perf_counter()
    for k in range(args.steps):
        state, m = exp.step(state, batches[k % 8])
    jax.block_until_ready(m)
    step = args.steps * tokens_per_batch / (time.perf_counter() - t)

    summary = train(cfg, tmp / "run")
    print(f"corpus: {data.description}; model tiny, {jax.device_count()} simulated CPU devices, "
          f"batch {cfg.data.batch_size} x seq {cfg.data.seq_len}, workers {args.workers}")
    print(f"pipeline alone        {pipeline:14,.0f} tokens/s")
    print(f"train step consumes   {step:14,.0f} tokens/s")
    print(f"ratio                 {pipeline / step:14.1f} x")
    print(f"perf/data_wait_frac   {summary['perf/data_wait_frac']:14.3f} (in a {args.steps}-step run)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
