"""The one metrics path: every logged row goes to ``metrics.jsonl`` and to the backends the
``logger`` group names (W&B, TensorBoard, CSV, MLflow), the terminal shows the run's progress,
and the run's end is reported in ``summary.json``. Only process 0 logs.

Section by section: an offline W&B run read back from its file; the backend interface and the
backends that write local files; W&B as a backend; the logger itself (``MetricsLogger``,
``rewind_metrics``); the console; a monitored metric (keep-best and early stop); and the run's
summary at its end. A backend's trouble never stops training: a failing open or call is warned
about once and the run goes on without it.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.config import UNFINISHED, LoggerConfig
from dxrun.run import finite_or_null, is_main, mlflow_store_uri, read_status, write_json
from dxrun.tracking import goodput

# ------------------------------------------------------------------------------------------------
# Read an offline W&B run back from the ``run-*.wandb`` file it wrote.
#
# An offline run keeps everything in one binary file: a LevelDB-style log (32 KiB blocks of
# checksummed chunks) whose records are W&B ``Record`` protobufs. dxrun uses this to check what a
# run would show once synced, and for local reports, without a server.

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # crc32, length, chunk type
_FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[bytes]:
    ident, magic, _version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError("not a W&B run file (bad header)")
    pos, record = _FILE_HEADER.size, b""
    while pos + _HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER.size:  # block trailer padding
            pos += left_in_block
            continue
        crc, length, kind = _HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            pos += left_in_block  # zero padding to the end of the block
            continue
        if pos + _HEADER.size + length > len(data):
            return  # a record cut short at the end: its writer was killed mid-write
        payload = data[pos + _HEADER.size: pos + _HEADER.size + length]
        pos += _HEADER.size + length
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"W&B run file corrupt at byte {pos}")
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            record = payload
        elif kind == _MIDDLE:
            record += payload
        elif kind == _LAST:
            yield record + payload
            record = b""


def records(path: str | Path) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` in the file, in order."""
    from wandb.proto import wandb_internal_pb2

    for chunk in _chunks(Path(path).read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(chunk)
        yield rec


def _items(items: Any) -> dict[str, Any]:
    out = {}
    for item in items:
        key = item.key or "/".join(item.nested_key)
        out[key] = json.loads(item.value_json)
    return out


def read_run(path: str | Path) -> dict[str, Any]:
    """The run's name, group, tags, config (merged updates), history rows and summary."""
    run: dict[str, Any] = {"config": {}, "history": [], "summary": {}}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            run.update(name=r.display_name, group=r.run_group, job_type=r.job_type,
                       tags=list(r.tags), project=r.project, id=r.run_id,
                       start=r.start_time.ToNanoseconds())
            if r.HasField("branch_point"):  # resume_from: the run was rewound to this step
                run["rewind"] = (r.branch_point.run, r.branch_point.metric, r.branch_point.value)
            run["config"].update({k: v.get("value", v) if isinstance(v, dict) else v
                                  for k, v in _items(r.config.update).items()})
        elif kind == "config":
            run["config"].update({k: v.get("value", v) if isinstance(v, dict) else v
                                  for k, v in _items(rec.config.update).items()})
        elif kind == "history":
            run["history"].append(_items(rec.history.item))
        elif kind == "summary":
            run["summary"].update(_items(rec.summary.update))
    return run


def read_history(paths: list[str | Path]) -> list[dict[str, Any]]:
    """The history of one run written by several attempts (one file each), as W&B shows it
    once they are synced in order: an attempt started with ``resume_from`` first drops the
    rows past its rewind point, as the server's rewind does."""
    return _synced([read_run(p) for p in paths])


def held_steps(paths: list[str | Path]) -> list[int] | None:
    """The steps of ``read_history(paths)``; None when a file cannot be read (damaged, or not
    W&B's): what the run holds is then unknown."""
    try:
        runs = [read_run(p) for p in paths]
    except Exception:  # noqa: BLE001 - protobuf's DecodeError is no ValueError
        return None
    return [row["step"] for row in _synced(runs) if isinstance(row.get("step"), int)]


def _synced(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    # An attempt killed before W&B wrote its first block left only the file header: nothing
    # of it would sync.
    runs = [r for r in runs if "start" in r]
    for run in sorted(runs, key=lambda r: r["start"]):
        if "rewind" in run:
            _, metric, value = run["rewind"]
            history = [row for row in history if row[metric] <= value]
        history += run["history"]
    return history


# ------------------------------------------------------------------------------------------------
# The logging interface every backend implements, and the backends that write local files:
# TensorBoard event files, a CSV table and an MLflow run (W&B's is ``wandb_backend``).
#
# ``MetricsLogger`` (``logger``) hands each backend the same reduced rows (``log``), the config
# with the plan (when it opens it), run-level figures and the run's summary (``summary``), and
# closes it (``finish``); it opens them on process 0 only. A backend that fails to open or to
# write is one warning, and the run goes on without it: ``metrics.jsonl`` stays the record.

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


# ------------------------------------------------------------------------------------------------
# W&B as one of the logging backends (``Backend``): an offline run unless told
# otherwise, continued by a resume in place as ``metrics.jsonl`` reads.
#
# A resume in place gives its W&B run the rows of ``metrics.jsonl`` it lacks (``catch_up``): a
# killed attempt's W&B writer loses what it had not written yet, which ``metrics.jsonl``, written
# row by row, keeps.

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


# ------------------------------------------------------------------------------------------------
# The one metrics path: every logged row goes to ``metrics.jsonl`` and to the backends the
# ``logger`` group names (W&B, TensorBoard, CSV, MLflow: ``backends``, ``wandb_backend``).
#
# A backend's trouble never stops training: a failing open or call is warned about once and the
# run goes on without it. Only process 0 logs. ``rewind_metrics`` sets aside what an interrupted
# attempt logged past the checkpoint it resumes from; a resume in place then opens the backends
# with the rows it kept.

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


# ------------------------------------------------------------------------------------------------
# What the user sees while a run trains: a rich progress bar on a terminal, plain log lines
# otherwise. The log lines always also reach the run dir's log file (Hydra's file handler).
#
# The bar advances per dispatched step on the host; loss, tokens/s and MFU change only at log
# steps, when the host has the numbers anyway, so the bar adds no device sync.

def format_line(step: int, total: int, m: dict[str, float], note: str = "") -> str:
    """A log step's line; an evaluation between log steps has only the eval numbers. ``note``
    (e.g. ``save_note``) goes after the tokens/s it explains."""
    parts = [f"step {step}/{total}"]
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.4f}")
    if "eval/loss" in m:
        parts.append(f"eval {m['eval/loss']:.4f}")
        if "train/loss" not in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
    if "perf/tokens_per_s" in m:
        parts.append(f"{m['perf/tokens_per_s']:,.0f} tok/s" + (f" {note}" if note else ""))
    if "perf/mfu" in m:
        parts.append(f"MFU {100 * m['perf/mfu']:.1f}%")
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    return "  ".join(parts)


class _RichHandler(logging.Handler):
    """Prints log records above the live bar instead of through it."""

    def __init__(self, console: Any, fmt: logging.Formatter | None):
        super().__init__()
        self.console = console
        self.setFormatter(fmt or logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(self.format(record), markup=False, highlight=False)


class Progress:
    def __init__(self, total: int, enabled: bool | None = None):
        self.total = total
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self._bar = None

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
        )
        self._task = self._bar.add_task("train", total=self.total, info="compiling…")
        self._bar.start()
        # Console handlers would write through the live display; route them above it.
        root = logging.getLogger()
        self._swapped = [h for h in root.handlers if type(h) is logging.StreamHandler]
        fmt = self._swapped[0].formatter if self._swapped else None
        self._handler = _RichHandler(self._bar.console, fmt)
        for h in self._swapped:
            root.removeHandler(h)
        root.addHandler(self._handler)
        return self

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def update(self, step: int, metrics: dict[str, float], note: str = "") -> None:
        line = format_line(step, self.total, metrics, note)
        if self._bar is not None and "train/loss" in metrics:
            info = line.split("  ", 1)[1]
            self._bar.update(self._task, completed=step, info=info)
            # The same line in the log file, not on the screen (the bar shows it).
            for h in logging.getLogger().handlers:
                if isinstance(h, logging.FileHandler):
                    h.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, None,
                                            None))
        else:
            log.info(line)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is None:
            return
        self._bar.stop()
        root = logging.getLogger()
        root.removeHandler(self._handler)
        for h in self._swapped:
            root.addHandler(h)


