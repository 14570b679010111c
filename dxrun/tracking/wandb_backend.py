"""W&B as one of the logging backends (``backends.Backend``): an offline run unless told
otherwise, continued by a resume in place as ``metrics.jsonl`` reads.

A resume in place gives its W&B run the rows of ``metrics.jsonl`` it lacks (``catch_up``): a
killed attempt's W&B writer loses what it had not written yet, which ``metrics.jsonl``, written
row by row, keeps.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dxrun.config.schema import LoggerConfig
from dxrun.tracking.backends import Backend, Declined, Opening
from dxrun.tracking.wandb_file import held_steps

log = logging.getLogger("dxrun")


class WandbBackend(Backend):
    title = "W&B"

    def __init__(self, o: Opening):
        held = held_steps(sorted(o.run_dir.glob(f"wandb/*run-*/run-{o.resume_id}.wandb"))
                          ) if o.resume_id and o.kept is not None else []
        rewind_to, missing = catch_up(o.kept or [], held) if o.resume_id else (None, [])
        self.run, rewound = _open_wandb(o.run_dir, o.lc, o.run_config, o.name, o.group,
                                        o.tags, o.resume_id, rewind_to, o.job_type)
        if self.run is None:
            raise Declined  # _open_wandb said why
        # W&B's own banner is off (``_open_wandb``): where its run lives, in one line.
        where = Path(self.run.dir).parent
        log.info("W&B: %s", f"offline run in {where} (upload: wandb sync {where})"
                 if self.run.offline else f"run {self.run.url}")
        if not rewound:  # continued as it is: W&B ignores steps at or below its last
            missing = [r for r in missing if held is not None and r["step"] > max(
                held, default=0)]
        if missing:
            for row in missing:
                self.run.log(row, step=row["step"])
            log.info("W&B: logged again the %d row(s) of metrics.jsonl its run lacked "
                     "(steps %d-%d)", len(missing), missing[0]["step"], missing[-1]["step"])

    def log(self, step: int, row: dict[str, Any]) -> None:
        # W&B's own step is the train step: a resume can rewind the run to it.
        self.run.log(row, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if "step" in values:  # the run's summary.json: beside W&B's own per-metric summary
            values = {"run_summary": values}
        self.run.summary.update(values)

    def upload(self, directory: Path, name: str, kind: str) -> None:
        """An online run's artifact (offline runs keep it on disk only: a trace can be large)."""
        if self.run.offline:
            return
        import wandb

        art = wandb.Artifact(f"{name}-{self.run.id}", type=kind)
        art.add_dir(str(directory))
        self.run.log_artifact(art)

    def finish(self) -> None:
        self.run.finish()


def catch_up(kept: list[dict[str, Any]], held: list[int] | None
             ) -> tuple[int | None, list[dict[str, Any]]]:
    """How a resumed W&B run comes to hold ``kept`` (the rows of metrics.jsonl a resume kept)
    when it holds ``held`` (its steps, ``wandb_file.held_steps``; None: unknown, so all of
    them again): the step to rewind it to (None: no rewind) and the kept rows to log again. Up
    to the first kept row it lacks, it holds them all; the rest are logged again after it, and
    a rewind to there first drops whatever it holds past it (rows metrics.jsonl moved aside,
    or kept rows that would otherwise come twice)."""
    if held is None:
        return 0, kept
    have = set(held)
    first_missing = next((i for i, r in enumerate(kept) if r["step"] not in have), len(kept))
    upto = kept[first_missing - 1]["step"] if first_missing else 0
    rewind = upto if max(held, default=0) > upto else None
    return rewind, kept[first_missing:]


def open_wandb(run_dir: Path, lc: LoggerConfig, run_config: dict[str, Any] | None, name: str | None,
               group: str | None, tags: list[str] | None, resume_id: str | None,
               rewind_to: int | None = None) -> Any:
    """A W&B run under ``run_dir`` (``resume_id``: continue that run; ``rewind_to``: first
    rewind it to that step), its history keyed by ``step``; None, with one warning, if W&B
    fails: it never stops the caller."""
    return _open_wandb(run_dir, lc, run_config, name, group, tags, resume_id, rewind_to,
                       lc.job_type or "train")[0]


def _open_wandb(run_dir: Path, lc: LoggerConfig, run_config: dict[str, Any] | None,
                name: str | None, group: str | None, tags: list[str] | None,
                resume_id: str | None, rewind_to: int | None, job_type: str
                ) -> tuple[Any, bool]:
    """``open_wandb``'s run, and whether it was rewound as asked (True when no rewind was
    asked)."""
    try:
        import wandb

        mode = lc.mode or os.environ.get("WANDB_MODE") or "offline"
        # A resumed run continues its W&B run: one id, one curve on the dashboard. When the
        # interrupted attempt logged steps past the checkpoint, W&B's rewind drops them (they
        # are retrained and logged again, as in metrics.jsonl); W&B keys its rewind point by
        # its own _step, which MetricsLogger.log keeps equal to the train step.
        resumes = [{"resume": "allow"}] if resume_id else [{}]
        if resume_id is not None and rewind_to is not None:
            resumes.insert(0, {"resume_from": f"{resume_id}?_step={rewind_to}"})
        # W&B's banner and its history/summary tables after the run's own last lines: off,
        # unless $WANDB_SILENT or $WANDB_QUIET says how much of it to show.
        quiet = {"WANDB_SILENT", "WANDB_QUIET"} & os.environ.keys()
        settings = None if quiet else wandb.Settings(silent=True)
        for i, how in enumerate(resumes):
            try:
                run = wandb.init(settings=settings,
                    project=lc.project, entity=lc.entity, name=name, group=group,
                    job_type=job_type, tags=tags, dir=str(run_dir), mode=mode,
                    config=run_config, reinit="finish_previous", id=resume_id, **how)
                rewound = rewind_to is None or "resume_from" in how
                break
            except Exception as e:  # noqa: BLE001
                if i == len(resumes) - 1:
                    raise
                # A server without rewind: continue the run as it is. W&B then ignores the
                # steps it already holds (logged steps must increase), so those keep the
                # interrupted attempt's values, unlike metrics.jsonl.
                log.warning("W&B could not rewind run %s to step %d (%s); continuing it "
                            "without rewinding: its steps %d+ keep the interrupted attempt's "
                            "values", resume_id, rewind_to, e, rewind_to + 1)
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        run.define_metric("train/loss", summary="min")
        return run, rewound
    except Exception as e:  # noqa: BLE001 - any W&B failure must not stop training
        log.warning("W&B init failed (%s); continuing with metrics.jsonl only", e)
        return None, True
