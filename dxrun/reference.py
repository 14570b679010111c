"""The docs' Reference pages, generated from the code at every ``mkdocs build`` (docs/hooks.py),
so they cannot drift from it: every config key, every preset, every file a run writes with its
keys, every metric, every command-line tool.

Generated at build time rather than committed: a committed page would need a test to say it is
stale and a person to paste it; a generated one is never stale, and ``mkdocs build --strict`` in
CI fails on a page that does not render. ``tests/test_reference.py`` fails when something exists
in the code without its entry here (a key without a meaning, a metric the train loop logs but
METRICS lacks, a tool without its usage).

Pure: reads the schema dataclasses and their fields' metadata, the YAML presets and the tools'
argument parsers; never imports JAX (a docs build needs no accelerator stack).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import os
import re
from pathlib import Path
from typing import Any

import yaml

from dxrun import config, schema

PACKAGE = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------
# Config keys

@dataclasses.dataclass(frozen=True)
class Key:
    key: str
    type: str
    default: Any
    allowed: str
    meaning: str


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


def _type_name(tp: Any) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "").replace("Any", "any")


def _allowed(key: str, type_text: str) -> str:
    """What the key's field says it accepts: its choices, its range, or why it has none."""
    null = " or null" if schema.null_is_a_value(key) else ""
    if schema.choices_of(key):
        return " \\| ".join(f"`{c}`" for c in schema.choices_of(key)) + null
    if key in schema.RANGES:
        return str(schema.RANGES[key]) + null
    if key in schema.UNRANGED:
        return schema.UNRANGED[key].partition(":")[0]
    if type_text == "bool":
        return "`true` \\| `false`"
    return ""


def config_keys() -> list[Key]:
    """Every key of the schema in order, with the default the default run composes and what its
    field says (``dxrun.schema.key``): the accepted values and the meaning."""
    defaults = _composed_defaults()
    out = []
    for key, f in schema.FIELDS.items():
        type_text = _type_name(f.type)
        out.append(Key(key, type_text, defaults.get(key), _allowed(key, type_text),
                       f.metadata["meaning"]))
    return out


def _composed_defaults() -> dict[str, Any]:
    """``python -m dxrun``'s config (the default options of every group), unresolved."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base=None):
        cfg = compose("config")
    GlobalHydra.instance().clear()
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and prefix.count(".") == 0 and k == "profile":
                walk(v, f"{prefix}.{k}")  # a nested section (train.profile)
            else:
                flat[f"{prefix}.{k}"] = v

    for section, values in OmegaConf.to_container(cfg, resolve=False).items():
        walk(values, section)
    return flat


def _cell(v: Any) -> str:
    """A table cell: ``|`` escaped, and ``<name>`` outside code spans escaped so Markdown does
    not take it for an HTML tag (``dxrun.<rank>.log``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    parts = str(v).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;")
                    for i, p in enumerate(parts))