# ------------------------------------------------------------------------------------------------
# A monitored metric: its best value so far, the step of it, and the rows since it improved.
#
# One concept behind two features: ``checkpoint.keep_best`` (the checkpoint of the best value is
# kept beside the newest ``checkpoint.keep``, never rotated out) and ``train.early_stop`` (the run
# ends once ``patience`` rows in a row have not improved on the best). Both travel in each
# checkpoint's meta (``to_json``/``from_json``), so a resume continues their counts where the
# checkpoint left them. Pure: values in, values out.

@dataclass
class Monitor:
    metric: str
    mode: str = "min"  # min: lower is better; max: higher is better
    min_delta: float = 0.0  # an improvement is a change by more than this
    best: float | None = None
    step: int | None = None  # the step of ``best``
    stale: int = 0  # rows of the metric since ``best`` (0: the last one was the best)

    def see(self, step: int, row: dict[str, Any]) -> bool | None:
        """Take step ``step``'s row: whether its value is a new best (None: the row has no
        finite value of the metric, and counts for nothing)."""
        value = row.get(self.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.step, self.stale = float(value), step, 0
            return True
        self.stale += 1
        return False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None, metric: str, mode: str,
                  min_delta: float = 0.0) -> Monitor:
        """The monitor a checkpoint saved, if it watched the same metric the same way; else a
        fresh one (a resume that changed the metric starts counting anew)."""
        fresh = cls(metric, mode, min_delta)
        if not saved or (saved.get("metric"), saved.get("mode")) != (metric, mode):
            return fresh
        return cls(metric, mode, min_delta, saved.get("best"), saved.get("step"),
                   int(saved.get("stale", 0)))


