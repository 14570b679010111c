"""The TPU figures: GPT-2 small, medium and large on one chip in bf16 at seq_len 1024, dxrun's step
against a hand-written ``jax.jit`` step of the same model (fp32 master weights, bf16 compute,
the same optax AdamW, Pallas' splash attention), tokens/s and MFU, the compiled step's memory.

    python -m benchmarks.tpu small:16:none medium:16:dots large:8:dots [--hand] [--out DIR]

Each shape is ``model:batch:remat[:key=value,...]`` (extra dxrun overrides), ``+hand`` at its
end to time the hand-written step of that shape alone. The steps of one
shape are timed back to back on the chip (dxrun's, then the hand-written one's: two train states
of the large model do not fit one chip together), after a compiling step and a warm-up step,
each step blocked on (as the loop blocks on its metrics every ``train.log_every``).
Writes ``tpu.json`` (one record per shape) into ``--out``. ``benchmarks/tpu.sh`` runs it with
the time to the first step and plan mode's estimates, and writes BENCHMARKS.md's TPU section.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax

from benchmarks import reference
from benchmarks.speed import compose_cfg, dxrun_runner
from dxrun.experiment import Experiment
from dxrun.plan import flops
from dxrun.step import COMPUTE_DTYPES, step_bytes

GPT2 = ("parallelism=dp1", "train.precision=bf16", "data.seq_len=1024", "data.vocab_size=50304")


def overrides(shape: str) -> list[str]:
    model, batch, remat, *extra = shape.split(":")
    more = [kv for part in extra for kv in part.split(",") if kv]
    return [f"model={model}", *GPT2, f"data.batch_size={batch}", f"model.remat={remat}", *more]


def time_steps(run: Any, steps: int) -> list[float]:
    run()  # the warm-up after the compiling step
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def hand_runner(exp: Experiment, state: Any) -> Any:
    """The hand-written step from ``state`` (host copy): bf16 compute over fp32 masters."""
    from dxrun.splash_attention import attend

    cpu = jax.default_backend() == "cpu"  # Pallas interpreted: the script's own check off the chip

    step = reference.make_step(exp.tx, dtype=COMPUTE_DTYPES["bf16"],
                               attend=lambda q, k, v: attend(q, k, v, True, cpu))
    rows = [exp.data.local_batch(k) for k in range(4)]
    box = {"p": jax.device_put(state.params), "o": jax.device_put(state.opt_state), "i": 0}

    def run() -> Any:
        tokens = jax.device_put(rows[box["i"] % len(rows)])
        box["p"], box["o"], loss = step(box["p"], box["o"], tokens)
        box["i"] += 1
        jax.block_until_ready((box["p"], box["o"], loss))
        return loss

    return run


def measure(shape: str, steps: int, hand: bool) -> dict[str, Any]:
    cfg = compose_cfg(*overrides(shape))
    exp = Experiment.build(cfg)
    host = jax.device_get(exp.init_state())  # both steps start from it (theirs are donated)
    run = dxrun_runner(exp, host)
    t0 = time.perf_counter()
    first_loss = float(run())  # compiles
    compile_s = time.perf_counter() - t0
    wall = time_steps(run, steps)
    n_params = exp.count_params(exp.abstract_state().params)
    tokens = exp.plan.global_batch * exp.plan.seq_len
    per_token = flops.flops_per_token(cfg.model, n_params, exp.plan.seq_len)
    peak = flops.peak_tflops(jax.devices()[0].device_kind, "bf16")
    step_s = statistics.median(wall)
    mem = exp.step.compiled.memory_analysis()
    rec: dict[str, Any] = {
        "shape": shape, "model": cfg.model.name, "batch_size": exp.plan.global_batch,
        "seq_len": exp.plan.seq_len, "remat": exp.plan.remat, "attention": exp.attention_kernel,
        "loss_chunk": exp.cfg.model.loss_chunk, "n_params": n_params,
        "step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(tokens / step_s),
        "mfu": round(per_token * tokens / step_s / (peak * 1e12), 4) if peak else None,
        "first_loss": first_loss, "compile_s": round(compile_s, 1),
        "step_bytes": step_bytes(exp.step.compiled),
        "temp_bytes": mem.temp_size_in_bytes if mem else None,
        "peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "device_kind": jax.devices()[0].device_kind,
    }
    print(json.dumps(rec), flush=True)
    if hand:
        del run
        gc.collect()
        hrun = hand_runner(exp, host)
        hand_first = float(hrun())
        hwall = time_steps(hrun, steps)
        rec["hand_step_ms"] = round(1e3 * statistics.median(hwall), 2)
        rec["hand_tokens_per_s"] = round(tokens / statistics.median(hwall))
        rec["hand_first_loss"] = hand_first
        del hrun
        print(json.dumps({k: rec[k] for k in ("shape", "hand_step_ms", "hand_tokens_per_s",
                                               "hand_first_loss")}), flush=True)
    del exp
    gc.collect()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hand", action="store_true")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    records = []
    for shape in a.shapes:
        try:
            records.append(measure(shape.removesuffix("+hand"), a.steps,
                                   a.hand or shape.endswith("+hand")))
        except Exception as e:  # a shape that does not fit: say so, time the others
            print(json.dumps({"shape": shape, "error": repr(e)[:400]}), flush=True)
            records.append({"shape": shape, "error": repr(e)[:400]})
        jax.clear_caches()
    Path(a.out, "tpu.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
