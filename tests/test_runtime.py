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


def test_the_suite_runs_on_cpu_whatever_the_machine():
    """conftest.py sets JAX_PLATFORMS=cpu before JAX starts (unless DXRUN_TEST_GPU=1), so a GPU
    machine runs the suite, and the subprocesses it starts, on simulated CPU devices."""
    import os

    import jax

    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert jax.default_backend() == "cpu" and jax.device_count() == 8


def test_cpu_fallback_on_a_gpu_host_is_refused(tmp_path):
    """The probe reads device nodes under a root (here a tmp dir standing for /); JAX on CPU
    beside an NVIDIA node is refused naming the install, unless CPU was chosen."""
    from dxrun.runtime import cpu_fallback_refusal, nvidia_device_node

    assert nvidia_device_node(tmp_path) is None
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    node = nvidia_device_node(tmp_path)
    assert node == tmp_path / "dev" / "nvidia0"
    (tmp_path / "dev" / "nvidiactl").touch()
    assert nvidia_device_node(tmp_path) == tmp_path / "dev" / "nvidiactl"

    line = cpu_fallback_refusal("cpu", node, None, allow_cpu=False)
    assert "pip install -e '.[gpu]'" in line and "runtime.allow_cpu=true" in line
    assert str(node) in line and "\n" not in line
    assert cpu_fallback_refusal("cpu", node, "cuda,cpu", allow_cpu=False) == line
    # Chosen: the override, or JAX_PLATFORMS naming only cpu (as the test suite sets it).
    assert cpu_fallback_refusal("cpu", node, None, allow_cpu=True) is None
    assert cpu_fallback_refusal("cpu", node, "cpu", allow_cpu=False) is None
    # No GPU on the host, or JAX found it: nothing to refuse.
    assert cpu_fallback_refusal("cpu", None, None, allow_cpu=False) is None
    assert cpu_fallback_refusal("gpu", node, None, allow_cpu=False) is None
