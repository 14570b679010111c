"""The run directory: claimed atomically, so concurrent launches never share one."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from dxrun.runtime import claim_run_dir


def _claim(path: str, barrier, out) -> None:
    barrier.wait()  # all claim at the same instant, like a SLURM array starting
    out.put(str(claim_run_dir(Path(path))))


def test_concurrent_launches_claim_distinct_dirs(tmp_path):
    ctx = mp.get_context("spawn")
    n = 6
    barrier, out = ctx.Barrier(n), ctx.Queue()
    target = tmp_path / "outputs" / "12-00-00"
    procs = [ctx.Process(target=_claim, args=(str(target), barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert len(set(got)) == n
    assert got == sorted([str(target)] + [f"{target}_{i}" for i in range(1, n)])
    assert all((Path(d) / ".hydra").is_dir() for d in got)


def test_reuse_takes_the_dir_as_it_is(tmp_path):
    first = claim_run_dir(tmp_path / "run")
    (first / "plan.json").write_text("{}")
    assert claim_run_dir(tmp_path / "run", reuse=True) == first
    assert claim_run_dir(tmp_path / "run") == tmp_path / "run_1"