def config_markdown() -> str:
    groups = {g: sorted(p.stem for p in (config.conf_dir() / g).glob("*.yaml"))
              for g in ("model", "parallelism", "data", "optimizer", "logger")}
    out = ["# Config keys", "",
           "Every key of the run config, generated from the schema in `dxrun/schema.py`: each "
           "field's type and default, and the meaning, range or choices its `key(...)` carries. "
           "The default is what `python -m dxrun` composes (`model=tiny`, `parallelism=auto`, "
           "`data=markov`, `optimizer=adamw`, `logger=wandb`); a preset of a group may set another "
           "(see [Presets](presets.md)). Set any key on the command line: "
           "`python -m dxrun section.key=value`. A value outside its range is refused in one "
           "line before anything runs.", ""]
    by_section: dict[str, list[Key]] = {}
    for k in config_keys():
        by_section.setdefault(k.key.partition(".")[0], []).append(k)
    sections = {f.name: f.metadata["meaning"] for f in dataclasses.fields(schema.RunConfig)}
    for section, keys in by_section.items():
        out += [f"## {section}", "", sections[section][:1].upper() + sections[section][1:] + ".",
                ""]
        if section in groups:
            out += [f"Group `{section}`: options " + ", ".join(f"`{o}`" for o in groups[section])
                    + f" (`{section}=NAME`, files in `conf/{section}/`).", ""]
        out += ["| key | type | default | accepted | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{k.key}` | `{k.type}` | `{_cell(k.default)}` | {k.allowed} | "
                f"{_cell(k.meaning)} |" for k in keys]
        out.append("")
    out += ["## Accepted ranges", "",
            "The same ranges by kind (`dxrun.schema.ranges_markdown()`); the numeric keys left "
            "out, each with its reason, are `dxrun/schema.py: UNRANGED`.", "",
            schema.ranges_markdown(), ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Presets

def preset_files() -> dict[str, list[Path]]:
    """Every preset file by where it is chosen: ``conf/<group>/``, ``experiments/``, ``sweeps/``,
    ``sweeps/wandb/`` and the SLURM batch script."""
    conf = config.conf_dir()
    out = {f"{g.name}=": sorted(g.glob("*.yaml")) for g in sorted(conf.iterdir()) if g.is_dir()
           and g.name != "hydra"}
    out["hydra/launcher="] = sorted((conf / "hydra" / "launcher").glob("*.yaml"))
    out["experiment="] = sorted(config.preset_dir("experiment").glob("*.yaml"))
    out["sweep="] = sorted(config.preset_dir("sweep").glob("*.yaml"))
    out["wandb sweep"] = sorted((config.preset_dir("sweep") / "wandb").glob("*.yaml"))
    out["sbatch"] = sorted(config.preset_dir("experiment").glob("*.sbatch"))
    return out


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _flatten(v, f"{prefix}{k}.")
        return out or [f"{prefix[:-1]}={{}}"]
    if isinstance(node, list) and prefix == "defaults.":
        return [f"{_defaults_entry(e)}" for e in node]
    text = yaml.safe_dump(node, default_flow_style=True, width=10**6).strip()
    return [f"{prefix[:-1]}={text.removesuffix(chr(10) + '...')}"]


def _defaults_entry(e: Any) -> str:
    if isinstance(e, dict):
        ((k, v),) = e.items()
        return f"{k.replace('override /', '')}={v}"
    return f"defaults: {e}"


def _header(path: Path) -> str:
    """The file's leading comment, without the ``@package`` line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(("#!", "# @package")):
            continue
        lines.append(line.lstrip("#")[1:] if line.startswith("# ") else line.lstrip("#"))
    return "\n".join(lines).strip()


def presets_markdown() -> str:
    out = ["# Presets", "",
           "Every preset file shipped with dxrun (inside the package as `dxrun.conf`, "
           "`dxrun.experiments`, `dxrun.sweeps`) and the keys it sets, read from the files. "
           "`group=option` lines are the file's defaults list (the presets it brings).", ""]
    for choose, paths in preset_files().items():
        if not paths:
            continue
        where = os.path.relpath(paths[0].parent, _repo_or_package())
        out += [f"## `{choose}` ({where}/)", ""]
        for p in paths:
            out += [f"### `{p.name}`", ""]
            head = _header(p)
            if head:
                out += ["```text", head, "```", ""]
            if p.suffix == ".yaml":
                sets = _flatten(yaml.safe_load(p.read_text()) or {})
                out += ["Sets: " + ", ".join(f"`{s}`" for s in sets), ""]
    return "\n".join(out)


def _repo_or_package() -> Path:
    return PACKAGE.parent


# ----------------------------------------------------------------------------------------------
# Metrics and the files a run writes

# Every metric name the code logs, with its unit and how it is reduced to one number per row.
# tests/test_reference.py scans dxrun/ for metric-like string literals and fails on one missing.
METRICS: dict[str, tuple[str, str, str]] = {
    "train/loss": ("nats/token", "mean over the step's global batch (in the jitted step)",
                   "cross-entropy of the step"),
    "train/ppl": ("-", "exp of train/loss", "perplexity"),
    "train/accuracy": ("fraction", "mean over the global batch's tokens", "next-token argmax accuracy"),
    "train/grad_norm": ("-", "global L2 norm over all gradients, before clipping", "gradient norm"),
    "train/param_norm": ("-", "global L2 norm over all parameters, after the update", "parameter norm"),
    "train/lr": ("-", "the schedule at the optimizer's count (after optimizer.lr_scaling)",
                 "learning rate of the step"),
    "train/skipped_steps": ("steps", "count since the start (train.nan_policy=skip only)",
                            "updates left out for a non-finite loss or gradient"),
    "perf/step_time_s": ("s", "mean over the log window, device-ready to device-ready; the "
                         "compiling first step excluded", "wall time per step"),
    "perf/tokens_per_s": ("tokens/s", "log window; all devices together", "batch x seq_len / step time"),
    "perf/tokens_per_s_per_device": ("tokens/s", "perf/tokens_per_s / devices in the mesh",
                                     "throughput per device"),
    "perf/tflops_per_device": ("TFLOP/s", "log window; model FLOPs / step time / devices",
                               "achieved model TFLOP/s per device"),
    "perf/mfu": ("fraction", "perf/tflops_per_device / peak (only where the peak is known)",
                 "model FLOPs utilisation"),
    "perf/data_wait_frac": ("fraction", "share of the log window", "host time getting the next "
                            "batch onto the devices"),
    "perf/compile_time_s": ("s", "once (first row)", "lowering + compiling the train step"),
    "perf/layout_search_s": ("s", "once (first row); parallelism=auto",
                             "the layout search's own time, goodput's search: the other "
                             "layouts' compiles and timed steps (0 when the run did not search)"),
    "perf/checkpoint_block_s": ("s", "rows whose window held a save: the saves since the "
                                "previous row, the one made at its step included",
                                "how long saves held the loop inside this row's timing window "
                                "(its tokens/s); absent without one. The save after the last "
                                "step is in no row: summary.json's checkpoint_block_s counts "
                                "it"),
    "mem/step_bytes_per_device": ("bytes", "once (first row); XLA's memory analysis",
                                  "arguments + outputs - donated state + temporaries per device"),
    "mem/peak_bytes_per_device": ("bytes", "every log row; GPU/TPU allocator high-water mark "
                                  "(Device.memory_stats), the largest over this process's "
                                  "devices", "peak device memory during this run so far (when "
                                  "it rose above an earlier job's)"),
    "perf/profiled": ("true", "log rows whose window held traced steps (train.profile)",
                      "the traced steps are left out of this row's perf/* figures"),
    "data/tokens_seen": ("tokens", "cumulative", "tokens trained on, summed over batch changes"),
    "data/entropy_floor": ("nats/token", "constant (markov data)", "the best achievable train/loss"),
    "eval/loss": ("nats/token", "mean over eval.batches held-out batches", "held-out cross-entropy"),
    "eval/ppl": ("-", "exp of eval/loss", "held-out perplexity"),
    "eval/accuracy": ("fraction", "mean over the held-out tokens", "held-out next-token accuracy"),
    "eval/tokens": ("tokens", "sum over the evaluated batches (dxrun.evaluate only)",
                    "tokens scored"),
    "best/train_loss": ("nats/token", "minimum over the logged finite train/loss (summary.json)",
                        "lowest train loss"),
}

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
    "checkpoints/": "Orbax checkpoints `<step>/` (the newest checkpoint.keep)",
    "checkpoints.txt": "with checkpoint.dir: the dir `<checkpoint.dir>/<run id>/` holding this "
                       "run's checkpoints",
    "wandb/": "the offline W&B run: `wandb sync <run dir>/wandb/offline-run-*`",
    "profile/": "train.profile's trace (`plugins/profile/<time>/*.xplane.pb`, "
                "`perfetto_trace.json.gz`) and the step's HLO (`step.hlo.txt`); "
                "`profile/<rank>/` per process of a multi-process run",
    "goodput.json": "`attempts`: each attempt's wall time by part (see `goodput_s`), with its "
                    "first and last step and its `checkpoint_saves` and `checkpoint_block_s`, "
                    "recorded from its start (an attempt killed before its first step counts); "
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
    "flops_per_token": "model FLOPs per token (dxrun/plan/flops.py)",
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
                 "layout search), compile (the preflight's and the first step), data, "
                 "productive, eval, checkpoint, logging, profile, rest; "
                 "its goodput, first_step and last_step, and its checkpoint_saves and "
                 "checkpoint_block_s",
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

# plan.json: the MeshPlan's fields plus what to_json adds. Meanings from plan.py's comments.
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
    """The keys of the dict ``RunSummary.record`` returns (dxrun/tracking/run_summary.py; ``**last`` for
    the splat of the last values)."""
    tree = ast.parse((PACKAGE / "tracking" / "run_summary.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "record":
            d = next(n.value for n in ast.walk(node)
                     if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
            return [k.value if k is not None else "**" + getattr(v, "attr", getattr(v, "id", ""))
                    for k, v in zip(d.keys, d.values, strict=True)]
    raise LookupError("dxrun/tracking/run_summary.py: RunSummary.record returns no summary dict")


def status_keys() -> list[str]:
    """Every field a ``_status(...)`` call in dxrun/__main__.py writes, plus write_status's own."""
    tree = ast.parse((PACKAGE / "__main__.py").read_text())
    keys = ["status"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_status":
            keys += [k.arg for k in node.keywords if k.arg and k.arg not in keys]
        if isinstance(node, ast.FunctionDef) and node.name == "_job_fields":
            keys += [k.value for n in ast.walk(node) if isinstance(n, ast.Dict)
                     for k in n.keys if isinstance(k, ast.Constant) and k.value not in keys]
    return [*keys, "started", "finished", "attempts"]


def plan_keys() -> dict[str, str]:
    from dxrun.plan.mesh import MeshPlan  # pure: dataclasses and arithmetic

    comments = _field_comments(MeshPlan)
    out = {f.name: comments.get(f.name, "") for f in dataclasses.fields(MeshPlan)}
    tree = ast.parse(inspect.getsource(MeshPlan.to_json).strip())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.ctx, ast.Store)):
            out.setdefault(node.slice.value, "")
    doc = {name: (inspect.getdoc(getattr(MeshPlan, name)) or "").split("\n\n")[0].replace("\n", " ")
           for name in out if isinstance(getattr(MeshPlan, name, None), property)}
    return {k: v or doc.get(k, "") for k, v in out.items()} | PLAN_EXTRA


