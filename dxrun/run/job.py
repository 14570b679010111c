"""Where a run sits among others (Hydra's group choices, the overrides, the W&B group and job
type) and the names that follow from it: the run's name and its model's description."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dxrun.config.registry import model_changes

if TYPE_CHECKING:
    from dxrun.config.schema import ModelConfig, RunConfig


@dataclass
class Job:
    """Where a run sits among others: Hydra's group choices, the command-line overrides, and
    the W&B group (the experiment or multirun sweep) and job type. The W&B names are decided
    for the run (``logger.group``/``logger.job_type``, or what the launch fills in where they
    are unset) and carried here, never written into the config the run follows; the run's
    saved config records them (``run_plan.saved_config``). None: the config's own."""

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
