"""Every metric name a run logs, with its unit, how it is reduced to one number per row and
what it means: the one list (the docs' Outputs page reads it; ``tests/test_reference.py`` scans
dxrun/ for metric-like string literals and fails on one without its entry here, or on an entry
nothing logs). Pure data: no import of dxrun or JAX."""

from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    unit: str
    reduction: str
    meaning: str


METRICS: dict[str, Metric] = {
    "train/loss": Metric(
        "nats/token",
        "mean over the step's global batch (in the jitted step)",
        "cross-entropy of the step; model.objective=mdlm: the masked-diffusion bound (ELBO) "
        "on it, over all tokens"),
    "train/ppl": Metric("-", "exp of train/loss", "perplexity"),
    "train/accuracy": Metric(
        "fraction",
        "mean over the global batch's tokens",
        "next-token argmax accuracy; model.objective=mdlm: on the masked tokens (their share "
        "of the batch's, per micro-batch)"),
    "train/mask_rate": Metric(
        "fraction",
        "the step's global batch (model.objective=mdlm only)",
        "share of the batch's tokens the step's forward process masked"),
    "train/grad_norm": Metric(
        "-",
        "global L2 norm over all gradients, before clipping",
        "gradient norm"),
    "train/param_norm": Metric(
        "-",
        "global L2 norm over all parameters, after the update",
        "parameter norm"),
    "train/lr": Metric(
        "-",
        "the schedule at the optimizer's count (after optimizer.lr_scaling)",
        "learning rate of the step"),
    "train/skipped_steps": Metric(
        "steps",
        "count since the start (train.nan_policy=skip only)",
        "updates left out for a non-finite loss or gradient"),
    "perf/step_time_s": Metric(
        "s",
        "mean over the log window, device-ready to device-ready; the compiling first step excluded",
        "wall time per step"),
    "perf/tokens_per_s": Metric(
        "tokens/s",
        "log window; all devices together",
        "batch x seq_len / step time"),
    "perf/tokens_per_s_per_device": Metric(
        "tokens/s",
        "perf/tokens_per_s / devices in the mesh",
        "throughput per device"),
    "perf/tflops_per_device": Metric(
        "TFLOP/s",
        "log window; model FLOPs / step time / devices",
        "achieved model TFLOP/s per device"),
    "perf/mfu": Metric(
        "fraction",
        "perf/tflops_per_device / peak (only where the peak is known)",
        "model FLOPs utilisation"),
    "perf/data_wait_frac": Metric(
        "fraction",
        "share of the log window",
        "host time getting the next batch onto the devices"),
    "perf/compile_time_s": Metric("s", "once (first row)", "lowering + compiling the train step"),
    "perf/layout_search_s": Metric(
        "s",
        "once (first row); parallelism=auto",
        "the layout search's own time, goodput's search: the other layouts' compiles and timed steps "
        "(0 when the run did not search)"),
    "perf/checkpoint_block_s": Metric(
        "s",
        "rows whose window held a save: the saves since the previous row, the one made at its step "
        "included",
        "how long saves held the loop inside this row's timing window (its tokens/s); absent without "
        "one. The save after the last step is in no row: summary.json's checkpoint_block_s counts it"),
    "mem/step_bytes_per_device": Metric(
        "bytes",
        "once (first row); XLA's memory analysis",
        "arguments + outputs - donated state + temporaries per device"),
    "mem/peak_bytes_per_device": Metric(
        "bytes",
        "every log row; GPU/TPU allocator high-water mark (Device.memory_stats), the largest over this"
        " process's devices",
        "peak device memory during this run so far (when it rose above an earlier job's)"),
    "perf/profiled": Metric(
        "true",
        "log rows whose window held traced steps (train.profile)",
        "the traced steps are left out of this row's perf/* figures"),
    "data/tokens_seen": Metric("tokens", "cumulative", "tokens trained on, summed over batch changes"),
    "data/entropy_floor": Metric(
        "nats/token",
        "constant (markov data)",
        "the best achievable train/loss"),
    "eval/loss": Metric(
        "nats/token",
        "mean over eval.batches held-out batches (model.objective=mdlm: and eval.draws "
        "masking draws of each)",
        "held-out cross-entropy; model.objective=mdlm: its bound (ELBO)"),
    "eval/ppl": Metric("-", "exp of eval/loss", "held-out perplexity"),
    "eval/accuracy": Metric("fraction", "mean over the held-out tokens",
                            "held-out next-token accuracy; model.objective=mdlm: on the masked "
                            "tokens"),
    "eval/tokens": Metric(
        "tokens",
        "sum over the evaluated batches (dxrun.evaluate only)",
        "distinct held-out tokens scored (a split smaller than one batch repeats its windows "
        "in the batch: each counted once)"),
    "moe/aux_loss": Metric(
        "-", "mean over the MoE layers, of the step's global batch (model.moe.n_experts > 0)",
        "load-balancing loss before its coefficient (model.moe.aux_loss): 1 when balanced"),
    "moe/z_loss": Metric(
        "-", "mean over the MoE layers, of the step's global batch (model.moe.n_experts > 0)",
        "router z-loss (mean squared logsumexp of the router logits) before its coefficient"),
    "moe/load_max": Metric(
        "x mean", "the most loaded expert's tokens over the mean, the largest over the layers",
        "expert load imbalance, 1 when balanced"),
    "moe/load_min": Metric(
        "x mean", "the least loaded expert's tokens over the mean, the smallest over the layers",
        "an expert starved of tokens shows as 0"),
    "moe/dropped": Metric(
        "fraction", "routed assignments over the step's batch and the MoE layers",
        "share of routed assignments past an expert's capacity (model.moe.capacity_factor), "
        "not computed; 0 when dropless"),
    "best/train_loss": Metric(
        "nats/token",
        "minimum over the logged finite train/loss (summary.json)",
        "lowest train loss"),
}

# Which of METRICS a training run's rows hold (what ``checkpoint.keep_best`` and
# ``train.early_stop.monitor`` can watch: ``dxrun.checks.validation.logged_metrics``). Every name is
# in them, under these conditions: eval/* when the run evaluates (train.eval_every > 0); the
# names of ONLY_WITH under that one setting (data/entropy_floor also from a data._target_ of
# yours, which may give one); moe/* with an expert count (model.moe.n_experts); never the
# names of NOT_IN_ROWS, which are elsewhere. Names whose rows the device decides (perf/mfu: a
# known peak; mem/peak_bytes_per_device: an accelerator) count as logged: the config cannot tell.
ONLY_WITH: dict[str, tuple[str, str]] = {
    "train/mask_rate": ("model.objective", "mdlm"),
    "train/skipped_steps": ("train.nan_policy", "skip"),
    "data/entropy_floor": ("data.name", "markov"),
}
NOT_IN_ROWS: dict[str, str] = {
    "eval/tokens": "dxrun.evaluate's",
    "best/train_loss": "summary.json's",
}
