"""The one metrics path: every logged row goes to ``metrics.jsonl`` and, if enabled, to W&B.

W&B trouble never stops training: a failing init or log call is warned about once and the run
goes on with the local file. Only process 0 logs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from dxrun.runtime import finite_or_null

log = logging.getLogger("dxrun")


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Any, run_config: dict[str, Any], name: str,
                 group: str | None = None, choices: dict[str, str] | None = None,
                 is_main: bool = True, resume_id: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.is_main = is_main
        self.wandb = None
        self.warned_non_finite = False
        self._file = open(self.path, "a") if is_main else None  # noqa: SIM115 - closed in finish
        if is_main and cfg.logger.name == "wandb":
            tags = [f"{g}:{choices[g]}" for g in ("model", "parallelism", "data", "optimizer")
                    if choices and g in choices]
            self.wandb = open_wandb(run_dir, cfg.logger, run_config, name,
                                    cfg.logger.group or group, tags + list(cfg.logger.tags),
                                    resume_id)

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (saved in checkpoints, so a resumed run continues the same run)."""
        return self.wandb.id if self.wandb is not None else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        row, bad = finite_or_null({"step": step, **{k: float(v) for k, v in metrics.items()}})
        if bad and not self.warned_non_finite:
            log.warning("step %d: %s not finite (the run diverged?); written as null, here and "
                        "in every later row, without another warning", step, ", ".join(bad))
            self.warned_non_finite = True
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self.wandb is not None:
            try:
                self.wandb.log(row)
            except Exception as e:  # noqa: BLE001
                log.warning("W&B log failed (%s); continuing with metrics.jsonl only", e)
                self.wandb = None

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("W&B finish failed (%s)", e)
            self.wandb = None


def rewind_metrics(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """Resuming at ``step``: rows the interrupted attempt logged after it move to
    ``metrics.discarded.jsonl`` (never silently dropped), so ``metrics.jsonl`` reads as one
    uninterrupted run. Returns the rows kept."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    keep = [x for x in lines if json.loads(x)["step"] <= step]
    gone = [x for x in lines if json.loads(x)["step"] > step]
    if gone:
        with open(run_dir / "metrics.discarded.jsonl", "a") as f:
            f.write("".join(x + "\n" for x in gone))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(path)
        log.info("moved %d metrics rows after step %d to metrics.discarded.jsonl", len(gone), step)
    return [json.loads(x) for x in keep]


def open_wandb(run_dir: Path, lc: Any, run_config: dict[str, Any] | None, name: str | None,
               group: str | None, tags: list[str] | None, resume_id: str | None) -> Any:
    """A W&B run under ``run_dir`` (``resume_id``: continue that run), its history keyed by
    ``step``; None, with one warning, if W&B fails: it never stops the caller."""
    try:
        import wandb

        mode = lc.mode or os.environ.get("WANDB_MODE") or "offline"
        run = wandb.init(
            project=lc.project, entity=lc.entity, name=name, group=group,
            job_type=lc.job_type or "train", tags=tags, dir=str(run_dir), mode=mode,
            config=run_config, reinit="finish_previous",
            # A resumed run continues its W&B run: one id, one curve on the dashboard.
            id=resume_id, resume="allow" if resume_id else None,
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        run.define_metric("train/loss", summary="min")
        return run
    except Exception as e:  # noqa: BLE001 - any W&B failure must not stop training
        log.warning("W&B init failed (%s); continuing with metrics.jsonl only", e)
        return None
