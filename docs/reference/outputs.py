"""The Outputs and metrics page: every file a run writes, every metric it logs
(``dxrun.config.metric_names``), and the keys of summary.json, status.json and plan.json,
read from the code that writes them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

from docs.reference.markdown import PACKAGE, cell, table
from dxrun.config.metric_names import METRICS
from dxrun.config.schema_parallel import AXES

DEFINED = PACKAGE / "config" / "metric_names.py"  # the names' one list, not a use of them

# Every file a run (or a tool run on it) writes into the run dir.
RUN_FILES: dict[str, str] = {
    ".hydra/": "config.yaml (resolved), hydra.yaml, overrides.yaml; written after validation; "
               "`attempts/<n>/` keeps each launch's config.yaml and overrides.yaml; "
               "`lock` while a run holds the dir (its pid, host and start)",
    "dxrun.log": "the console lines (a multi-process run: dxrun.<rank>.log per process)",
    "plan.json": "the mesh plan (keys below); plan mode adds `plan_mode`",
    "metrics.jsonl": "one JSON object per log step: `step` and every metric of the row (see Metrics)",
    "metrics.discarded.jsonl": "rows a resume moved aside (logged after the last checkpoint, or "
                               "cut short)",
    "summary.json": "the last row plus the run's totals (keys below)",
    "status.json": "running | ok | stopped | failed, with the fields below",
    "eval.json": "a list: one record per `python -m dxrun.evaluate` of this run",
    "checkpoints/": "Orbax checkpoints `<step>/` (the newest checkpoint.keep), from the first save on",
    "checkpoints.txt": "with checkpoint.dir: the dir `<checkpoint.dir>/<run id>/` holding this "
                       "run's checkpoints",
    "wandb/": "the offline W&B run: `wandb sync <run dir>/wandb/offline-run-*`",
    "profile/": "train.profile's trace (`plugins/profile/<time>/*.xplane.pb`, "
                "`perfetto_trace.json.gz`) and the step's HLO (`step.hlo.txt`); "
                "`profile/<rank>/` per process of a multi-process run",
    "goodput.json": "`attempts`: each attempt's wall time by part (see `goodput_s`) and its "
                    "startup by phase (`startup_phases`), with its first and last step and "
                    "its `checkpoint_saves` and `checkpoint_block_s`, recorded from its start "
                    "(an attempt killed before its first step counts); "
                    "the run's `goodput`, `wall_s`, `productive_s`, `lost_s` over them",
    "memory_breakdown.txt": "an out-of-memory step (a memory refusal: in a new dxrun-memory-* "
                            "dir under the temp dir): the compiled step's memory by part, its "
                            "largest arguments and temporaries",
    "memory.prof": "with memory_breakdown.txt on a GPU/TPU: the device memory profile (pprof)",
}

SUMMARY: dict[str, str] = {
    "step": "the last step",
    "**last": "every metric of the last log row (see Metrics)",
    "train/loss": "the last logged train loss",
    "best/train_loss": "the lowest finite train loss logged",
    "n_params": "parameters (the real vocabulary, without padding)",
    "flops_per_token": "model FLOPs per token (dxrun/cost/flops.py)",
    "tokens_per_s": "the last window's perf/tokens_per_s",
    "loop_tokens_per_s": "tokens/s of the whole loop after the first step (data, logging, "
                         "evaluation, saves)",
    "compile_time_s": "lowering + compiling the train step",
    "entropy_floor": "markov data: the best achievable loss; else null",
    "device_kind": "jax.devices()[0].device_kind",
    "peak_tflops": "the peak perf/mfu divides by; null when unknown",
    "checkpoint_saves": "saves made, over all attempts of the run (goodput.json has each's)",
    "checkpoint_block_s": "total seconds those saves held the loop (the final save "
                          "included, which no row records)",
    "goodput": "productive step time / wall time, over all attempts of the run (steps a resume "
               "redid count as lost)",
    "goodput_s": "this attempt's wall time by part: wall, startup, search (parallelism=auto's "
                 "layout search), compile (the preflight's, the init's programs and the "
                 "first step), data, productive, eval, checkpoint, logging, profile, rest; "
                 "startup_phases (the startup by phase: launch, compose, jax, decide, files, "
                 "init, open, other); its goodput, first_step and last_step, and its "
                 "checkpoint_saves and checkpoint_block_s",
    "attempts": "attempts of this run (a resume in place adds one)",
}

STATUS: dict[str, str] = {
    "status": "running | ok | stopped | failed",
    "kind": "failed: refused (bad input) | crashed | nonfinite | disk (a write the disk "
            "refused: no space, an I/O error)",
    "reason": "failed or stopped: the one line that was printed",
    "log": "failed: the file holding the traceback",
    "signal": "stopped: SIGTERM | SIGINT | SIGUSR1 (outside the train loop)",
    "step": "stopped: the step it stopped at (outside the loop: its newest checkpoint's, or 0)",
    "checkpoint": "stopped: the committed checkpoint (null: none yet)",
    "relaunch": "stopped: the command that continues the run",
    "job": "the job's number in its multirun (its dir name)",
    "attempt": "which launch of this run dir this is (1: the first; a relaunch that continues "
               "the run adds one)",
    "lost_attempts": "earlier attempts that ended without recording it (killed outright: their "
                     "status still said running)",
    "overrides": "the job's command-line overrides",
    "started": "epoch seconds the run started (kept over a resume)",
    "finished": "epoch seconds it ended (absent while running)",
    "attempts": "one per launch into the run dir: `attempt` (n), `config` "
                "(`.hydra/attempts/<n>/config.yaml`), `started`, `status` (an earlier one that "
                "never ended: killed), `finished`",
}

# plan.json: the MeshPlan's fields plus what to_json adds. Meanings from plan/mesh.py's comments.
PLAN_EXTRA: dict[str, str] = {
    "plan_mode": "run.mode=plan only: memory per device, FLOPs, collectives, target, estimate, "
                 "checkpoint cost, suggestion",
}

CHECKPOINT: dict[str, str] = {
    "state": "step, fp32 parameters, optimizer state, the NaN counters; each process writes its "
             "own shards",
    "meta": "data iterator position, tokens seen, resolved config, mesh plan, W&B run id, run_id "
            "and run_dir",
}


def summary_keys() -> list[str]:
    """The keys of the dict ``RunSummary.record`` returns (dxrun/tracking/summary.py; ``**last`` for
    the splat of the last values)."""
    tree = ast.parse((PACKAGE / "tracking" / "summary.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "record":
            d = next(n.value for n in ast.walk(node)
                     if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
            return [k.value if k is not None else "**" + getattr(v, "attr", getattr(v, "id", ""))
                    for k, v in zip(d.keys, d.values, strict=True)]
    raise LookupError("dxrun/tracking/summary.py: RunSummary.record returns no summary dict")


def status_keys() -> list[str]:
    """Every field ``JobStatus`` (dxrun/launch/job_status.py) writes into status.json, plus
    write_status's own."""
    tree = ast.parse((PACKAGE / "launch" / "job_status.py").read_text())
    keys = ["status"]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    for node in [c for c in calls if getattr(c.func, "id", None) == "write_status"] + [
            c for c in calls if getattr(c.func, "attr", None) == "write"]:
        keys += [k.arg for k in node.keywords if k.arg and k.arg not in keys]
    return [*keys, "started", "finished", "attempts"]


