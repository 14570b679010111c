"""Pure run bookkeeping: the allocator peak of this run, JSON-safe numbers."""

from __future__ import annotations

import math

from dxrun.runtime import finite_or_null, peak_bytes_since


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