def metric_names_in_code() -> set[str]:
    """Every string literal in dxrun/ that reads like a metric name (``section/name``)."""
    found = set()
    pattern = re.compile(r"^(train|eval|perf|mem|data|best)/[a-z_]+$")
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and pattern.match(node.value):
                found.add(node.value)
    return found


def outputs_markdown() -> str:
    def table(head: str, rows: dict[str, str]) -> list[str]:
        return [f"| {head} | meaning |", "|---|---|",
                *[f"| `{k}` | {_cell(v)} |" for k, v in rows.items()], ""]

    out = ["# Outputs and metrics", "",
           "What a run writes, generated from the code (`dxrun/reference.py`: the metric "
           "table, the keys read from `dxrun/tracking/run_summary.py`, `dxrun/__main__.py` and "
           "`dxrun/plan/mesh.py`). A run dir is `outputs/<date>/<time>/`; a multirun job's is "
           "`multirun/<date>/<time>/<n>/`.", "", "## Files of a run dir", ""]
    out += table("file", RUN_FILES)
    out += ["## Metrics", "",
            "One row per `train.log_every` steps in `metrics.jsonl` and the W&B run (x axis "
            "`step`); evaluation rows every `train.eval_every`. A non-finite value is written "
            "as `null`.", "",
            "| metric | unit | reduction | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {u} | {_cell(r)} | {_cell(m)} |" for k, (u, r, m) in METRICS.items()]
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


