"""The logging interface every backend implements, and the backends that write local files:
TensorBoard event files, a CSV table and an MLflow run (W&B's is ``wandb_backend``).

``MetricsLogger`` (``logger``) hands each backend the same reduced rows (``log``), the config
with the plan (when it opens it), run-level figures and the run's summary (``summary``), and
closes it (``finish``); it opens them on process 0 only. A backend that fails to open or to
write is one warning, and the run goes on without it: ``metrics.jsonl`` stays the record.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.config.schema import LoggerConfig
from dxrun.tracking.stores import mlflow_store_uri


class Opening(NamedTuple):
    """What a backend is opened with: the run's names, its config (``plan`` inside) and, for a
    resume in place, the rows of metrics.jsonl it kept (None: a fresh start)."""

    run_dir: Path
    lc: LoggerConfig
    run_config: dict[str, Any]
    name: str
    group: str | None
    tags: list[str]
    job_type: str
    resume_id: str | None  # W&B's run id from the checkpoint (a resume in place)
    kept: list[dict[str, Any]] | None


class Declined(Exception):  # noqa: N818 - a backend's own refusal, already warned about
    """A backend that did not open and has said why itself: no second warning."""


class Backend:
    """A place the rows go beside metrics.jsonl. ``title`` names it in warnings."""

    title = "backend"

    def log(self, step: int, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def summary(self, values: dict[str, Any]) -> None:
        """Run-level figures: goodput at the attempt's end, then the run's ``summary.json``."""

    def upload(self, directory: Path, name: str, kind: str) -> None:
        """A directory the run wrote (a trace), where the backend keeps files remotely."""

    def finish(self) -> None:
        """Flush and close."""


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """The row's values that a scalar writer takes (a flag as 0/1; null, not finite, left out)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class CsvBackend(Backend):
    """``<run dir>/metrics.csv``: a row per logged step, a column per metric (empty where a row
    lacks it). A metric first seen late (eval/*, the first row's compile figures) widens the
    table: the file is written anew with the wider header."""

    title = "CSV"

    def __init__(self, o: Opening):
        self.path = o.run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = list(o.kept or [])  # a resume continues its rows
        self.columns: list[str] = ["step"]
        self._rewrite()

    def _widen(self, row: dict[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        self.columns += new
        return bool(new)

    def _rewrite(self) -> None:
        for row in self.rows:
            self._widen(row)
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(self.rows)
        tmp.replace(self.path)

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._widen(row):
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)


class TensorBoardBackend(Backend):
    """Event files in ``<run dir>/tensorboard/`` (tensorboardX's writer): a scalar per metric
    at its step, the config and the plan as text at step 0, the summary as text at the end. A
    resume in place purges the interrupted attempt's events past the checkpoint."""

    title = "TensorBoard"

    def __init__(self, o: Opening):
        from tensorboardX import SummaryWriter

        resumed_at = o.kept[-1]["step"] + 1 if o.kept else None
        self.writer = SummaryWriter(str(o.run_dir / "tensorboard"), purge_step=resumed_at)
        config = {k: v for k, v in o.run_config.items() if k != "plan"}
        if o.kept is None:
            self.writer.add_text("config", _markdown_json(config), 0)
            self.writer.add_text("plan", _markdown_json(o.run_config.get("plan", {})), 0)

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in _numbers(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def summary(self, values: dict[str, Any]) -> None:
        self.writer.add_text("summary", _markdown_json(values), values.get("step", 0) or 0)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _markdown_json(value: Any) -> str:
    # TensorBoard renders text as markdown: indented JSON is a code block there.
    return "\n".join("    " + line for line in json.dumps(value, indent=1, default=str)
                     .splitlines())


class MlflowBackend(Backend):
    """An MLflow run (its ``MlflowClient``): params from the config, ``config.json`` and
    ``plan.json`` as artifacts, a metric per logged value, the summary as ``summary.json`` and
    ``summary.*`` metrics. The store is ``logger.mlflow_uri`` (a plain dir: a file store),
    else the run dir's own file store (``mlruns/``); the experiment is ``logger.project``. A
    resume in place continues the run that names this run dir (tag ``dxrun.run_dir``);
    MLflow's histories are append-only, so the interrupted attempt's values past the checkpoint
    stay there beside the retrained ones."""

    title = "MLflow"

    def __init__(self, o: Opening):
        uri = mlflow_store_uri(o.lc.mlflow_uri, o.run_dir)
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless asked for it; a run dir's own store (or a
            # dir logger.mlflow_uri names) is what makes this backend work with no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(tracking_uri=uri)
        exp = c.get_experiment_by_name(o.lc.project)
        exp_id = exp.experiment_id if exp is not None else c.create_experiment(o.lc.project)
        where = str(o.run_dir.resolve())
        runs = c.search_runs([exp_id], f"tags.`dxrun.run_dir` = '{where}'",
                             max_results=1) if o.kept is not None else []
        if runs:
            self.run_id = runs[0].info.run_id
            c.update_run(self.run_id, status="RUNNING")
            return
        tags = {"dxrun.run_dir": where, "dxrun.job_type": o.job_type,
                **({"dxrun.group": o.group} if o.group else {}),
                **({"dxrun.tags": ",".join(o.tags)} if o.tags else {})}
        self.run_id = c.create_run(exp_id, run_name=o.name, tags=tags).info.run_id
        config = {k: v for k, v in o.run_config.items() if k != "plan"}
        params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            c.log_batch(self.run_id, params=params[i:i + 100])
        c.log_dict(self.run_id, config, "config.json")
        c.log_dict(self.run_id, o.run_config.get("plan", {}), "plan.json")
        self.summaries: dict[str, Any] = {}

    def log(self, step: int, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, ms, step) for k, v in _numbers(row).items()])

    def summary(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        self.summaries = {**getattr(self, "summaries", {}), **values}
        self.client.log_dict(self.run_id, self.summaries, "summary.json")
        ms, step = int(time.time() * 1000), values.get("step") or 0
        flat = {k: v for k, v in _flat(values).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.client.log_batch(self.run_id, metrics=[
            # Dots, not slashes: the file store keeps a slash as a folder, and goodput's
            # figures name both "goodput" and "goodput/wall_s".
            Metric("summary." + k.replace("/", "."), float(v), ms, step)
            for k, v in flat.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
