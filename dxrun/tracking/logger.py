"""The one metrics path: every logged row goes to ``metrics.jsonl`` and to the backends the
``logger`` group names (W&B, TensorBoard, CSV, MLflow: ``backends``, ``wandb_backend``).

A backend's trouble never stops training: a failing open or call is warned about once and the
run goes on without it. Only process 0 logs. ``rewind_metrics`` sets aside what an interrupted
attempt logged past the checkpoint it resumes from; a resume in place then opens the backends
with the rows it kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.config import LoggerConfig
from dxrun.run import finite_or_null
from dxrun.tracking.backends import (
    Backend,
    CsvBackend,
    Declined,
    MlflowBackend,
    Opening,
    TensorBoardBackend,
    WandbBackend,
)

log = logging.getLogger("dxrun")


class MetricsLogger:
    """metrics.jsonl and the backends ``logger.name`` (or ``logger.backends``) names, each a
    ``Backend``; process 0 only (``is_main``). A backend that fails is dropped with
    one warning."""

    def __init__(self, run_dir: Path, lc: LoggerConfig, run_config: dict[str, Any], name: str,
                 group: str | None = None, choices: dict[str, str] | None = None,
                 is_main: bool = True, resume_id: str | None = None,
                 kept: list[dict[str, Any]] | None = None, job_type: str | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.is_main = is_main
        self.warned_non_finite = False
        self._file = open(self.path, "a") if is_main else None  # noqa: SIM115 - closed in finish
        self.backends: list[Backend] = []
        if not is_main:
            return
        tags = [f"{g}:{choices[g]}" for g in ("model", "parallelism", "data", "optimizer")
                if choices and g in choices]
        # The names: the config's, else the ones the launch gave the run (``runtime.Job``).
        opening = Opening(run_dir, lc, run_config, name, lc.group or group, tags + list(lc.tags),
                          lc.job_type or job_type or "train", resume_id, kept)
        for backend in backend_names(lc):
            try:
                self.backends.append(BACKENDS[backend](opening))
            except Declined:
                pass
            except Exception as e:  # noqa: BLE001 - a logger never stops training
                log.warning("%s init failed (%s: %s); continuing with metrics.jsonl only",
                            backend, type(e).__name__, e)

    @property
    def wandb(self) -> Any:
        """The W&B run, if W&B is one of the backends and still open."""
        return next((b.run for b in self.backends if isinstance(b, WandbBackend)), None)

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
        self._each("log", step, row)

    def _each(self, what: str, *args: Any) -> None:
        """``what`` on every backend; one that raises is warned about once and dropped."""
        for b in list(self.backends):
            try:
                getattr(b, what)(*args)
            except Exception as e:  # noqa: BLE001 - a logger never stops training
                log.warning("%s %s failed (%s); continuing with metrics.jsonl only", b.title,
                            what, e)
                self.backends.remove(b)

    def upload(self, directory: Path, name: str, kind: str) -> None:
        """``directory`` (a trace) to the backends that keep files remotely."""
        self._each("upload", directory, name, kind)

    def summary(self, values: dict[str, Any]) -> None:
        """Run-level figures (goodput), then the run's summary, into every backend."""
        self._each("summary", values)

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._each("finish")
        self.backends = []


def backend_names(lc: LoggerConfig) -> list[str]:
    """The backends ``lc`` names, in order, each once."""
    names = list(lc.backends) if lc.name == "many" else [] if lc.name == "none" else [lc.name]
    return list(dict.fromkeys(names))


BACKENDS: dict[str, Callable[[Opening], Backend]] = {
    "wandb": WandbBackend, "tensorboard": TensorBoardBackend, "csv": CsvBackend,
    "mlflow": MlflowBackend}


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
