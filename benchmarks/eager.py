"""dxrun's one-device step against a PyTorch eager loop of the same model
(``benchmarks/torch_reference.py``): what a user picks instead for a small model on a laptop.

Each variant is a long-lived process that builds and warms up once, then runs the number of
steps asked on each line of its stdin and answers with one line (``parse_line``); the parent
asks them in turn, round after round, so the variants alternate on the same cores and load from
other jobs falls on all of them alike. A process waiting for its next request is idle, so each
variant has every core while it runs. The variants:

- ``torch``: the PyTorch eager loop, run by the Python given with ``--torch`` (a separate
  environment: torch is no dependency of dxrun), with its default threads (the cores);
- ``torch_1thread``: the same with one thread, which load from other jobs stretches far less;
- ``dxrun``: dxrun's step, ``parallelism=dp1`` in a process with one CPU device
  (``runtime.cpu_devices=1``);
- ``dxrun_sim8``: the same step in a process simulating 8 CPU devices (the default,
  ``runtime.cpu_devices=8``), of which it uses one.

dxrun's steps are dispatched back to back and waited for at the end, as its train loop does on
one device; the PyTorch loop reads its last loss, as a logging loop would.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from benchmarks.report import Figure, figure
from dxrun.plan import precision_of

ROOT = Path(__file__).resolve().parents[1]
SECTION = "One CPU device: dxrun vs a PyTorch eager loop"
# nanoGPT's CPU recipe (4 layers, d_model 128, 4 heads, d_ff 512, seq 64, batch 12, no bias),
# tied embeddings, fp32, AdamW; vocab 64, which BENCHMARKS.md's figures were taken at (the markov
# data's then; it is 16 now).
SHAPE = ["model=tiny", "model.n_layers=4", "model.d_model=128", "model.n_heads=4",
         "model.n_kv_heads=4", "model.d_ff=512", "model.bias=false",
         "model.tie_embeddings=true", "model.max_seq_len=64", "data.seq_len=64",
         "data.batch_size=12", "data.vocab_size=64", "parallelism=dp1"]
VARIANTS = {"dxrun": 1, "dxrun_sim8": 8}  # dxrun's variants: the CPU devices of the process


def parse_line(line: str) -> dict[str, Any]:
    """``name key=value ...`` (one timed run of a worker) as a dict: ``name`` and each key,
    numbers as floats. Raises ValueError on a line without ``ms_per_step``."""
    name, *pairs = line.split()
    out: dict[str, Any] = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"not key=value: {pair!r} in {line!r}")
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value
    if not isinstance(out.get("ms_per_step"), float):
        raise ValueError(f"no ms_per_step in {line!r}")
    return out


def torch_argv(cfg: Any) -> list[str]:
    """``benchmarks/torch_reference.py``'s arguments for the model and optimizer of ``cfg``."""
    m, d, o = cfg.model, cfg.data, cfg.optimizer
    args = {"vocab": d.vocab_size, "seq": d.seq_len, "batch": d.batch_size, "layers": m.n_layers,
            "d-model": m.d_model, "heads": m.n_heads, "d-ff": m.d_ff, "lr": o.lr,
            "wd": o.weight_decay, "b1": o.b1, "b2": o.b2, "clip": o.clip_norm,
            "warmup-lr": o.warmup_steps, "total": cfg.train.steps}
    if m.bias or not m.tie_embeddings or m.norm != "layernorm" or m.mlp != "gelu" \
            or m.pos != "learned" or m.n_kv_heads != m.n_heads \
            or precision_of(cfg.train.precision, "cpu") != "fp32":
        raise ValueError("the PyTorch reference is the fp32 GPT-2 block without biases, with "
                         "tied embeddings (see benchmarks/torch_reference.py)")
    return [str(ROOT / "benchmarks" / "torch_reference.py"), "--serve",
            *(f"--{k}={v}" for k, v in args.items())]


