"""A real 2-process run over loopback trains exactly like one process with the same mesh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(nproc: int, out: Path, overrides: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_worker.py"), str(port),
                               str(p), str(nproc), str(out), *overrides], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in range(nproc)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # one process failing leaves the other waiting for it: never leave it behind
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(Path(f"{out}.{p}").read_text()) for p in range(nproc)]


@pytest.mark.e2e
@pytest.mark.parametrize("data", ["text"])  # markov: test_launch.py, through the launcher
def test_two_processes_equal_one(tmp_path, data):
    overrides = ["parallelism=dp4_tp2", "logger=none", "data.batch_size=16"]
    if data == "text":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text(" ".join(f"w{i % 97}" for i in range(20000)))
        overrides += ["data=text", f"data.path={corpus}"]
    one = _run(1, tmp_path / "one", overrides)[0]
    two = _run(2, tmp_path / "two", overrides)
    assert [r["process_count"] for r in two] == [2, 2]
    # Each process read half of every global batch: its own rows, and together all of them.
    for step in range(4):
        joined = np.concatenate([np.asarray(r["rows"][step]) for r in two])
        np.testing.assert_array_equal(joined, np.asarray(one["rows"][step]))
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(two[1]["losses"], one["losses"], rtol=1e-5)
