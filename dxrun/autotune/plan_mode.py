"""Plan mode (``run.mode=plan``): the run's decision (``fit.decide``) reported for a
target, training nothing. The train step is compiled for the planned mesh from shapes alone
and XLA's analyses of it give the per-device memory, FLOPs, bytes and collectives; from those
the table says whether it **fits** the target's memory (and when not, the fastest setting
that does: ``autotune.advice``) and how fast it would go (an estimate: the accelerator time
model on a GPU/TPU target, a roofline of XLA's counts on ``plan.target=cpu``), with the
model's shape, the TFLOP/s per device and the warnings (``dxrun.estimates``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from dxrun.autotune.advice import advice_text, fastest_that_fits
from dxrun.autotune.footprint import step_estimate
from dxrun.autotune.search import search
from dxrun.cost import GB, checkpoint_cost, checkpoint_line, gb_text, plan_platform, save_cadence, table
from dxrun.estimates import (
    disagreement,
    exposed_warning,
    fit_warning,
    kv_heads_warning,
    preset_note,
    shape_line,
    shape_warning,
    tflops_per_device,
    unsplit_warning,
)
from dxrun.fit import Decided, decide, resolve_target, state_bytes
from dxrun.model import plan_line, replicated_bytes_over
from dxrun.plan import (
    RunPlan,
    resolved_config,
)
from dxrun.run import (
    write_json,
)

log = logging.getLogger("dxrun")


def plan_report(cfg: Any, exp: Any, suggest: bool = True,
                plan: RunPlan | None = None) -> dict[str, Any]:
    """Everything plan mode prints and writes into plan.json (beside the mesh plan) for
    ``exp``'s step. ``plan``: the run plan it was built for (its save cadence, and the layout
    a refusal's settings start from); None: ``exp.plan`` as given, its cadence as a run's.
    ``suggest=False``: no search for a setting that fits (the published-runs benchmark)."""
    target, peak = resolve_target(cfg, exp.plan.n_devices)
    t0 = time.perf_counter()
    compiled = exp.compile_step()
    compile_s = time.perf_counter() - t0
    s = step_estimate(cfg, exp, compiled, target, peak)
    fp, mem, est, parts, model_flops = s.fp, s.mem, s.est, s.parts, s.model_flops
    state = exp.abstract_state()
    platform = plan_platform(cfg.plan.target, exp.plan.platform)
    nbytes, write = state_bytes(state), cfg.plan.write_gb_per_s * GB
    if plan is None:
        ck = cfg.checkpoint
        plan = RunPlan(exp.plan, save_cadence(ck.every, ck.every_minutes, platform, nbytes,
                                              write))
    tokens = exp.plan.global_batch * exp.plan.seq_len
    warning = shape_warning(platform, exp.plan.seq_len, cfg.model.max_seq_len, tokens)
    zero = exp.plan.shard_optimizer
    report: dict[str, Any] = {
        "n_params": s.n_params,
        "n_devices": exp.plan.n_devices,
        "per_device": {k: v for k, v in asdict(fp).items() if k != "collectives"}
        | {"activations_bytes": fp.activations_bytes},
        "shard_optimizer": zero,
        # ZeRO-1 (parallelism.shard_optimizer): per device, the optimizer state no axis of
        # which the data replicas divide, held whole by every replica (counters at least)
        "opt_state_unsplit_bytes": replicated_bytes_over(state.opt_state) if zero else 0.0,
        "loss_chunk": exp.plan.loss_chunk,
        "model_flops_per_step": model_flops,
        # counted from the shapes (flops.step_flops): per step, all devices; MFU's numerator
        # is "model" (full attention square), "hardware" adds what the device really runs
        "flops": parts | {"per_device_hardware": parts["hardware"] / exp.plan.n_devices},
        "collectives": fp.collectives,
        "compile_s": compile_s,
        "target": est,
    }
    if mem is not None:
        report["memory_model"] = mem.to_json() | {
            "xla_cpu_total_bytes": fp.total_bytes, "precision": exp.plan.precision,
            "disagreement": disagreement(mem.total_bytes, fp.total_bytes)}
    report["checkpoint"] = checkpoint_cost(nbytes, write, *plan.cadence, est.get("step_time_s"))
    report["model"] = (plan_line(cfg.model, s.n_params) if cfg.model._target_
                       else shape_line(cfg.model, s.n_params))
    report["tflops_per_device"] = tflops_per_device(model_flops, exp.plan.n_devices,
                                                        est.get("step_time_s"))
    report["preset"] = preset_note(cfg.parallelism.name, exp.plan.shape)
    if not est["fits"] and suggest:
        # The asked step priced as the candidates are: on a CPU target from the shapes' FLOPs
        # and this compile's bytes, not the two more compiles of XLA's own count.
        asked = est if mem is not None else step_estimate(cfg, exp, compiled, target, peak,
                                                         xla_cost=False).est
        report["advice"] = fastest_that_fits(
            resolved_config(cfg, plan), exp, state, target, peak, asked, s.n_params)
        best = report["advice"].get("suggestion")
        report["suggestion"] = best["overrides"] if best else None
    unsplit = report["opt_state_unsplit_bytes"]
    opt = mem.opt_state_bytes if mem is not None else fp.opt_state_bytes
    found = report.get("advice")
    report["warnings"] = [w for w in (
        fit_warning(est, found and advice_text(found, exp.plan.n_devices, short=True)),
        kv_heads_warning(cfg.model), warning,
        unsplit_warning(zero, opt, unsplit, exp.plan.dp),
        exposed_warning(est)) if w]
    return report


def plan_table(report: dict[str, Any]) -> str:
    t = report["target"]
    rows = [*([("preset", report["preset"])] if report.get("preset") else []),
            ("model", report.get("model") or f"{report['n_params']:,} parameters"),
            *memory_rows(report)]
    rows += [
        ("model FLOPs", f"{report['model_flops_per_step']:.3e} per step" + _flops_parts(report)),
        ("collectives", ", ".join(f"{k} x{int(v['count'])} ({gb_text(v['bytes'])}/step)"
                                  for k, v in sorted(report["collectives"].items())) or "none"),
        ("target", f"{t['target']}: {t['memory_per_device_gb']:.1f} GB per device, usable "
                   f"{100 * t['usable_fraction']:.0f}% = {t['usable_per_device_gb']:.1f} GB "
                   f"({t['usable_source']})"),
        ("fits", f"{'yes' if t['fits'] else 'NO'}: needs {t['needs_per_device_gb']:.2f} GB, "
                 f"headroom {t['headroom_gb']:.2f} GB"),
    ]
    if "timing" in t:
        g = t["timing"]
        rows.append(("estimate", t["estimate"]))
        rows.append(("step", f"{t['step_time_s'] * 1e3:.1f} ms ({t['bound']}-bound: matmuls "
                             f"{g['matmul_s'] * 1e3:.1f} ms, attention {g['attention_s'] * 1e3:.1f}"
                             f" ms ({'fused' if g['fused_attention'] else 'XLA'}), elementwise "
                             f"{g['elementwise_s'] * 1e3:.1f} ms, collectives "
                             f"{(g['tensor_collective_s'] + g['data_collective_s']) * 1e3:.1f} ms"
                             f" of which exposed {g['exposed_collective_s'] * 1e3:.1f} ms), "
                             f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.0f}%"
                             f" ({t['precision']}, peak {t['peak_tflops']:g} TFLOP/s)"))
    elif "step_time_s" in t:
        rows.append(("estimate", f"step {t['step_time_s'] * 1e3:.1f} ms ({t['bound']}-bound: "
                                 f"compute {t['compute_s'] * 1e3:.1f} ms, memory "
                                 f"{t['memory_s'] * 1e3:.1f} ms, collectives "
                                 f"{t['collective_s'] * 1e3:.1f} ms), "
                                 f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.0f}%"
                                 f" ({t['precision']}, peak {t['peak_tflops']:g} TFLOP/s)"))
    if report.get("tflops_per_device"):
        rows.append(("TFLOP/s", f"{report['tflops_per_device']:.1f} per device (model FLOPs per "
                                "device / the estimated step)"))
    if "checkpoint" in report:
        rows.append(("checkpoint", checkpoint_line(report["checkpoint"])))
    if "advice" in report:
        rows.append(("suggestion", advice_text(report["advice"], report["n_devices"])))
    rows += [("warning", w) for w in report.get("warnings", [])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _flops_parts(report: dict[str, Any]) -> str:
    f = report.get("flops")
    if not f or "block_matmuls" not in f:  # a user model's: counted whole
        return ""
    return (f" (matmuls {f['block_matmuls']:.2e}, attention {f['attention_full']:.2e} full / "
            f"{f['attention_causal']:.2e} causal, output layer {f['output_layer']:.2e}); "
            f"hardware {f['per_device_hardware']:.3e} per device with recomputation")


MEMORY_AGREEMENT = 0.10  # beyond it (fp32) the table shows the CPU compile's figure as well


def memory_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's per-device memory: XLA's compile on a CPU target; on an accelerator the
    memory model's breakdown, and the CPU compile's figure beside it when the two disagree by
    more than 10% in fp32 (in bf16 the CPU program is not the accelerator's, so never)."""
    pd, mm = report["per_device"], report.get("memory_model")
    opt = gb_text(pd["opt_state_bytes"] if mm is None else mm["opt_state_bytes"])
    if report.get("shard_optimizer"):
        opt += f" (split over data; {gb_text(report.get('opt_state_unsplit_bytes', 0.0))} not)"
    xla = (f"params {gb_text(pd['params_bytes'])}, optimizer {opt}, "
           f"gradients {gb_text(pd['grads_bytes'])}, activations+temps "
           f"{gb_text(pd['activations_bytes'])}; total {gb_text(pd['total_bytes'])}")
    if mm is None:
        return [("per device", xla)]
    gathers = f", FSDP gathers {gb_text(mm['gathers_bytes'])}" if mm["gathers_bytes"] else ""
    chunk = (f" (in chunks of {report['loss_chunk']} positions)" if report.get("loss_chunk")
             else "")
    rows = [("per device",
             f"params {gb_text(mm['params_bytes'])}, optimizer {opt}, "
             f"gradients {gb_text(mm['grads_bytes'])}, activations {gb_text(mm['activations_bytes'])} "
             f"+ one layer's backward {gb_text(mm['working_bytes'])} + logits "
             f"{gb_text(mm['head_bytes'])}{chunk}{gathers}; total {gb_text(mm['total_bytes'])} "
             f"({mm['basis']})")]
    rows += [("memory note", note) for note in mm.get("notes", [])]
    if mm["precision"] == "fp32" and mm["disagreement"] > MEMORY_AGREEMENT:
        rows.append(("XLA:CPU", f"{xla} ({100 * mm['disagreement']:.0f}% from the model)"))
    return rows


def planned(cfg: Any) -> Decided:
    """The run plan mode reports: ``decide`` for ``plan.target`` on the visible devices (for
    ``parallelism=auto`` the layout ranked first by the estimate alone)."""
    return decide(cfg, plan_mode=True, search=search)


def run_plan(cfg: Any, run_dir: Any, decided: Decided) -> dict[str, Any]:
    """``run.mode=plan``: compile for the mesh, print the table, write plan.json; train nothing."""
    plan = decided.plan
    report = plan_report(cfg, decided.exp, plan=plan)
    write_json(run_dir / "plan.json", {**plan.to_json(), "plan_mode": report})
    log.info("mesh plan\n%s\n%s", plan.mesh.table(), plan_table(report))
    if plan.search:
        log.info("parallelism=auto\n%s", table(plan.search, run=False))
    if report["warnings"]:  # each is a row of the table above
        n = len(report["warnings"])
        log.warning("plan mode: %d warning%s (the table's warning rows)", n, "s" * (n > 1))
    if report["checkpoint"]["too_costly"]:
        log.warning("checkpoints: %s", checkpoint_line(report["checkpoint"]))
    return report