# ----------------------------------------------------------------------------------------------
# Command-line tools

# Every ``python -m`` entry point a user runs, with how its usage is read. Entry points that are
# not user tools (a benchmark's worker process) are in INTERNAL; a new one in neither fails the
# tests.
TOOLS: dict[str, str] = {
    "dxrun": "hydra",
    "dxrun.evaluate": "docstring",
    "dxrun.sample": "docstring",
    "dxrun.launch": "argparse",
    "dxrun.report": "argparse",
    "dxrun.bench": "argparse",
    "dxrun.data.prepare": "argparse",
    "dxrun.dashboard": "argparse",
    "dxrun.profile": "argparse",
}
INTERNAL = {"dxrun.bench.allocator": "one variant of the allocator benchmark, started by dxrun.bench",
            "dxrun.bench.eager": "dxrun's worker in the PyTorch comparison, started by dxrun.bench "
                                 "--torch"}


_MAIN_GUARDS = ("__name__ == '__main__'", "'__main__' == __name__")


def entry_points() -> set[str]:
    """Modules of dxrun/ runnable with ``python -m``: a ``__main__.py`` or a ``__main__`` guard."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        mod = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if path.name == "__main__.py":
            out.add(mod.removesuffix(".__main__"))
        elif any(isinstance(n, ast.If) and ast.unparse(n.test) in _MAIN_GUARDS
                 for n in ast.parse(path.read_text()).body):
            out.add(mod)
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _argparse_help(module: str) -> str:
    """The tool's own ``--help``: its main() is run until it parses, and the parser kept."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    is_package = spec is not None and spec.submodule_search_locations is not None
    mod = importlib.import_module(module + ".__main__" if is_package else module)

    def capture(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self)

    saved = {n: getattr(argparse.ArgumentParser, n) for n in ("parse_args", "parse_known_args")}
    old_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        for n in saved:
            setattr(argparse.ArgumentParser, n, capture)
        try:
            mod.main([])
        except _Captured as c:
            parser = c.parser
        else:
            raise LookupError(f"{module}.main() parsed no arguments")
    finally:
        for n, f in saved.items():
            setattr(argparse.ArgumentParser, n, f)
    try:
        parser.prog = f"python -m {module}"
        text = parser.format_help()
    finally:
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns
    return text.replace(str(PACKAGE.parent) + os.sep, "")


