"""The logger group's backends read back with their own libraries' readers: TensorBoard's event
reader, MLflow's client on the run's file store, the CSV; a failing backend is a warning."""

from __future__ import annotations

import csv
import json
import logging

import pytest
from conftest import ROOT, cli_in_process, make_cfg

from dxrun.checks import config_warnings
from dxrun.tracking.logger import MlflowBackend, Opening, backend_names
from dxrun.train import train

TINY = ["model=tiny", "model.n_layers=1", "data.seq_len=16", "data.batch_size=8",
        "parallelism=dp2", "train.steps=4", "train.log_every=2", "train.eval_every=4",
        "checkpoint.every=0"]


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """One run writing every local backend at once (logger=many)."""
    run_dir = tmp_path_factory.mktemp("many")
    summary = train(make_cfg(*TINY, "logger=many"), run_dir)
    return run_dir, summary


def test_many_names_its_backends_once():
    cfg = make_cfg("logger=many", "logger.backends=[wandb,csv,wandb]")
    assert backend_names(cfg.logger) == ["wandb", "csv"]
    assert backend_names(make_cfg("logger=none").logger) == []
    assert backend_names(make_cfg("logger=tensorboard").logger) == ["tensorboard"]


def test_csv_equals_metrics_jsonl(many):
    run_dir, _ = many
    with open(run_dir / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    rows = _rows(run_dir)
    assert [int(r["step"]) for r in table] == [r["step"] for r in rows] == [2, 4]
    for got, want in zip(table, rows, strict=True):
        for k, v in want.items():
            assert (float(got[k]) if v is not None and got[k] != "True" else got[k]) == (
                v if v is not True else "True"), k
    assert got["eval/loss"] and table[0]["eval/loss"] == ""  # a column first seen late


def test_tensorboard_scalars_config_and_summary(many):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, summary = many
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    rows = _rows(run_dir)
    loss = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["train/loss"], rel=1e-6)) for r in rows]
    assert [e.step for e in ea.Scalars("eval/loss")] == [4]
    texts = ea.Tags()["tensors"]
    assert {"config/text_summary", "plan/text_summary", "summary/text_summary"} <= set(texts)
    text = ea.Tensors("summary/text_summary")[-1]  # goodput first, then summary.json
    assert f'"step": {summary["step"]}' in text.tensor_proto.string_val[0].decode()


def test_mlflow_run_in_the_file_store(many):
    from mlflow.tracking import MlflowClient

    run_dir, summary = many
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("dxrun").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name.startswith("tiny-dp2")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    rows = _rows(run_dir)
    assert [(m.step, m.value) for m in history] == [
        (r["step"], pytest.approx(r["train/loss"])) for r in rows]
    assert run.data.params["data.batch_size"] == "8" and run.data.params["train.steps"] == "4"
    assert run.data.metrics["summary.train.loss"] == pytest.approx(summary["train/loss"])
    art = run_dir / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts"
    assert json.loads((art / "plan.json").read_text())["mesh_shape"] == [2, 1, 1, 1, 1]
    assert json.loads((art / "summary.json").read_text())["step"] == 4


def test_a_failing_backend_is_one_warning(tmp_path, caplog):
    (tmp_path / "tensorboard").write_text("a file where TensorBoard wants its folder")
    with caplog.at_level(logging.WARNING, logger="dxrun"):
        train(make_cfg(*TINY, "train.eval_every=0", "logger=many",
                       "logger.backends=[tensorboard,csv]"), tmp_path)
    warnings = [r.message for r in caplog.records if "tensorboard" in r.message.lower()]
    assert len(warnings) == 1 and "continuing with metrics.jsonl" in warnings[0]
    assert len(list(csv.DictReader(open(tmp_path / "metrics.csv")))) == len(_rows(tmp_path)) == 2


def test_a_plain_dir_is_an_mlflow_file_store(tmp_path, monkeypatch, caplog):
    """logger.mlflow_uri=<a dir> (no file: scheme) opens MLflow's file store there: no
    warning quoting MLflow's "maintenance mode" refusal, no run without its store; one line
    says where the run went, as W&B's does (there was none)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # what a fresh process has
    monkeypatch.chdir(tmp_path)  # a relative dir is the launch dir's
    lc = make_cfg("logger=mlflow", "logger.mlflow_uri=store").logger
    with caplog.at_level(logging.INFO, logger="dxrun"):
        backend = MlflowBackend(Opening(tmp_path / "run", lc, {"a": 1}, "plain", None, [],
                                        "train", None, None))
    uri = (tmp_path / "store").as_uri()
    assert [r.getMessage() for r in caplog.records if r.name == "dxrun"] == [
        f"MLflow: run {backend.run_id} in experiment dxrun of {uri} (browse: mlflow ui "
        f"--backend-store-uri {uri})"]
    backend.log(3, {"step": 3, "train/loss": 2.5})
    backend.finish()
    client = MlflowClient(tracking_uri=(tmp_path / "store").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("dxrun").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"a": "1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                 "train/loss")] == [(3, 2.5)]


@pytest.mark.parametrize("uri, said", [
    ("/proc/mlflow", "logger.mlflow_uri=/proc/mlflow cannot be created: /proc is not writable"),
    ("file:{file}", "logger.mlflow_uri=file:{file}: the store's dir={file} is a file, not a "
     "directory"),
    ("sqlite:////proc/db/m.db", "logger.mlflow_uri=sqlite:////proc/db/m.db: the database's dir"
     "=/proc/db cannot be created: /proc is not writable")])
def test_an_mlflow_store_that_cannot_be_written_is_refused(tmp_path, uri, said):
    """Before the run (no run dir left, nothing compiled), in one line, exit 2."""
    (tmp_path / "taken").write_text("a file")
    uri, said = (x.replace("{file}", str(tmp_path / "taken")) for x in (uri, said))
    proc = cli_in_process("logger=mlflow", f"logger.mlflow_uri={uri}", "train.steps=2",
                          cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("dxrun: error:")]
    assert said in line and "leave logger.mlflow_uri null (<run dir>/mlruns)" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no run dir, no store


def test_a_logger_key_the_logger_does_not_read_is_one_warning():
    (w,) = config_warnings(make_cfg("train.steps=100", "logger=csv", "logger.entity=me"))
    assert w == ("logger.entity=me does nothing with logger=csv (only logger=wandb reads it); "
                 "drop it, or choose a logger that reads it")
    (w,) = config_warnings(make_cfg("train.steps=100", "logger=many", "logger.backends=[csv]",
                                    "logger.mlflow_uri=x"))
    assert w.startswith("logger.mlflow_uri=x does nothing with logger=many (only logger=mlflow")
    (w,) = config_warnings(make_cfg("train.steps=100", "logger=wandb", "logger.backends=[csv]"))
    assert w.startswith("logger.backends=[csv] does nothing with logger=wandb")
    for name in ("wandb", "mlflow", "many", "csv", "tensorboard", "none"):  # as shipped: quiet
        assert config_warnings(make_cfg("train.steps=100", f"logger={name}")) == [], name
    for experiment in sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml")):
        cfg = make_cfg(f"experiment={experiment}", "logger=none")  # its tags, no logger
        assert [w for w in config_warnings(cfg) if w.startswith("logger.")] == [], experiment
    assert config_warnings(make_cfg("train.steps=100", "logger=mlflow", "logger.project=p",
                                    "logger.mlflow_uri=x", "logger.tags=[a]")) == []
