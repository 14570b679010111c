"""The one metrics path: every logged row goes to ``metrics.jsonl`` and, if enabled, to W&B.

W&B trouble never stops training: a failing init or log call is warned about once and the run
goes on with the local file. Only process 0 logs. A resume in place gives its W&B run the rows
of ``metrics.jsonl`` it lacks (``catch_up``): a killed attempt's W&B writer loses what it had
not written yet, which ``metrics.jsonl``, written row by row, keeps.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.runtime import finite_or_null
from dxrun.schema import LoggerConfig
from dxrun.tracking.wandb_file import held_steps

log = logging.getLogger("dxrun")


class MetricsLogger:
    def __init__(self, run_dir: Path, lc: LoggerConfig, run_config: dict[str, Any], name: str,
                 group: str | None = None, choices: dict[str, str] | None = None,
                 is_main: bool = True, resume_id: str | None = None,
                 kept: list[dict[str, Any]] | None = None, job_type: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.is_main = is_main
        self.wandb = None
        self.warned_non_finite = False
        self._file = open(self.path, "a") if is_main else None  # noqa: SIM115 - closed in finish
        if is_main and lc.name == "wandb":
            tags = [f"{g}:{choices[g]}" for g in ("model", "parallelism", "data", "optimizer")
                    if choices and g in choices]
            # A resume in place (``kept``: the rows of metrics.jsonl it kept) continues its W&B
            # run as metrics.jsonl reads: rewound past what metrics.jsonl moved aside, and given
            # again the kept rows W&B lacks.
            held = held_steps(sorted(run_dir.glob(f"wandb/*run-*/run-{resume_id}.wandb"))
                              ) if resume_id and kept is not None else []
            rewind_to, missing = catch_up(kept or [], held) if resume_id else (None, [])
            # The W&B names: the config's, else the ones the launch gave the run (``job.Job``).
            self.wandb, rewound = _open_wandb(run_dir, lc, run_config, name, lc.group or group,
                                              tags + list(lc.tags), resume_id, rewind_to,
                                              lc.job_type or job_type or "train")
            if not rewound:  # continued as it is: W&B ignores steps at or below its last
                missing = [r for r in missing if held is not None and r["step"] > max(
                    held, default=0)]
            self._log_again(missing)

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (saved in checkpoints, so a resumed run continues the same run)."""
        return self.wandb.id if self.wandb is not None else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        # A flag (perf/profiled) stays a JSON true; every other value is a float.
        row, bad = finite_or_null({"step": step, **{
            k: v if isinstance(v, bool) else float(v) for k, v in metrics.items()}})
        if bad and not self.warned_non_finite:
            log.warning("step %d: %s not finite (the run diverged?); written as null, here and "
                        "in every later row, without another warning", step, ", ".join(bad))
            self.warned_non_finite = True
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self.wandb is not None:
            try:
                # W&B's own step is the train step: a resume can rewind the run to it.
                self.wandb.log(row, step=step)
            except Exception as e:  # noqa: BLE001
                log.warning("W&B log failed (%s); continuing with metrics.jsonl only", e)
                self.wandb = None

    def _log_again(self, rows: list[dict[str, Any]]) -> None:
        """Rows of metrics.jsonl, as they were written, into the W&B run."""
        if self.wandb is None or not rows:
            return
        try:
            for row in rows:
                self.wandb.log(row, step=row["step"])
        except Exception as e:  # noqa: BLE001
            log.warning("W&B log failed (%s); continuing with metrics.jsonl only", e)
            self.wandb = None
            return
        log.info("W&B: logged again the %d row(s) of metrics.jsonl its run lacked (steps %d-%d)",
                 len(rows), rows[0]["step"], rows[-1]["step"])

    def upload(self, directory: Path, name: str, kind: str) -> None:
        """``directory`` as an artifact of an online W&B run (offline runs keep it on disk
        only: a trace can be large)."""
        if self.wandb is None or self.wandb.offline:
            return
        try:
            import wandb

            art = wandb.Artifact(f"{name}-{self.wandb.id}", type=kind)
            art.add_dir(str(directory))
            self.wandb.log_artifact(art)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B artifact upload of %s failed (%s)", directory, e)

    def summary(self, values: dict[str, Any]) -> None:
        """Run-level figures (goodput) into the W&B run's summary."""
        if self.wandb is not None:
            try:
                self.wandb.summary.update(values)
            except Exception as e:  # noqa: BLE001
                log.warning("W&B summary update failed (%s)", e)

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


def _row(line: str | bytes) -> dict[str, Any] | None:
    """A metrics row, or None for a line cut short (SIGKILL, a node crash or a full disk
    mid-write leaves e.g. ``{"step": 4, "train/lo``) or damaged (not UTF-8, not an object, a
    value that is not a number: ``log`` writes numbers, a flag or null only)."""
    try:
        row = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None
    if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
        return None
    return row if all(v is None or isinstance(v, (int, float)) for v in row.values()) else None


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a ``metrics.jsonl`` and the lines that are not rows (cut short or damaged,
    as text with any byte that is not UTF-8 replaced)."""
    # Bytes, not text: one damaged byte costs its own line, not the file.
    lines = [x for x in path.read_bytes().splitlines() if x.strip()] if path.is_file() else []
    rows = [_row(x) for x in lines]
    return ([r for r in rows if r is not None],
            [x.decode("utf-8", "replace") for x, r in zip(lines, rows, strict=True) if r is None])


class Rewound(NamedTuple):
    kept: list[dict[str, Any]]  # the rows up to the resumed step
    moved: int  # lines moved to metrics.discarded.jsonl (rows past the step, lines cut short)


def rewind_metrics(run_dir: Path, step: int) -> Rewound:
    """Resuming at ``step``: rows the interrupted attempt logged after it, and a line it left
    cut short, move to ``metrics.discarded.jsonl`` (never silently dropped), so
    ``metrics.jsonl`` reads as one uninterrupted run."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return Rewound([], 0)
    # Bytes, not text: a damaged line (one byte that is not UTF-8) is set aside as it is, and
    # the rows around it are kept.
    lines = [x for x in path.read_bytes().splitlines() if x.strip()]
    rows = [_row(x) for x in lines]
    keep = [r for r in rows if r is not None and r["step"] <= step]
    gone = [x for x, r in zip(lines, rows, strict=True) if r is None or r["step"] > step]
    if gone:
        with open(run_dir / "metrics.discarded.jsonl", "ab") as f:
            f.write(b"".join(x + b"\n" for x in gone))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(x + b"\n" for x, r in zip(lines, rows, strict=True)
                                 if r is not None and r["step"] <= step))
        tmp.replace(path)
        torn = sum(r is None for r in rows)
        # A line cut short or damaged is worth a warning; rows past the checkpoint are not.
        log.log(logging.WARNING if torn else logging.INFO,
                "moved %d metrics rows after step %d%s to metrics.discarded.jsonl",
                len(gone) - torn, step,
                f" and {torn} line(s) cut short or damaged" if torn else "")
    return Rewound(keep, len(gone))


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
        for i, how in enumerate(resumes):
            try:
                run = wandb.init(
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
