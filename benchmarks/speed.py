"""The timed figures: dxrun's step against the hand-written one per layout, 8 devices against
one, the whole loop against the bare step, bf16 against fp32.

Every figure compares variants timed side by side in one process (``search.interleaved``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import reference
from benchmarks.report import Figure, figure
from benchmarks.timing import interleaved
from dxrun.experiment import Experiment

LAYOUTS = ("dp1", "dp8", "dp4_tp2", "fsdp8")


def compose_cfg(*overrides: str) -> Any:
    """The run config ``python -m dxrun <overrides>`` would build (W&B off unless asked)."""
    from hydra import compose, initialize_config_dir

    from dxrun.config.registry import conf_dir, register

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="bench"):
        return compose(config_name="config", overrides=["logger=none", *overrides])


def _rows(exp: Experiment, n: int = 4) -> list[np.ndarray]:
    return [np.asarray(exp.data.local_batch(k)) for k in range(n)]


def dxrun_runner(exp: Experiment, state: Any = None) -> Callable[[], Any]:
    """One step of dxrun as its loop takes it: the host rows placed by ``global_batch``, then
    ``exp.step``; blocks on the new state and the metrics, returns the loss. ``state``: a host
    copy to start from (None: the seeded init)."""
    rows = _rows(exp)
    box = {"state": exp.init_state() if state is None else jax.device_put(
        state, exp.state_shardings), "i": 0}

    def run() -> Any:
        tokens = exp.global_batch(rows[box["i"] % len(rows)])
        box["state"], metrics = exp.step(box["state"], tokens)
        box["i"] += 1
        jax.block_until_ready((box["state"], metrics))
        return metrics["train/loss"]

    return run


def hand_runner(exp: Experiment, state: Any) -> Callable[[], Any]:
    """One step of the hand-written ``jax.jit`` step from the same parameters (a host copy of
    ``state``, placed by the same rules), optimizer and batches; returns the loss. Its
    optimizer state follows the parameters' rules, as without a framework: placed by dxrun's
    ZeRO-1 shardings (``parallelism.shard_optimizer``, on by default when dp > 1), the bare
    jit left the moments' layout to XLA's propagation and ran 3.6x slower than dxrun's under
    dp8 (2.3x under dp4_tp2), a figure about the baseline, not the step."""
    from omegaconf import OmegaConf

    rows = _rows(exp)
    step = reference.make_step(exp.tx)
    plain = Experiment.build(OmegaConf.merge(exp.cfg, {"parallelism": {
        "shard_optimizer": False}}), exp.plan, exp.data)
    placed = jax.device_put(state, plain.state_shardings)
    box = {"p": placed.params, "o": placed.opt_state, "i": 0}

    def run() -> Any:
        tokens = jax.device_put(rows[box["i"] % len(rows)], exp.batch_sharding)
        box["p"], box["o"], loss = step(box["p"], box["o"], tokens)
        box["i"] += 1
        jax.block_until_ready((box["p"], box["o"], loss))
        return loss

    return run


def runners(exp: Experiment) -> dict[str, Callable[[], Any]]:
    """dxrun's step and the hand-written one, from one seeded init (compiled once)."""
    state = jax.device_get(exp.init_state())
    return {"dxrun": dxrun_runner(exp, state), "hand": hand_runner(exp, state)}