def plateau(m: Monitor, patience: int) -> str | None:
    """``train.early_stop``'s reason to end the run once ``m`` has gone ``patience`` rows
    without improving on its best; None before."""
    if m.best is None or m.stale < patience:
        return None
    return (f"early stop: {m.metric} has not improved on {m.best:.6g} (step {m.step}) by "
            f"more than {m.min_delta:g} in {m.stale} rows (train.early_stop.patience={patience})")


def stopped_early(meta: Mapping[str, Any], early_stop: Mapping[str, Any] | None) -> str | None:
    """Why a run resumed from a checkpoint (``meta``: its meta, which holds the monitor as it
    left it) under ``early_stop`` (a ``train.early_stop`` section, a config's or as a
    checkpoint saved it) would stop before its first step: the reason, as the run that
    stopped gave it; None when it trains on."""
    if not isinstance(early_stop, Mapping) or not early_stop.get("monitor"):
        return None
    m = Monitor.from_json(meta.get("early_stop"), early_stop["monitor"],
                          early_stop.get("mode", "min"), early_stop.get("min_delta", 0.0))
    return plateau(m, int(early_stop.get("patience", 3)))


# ------------------------------------------------------------------------------------------------
# What a run reports at its end (``summary.json``, the return value of ``train``): the last
# value of every logged metric, the best train loss, and the attempt's figures.
#
# The rows a resume in place kept count as logged: their last values and their best loss carry
# over. A relaunch of a run that reached its end without recording it writes it from the run's
# files (``record_end``). No JAX: tests feed rows by hand.

def best_loss(best: float | None, loss: float | None) -> float | None:
    """The lower finite train/loss of the two (None: none was finite)."""
    if not isinstance(loss, float) or not math.isfinite(loss):
        return best
    return loss if best is None or loss < best else best


