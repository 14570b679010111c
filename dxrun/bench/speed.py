"""The timed figures: dxrun's step against the hand-written one per layout, 8 devices against
one, the allocator setting on and off, the whole loop against the bare step, bf16 against fp32.

Every figure compares variants timed side by side in one process (``timing.interleaved``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dxrun.bench import reference
from dxrun.bench.report import Figure, figure
from dxrun.bench.timing import interleaved
from dxrun.experiment import Experiment
from dxrun.runtime import reuse_freed_memory

LAYOUTS = ("dp1", "dp8", "dp4_tp2", "fsdp8")


def compose_cfg(*overrides: str) -> Any:
    """The run config ``python -m dxrun <overrides>`` would build (W&B off unless asked)."""
    from hydra import compose, initialize_config_dir

    from dxrun.config import conf_dir, register

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="bench"):
        return compose(config_name="config", overrides=["logger=none", *overrides])


def _rows(exp: Experiment, n: int = 4) -> list[np.ndarray]:
    return [np.asarray(exp.data.local_batch(k)) for k in range(n)]


def dxrun_runner(exp: Experiment) -> Callable[[], Any]:
    """One step of dxrun as its loop takes it: the host rows placed by ``global_batch``, then
    ``exp.step``; blocks on the new state and the metrics."""
    rows, box = _rows(exp), {"state": exp.init_state(), "i": 0}

    def run() -> Any:
        tokens = exp.global_batch(rows[box["i"] % len(rows)])
        box["state"], metrics = exp.step(box["state"], tokens)
        box["i"] += 1
        return jax.block_until_ready((box["state"], metrics))

    return run


def hand_runner(exp: Experiment) -> Callable[[], Any]:
    """One step of the hand-written ``jax.jit`` step on the same parameters (placed by the same
    rules), optimizer and batches."""
    rows, state = _rows(exp), exp.init_state()
    step = reference.make_step(exp.tx)
    box = {"p": state.params, "o": state.opt_state, "i": 0}

    def run() -> Any:
        tokens = jax.device_put(rows[box["i"] % len(rows)], exp.batch_sharding)
        box["p"], box["o"], loss = step(box["p"], box["o"], tokens)
        box["i"] += 1
        return jax.block_until_ready((box["p"], box["o"], loss))

    return run


def step_vs_hand(shape: list[str], steps: int, reps: int,
                 layouts: tuple[str, ...] = LAYOUTS) -> list[Figure]:
    """dxrun's step and the hand-written step on every layout, all interleaved in one loop, so
    that the 8-device layouts compare with one device too."""
    variants = {}
    for layout in layouts:
        exp = Experiment.build(compose_cfg(*shape, f"parallelism={layout}"))
        variants[(layout, "dxrun")] = dxrun_runner(exp)
        variants[(layout, "hand")] = hand_runner(exp)
    t = interleaved(variants, steps, reps)
    out = []
    for layout in layouts:
        dx, hand = t[(layout, "dxrun")], t[(layout, "hand")]
        out.append(figure(
            "Train step vs a hand-written jax.jit step", f"{layout}: dxrun / hand tokens/s",
            hand.median_s / dx.median_s, {"dxrun": dx.summary(), "hand": hand.summary()},
            ">= 1.0"))
    one = t[(layouts[0], "dxrun")]
    for layout in layouts[1:]:
        many = t[(layout, "dxrun")]
        out.append(figure(
            "Eight devices vs one, same global batch", f"{layout} / dp1 tokens/s (dxrun)",
            one.median_s / many.median_s, {"dp1_ms": one.summary()["wall_ms"],
                                           f"{layout}_ms": many.summary()["wall_ms"]},
            ">= 1.0"))
    return out


def allocator(shape: list[str], steps: int, reps: int, layout: str = "dp8") -> list[Figure]:
    """The measured cause of the multi-device gap: glibc's fresh mmap of every large block
    (``runtime.reuse_freed_memory``), switched off and on between turns in the same process."""
    exp = Experiment.build(compose_cfg(*shape, f"parallelism={layout}"))
    runners = {"dxrun": dxrun_runner(exp), "hand": hand_runner(exp)}
    variants = {(s, n): run for s in ("off", "on") for n, run in runners.items()}
    t = interleaved(variants, steps, reps, before=lambda name: reuse_freed_memory(name[0] == "on"))
    reuse_freed_memory(True)
    temp = exp.step.compiled.memory_analysis().temp_size_in_bytes
    return [figure(
        "The cause: large blocks mapped afresh every step",
        f"{layout} {name}: glibc default / reuse_freed_memory tokens/s",
        t[("off", name)].median_s / t[("on", name)].median_s,
        {"default": t[("off", name)].summary(), "reuse": t[("on", name)].summary(),
         "temp_MB_per_device": round(temp / 1e6, 1)},
        note="≥ 1 = the setting is faster; the default's minor faults and system time per step "
             "are the pages of the step's temporaries mapped anew") for name in ("dxrun", "hand")]


def loop_vs_step(shape: list[str], steps: int, reps: int, layout: str = "dp8") -> list[Figure]:
    """``train()`` (data, W&B offline logging every 10 steps, the progress bar) for ``steps``
    and for ``2 * steps`` steps: the difference is the loop's time for ``steps`` steps, free of
    its fixed costs (compile, W&B start, the last log); against the bare step dispatched
    ``steps`` times back to back. Evaluation and checkpoints are off (their own figures)."""
    from dxrun.runtime import enable_compile_cache
    from dxrun.train import train

    tmp = Path(tempfile.mkdtemp(prefix="dxrun-bench-"))
    enable_compile_cache(str(tmp / "cache"))  # each train() builds its step anew
    loop = [*shape, f"parallelism={layout}", "logger=wandb", "logger.mode=offline",
            "train.log_every=10", "train.eval_every=0", "checkpoint.every=0"]
    exp = Experiment.build(compose_cfg(*shape, f"parallelism={layout}"))
    rows = _rows(exp)
    state = exp.init_state()
    batches = [exp.global_batch(r) for r in rows]

    def bare() -> float:
        nonlocal state
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = exp.step(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - t0

    def whole(n: int) -> float:
        run_dir = Path(tempfile.mkdtemp(dir=tmp))
        t0 = time.perf_counter()
        train(compose_cfg(*loop, f"train.steps={n}"), run_dir)
        return time.perf_counter() - t0

    bare()
    whole(2)  # compiles into the cache
    b, d = [], []
    for _ in range(reps):
        b.append(bare() / steps)
        short, long_ = whole(steps), whole(2 * steps)
        d.append((long_ - short) / steps)
    b_ms, d_ms = 1e3 * float(np.median(b)), 1e3 * float(np.median(d))
    return [figure("The whole loop vs the bare step", f"{layout}: python -m dxrun loop / step "
                   "tokens/s", b_ms / d_ms,
                   {"step_ms": round(b_ms, 2), "loop_ms": round(d_ms, 2),
                    "loop_ms_per_rep": [round(1e3 * x, 1) for x in d]}, ">= 0.97",
                   note=f"loop = (train() of {2 * steps} steps - of {steps}) / {steps}")]


def precision(shape: list[str], steps: int, reps: int, layout: str = "dp8") -> list[Figure]:
    """bf16 compute (fp32 master weights) against fp32: step time and the compiled step's
    memory per device."""
    exps = {p: Experiment.build(compose_cfg(*shape, f"parallelism={layout}",
                                            f"train.precision={p}")) for p in ("fp32", "bf16")}
    t = interleaved({p: dxrun_runner(e) for p, e in exps.items()}, steps, reps)
    mem = {p: e.step.memory_bytes() for p, e in exps.items()}
    temp = {p: e.step.compiled.memory_analysis().temp_size_in_bytes for p, e in exps.items()}
    return [
        figure("bf16 vs fp32", f"{layout}: bf16 / fp32 step time", t["bf16"].median_s
               / t["fp32"].median_s, {"bf16": t["bf16"].summary(), "fp32": t["fp32"].summary()},
               note="XLA:CPU computes bf16 in fp32 (converts added); a GPU figure needs a GPU"),
        figure("bf16 vs fp32", f"{layout}: bf16 / fp32 step memory per device",
               mem["bf16"] / mem["fp32"],
               {"bf16_MB": round(mem["bf16"] / 1e6, 2), "fp32_MB": round(mem["fp32"] / 1e6, 2),
                "temp_bf16_MB": round(temp["bf16"] / 1e6, 2),
                "temp_fp32_MB": round(temp["fp32"] / 1e6, 2)},
               note="arguments + outputs - donated + temporaries (XLA's memory analysis)"),
    ]