def step_vs_hand(shape: list[str], steps: int, reps: int,
                 layouts: tuple[str, ...] = LAYOUTS) -> list[Figure]:
    """dxrun's step and the hand-written step on every layout, all interleaved in one loop, so
    that the 8-device layouts compare with one device too."""
    variants = {}
    for layout in layouts:
        exp = Experiment.build(compose_cfg(*shape, f"parallelism={layout}"))
        variants |= {(layout, name): run for name, run in runners(exp).items()}
    # The same model: both take their first step from the same state and batch.
    first_loss = {k: float(run()) for k, run in variants.items()}
    t = interleaved(variants, steps, reps)
    out = []
    for layout in layouts:
        dx, hand = t[(layout, "dxrun")], t[(layout, "hand")]
        out.append(figure(
            "Train step vs a hand-written jax.jit step", f"{layout}: dxrun / hand tokens/s",
            hand.median_s / dx.median_s,
            {"dxrun": dx.summary(), "hand": hand.summary(),
             "cpu_ratio": round(hand.cpu_s / dx.cpu_s, 3),
             "first_loss": {n: first_loss[(layout, n)] for n in ("dxrun", "hand")}}, ">= 1.0",
            note="ratio of wall-clock medians; cpu_ratio: of CPU seconds per step, which other "
                 "jobs on the machine stretch less"))
    one = t[(layouts[0], "dxrun")]
    for layout in layouts[1:]:
        many = t[(layout, "dxrun")]
        out.append(figure(
            "Eight devices vs one, same global batch", f"{layout} / dp1 tokens/s (dxrun)",
            one.median_s / many.median_s, {"dp1_ms": one.summary()["wall_ms"],
                                           f"{layout}_ms": many.summary()["wall_ms"],
                                           "cpu_ratio": round(one.cpu_s / many.cpu_s, 3)},
            ">= 1.0", note="8 simulated devices share the 2 cores one device has alone; "
                           "cpu_ratio < 1 is work the many devices add: their collectives and, "
                           "with parallelism.shard_optimizer=false, each data-parallel "
                           "replica's whole optimizer update"))
    return out


def loop_vs_step(shape: list[str], steps: int, reps: int, layout: str = "dp8",
                 logger: str = "wandb") -> list[Figure]:
    """``train()`` as ``python -m dxrun`` runs it (the data pipeline, the step, metrics logged
    every 10 steps to metrics.jsonl and W&B offline, the progress bar): its throughput from
    the end of the compiling step to the end (``loop_tokens_per_s``), against the bare step
    dispatched ``steps`` times back to back on batches already placed. Evaluation and
    checkpoints are off (their own figures); runs and bare blocks alternate."""
    from dxrun.run import enable_compile_cache
    from dxrun.train import train

    os.environ["WANDB_SILENT"] = "true"  # the suite's own output stays readable
    logging.getLogger("dxrun").setLevel(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="dxrun-bench-"))
    if not jax.config.jax_compilation_cache_dir:  # (python -m benchmarks sets one)
        enable_compile_cache(str(tmp / "cache"))  # each train() builds its step anew
    loop = compose_cfg(*shape, f"parallelism={layout}", f"logger={logger}",
                       "train.log_every=10", "train.eval_every=0", "checkpoint.every=0",
                       f"train.steps={steps + 1}")
    exp = Experiment.build(compose_cfg(*shape, f"parallelism={layout}"))
    state = exp.init_state()
    batches = [exp.global_batch(r) for r in _rows(exp)]
    tokens = loop.data.batch_size * loop.data.seq_len

    def bare() -> float:
        nonlocal state
        t0 = time.perf_counter()
        for i in range(steps):
            state, metrics = exp.step(state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        return steps * tokens / (time.perf_counter() - t0)

    def whole() -> float:
        return train(loop, Path(tempfile.mkdtemp(dir=tmp)))["loop_tokens_per_s"]

    bare()
    if reps > 1:  # (one repetition, --quick's: its run compiles its own step before its window)
        whole()  # compiles into the cache
    b, w = [], []
    for _ in range(reps):
        b.append(bare())
        w.append(whole())
    b_tps, w_tps = float(np.median(b)), float(np.median(w))
    return [figure("The whole loop vs the bare step", f"{layout}: python -m dxrun loop / step "
                   "tokens/s", w_tps / b_tps,
                   {"step_tokens_per_s": round(b_tps), "loop_tokens_per_s": round(w_tps),
                    "step_ms": round(1e3 * tokens / b_tps, 2),
                    "loop_ms": round(1e3 * tokens / w_tps, 2),
                    "loop_per_rep": [round(x) for x in w], "step_per_rep": [round(x) for x in b]},
                   ">= 0.97", note=f"{steps} steps after the compiling one, logger={logger}")]


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
