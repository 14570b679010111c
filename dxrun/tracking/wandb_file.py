"""Read an offline W&B run back from the ``run-*.wandb`` file it wrote.

An offline run keeps everything in one binary file: a LevelDB-style log (32 KiB blocks of
checksummed chunks) whose records are W&B ``Record`` protobufs. dxrun uses this to check what a
run would show once synced, and for local reports, without a server.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