def serve(devices: int, overrides: list[str], warmup: int) -> None:
    """A dxrun worker (``python -m benchmarks.eager DEVICES OVERRIDES_JSON WARMUP``): the
    step of ``overrides`` in a process with ``devices`` CPU devices, serving stdin."""
    from dxrun.run import simulate_cpu_devices

    simulate_cpu_devices(devices)  # before JAX starts
    import jax

    from benchmarks.speed import _rows, compose_cfg
    from dxrun.experiment import Experiment

    exp = Experiment.build(compose_cfg(*overrides))
    batches = [exp.global_batch(r) for r in _rows(exp)]
    box = {"state": exp.init_state(), "i": 0}

    def timed(n: int) -> str:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            box["state"], metrics = exp.step(box["state"], batches[box["i"] % len(batches)])
            box["i"] += 1
        loss = float(metrics["train/loss"])  # waits for the last step
        ms, cpu_ms = (1e3 * (time.perf_counter() - t0) / n, 1e3 * (time.process_time() - c0) / n)
        return (f"dxrun ms_per_step={ms:.3f} cpu_ms_per_step={cpu_ms:.3f} steps={n} loss={loss:.4f} "
                f"devices={jax.device_count()} jax={jax.__version__}")

    timed(warmup)
    print(f"ready devices={jax.device_count()}", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(timed(int(line)), flush=True)


class Worker:
    """One variant's process: ``ask(n)`` runs n steps in it and returns the parsed line."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ready = self._read()

    def _read(self) -> str:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[:3]} exited ({self.proc.wait()})")
        return line.strip()

    def ask(self, n: int) -> dict[str, Any]:
        self.proc.stdin.write(f"{n}\n")  # type: ignore[union-attr]
        return parse_line(self._read())

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait()


def rounds(workers: dict[str, Worker], steps: int, reps: int) -> dict[str, list[dict]]:
    """Each variant's parsed line per round, the variants taking turns in every round."""
    out: dict[str, list[dict]] = {name: [] for name in workers}
    for _ in range(reps):
        for name, w in workers.items():
            out[name].append(w.ask(steps))
    return out


def figures(torch_python: str, steps: int = 100, reps: int = 5, warmup: int = 20,
            shape: list[str] | None = None) -> list[Figure]:
    from benchmarks.speed import compose_cfg

    shape = SHAPE if shape is None else shape
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    argv = [torch_python, *torch_argv(compose_cfg(*shape)), f"--warmup={warmup}"]
    workers = {"torch": Worker(argv, env), "torch_1thread": Worker([*argv, "--threads=1"], env)}
    for name, devices in VARIANTS.items():
        workers[name] = Worker([sys.executable, "-m", "benchmarks.eager", str(devices),
                                json.dumps(shape), str(warmup)], env)
    try:
        lines = rounds(workers, steps, reps)
    finally:
        for w in workers.values():
            w.close()
    ms = {name: [x["ms_per_step"] for x in xs] for name, xs in lines.items()}
    cpu = {name: statistics.median(x["cpu_ms_per_step"] for x in xs) for name, xs in lines.items()}
    med = {name: statistics.median(xs) for name, xs in ms.items()}
    raw = lambda name: {"ms": round(med[name], 2), "cpu_ms": round(cpu[name], 2),  # noqa: E731
                        "ms_per_round": [round(x, 1) for x in ms[name]]}
    note = (f"{reps} rounds of {steps} steps per variant, alternating, after {warmup} warm-up "
            f"steps; one process per variant; {workers['torch'].ready}")
    return [
        figure(SECTION, "dxrun dp1 / PyTorch eager, steps/s (runtime.cpu_devices=1)",
               med["torch"] / med["dxrun"], {"dxrun": raw("dxrun"), "torch": raw("torch"),
                                             "cpu_ratio": round(cpu["torch"] / cpu["dxrun"], 3)},
               ">= 1.0", note=note + "; ms: wall clock, cpu_ms: CPU seconds of the process (all "
               "threads), which other jobs on the machine stretch less"),
        figure(SECTION, "dxrun dp1 on 8 simulated devices / PyTorch eager, steps/s",
               med["torch"] / med["dxrun_sim8"],
               {"dxrun_sim8": raw("dxrun_sim8"), "torch": raw("torch"),
                "cpu_ratio": round(cpu["torch"] / cpu["dxrun_sim8"], 3)}, ">= 1.0",
               note="the default runtime.cpu_devices=8, one device used"),
        figure(SECTION, "dxrun dp1 / PyTorch eager with 1 thread, steps/s",
               med["torch_1thread"] / med["dxrun"],
               {"dxrun": raw("dxrun"), "torch_1thread": raw("torch_1thread"),
                "cpu_ratio": round(cpu["torch_1thread"] / cpu["dxrun"], 3)}, ">= 1.0",
               note="torch.set_num_threads(1): PyTorch's two threads meet at every op, and "
                    "under load (another job on the cores) one of them is often descheduled, "
                    "which slows its default loop far more than the steps differ"),
    ]


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]))