class RunSummary:
    def __init__(self, kept: list[dict[str, Any]] | None = None):
        self.last: dict[str, Any] = {}
        self.best_loss: float | None = None  # the lowest finite train/loss; None: none was
        for row in kept or []:
            self.add({k: v for k, v in row.items() if k != "step"})

    def add(self, row: dict[str, Any]) -> None:
        """A logged row (a log step's, an evaluation's, or both)."""
        self.best_loss = best_loss(self.best_loss, row.get("train/loss"))
        self.last = {**self.last, **row}

    @property
    def logged(self) -> bool:
        """Any row yet (a resume's kept rows count): the one-off numbers went on the first."""
        return bool(self.last)

    def record(self, *, steps: int, n_params: int, flops_per_token: float,
               loop_tokens_per_s: float | None, compile_time_s: float,
               entropy_floor: float | None, device_kind: str, peak_tflops: float | None,
               checkpoint_saves: int, checkpoint_block_s: float,
               goodput_total: dict[str, Any], attempt: dict[str, float]) -> dict[str, Any]:
        """``summary.json``: the run's figures after its last values."""
        return {
            "step": steps,
            **self.last,
            "train/loss": self.last.get("train/loss"),
            "best/train_loss": self.best_loss,
            "n_params": n_params,
            "flops_per_token": flops_per_token,
            "tokens_per_s": self.last.get("perf/tokens_per_s"),  # the last window's steps alone
            "loop_tokens_per_s": loop_tokens_per_s,  # the whole loop after the compiling step
            "compile_time_s": compile_time_s,
            "entropy_floor": entropy_floor,
            "device_kind": device_kind,
            "peak_tflops": peak_tflops,
            # The run's saves over its attempts (goodput.json's records), and the time they held
            # the loop.
            "checkpoint_saves": checkpoint_saves,
            "checkpoint_block_s": checkpoint_block_s,
            # Productive step time / wall time over the run's attempts (goodput.json holds each).
            "goodput": goodput_total["goodput"],
            "goodput_s": attempt,  # this attempt's wall time by part (goodput.PARTS, rest)
            "attempts": goodput_total["attempts"],
        }


def record_end(run_dir: Path, checkpoint_meta: dict[str, Any]) -> dict[str, Any] | None:
    """A relaunch of a run whose checkpoint (``checkpoint_meta``: its meta) is at the run's
    end (its own ``train.steps``, or where its own ``train.early_stop`` ended it) but which was
    stopped or killed before it recorded that end (no summary.json, or status.json still
    unfinished): write summary.json from metrics.jsonl and goodput.json (the figures only the
    last attempt itself measured, its compile and loop times and saves, are null or 0) and
    return it; the launcher then writes status ok. None, writing nothing, for a run that
    recorded its end or had not reached it."""
    run_config = checkpoint_meta.get("config", {})
    train_config = run_config.get("train", {})
    steps, step = train_config.get("steps"), checkpoint_meta.get("step", 0)
    stopped = stopped_early(checkpoint_meta, train_config.get("early_stop"))
    summary_path = run_dir / "summary.json"
    recorded = summary_path.is_file() and read_status(run_dir).get("status") not in UNFINISHED
    if steps is None or (step < steps and not stopped) or recorded:
        return None
    # Written anew even where a summary is there: an earlier end's, before the run trained on.
    rows, _ = read_metrics(run_dir / "metrics.jsonl")
    attempts = goodput.earlier_attempts(run_dir, True)
    total = goodput.run_total(attempts) if attempts else {"goodput": None, "attempts": 0}
    summary = RunSummary(rows).record(
        steps=step if stopped else steps, n_params=run_config.get("n_params"),
        flops_per_token=run_config.get("flops_per_token"), loop_tokens_per_s=None,
        compile_time_s=None, entropy_floor=None,
        device_kind=run_config.get("jax", {}).get("device_kind"), peak_tflops=None,
        checkpoint_saves=0, checkpoint_block_s=0.0, goodput_total=total,
        attempt=attempts[-1] if attempts else {})
    if stopped:
        summary["early_stop"] = stopped
    if is_main():
        write_json(summary_path, summary)
    return summary
