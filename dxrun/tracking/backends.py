"""The logging interface every backend implements, and the backends that write local files:
TensorBoard event files, a CSV table and an MLflow run (W&B's is ``wandb_backend``).

``MetricsLogger`` (``logger``) hands each backend the same reduced rows (``log``), the config
with the plan (when it opens it), run-level figures and the run's summary (``summary``), and
closes it (``finish``); it opens them on process 0 only. A backend that fails to open or to
write is one warning, and the run goes on without it: ``metrics.jsonl`` stays the record.

And W&B as one of the logging backends (``Backend``): an offline run unless told
otherwise, continued by a resume in place as ``metrics.jsonl`` reads.

A resume in place gives its W&B run the rows of ``metrics.jsonl`` it lacks (``catch_up``): a
killed attempt's W&B writer loses what it had not written yet, which ``metrics.jsonl``, written
row by row, keeps.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.config import LoggerConfig
from dxrun.run import mlflow_store_uri
from dxrun.tracking.wandb_file import held_steps

log = logging.getLogger("dxrun")


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
        self.summaries: dict[str, Any] = {}
        if runs:
            self.run_id = runs[0].info.run_id
            c.update_run(self.run_id, status="RUNNING")
        else:
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
        log.info("MLflow: %s", mlflow_where(uri, o.lc.project, exp_id, self.run_id))

    def log(self, step: int, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, ms, step) for k, v in _numbers(row).items()])

    def summary(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        self.summaries = {**self.summaries, **values}
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


def mlflow_where(uri: str, project: str, exp_id: str, run_id: str) -> str:
    """Where an MLflow run went, as W&B's line says where its run went: a server's page of
    the run, or the store with the command that browses it."""
    if uri.startswith(("http://", "https://")):
        return f"run {uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}"
    return (f"run {run_id} in experiment {project} of {uri} (browse: mlflow ui "
            f"--backend-store-uri {uri})")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
    when it holds ``held`` (its steps, ``held_steps``; None: unknown, so all of
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
