"""The GPU figures: GPT-2 small and medium on one device in bf16, tokens/s and MFU against the
device's dense bf16 peak (989 TFLOP/s for an H200), with ``model.attention=dot_product`` and
with the einsum ``reference``. On an NVIDIA GPU in bf16 (head dim 64) ``dot_product`` asks for
cuDNN's fused flash attention (``dxrun/plan/kernels.py``); each figure records the kernel the
step selected and how many cuDNN fused-attention calls its compiled program holds, so a figure
says which attention it timed (XLA's, where cuDNN was not selected). Without a GPU plan mode's
estimate (``run.mode=plan plan.target=h200``) stands in, labelled as such: the accelerator time
model of ``dxrun/estimates/time_model.py`` (the GPU program's FLOPs, fused attention and fused
elementwise traffic; the CPU compile only for the collectives).

    python -m benchmarks --gpu        # on a machine with an NVIDIA GPU: measured
"""

from __future__ import annotations

import jax

from benchmarks.report import Figure, figure
from benchmarks.speed import compose_cfg, dxrun_runner
from benchmarks.timing import interleaved
from dxrun.autotune import plan_report
from dxrun.cost import flops_per_token, mfu, peak_tflops
from dxrun.experiment import Experiment
from dxrun.fit import NoData

MODELS = ("small", "medium")
# GPT-2's padded vocabulary and context; a batch that fills an H200 without remat.
GPT2 = ("parallelism=dp1", "train.precision=bf16", "data.vocab_size=50304", "data.seq_len=1024")
SECTION = "GPU: GPT-2 small and medium, one device, bf16"
CUDNN_CALL = "__cudnn$fmha"  # custom-call targets of cuDNN's fused attention (fwd and bwd)


def cudnn_attention_calls(compiled_text: str) -> int:
    """cuDNN fused-attention custom calls in a compiled program's HLO text (0 off NVIDIA GPUs):
    what the step really runs, beside what ``Experiment.attention_kernel`` asked for."""
    return compiled_text.count(CUDNN_CALL)


def roofline(models: tuple[str, ...] = MODELS, batch: int = 16,
             target: str = "h200") -> list[Figure]:
    """Plan mode's estimate (compiled here for the target from shapes alone)."""
    out = []
    for model in models:
        cfg = compose_cfg(f"model={model}", *GPT2, f"data.batch_size={batch}",
                          "run.mode=plan", f"plan.target={target}")
        exp = Experiment.build(cfg, data=NoData())
        t = plan_report(cfg, exp)["target"]
        out.append(figure(
            f"{SECTION} (plan-mode roofline estimate, no GPU measured)",
            f"{model} on {t['target']}: estimated MFU", t["mfu"],
            {"step_ms": round(1e3 * t["step_time_s"], 1),
             "tokens_per_s": round(t["tokens_per_s"]), "bound": t["bound"],
             "compute_ms": round(1e3 * t["compute_s"], 1),
             "memory_ms": round(1e3 * t["memory_s"], 1), "peak_tflops": t["peak_tflops"]},
            note=f"an estimate (dxrun/estimates/time_model.py): {t['estimate']}",
            command=f"python -m dxrun run.mode=plan plan.target={target} model={model} "
                    + " ".join(GPT2) + f" data.batch_size={batch}"))
    return out


def measured(models: tuple[str, ...] = MODELS, batch: int = 16, steps: int = 10,
             reps: int = 2, shape: tuple[str, ...] = GPT2) -> list[Figure]:
    """Tokens/s and MFU of the real step on this machine's first device, fused attention and
    the reference einsum attention interleaved (``shape``: the tests' tiny stand-in)."""
    kind = jax.devices()[0].device_kind
    peak = peak_tflops(kind, "bf16")
    out = []
    for model in models:
        exps = {a: Experiment.build(compose_cfg(f"model={model}", *shape,
                                                f"data.batch_size={batch}",
                                                f"model.attention={a}"))
                for a in ("dot_product", "reference")}
        t = interleaved({a: dxrun_runner(e) for a, e in exps.items()}, steps, reps)
        for a, e in exps.items():
            cfg = e.cfg
            n_params = e.count_params(e.abstract_state().params)
            tokens = cfg.data.batch_size * cfg.data.seq_len
            tflops = (flops_per_token(cfg.model, n_params, cfg.data.seq_len) * tokens
                      / t[a].median_s / 1e12)
            calls = cudnn_attention_calls(e.step.compiled.as_text())
            print(f"{model}, attention={a}: kernel {e.attention_kernel}, {calls} cuDNN "
                  f"fused-attention call(s) in the compiled step", flush=True)
            out.append(figure(
                f"{SECTION} (measured on {kind})", f"{model}, attention={a}: MFU",
                mfu(tflops, peak) if peak else None,
                {"kernel": e.attention_kernel, "cudnn_calls": calls,
                 "tokens_per_s": round(tokens / t[a].median_s), "tflops": round(tflops, 1),
                 "peak_tflops": peak, **t[a].summary()},
                note="MFU: model FLOPs (6N + attention) / step time / peak"))
    return out