def plan_keys() -> dict[str, str]:
    from dxrun.plan import MeshPlan

    comments = _field_comments(MeshPlan)
    # each axis's size by its key (MeshPlan.sizes, written flat), as a run's parallelism names it
    out = {a.key: f"the {a.mesh} axis's size (parallelism.{a.key})" for a in AXES}
    out |= {f.name: comments.get(f.name, "") for f in dataclasses.fields(MeshPlan)
            if f.name != "sizes"}
    tree = ast.parse(inspect.getsource(MeshPlan.to_json).strip())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.ctx, ast.Store)):
            out.setdefault(node.slice.value, "")
    doc = {name: (inspect.getdoc(getattr(MeshPlan, name)) or "").split("\n\n")[0].replace("\n", " ")
           for name in out if isinstance(getattr(MeshPlan, name, None), property)}
    return {k: v or doc.get(k, "") for k, v in out.items()} | PLAN_EXTRA


def metric_names_in_code() -> set[str]:
    """Every string literal in dxrun/ that reads like a metric name (``section/name``), the
    list of them (``metric_names.py``) left out."""
    found = set()
    pattern = re.compile(r"^(train|eval|perf|mem|data|best|moe)/[a-z_]+$")
    for path in PACKAGE.rglob("*.py"):
        if path == DEFINED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and pattern.match(node.value):
                found.add(node.value)
    return found


def outputs_markdown() -> str:
    out = ["# Outputs and metrics", "",
           "What a run writes, generated from the code (`docs/reference/outputs.py`: the "
           "metrics of `dxrun/config/metric_names.py`, the keys read from "
           "`dxrun/tracking/summary.py`, `dxrun/launch/job_status.py` and "
           "`dxrun/plan/mesh.py`). A run "
           "dir is `outputs/<date>/<time>/`; a multirun job's is "
           "`multirun/<date>/<time>/<n>/`.", "", "## Files of a run dir", ""]
    out += table("file", RUN_FILES)
    out += ["## Metrics", "",
            "One row per `train.log_every` steps in `metrics.jsonl` and the W&B run (x axis "
            "`step`); evaluation rows every `train.eval_every`. A non-finite value is written "
            "as `null`.", "",
            "| metric | unit | reduction | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {u} | {cell(r)} | {cell(m)} |" for k, (u, r, m) in METRICS.items()]
    out += ["", "## summary.json", ""]
    out += table("key", {k: SUMMARY.get(k, "") for k in summary_keys()})
    out += ["## status.json", ""]
    out += table("key", {k: STATUS.get(k, "") for k in status_keys()})
    out += ["## plan.json", ""]
    out += table("key", plan_keys())
    out += ["## Checkpoints", "",
            "`<run dir>/checkpoints/<step>/` (or `<checkpoint.dir>/<run id>/<step>/`), written "
            "by Orbax into a tmp dir and renamed when complete; two items:", ""]
    out += table("item", CHECKPOINT)
    return "\n".join(out)


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, else the comment lines just above it."""
    lines = inspect.getsource(cls).splitlines()
    out, above = {}, []
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            above.append(s.lstrip("# ").strip())
            continue
        m = re.match(r"(\w+):\s*[^=]+(=.*)?$", s)
        if m and not s.startswith(("def ", "class ", "@")):
            trailing = re.sub(r"type: ignore\[\w+\]", "", s.partition("  #")[2]).strip()
            out[m.group(1)] = trailing or " ".join(above)
        above = []
    return out
