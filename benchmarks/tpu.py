"""The TPU figures: GPT-2 small, medium and large on one chip in bf16 at seq_len 1024, dxrun's step
against a hand-written ``jax.jit`` step of the same model (fp32 master weights, bf16 compute,
the same optax AdamW, Pallas' splash attention), tokens/s and MFU, the compiled step's memory.

    python -m benchmarks.tpu small:16:none medium:16:dots large:8:dots [--hand] [--out DIR]
    python -m benchmarks.tpu large:16:full+hand --profile     # dxrun's step beside the hand one's
    python -m benchmarks.tpu small:16:none --loss-at e289544  # the loss then and now, side by side

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
import math
import statistics
import time
from pathlib import Path
from typing import Any

import jax

from benchmarks import reference
from benchmarks.speed import compose_cfg, dxrun_runner
from dxrun.cost import flops_per_token, peak_tflops
from dxrun.experiment import Experiment, jax_dtype, step_bytes

GPT2 = ("parallelism=dp1", "train.precision=bf16", "data.seq_len=1024", "data.vocab_size=50304")


def overrides(shape: str, tokens: str | None = None) -> list[str]:
    model, batch, remat, *extra = shape.split(":")
    more = [kv for part in extra for kv in part.split(",") if kv]
    data = ["data=tokens", f"data.path={tokens}"] if tokens else []
    return [f"model={model}", *data, *GPT2, f"data.batch_size={batch}", f"model.remat={remat}",
            *more]


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
    from dxrun.model.splash_attention import attend

    cpu = jax.default_backend() == "cpu"  # Pallas interpreted: the script's own check off the chip

    step = reference.make_step(exp.tx, dtype=jax_dtype("bfloat16"),
                               attend=lambda q, k, v: attend(q, k, v, True, cpu),
                               remat=exp.plan.remat)
    rows = [exp.data.local_batch(k) for k in range(4)]
    box = {"p": jax.device_put(state.params), "o": jax.device_put(state.opt_state), "i": 0}

    def run() -> Any:
        tokens = jax.device_put(rows[box["i"] % len(rows)])
        box["p"], box["o"], loss = step(box["p"], box["o"], tokens)
        box["i"] += 1
        jax.block_until_ready((box["p"], box["o"], loss))
        return loss

    return run


def commit() -> str:
    """``$DXRUN_COMMIT`` where set (a copy of the tree whose git dir is absent or not its
    own), else the checkout's commit."""
    import os
    import subprocess

    if os.environ.get("DXRUN_COMMIT"):
        return os.environ["DXRUN_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    return out or "unknown"


def traced(run: Any, out: Path) -> None:
    """Two steps of ``run`` traced under ``out`` and ``dxrun.profile``'s table of them in
    ``out``/profile.md (every op of the trace: a bare jit's module has no run dir's HLO)."""
    from dxrun import profile

    with jax.profiler.trace(str(out)):
        for _ in range(2):
            run()
    ops = profile.read_ops(profile.trace_files(out)[-1], None)
    table = profile.table(profile.summarize(ops, {}, top=40),
                          {o.name: o.source for o in ops if o.source})
    Path(out, "profile.md").write_text(table + "\n")
    print(table.split("\n\n")[0], flush=True)


def old_loss(rev: str) -> Any:
    """``dxrun.model.losses.chunked_cross_entropy`` as it was at commit ``rev``."""
    import subprocess
    import types

    # in dxrun/model/objectives.py before the model package's split, in losses.py since
    shown = [subprocess.run(["git", "show", f"{rev}:dxrun/model/{name}.py"], capture_output=True,
                            text=True) for name in ("losses", "objectives")]
    source = next(p for p in shown if p.returncode == 0).stdout
    module = types.ModuleType(f"chunked_loss_at_{rev}")
    exec(compile(source, module.__name__, "exec"), module.__dict__)  # noqa: S102
    return module.chunked_cross_entropy


def measure(shape: str, steps: int, hand: bool, tokens: str | None = None,
            profile_dir: Path | None = None) -> dict[str, Any]:
    """One shape's record; ``profile_dir``: each step traced there too (``traced``)."""
    cfg = compose_cfg(*overrides(shape, tokens))
    exp = Experiment.build(cfg)
    host = jax.device_get(exp.init_state())  # both steps start from it (theirs are donated)
    run = dxrun_runner(exp, host)
    t0 = time.perf_counter()
    first_loss = float(run())  # compiles
    compile_s = time.perf_counter() - t0
    wall = time_steps(run, steps)
    n_params = exp.count_params(exp.abstract_state().params)
    tokens = exp.plan.global_batch * exp.plan.seq_len
    per_token = flops_per_token(cfg.model, n_params, exp.plan.seq_len)
    peak = peak_tflops(jax.devices()[0].device_kind, "bf16")
    step_s = statistics.median(wall)
    mem = exp.step.compiled.memory_analysis()
    rec: dict[str, Any] = {
        "shape": shape, "model": cfg.model.name, "layout": exp.plan.layout.mesh,
        "batch_size": exp.plan.global_batch,
        "seq_len": exp.plan.seq_len, "remat": exp.plan.remat, "attention": exp.attention_kernel,
        "loss_chunk": exp.cfg.model.loss_chunk, "n_params": n_params,
        "step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(tokens / step_s),
        "mfu": round(per_token * tokens / step_s / (peak * 1e12), 4) if peak else None,
        "first_loss": first_loss, "compile_s": round(compile_s, 1),
        "step_bytes": step_bytes(exp.step.compiled),
        "temp_bytes": mem.temp_size_in_bytes if mem else None,
        "peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "device_kind": jax.devices()[0].device_kind, "commit": commit(),
    }
    print(json.dumps(rec), flush=True)
    name = shape.replace(":", "_").replace(",", "_").replace("=", "-")
    if profile_dir is not None:
        traced(run, profile_dir / f"{name}-dxrun")
    if hand:
        del run
        gc.collect()
        try:
            hrun = hand_runner(exp, host)
            rec["hand_first_loss"] = float(hrun())
            hwall = time_steps(hrun, steps)
            if profile_dir is not None:
                traced(hrun, profile_dir / f"{name}-hand")
            rec["hand_step_ms"] = round(1e3 * statistics.median(hwall), 2)
            rec["hand_tokens_per_s"] = round(tokens / statistics.median(hwall))
            del hrun
        except Exception as e:  # noqa: BLE001 - e.g. the hand-written step does not fit
            rec["hand_error"] = repr(e)[:300]
        print(json.dumps({k: rec.get(k) for k in ("shape", "hand_step_ms", "hand_tokens_per_s",
                                                   "hand_first_loss", "hand_error")}), flush=True)
    del exp
    gc.collect()
    return rec


def first_step(run_dir: str) -> float:
    """Seconds from the command to the end of the run's first step, as its goodput books them:
    the startup (from the process's start), the layout search and the compiling first step."""
    a = json.loads(Path(run_dir, "goodput.json").read_text())["attempts"][0]
    return round(a["startup_s"] + a["search_s"] + a["compile_s"], 1)


def plan_estimate(shape: str, tokens: str | None) -> tuple[float, float, bool]:
    """Plan mode's estimate of the shape on a v5e (``run.mode=plan plan.target=v5e``), compiled
    on CPU from shapes alone (run it where no chip is held): the step in ms, the memory model's
    need per device in bytes, and whether it says the shape fits."""
    from dxrun.autotune import plan_report, planned

    cfg = compose_cfg(*overrides(shape, tokens), "run.mode=plan", "plan.target=v5e")
    t = plan_report(cfg, planned(cfg).exp, suggest=False)["target"]
    return round(1e3 * t["step_time_s"], 1), t["needs_per_device_gb"] * 1e9, bool(t["fits"])


def _xla_need(error: str) -> str:
    """``"HLO temporaries 17.53G of 15.75G"`` from XLA's out-of-memory text."""
    import re

    m = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", error)
    return f"HLO temporaries {m.group(1)} of {m.group(2)} HBM" if m else error[:60]


def _fastest(model: str, records: list[dict]) -> str:
    """One line: the model's fastest dxrun shape against the hand-written step's fastest, each
    at the batch and remat it fits best ("" where the hand-written step ran at none)."""
    ours = max(records, key=lambda r: r["tokens_per_s"])
    hands = [r for r in records if r.get("hand_tokens_per_s")]
    if not hands:
        return ""
    hand = max(hands, key=lambda r: r["hand_tokens_per_s"])
    return (f"- {model}: dxrun's fastest, {ours['tokens_per_s']:,} tokens/s (`{ours['shape']}`), "
            f"is {ours['tokens_per_s'] / hand['hand_tokens_per_s']:.3f}x the hand-written "
            f"step's fastest of these shapes, {hand['hand_tokens_per_s']:,} (`{hand['shape']}`).")


# Each sparse model beside the dense model of its active FLOPs per token (moe_small: 8 experts of
# half small's d_ff, top 2: small's MLP FLOPs).
DENSE_OF = {"moe_small": "small"}


def _sparse(model: str, records: list[dict]) -> str:
    """One line: the sparse model's fastest shape against its dense model's (``DENSE_OF``):
    the tokens/s ratio (issue 82's bar: 0.75) and its MFU, counted on active parameters."""
    ours = [r for r in records if r.get("model") == model and r.get("tokens_per_s")]
    dense = [r for r in records if r.get("model") == DENSE_OF.get(model) and r.get("tokens_per_s")]
    if not ours or not dense:
        return ""
    a, b = (max(rs, key=lambda r: r["tokens_per_s"]) for rs in (ours, dense))
    mfu = f"{100 * a['mfu']:.1f}%" if a.get("mfu") else "-"
    return (f"- {model}: its fastest, {a['tokens_per_s']:,} tokens/s (`{a['shape']}`, MFU {mfu} "
            f"on active parameters), is {a['tokens_per_s'] / b['tokens_per_s']:.3f}x "
            f"{DENSE_OF[model]}'s fastest, {b['tokens_per_s']:,} (`{b['shape']}`), the dense "
            "model of the same active FLOPs.")


def _runs(out: str, prefix: str) -> list[tuple[str, Path, dict, dict]]:
    """Each ``<prefix><model>`` run of ``out`` that logged: its model, dir, the medians of its
    perf/* over its logged rows after the first (the compiling step's), and the layout its
    search chose (plan.json's chosen row)."""
    found = []
    for run in sorted(Path(out).glob(f"{prefix}*")):
        if not run.is_dir() or not (run / "metrics.jsonl").is_file():
            continue
        logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        logged = [x for x in logged if "perf/tokens_per_s" in x][1:] or logged[-1:]
        # perf/mfu: where the chip's peak is known (a TPU's; not a CPU's)
        perf = {k: statistics.median([x.get(f"perf/{k}", math.nan) for x in logged])
                for k in ("mfu", "tokens_per_s", "step_time_s")}
        chosen = next(r for r in json.loads((run / "plan.json").read_text())["layout_search"][
            "rows"] if r["chosen"])
        found.append((run.name.removeprefix(prefix), run, perf, chosen))
    return found


def _label(chosen: dict) -> str:
    return " ".join([chosen["mesh"], *([f"remat={chosen['remat']}"]
                                       if chosen["remat"] != "none" else []),
                     *([f"accum={chosen['grad_accum']}"] if chosen["grad_accum"] > 1 else [])])


def default_rows(out: str, best: dict[str, float]) -> list[str]:
    """The defaults rows: each ``default-<model>`` run of ``out`` (its model and data only), the
    layout its search chose, its median tokens/s and MFU, against ``best``, the model's fastest
    tuned MFU."""
    rows = ["| model (defaults) | layout the run chose | tokens/s | MFU | of the model's best |",
            "|---|---|---:|---:|---:|"]
    for model, _, perf, chosen in _runs(out, "default-"):
        mfu = perf["mfu"]
        of = f"{mfu / best[model]:.2f}" if model in best else "-"
        rows.append(f"| {model} | {_label(chosen)} | {perf['tokens_per_s']:,.0f} | "
                    f"{100 * mfu:.1f}% | {of} |")
    return rows if len(rows) > 2 else []


def family_rows(out: str) -> list[str]:
    """The field's models (tpu.sh's ``family-<preset>`` runs, issue 81): the layout the run's
    search chose, its median tokens/s, MFU and step time, and plan mode's estimate of that
    layout's step on a v5e (compiled here from shapes alone; its ratio to the measured)."""
    from dxrun.autotune import fit

    rows = ["| model (tpu.sh's overrides) | layout the run chose | tokens/s | MFU | step ms | "
            "plan mode ms (ratio) |", "|---|---|---:|---:|---:|---:|"]
    for model, run, perf, chosen in _runs(out, "family-"):
        given = run.with_suffix(".args").read_text().split()
        cfg = compose_cfg(*given, f"parallelism={chosen['mesh']}",
                          f"model.remat={chosen['remat']}",
                          f"train.grad_accum={chosen['grad_accum']}", "run.mode=plan",
                          "plan.target=v5e")
        plan = 1e3 * fit.plan_report(cfg, fit.planned(cfg).exp, suggest=False)["target"][
            "step_time_s"]
        ms = 1e3 * perf["step_time_s"]
        shown = " ".join(g for g in given if not g.startswith(("data=", "data.path=")))
        rows.append(f"| {model}: `{shown}` | {_label(chosen)} | {perf['tokens_per_s']:,.0f} | "
                    f"{100 * perf['mfu']:.1f}% | {ms:.1f} | {plan:.1f} ({plan / ms:.3f}) |")
    return rows if len(rows) > 2 else []


def replan(path: Path = Path("BENCHMARKS.tpu.json")) -> list[dict]:
    """Plan mode's figures of every row in ``path`` made anew on this machine's CPU (after a
    change to the memory or time model; the chip's measurements stay as they are)."""
    records = json.loads(path.read_text())
    for r in records:
        plan, need, fits = plan_estimate(r["shape"], None)
        r.update({"plan_gib": round(need / 2**30, 2), "plan_fits": fits})
        if "step_ms" in r:
            r.update({"plan_step_ms": plan, "plan_vs_measured": round(plan / r["step_ms"], 3),
                      "plan_vs_xla_memory": round(need / r["step_bytes"], 3)})
        print(r["shape"], {k: r.get(k) for k in ("plan_vs_measured", "plan_gib",
                                                  "plan_vs_xla_memory", "plan_fits")}, flush=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return records


def report(out: str, tokens: str | None, command: str) -> None:
    """BENCHMARKS.tpu.json and BENCHMARKS.md's TPU section from ``out``'s measurements (the
    chip's tpu.json and first-step runs) and plan mode's estimates (made here)."""
    from benchmarks.report import markers

    cold, warm = (first_step(str(Path(out, f"first-{k}"))) for k in ("cold", "warm"))
    marker = Path(out, "first-commit")  # tpu.sh's: the commit the first-step runs ran
    first_commit = marker.read_text().strip() if marker.is_file() else None
    records = []
    for r in json.loads(Path(out, "tpu.json").read_text()):
        plan, need, fits = plan_estimate(r["shape"], tokens)
        memory = {"plan_gib": round(need / 2**30, 2), "plan_fits": fits}
        if "error" in r:
            records.append({**r, **memory, "command": command})
            continue
        small = r["model"] == "small"
        records.append({**r, "plan_step_ms": plan, **memory,
                        "plan_vs_measured": round(plan / r["step_ms"], 3),
                        "plan_vs_xla_memory": round(need / r["step_bytes"], 3),
                        "first_step_s_cold": cold if small else None,
                        "first_step_s_warm": warm if small else None,
                        "first_step_commit": (first_commit or r.get("commit")) if small else None,
                        "command": command})
    Path("BENCHMARKS.tpu.json").write_text(json.dumps(records, indent=1) + "\n")
    rows = ["| shape (model:batch:remat:overrides) | attention | tokens/s | MFU | hand-written "
            "tokens/s | dxrun / hand | step ms | plan mode ms (ratio) | args + temps GiB | plan "
            "mode GiB (ratio) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if "error" in r:
            said = "fits" if r["plan_fits"] else "does not fit"
            rows.append(f"| `{r['shape']}` | | does not fit: XLA's compile refuses it "
                        f"({_xla_need(r['error'])}) | | | | | | | {r['plan_gib']} ({said}) |")
            continue
        hand = r.get("hand_tokens_per_s")
        vs = (f"{hand:,} | {r['tokens_per_s'] / hand:.3f}" if hand
              else "does not fit (XLA: out of HBM) | -" if "hand_error" in r else "- | -")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        rows.append(
            f"| `{r['shape']}` | {r['attention']} | {r['tokens_per_s']:,} | "
            f"{mfu} "
            f"| {vs} | {r['step_ms']} | {r['plan_step_ms']} ({r['plan_vs_measured']}) "
            f"| {r['step_bytes'] / 2**30:.2f} | {r['plan_gib']} ({r['plan_vs_xla_memory']}"
            f"{'' if r['plan_fits'] else ', does not fit'}) |")
    begin, end = markers("tpu")
    first = records[0]
    best = [line for model in dict.fromkeys(r["model"] for r in records if "model" in r)
            if (line := _fastest(model, [r for r in records if r.get("model") == model])
                        or _sparse(model, records))]
    steps_at = ", ".join(sorted({str(r.get("commit", "unknown")) for r in records}))
    section = "\n".join([
        begin, "", f"`{command}` at {steps_at}, on one "
        f"{first.get('device_kind', 'TPU')} "
        "chip (bf16, seq_len 1024, random GPT-2 token ids, `parallelism=dp1`):", "", *rows, "",
        f"model=small's first step, from the command to the end of its first step "
        f"(goodput's startup + compile): {cold} s with an empty compile cache, {warm} s with a "
        f"warm one (at {first_commit or steps_at}).", "", *best, "",
        *default_rows(out, {m: max(r["mfu"] for r in records if r.get("model") == m and r.get(
            "mfu")) for m in {r["model"] for r in records if r.get("mfu")}}), "",
        *family_rows(out), "", end])
    md = Path("BENCHMARKS.md").read_text()
    if begin in md:
        md = md[:md.index(begin)] + section + md[md.index(end) + len(end):]
    else:
        md = (md.rstrip("\n") + "\n\n## TPU: GPT-2 small, medium and large on one chip\n\n"
              + section + "\n")
    Path("BENCHMARKS.md").write_text(md)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hand", action="store_true")
    ap.add_argument("--tokens", help="a token dir (data=tokens data.path=...); default: markov")
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true", help="trace two steps of each (dxrun's "
                    "and the hand-written one's) into --out/profiles/<shape>-<step>/")
    ap.add_argument("--loss-at", metavar="REV", help="each shape twice, side by side: first "
                    "with dxrun/model/losses.py as it was at commit REV, then as it is")
    ap.add_argument("--report", metavar="COMMAND", help="write BENCHMARKS.tpu.json and "
                    "BENCHMARKS.md's TPU section from --out's measurements, with plan mode's "
                    "estimates (made on this machine's CPU); COMMAND: the command to cite")
    ap.add_argument("--replan", action="store_true", help="plan mode's figures of every row of "
                    "BENCHMARKS.tpu.json made anew here (no chip: the measurements stay)")
    a = ap.parse_args()
    if a.replan:
        replan()
        return
    if a.report:
        report(a.out, a.tokens, a.report)
        return
    import dxrun.experiment.step

    profiles = Path(a.out, "profiles") if a.profile else None
    losses = {"now": dxrun.experiment.step.chunked_cross_entropy}
    if a.loss_at:
        losses = {a.loss_at: old_loss(a.loss_at), **losses}
    records = []
    for shape in a.shapes:
        for at, loss in losses.items():
            dxrun.experiment.step.chunked_cross_entropy = loss
            try:
                rec = measure(shape.removesuffix("+hand"), a.steps,
                              a.hand or shape.endswith("+hand"), a.tokens,
                              profiles / at if profiles and a.loss_at else profiles)
            except Exception as e:  # a shape that does not fit: say so, time the others
                print(json.dumps({"shape": shape, "error": repr(e)[:400]}), flush=True)
                rec = {"shape": shape, "error": repr(e)[:400]}
            records.append(rec | ({"loss_at": at} if a.loss_at else {}))
            jax.clear_caches()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "tpu.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
