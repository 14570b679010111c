"""The ``logger`` section checked before a run starts: an MLflow store that cannot be written
is refused in one line (``store_refusal``), a plain directory is MLflow's file store
(``mlflow_store_uri``), and a key the chosen logger does not read is one warning
(``unread_logger_keys``). No MLflow, W&B or JAX import.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from urllib.parse import unquote, urlparse

from omegaconf import ListConfig

from dxrun.config.schema import LoggerConfig
from dxrun.run.run_dir import dir_refusal

# The keys each backend reads (MLflow: the experiment, the store, and the names as tags).
NAMES = ("project", "group", "job_type", "tags")
READS = {"wandb": {*NAMES, "entity", "mode"}, "mlflow": {*NAMES, "mlflow_uri"},
         "tensorboard": set(), "csv": set(), "none": set()}
WHO = {"entity": "logger=wandb", "mode": "logger=wandb", "mlflow_uri": "logger=mlflow",
       "backends": "logger=many", **{k: "logger=wandb or logger=mlflow" for k in NAMES}}


def mlflow_store_uri(uri: str | None, run_dir: Path) -> str:
    """The tracking URI the MLflow backend opens: ``uri`` as given, a plain path as its
    ``file:`` URI (MLflow's file store, as the run dir's own ``mlruns/``, the default)."""
    if uri is None:
        return (run_dir / "mlruns").resolve().as_uri()
    if _local_path(uri) is not None and not uri.startswith("file:"):
        return Path(uri).expanduser().absolute().as_uri()
    return uri


def _local_path(uri: str) -> Path | None:
    """The directory a local file store URI (a path, ``file:``) names; None for another."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(uri).expanduser() if not parsed.scheme else None


def store_refusal(lc: LoggerConfig) -> str | None:
    """Why MLflow could not write ``logger.mlflow_uri`` (a file store's dir, or a
    ``sqlite:///`` database's dir, that cannot be made or written), in one line naming the
    key, the value and the fix; None when it can, or when the store is a server (MLflow
    reaches it when the backend opens)."""
    if lc.mlflow_uri is None or "mlflow" not in _backends(lc):
        return None
    fix = "give one you can write to, or leave logger.mlflow_uri null (<run dir>/mlruns)"
    if lc.mlflow_uri.startswith("sqlite:///"):
        db = Path(lc.mlflow_uri.removeprefix("sqlite:///")).expanduser()
        return dir_refusal(f"logger.mlflow_uri={lc.mlflow_uri}: the database's dir",
                           db.parent, fix)
    path = _local_path(lc.mlflow_uri)
    if path is None:
        return None
    plain = not lc.mlflow_uri.startswith("file:")
    return dir_refusal("logger.mlflow_uri" if plain else f"logger.mlflow_uri={lc.mlflow_uri}: "
                       "the store's dir", path, fix)


def _backends(lc: LoggerConfig) -> list[str]:
    return list(lc.backends) if lc.name == "many" else [lc.name]


def unread_logger_keys(lc: LoggerConfig) -> list[str]:
    """A warning for each ``logger.*`` key set away from its default that no backend of this
    run reads (``logger=csv logger.entity=me``): the setting would do nothing. ``tags`` aside:
    the experiments set theirs for whichever logger the run picks (``logger=none`` too)."""
    reads = set().union(*(READS.get(b, set()) for b in _backends(lc)))
    if lc.name == "many":
        reads.add("backends")
    defaults = LoggerConfig()
    out = []
    for f in fields(LoggerConfig):
        value = getattr(lc, f.name)
        if f.name in ("name", "tags") or f.name in reads or value == getattr(defaults, f.name):
            continue
        shown = f"[{','.join(value)}]" if isinstance(value, (list, ListConfig)) else value
        out.append(f"logger.{f.name}={shown} does nothing with logger={lc.name} (only "
                   f"{WHO[f.name]} reads it); drop it, or choose a logger that reads it")
    return out
