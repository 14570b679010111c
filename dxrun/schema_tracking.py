"""The schema of what a run reports and watches: the ``logger`` section (where the reduced rows,
the config, the plan and the summary go beside ``metrics.jsonl``) and ``train.early_stop`` (a
monitored metric that ends the run once it stops improving). Keys are written as in
``dxrun.schema`` (``config_key.key``), which places these sections in ``RunConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dxrun.config_key import NON_NEGATIVE, Range, key

# Every backend ``logger.name`` (or ``logger.backends`` under ``logger=many``) can name.
BACKENDS = ("wandb", "tensorboard", "csv", "mlflow")


@dataclass
class LoggerConfig:
    name: str = key("wandb", "where metrics go beside metrics.jsonl (the logger=NAME option): "
                    "one backend, none, or many (logger.backends)",
                    choices=(*BACKENDS, "many", "none"))
    backends: list[str] = key(meaning="logger=many: the backends written at once, any of "
                              + ", ".join(BACKENDS), factory=lambda: ["csv", "tensorboard",
                                                                     "mlflow"])
    project: str = key("dxrun", "the W&B project; MLflow's experiment name")
    entity: str | None = key(None, "the W&B entity (user or team); null = W&B's default")
    mode: str | None = key(None, "W&B's mode; null = $WANDB_MODE, else offline",
                           choices=("offline", "online", "disabled"),
                           fix="or leave it null to follow $WANDB_MODE")
    group: str | None = key(None, "the W&B group; null = the sweep's (sweep-<date>_<time>) in a "
                            "multirun")
    job_type: str | None = key(None, "None: \"train\" for a single run, \"sweep\" for a "
                               "multirun job")
    tags: list[str] = key(meaning="extra W&B tags beside the model/parallelism/data/optimizer "
                          "choices", factory=list)
    mlflow_uri: str | None = key(None, "MLflow's tracking URI (a dir or file: URI, a file "
                                 "store; sqlite:///...; a server); null = the run dir's own file "
                                 "store, <run dir>/mlruns")


@dataclass
class EarlyStopConfig:
    monitor: str | None = key(None, "End the run once this logged metric (e.g. eval/loss) has "
                              "not improved for train.early_stop.patience of its rows; null = "
                              "off. The run ends with status ok and the reason in status.json.")
    mode: str = key("min", "min: lower is better; max: higher is better", choices=("min", "max"))
    patience: int = key(3, "rows of the monitored metric without improvement before the stop",
                        range=Range(1))
    min_delta: float = key(0.0, "an improvement is a change by more than this",
                           range=NON_NEGATIVE)