def _hydra_help() -> str:
    import sys

    from hydra._internal.utils import get_args_parser

    argv0, sys.argv[0] = sys.argv[0], "python -m dxrun"  # the shell-completion help names it
    try:
        parser = get_args_parser()
        for action in parser._actions:  # Hydra's completion help is a lazy object, not a str
            action.help = None if action.help is None else str(action.help)
    finally:
        sys.argv[0] = argv0
    parser.prog = "python -m dxrun"
    with contextlib.redirect_stdout(io.StringIO()):
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"
        try:
            return parser.format_help()
        finally:
            os.environ.pop("COLUMNS", None) if old is None else os.environ.__setitem__("COLUMNS", old)


def tool_usage(module: str) -> str:
    how = TOOLS[module]
    if how == "argparse":
        return _argparse_help(module)
    if how == "hydra":
        return _hydra_help()
    import importlib

    doc = inspect.getdoc(importlib.import_module(module)) or ""
    text = doc.replace("``", "`")
    opts = getattr(importlib.import_module(module), "OPTIONS", None)
    if opts:
        text += "\n\nOptions (key=value, defaults): " + " ".join(f"{k}={v!r}" for k, v in opts.items())
    return text


def tools_markdown() -> str:
    out = ["# Command-line tools", "",
           "Each tool's usage as the code defines it: the argument parser of the argparse "
           "tools, Hydra's flags for `python -m dxrun`, the module docstring of the tools that "
           "take `key=value` arguments.", ""]
    for module in TOOLS:
        out += [f"## `python -m {module}`", ""]
        if module == "dxrun":
            out += ["Composes the run config from the config groups and `key=value` overrides "
                    "(every key: [Config keys](config.md); every option: [Presets](presets.md)), "
                    "then plans, trains and logs. `-m` runs a sweep (multirun). Also installed "
                    "as the `dxrun` command. Hydra's flags:", ""]
        if TOOLS[module] == "docstring":
            out += [tool_usage(module), ""]
        else:
            out += ["```text", tool_usage(module).rstrip(), "```", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The mesh figures of the Guide: drawn from the plan dxrun makes for a preset on 8 devices

FIGURE_LAYOUTS = ("dp4_tp2", "fsdp8", "dp2_fsdp2_tp2")


def preset_plan(parallelism: str, n_devices: int = 8) -> Any:
    """The mesh plan ``python -m dxrun parallelism=NAME`` makes on ``n_devices`` CPU devices."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dxrun.plan.mesh import make_plan

    config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config.conf_dir()), version_base=None):
        cfg = compose("config", overrides=[f"parallelism={parallelism}"])
    GlobalHydra.instance().clear()
    return make_plan(cfg, n_devices, "cpu")


def mesh_svg(plan: Any, title: str) -> str:
    """One box per device, laid out as the mesh orders them (data, fsdp, tensor; row-major):
    a row per batch shard (data x fsdp), a column per tensor rank. Each box says which part of
    the batch and of the weights' sharded axes it holds, read from the plan's rules."""
    by_axis: dict[str, list[str]] = {}
    for logical, mesh_axis in plan.rules.items():
        for a in (mesh_axis if isinstance(mesh_axis, (tuple, list)) else [mesh_axis]):
            if a is not None and logical != "batch":
                by_axis.setdefault(a, []).append(logical)
    rows, cols = plan.dp * plan.fsdp, plan.tp
    w, h, gap, top = 300, 78, 10, 58
    width, height = max(cols * (w + gap) + gap, 620), top + rows * (h + gap) + gap
    colours = ["#e3f2fd", "#fff3e0", "#e8f5e9", "#fce4ec", "#ede7f6", "#e0f7fa", "#f9fbe7",
               "#efebe9"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<text x="{gap}" y="20" font-size="13" font-weight="bold">{title}: data={plan.dp} '
           f'x fsdp={plan.fsdp} x tensor={plan.tp}</text>',
           f'<text x="{gap}" y="40">rows: batch shards (data x fsdp); columns: tensor ranks; '
           f'colour: one data replica</text>']
    for i, device in enumerate(plan.device_ids):
        d, rest = divmod(i, plan.fsdp * plan.tp)
        f, t = divmod(rest, plan.tp)
        r = d * plan.fsdp + f
        x, y = gap + t * (w + gap), top + r * (h + gap)
        lines = [f"device {device}", f"batch rows {r + 1}/{rows}"]
        if plan.tp > 1:
            lines.append(f"{', '.join(by_axis.get('tensor', []))}: part {t + 1}/{plan.tp}")
        if plan.fsdp > 1:
            lines.append(f"{', '.join(by_axis.get('fsdp', []))}: part {f + 1}/{plan.fsdp}")
        if plan.tp == plan.fsdp == 1:
            lines.append("every weight whole (replicated)")
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" '
                   f'fill="{colours[d % len(colours)]}" stroke="#555"/>')
        out += [f'<text x="{x + 8}" y="{y + 18 + 16 * k}"'
                f'{" font-weight=" + chr(34) + "bold" + chr(34) if k == 0 else ""}>{text}</text>'
                for k, text in enumerate(lines)]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def figures() -> dict[str, str]:
    return {f"figures/mesh_{name}.svg": mesh_svg(preset_plan(name), f"parallelism={name}")
            for name in FIGURE_LAYOUTS}


def pages() -> dict[str, str]:
    """The generated pages: path under docs/ -> markdown."""
    return {"reference/config.md": config_markdown(),
            "reference/presets.md": presets_markdown(),
            "reference/outputs.md": outputs_markdown(),
            "reference/tools.md": tools_markdown()}

