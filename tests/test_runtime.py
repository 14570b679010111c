"""Run bookkeeping: the run dir claimed atomically (concurrent launches never share one), the
allocator peak of this run, JSON-safe numbers."""

from __future__ import annotations

import math
import multiprocessing as mp
from pathlib import Path

from dxrun.runtime import claim_run_dir, finite_or_null, peak_bytes_since


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


def _stats(in_use: int, peak: int) -> dict:
    """Shaped like a GPU's ``Device.memory_stats()``."""
    return {"bytes_in_use": in_use, "peak_bytes_in_use": peak, "num_allocs": 12,
            "largest_alloc_size": peak // 2, "bytes_limit": 80 * 2**30,
            "bytes_reserved": 0, "peak_bytes_reserved": 0, "largest_free_block_bytes": 0}


def test_allocator_peak_counts_only_this_run():
    # First job of a process: the peak rose from nothing, it is this run's.
    assert peak_bytes_since(_stats(0, 0), _stats(10, 5_000)) == 5_000
    # A later, smaller job: the process-wide peak is still the earlier job's 5000: unknown,
    # not reported (the old code reported 5000 for every later job).
    assert peak_bytes_since(_stats(10, 5_000), _stats(10, 5_000)) is None
    # A later, larger job set a new high-water mark: exact.
    assert peak_bytes_since(_stats(10, 5_000), _stats(10, 7_000)) == 7_000
    # CPU keeps no statistics.
    assert peak_bytes_since(None, None) is None


def test_non_finite_numbers_become_null_with_their_keys():
    row = {"step": 3, "train/loss": math.nan, "ok": 1.5, "nested": {"x": [1.0, -math.inf]}}
    clean, bad = finite_or_null(row)
    assert clean == {"step": 3, "train/loss": None, "ok": 1.5, "nested": {"x": [1.0, None]}}
    assert bad == ["train/loss", "nested.x[1]"]
