"""Where a run sits among others: Hydra's group choices, the overrides, the W&B group and job type
(``Job``), the names that follow from them (the run's name, its model's description), a multirun's
exits, and the ``logger`` section checked before a run starts (an MLflow store that cannot be
written refused in one line, a key the chosen logger does not read one warning). No MLflow, W&B or
JAX import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from omegaconf import ListConfig

from dxrun.config import (
    LoggerConfig,
    RunConfig,
)
from dxrun.config.registry import model_changes
from dxrun.run.run_dir import dir_refusal

if TYPE_CHECKING:

    from dxrun.config import ModelConfig


# What each multirun started in this process exits with, once Hydra returns: the sweep report's
# callback (``report.sweep.SweepReport``) puts in its check of the jobs' status.json files, and
# the launcher (``dxrun.__main__.cli``) calls them. Hydra keeps no handle on a sweep dir once the
# multirun is over, and with submitit the jobs ran elsewhere.
SWEEP_EXITS: list[Callable[[], None]] = []


def sweep_group(sweep_dir: Path) -> str:
    """The W&B group of a multirun's jobs: ``sweep-<date>_<time>`` from its sweep dir."""
    return "sweep-" + "_".join(Path(sweep_dir).parts[-2:])

@dataclass
class Job:
    """Where a run sits among others: Hydra's group choices, the command-line overrides, and
    the W&B group (the experiment or multirun sweep) and job type. The W&B names are decided
    for the run (``logger.group``/``logger.job_type``, or what the launch fills in where they
    are unset) and carried here, never written into the config the run follows; the run's
    saved config records them (``plan.run_plan.saved_config``). None: the config's own."""

    choices: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    group: str | None = None
    job_type: str | None = None
    started: float | None = None  # epoch seconds the job began (goodput's startup); None = now
    # The run dir holds earlier attempts of this run (a relaunch continues them, with or without
    # a checkpoint): their rows after this attempt's start move aside, their goodput is kept.
    continues: bool = False


MAX_NAME = 120


def _model_label(model: ModelConfig, job: Job) -> str:
    """The preset's name, or the user's own (``model.name=...``) for a custom size."""
    named = any(ov.lstrip("+~").startswith("model.name=") for ov in job.overrides)
    return model.name if named else job.choices.get("model", model.name)


def run_name(cfg: RunConfig, job: Job, global_batch: int | None = None) -> str:
    """``tiny-dp4_tp2-bs64`` plus the key overrides, e.g. ``-lr0.01``. No slashes: a path
    value is its last component (``data.path=data/mycorpus`` gives ``pathmycorpus``), and a
    long name is cut between parts, never inside one. ``global_batch``: the plan's (None:
    ``data.batch_size``)."""
    batch = cfg.data.batch_size if global_batch is None else global_batch
    parts = [_model_label(cfg.model, job), job.choices.get("parallelism", cfg.parallelism.name),
             f"bs{batch}"]
    for ov in job.overrides:
        key, _, value = ov.lstrip("+~").partition("=")
        if "." in key and key not in ("data.batch_size", "model.name") and not key.startswith(
                ("logger.", "hydra", "runtime.", "distributed.", "run.")):
            value = (Path(value.rstrip("/")).name or value) if "/" in value else value
            parts.append(f"{key.rsplit('.', 1)[1]}{value}".replace("/", "_"))
    name = parts[0][:MAX_NAME]
    for part in parts[1:]:
        if len(name) + 1 + len(part) > MAX_NAME:
            break
        name += f"-{part}"
    return name


def describe_model(model: ModelConfig, job: Job) -> str:
    """``tiny``, or ``tiny (modified: n_layers=4, d_model=256)`` when keys differ from the
    preset, or ``mine (tiny modified: ...)`` for a size the user named; an imported model is
    its own, ``hf-gpt2 (hf:gpt2)``: its shape is the checkpoint's, not the preset's."""
    if model.init_from:
        return f"{model.name} ({model.init_from})"
    preset = job.choices.get("model", model.name)
    label = _model_label(model, job)
    changes = model_changes(model, preset)
    if not changes:
        return label
    base = "" if label == preset else f"{preset} "
    return f"{label} ({base}modified: {', '.join(changes)})"

# The keys each backend reads (MLflow: the experiment, the store, and the names as tags).
NAMES = ("project", "group", "job_type", "tags")
READS = {"wandb": {*NAMES, "entity", "mode"}, "mlflow": {*NAMES, "mlflow_uri"},
         "tensorboard": set(), "csv": set(), "none": set()}
WHO = {"entity": "logger=wandb", "mode": "logger=wandb", "mlflow_uri": "logger=mlflow",
       "backends": "logger=many", **{k: "logger=wandb or logger=mlflow" for k in NAMES}}


def mlflow_store_uri(uri: str | None, run_dir: Path) -> str:
    """The tracking URI the MLflow backend opens: ``uri`` as given, a plain path as its
    ``file:`` URI (MLflow's file store, as the run dir's own ``mlruns/``, the default)."""
    if uri is None:
        return (run_dir / "mlruns").resolve().as_uri()
    if _local_path(uri) is not None and not uri.startswith("file:"):
        return Path(uri).expanduser().absolute().as_uri()
    return uri


def _local_path(uri: str) -> Path | None:
    """The directory a local file store URI (a path, ``file:``) names; None for another."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(uri).expanduser() if not parsed.scheme else None


def store_refusal(lc: LoggerConfig) -> str | None:
    """Why MLflow could not write ``logger.mlflow_uri`` (a file store's dir, or a
    ``sqlite:///`` database's dir, that cannot be made or written), in one line naming the
    key, the value and the fix; None when it can, or when the store is a server (MLflow
    reaches it when the backend opens)."""
    if lc.mlflow_uri is None or "mlflow" not in _backends(lc):
        return None
    fix = "give one you can write to, or leave logger.mlflow_uri null (<run dir>/mlruns)"
    if lc.mlflow_uri.startswith("sqlite:///"):
        db = Path(lc.mlflow_uri.removeprefix("sqlite:///")).expanduser()
        return dir_refusal(f"logger.mlflow_uri={lc.mlflow_uri}: the database's dir",
                           db.parent, fix)
    path = _local_path(lc.mlflow_uri)
    if path is None:
        return None
    plain = not lc.mlflow_uri.startswith("file:")
    return dir_refusal("logger.mlflow_uri" if plain else f"logger.mlflow_uri={lc.mlflow_uri}: "
                       "the store's dir", path, fix)


def _backends(lc: LoggerConfig) -> list[str]:
    return list(lc.backends) if lc.name == "many" else [lc.name]


def unread_logger_keys(lc: LoggerConfig) -> list[str]:
    """A warning for each ``logger.*`` key set away from its default that no backend of this
    run reads (``logger=csv logger.entity=me``): the setting would do nothing. ``tags`` aside:
    the experiments set theirs for whichever logger the run picks (``logger=none`` too)."""
    reads = set().union(*(READS.get(b, set()) for b in _backends(lc)))
    if lc.name == "many":
        reads.add("backends")
    defaults = LoggerConfig()
    out = []
    for f in fields(LoggerConfig):
        value = getattr(lc, f.name)
        if f.name in ("name", "tags") or f.name in reads or value == getattr(defaults, f.name):
            continue
        shown = f"[{','.join(value)}]" if isinstance(value, (list, ListConfig)) else value
        out.append(f"logger.{f.name}={shown} does nothing with logger={lc.name} (only "
                   f"{WHO[f.name]} reads it); drop it, or choose a logger that reads it")
    return out
