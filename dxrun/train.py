"""The train loop and the run's outputs: plan.json, metrics.jsonl, summary.json, W&B run.

The host waits on the device only at log steps: metrics of the other steps stay on device.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
from omegaconf import OmegaConf

from dxrun.experiment import Experiment, visible_devices
from dxrun.logger import MetricsLogger
from dxrun.model import count_params
from dxrun.plan import make_plan
from dxrun.runtime import write_json

log = logging.getLogger("dxrun")


def run_name(cfg: Any, choices: dict[str, str]) -> str:
    return "-".join([choices.get("model", cfg.model.name),
                     choices.get("parallelism", cfg.parallelism.name),
                     f"bs{cfg.data.batch_size}"])


def train(cfg: Any, run_dir: Path, choices: dict[str, str] | None = None) -> dict[str, Any]:
    """Train per ``cfg``; write the run's files under ``run_dir``; return the summary."""
    choices = choices or {}
    run_dir.mkdir(parents=True, exist_ok=True)
    n_visible, platform = visible_devices()
    plan = make_plan(cfg, n_visible, platform)  # raises ConfigError before anything compiles
    for w in plan.warnings:
        log.warning(w)
    write_json(run_dir / "plan.json", plan.to_json())
    log.info("mesh plan\n%s", plan.table())

    exp = Experiment.build(cfg, plan)
    state = exp.init_state()
    n_params = count_params(state.params)
    floor = getattr(exp.source, "entropy_floor", None)
    log.info("model %s: %s parameters; data %s%s", cfg.model.name, f"{n_params:,}", cfg.data.name,
             f" (entropy floor {floor:.4f} nats/token)" if floor is not None else "")

    run_config = {
        **OmegaConf.to_container(cfg, resolve=True),
        "choices": choices,
        "plan": plan.to_json(),
        "n_params": n_params,
        "jax": {"version": jax.__version__, "device_kind": jax.devices()[0].device_kind,
                "device_count": jax.device_count()},
    }
    logger = MetricsLogger(run_dir, cfg, run_config, run_name(cfg, choices),
                           is_main=jax.process_index() == 0)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    steps, every = cfg.train.steps, cfg.train.log_every
    last: dict[str, float] = {}
    try:
        t_start = time.perf_counter()
        t_first = None  # when the first (compiling) step finished
        window_t, window_step = None, 0
        for i in range(steps):
            state, metrics = exp.step(state, exp.batch(i))
            done = i + 1
            if i == 0:
                jax.block_until_ready(metrics)
                t_first = time.perf_counter()
                window_t, window_step = t_first, 1
                compile_s = t_first - t_start
            if done % every == 0 or done == steps:
                last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                if done > window_step:
                    last["perf/step_time_s"] = (now - window_t) / (done - window_step)
                    last["perf/tokens_per_s"] = tokens_per_step / last["perf/step_time_s"]
                window_t, window_step = now, done
                last["data/tokens_seen"] = float(done * tokens_per_step)
                if floor is not None:
                    last["data/entropy_floor"] = floor
                logger.log(done, last)
                log.info("step %d/%d  loss %.4f  acc %.3f  lr %.2e", done, steps,
                         last["train/loss"], last["train/accuracy"], last["train/lr"])
        elapsed = time.perf_counter() - (t_first or t_start)
    finally:
        logger.finish()
    summary = {
        "step": steps,
        **last,
        "n_params": n_params,
        "tokens_per_s": tokens_per_step * (steps - 1) / elapsed if steps > 1 else None,
        "compile_time_s": compile_s,
        "entropy_floor": floor,
    }
    write_json(run_dir / "summary.json", summary)
    log.info("done: loss %.4f%s; outputs in %s", last.get("train/loss", float("nan")),
             f" (floor {floor:.4f})" if floor is not None else "", run_dir)
    return summary
