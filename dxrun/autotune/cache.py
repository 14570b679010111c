"""The decision cache: a layout search's record kept in the user's cache dir under what
decides its answer, checked before it is taken.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dxrun.config import AXES
from dxrun.cost import (
    REMATS,
    SEARCHES,
    normalize_kind,
)
from dxrun.plan import (
    layout_of,
    named,
    precision_of,
)
from dxrun.run import (
    user_cache_dir,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig


def cache_key(cfg: RunConfig, held: tuple[int, int], n_devices: int, device_kind: str,
              jax_version: str, processes: int) -> str:
    """What decides the answer: the model's shape, the batch and sequence length held
    (``held``), precision, optimizer, devices and their kind, JAX's version, and whether it
    was measured."""
    key = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "batch": held[0], "seq_len": held[1],
           "precision": precision_of(cfg.train.precision, normalize_kind(device_kind)),
           "optimizer": cfg.optimizer.name,
           "devices": n_devices, "processes": processes, "device_kind": device_kind,
           "jax": jax_version, "measured": cfg.parallelism.search != "model",
           "top": cfg.parallelism.search_top, "target": cfg.plan.target,
           "memory_gb": cfg.runtime.memory_gb}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return Path(user_cache_dir()) / "layouts"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


# The entries' layout: an entry written under another (by an older or newer dxrun) is decided
# again rather than read by guesswork. Raise it when a field's meaning changes.
CACHE_SCHEMA = 1


# Each axis's size: one that -1 could infer is in every row; one that cannot (context) came
# later and may be absent (1: ``layout_of``), and is checked where present.
_ROW_FIELDS = {**{a.key: int for a in AXES if a.inferable}, "remat": str, "grad_accum": int,
               "chosen": bool, "fits": bool, "why": str}


_ROW_NUMBERS = ("need_gb", "est_ms", "measured_ms")  # each a number or null


def read_cache(key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the decision cached under ``key``, None); (None, None) when there is none; (None, why)
    when the entry is in doubt (``entry_doubt``): the run decides again."""
    path = cache_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        record = json.loads(text)
    except ValueError:
        return None, "is not JSON"
    why = entry_doubt(record)
    return (None, why) if why else (record, None)


def entry_doubt(record: Any) -> str | None:
    """Why a cache entry cannot be taken as written (pure): another schema, a ranking row
    missing a field or holding the wrong type, a layout of no devices, or not exactly one
    chosen row that fits; None when every field the run and its ranking read is sound."""
    if not isinstance(record, dict):
        return "is not a decision"
    if record.get("schema") != CACHE_SCHEMA:
        return (f"was written under schema {record.get('schema')} (this dxrun reads "
                f"{CACHE_SCHEMA})")
    if record.get("search") not in SEARCHES or not isinstance(record.get("rows"), list):
        return "lacks its mode or its ranking"
    for r in record["rows"]:
        if not isinstance(r, dict):
            return "has a ranking row that is not one"
        for name, kind in {**{a.key: int for a in AXES if a.key in r}, **_ROW_FIELDS}.items():
            # bool is an int to isinstance: a size of true is as wrong as one of "2"
            if not isinstance(r.get(name), kind) or (kind is int and isinstance(r[name], bool)):
                return f"has a ranking row whose {name} is {r.get(name)!r}"
        sizes = layout_of(r).sizes
        if min(*sizes.values(), r["grad_accum"]) < 1 or r["remat"] not in REMATS:
            mesh = "x".join(str(v) for _, v in named(sizes))
            return (f"has a ranking row of no layout ({mesh}, "
                    f"remat={r['remat']}, grad_accum={r['grad_accum']})")
        for name in _ROW_NUMBERS:
            v = r.get(name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                return f"has a ranking row whose {name} is {v!r}"
        spread = r.get("spread_ms")
        if spread is not None and not (isinstance(spread, list) and len(spread) == 2 and all(
                isinstance(x, (int, float)) for x in spread)):
            return f"has a ranking row whose spread_ms is {spread!r}"
    chosen = [r for r in record["rows"] if r["chosen"]]
    if len(chosen) != 1 or not chosen[0]["fits"]:
        return f"has {len(chosen)} chosen layouts that fit, not one"
    return None


def write_cache(key: str, record: dict[str, Any]) -> None:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "schema": CACHE_SCHEMA}, indent=1))
    tmp.replace(path)  # concurrent sweep jobs: the last writer wins, never a torn file
