"""Goodput accounting and the log window's traced-step exclusion, on a clock driven by hand; the
pure pieces of the trace window, the memory report and the per-row allocator peak."""

import errno
import json

import pytest

from dxrun.config.errors import disk_error
from dxrun.fit import is_out_of_memory, shape_bytes
from dxrun.tracking import goodput
from dxrun.tracking.goodput import profile_dir, traced_steps
from dxrun.train import peak_bytes_since, peak_over_devices
from tests.conftest import FakeClock


def test_parts_add_up_to_the_wall_time_and_goodput_is_productive_over_wall():
    clock = FakeClock()
    g = goodput.Goodput(start=90.0, clock=clock)  # the job began 10 s before train()
    g.add("compile", 4.0)  # the preflight's compile, inside those 10 s
    g.add("search", 3.0)  # parallelism=auto's layout search, before it
    g.end_startup()
    assert g.spent["startup"] == pytest.approx(3.0)
    for part, dt in [("data", 0.5), ("productive", 8.0), ("eval", 1.0), ("checkpoint", 2.0),
                     ("logging", 0.25), ("profile", 1.5)]:
        with g.span(part):
            clock.tick(dt)
    clock.tick(0.75)  # outside every span
    b = g.breakdown()
    assert b["wall_s"] == pytest.approx(24.0) and b["search_s"] == pytest.approx(3.0)
    assert b["rest_s"] == pytest.approx(0.75)
    assert sum(b[f"{p}_s"] for p in goodput.PARTS) + b["rest_s"] == pytest.approx(b["wall_s"])
    assert b["goodput"] == pytest.approx(8.0 / 24.0)
    line = goodput.lines(b, goodput.run_total([{**b, "first_step": 0, "last_step": 10}]))[0]
    assert line.startswith("goodput 33.3%: productive steps 8.0s of 24.0s wall")
    assert "startup 3.0s, search 3.0s, compile 4.0s" in line and "profile 1.5s" in line
    untraced = {**b, "profile_s": 0.0, "search_s": 0.0}  # neither ran: neither is shown
    plain = goodput.lines(untraced, goodput.run_total([
        {**untraced, "first_step": 0, "last_step": 10}]))[0]
    assert "profile" not in plain and "search" not in plain


def test_before_the_loop_the_time_so_far_is_startup():
    """An attempt on record from its start (killed before its first step, it still counts):
    until end_startup, what no part took is startup, not rest."""
    clock = FakeClock()
    g = goodput.Goodput(start=90.0, clock=clock)
    g.add("compile", 4.0)
    b = g.breakdown()
    assert (b["wall_s"], b["startup_s"], b["rest_s"]) == (10.0, 6.0, 0.0)
    g.end_startup()
    clock.tick(1.0)
    b = g.breakdown()
    assert (b["startup_s"], b["rest_s"]) == (6.0, 1.0)


def test_the_startup_is_split_into_its_phases_less_what_they_booked_elsewhere():
    """From the job's start, each phase to its mark (a phase never marked: 0), less the
    compile and search booked inside it; ``other`` after the last mark. The phases add up to
    the startup, before end_startup (an attempt killed in its startup) and after."""
    clock = FakeClock(100.0)
    goodput._marks.clear()
    goodput.mark("launch", at=99.0)  # a mark before the job began: an earlier job's
    g = goodput.Goodput(start=100.0, clock=clock)
    for phase, at in [("launch", 100.5), ("compose", 101.0), ("jax", 103.0), ("decide", 110.0)]:
        goodput.mark(phase, at=at)
    g.add("compile", 4.0, within="decide")  # the preflight's compile, inside prepare
    g.add("search", 1.5, within="decide")
    clock.t = 111.0
    b = g.breakdown()  # recorded as the attempt starts: the startup so far
    assert b["startup_s"] == pytest.approx(5.5)
    assert b["startup_phases"] == pytest.approx({
        "launch": 0.5, "compose": 0.5, "jax": 2.0, "decide": 1.5, "files": 0.0, "init": 0.0,
        "open": 0.0, "other": 1.0})
    goodput.mark("files", at=111.5)
    g.add("compile", 2.0, within="init")  # the init's programs
    goodput.mark("init", at=116.0)
    goodput.mark("open", at=117.0)
    clock.t = 117.25
    g.end_startup()
    assert goodput._marks == []  # taken: the next job's phases are its own
    clock.tick(10.0)
    b = g.breakdown()
    phases = b["startup_phases"]
    assert list(phases) == [*goodput.STARTUP_PHASES, "other"]
    assert (phases["files"], phases["init"], phases["open"]) == pytest.approx((1.5, 2.5, 1.0))
    assert phases["other"] == pytest.approx(0.25)
    assert sum(phases.values()) == pytest.approx(b["startup_s"]) == pytest.approx(9.75)
    assert b["compile_s"] == 6.0 and b["rest_s"] == pytest.approx(10.0)


def test_a_span_that_raises_still_counts():
    clock = FakeClock()
    g = goodput.Goodput(start=clock(), clock=clock)
    with pytest.raises(RuntimeError), g.span("checkpoint"):
        clock.tick(3.0)
        raise RuntimeError
    assert g.spent["checkpoint"] == 3.0


def test_a_resume_counts_its_attempts_and_the_redone_steps_as_lost(tmp_path):
    first = {"wall_s": 100.0, "productive_s": 60.0, "first_step": 0, "last_step": 60}
    second = {"wall_s": 50.0, "productive_s": 40.0, "first_step": 50, "last_step": 100}
    # Steps 51-60 ran twice: a sixth of the first attempt's productive time was lost.
    assert goodput.lost_seconds(first, 50) == pytest.approx(10.0)
    total = goodput.run_total([first, second])
    assert total == pytest.approx({"attempts": 2, "wall_s": 150.0, "productive_s": 90.0,
                                   "lost_s": 10.0, "goodput": 0.6})
    assert "over 2 attempts: 60.0% (10.0s of steps redone" in goodput.lines(
        {**second, **{f"{p}_s": 0.0 for p in goodput.PARTS if p != "productive"},
         "rest_s": 0.0, "goodput": 0.8}, total)[1]
    # The file as a run writes it (its totals beside the list), read back by the next attempt.
    (tmp_path / goodput.FILE).write_text(json.dumps(goodput.file_content([first], second, total)))
    assert goodput.earlier_attempts(tmp_path, resumed_in_place=True) == [first, second]
    assert goodput.earlier_attempts(tmp_path, resumed_in_place=False) == []


def test_traced_steps_leave_the_log_window():
    clock = FakeClock(0.0)
    w = goodput.StepWindow(clock)
    w.reset(2)  # after step 2's log row
    clock.tick(1.0)  # step 3: 1 s
    w.wait(0.1)
    w.pause(3)  # steps 4-5 traced: 10 s
    clock.tick(10.0)
    w.wait(5.0)  # a traced step's data wait is left out too
    w.resume(5)
    clock.tick(2.0)  # step 6: 2 s
    assert w.measure(6) == (pytest.approx(3.0), 2, pytest.approx(0.1))
    assert w.profiled


def test_a_log_step_inside_the_trace_starts_a_paused_window():
    clock = FakeClock(0.0)
    w = goodput.StepWindow(clock)
    w.reset(0)
    clock.tick(1.0)
    w.pause(1)  # steps 2-3 traced, a log row at step 2
    clock.tick(5.0)
    assert w.measure(2) == (pytest.approx(1.0), 1, 0.0)
    w.reset(2)
    clock.tick(5.0)
    w.resume(3)
    clock.tick(1.0)  # step 4
    assert w.measure(4) == (pytest.approx(1.0), 1, 0.0)
    assert w.profiled  # the row of step 4 still held a traced step


@pytest.mark.parametrize("start,steps,first,last,want", [
    (0, 3, 0, 100, range(0)),  # off
    (5, 3, 0, 100, range(5, 8)),
    (1, 3, 0, 100, range(2, 5)),  # step 1 compiles: moved to 2
    (10, 3, 40, 100, range(42, 45)),  # a resumed attempt's first step (41) compiles
    (99, 3, 0, 100, range(99, 101)),  # cut at the run's end
    (200, 3, 0, 100, range(200, 101)),  # past the end: empty
])
def test_traced_steps(start, steps, first, last, want):
    assert traced_steps(start, steps, first, last) == want


def test_each_process_traces_into_its_own_dir(tmp_path):
    assert profile_dir(tmp_path, 0, 1) == tmp_path / "profile"
    assert profile_dir(tmp_path, 3, 4) == tmp_path / "profile" / "3"


def test_the_first_job_of_a_process_counts_from_the_process_start():
    goodput._first_job[0] = True
    now = 1e12
    started = goodput.job_started_at(now)
    assert started == goodput.process_started_at() and started < now
    assert goodput.job_started_at(now) == now  # a multirun's later job: from its own start


def test_peak_bytes_per_device_comes_from_the_accelerator_allocator_stats():
    gpu = [{"peak_bytes_in_use": 2 * 2**30, "bytes_in_use": 2**30}] * 2
    later = [{"peak_bytes_in_use": 3 * 2**30}, {"peak_bytes_in_use": 5 * 2**30}]
    assert peak_over_devices(gpu, later) == 5 * 2**30  # the largest device
    assert peak_over_devices(gpu, gpu) is None  # no rise: an earlier job's peak, not ours
    assert peak_over_devices([None] * 8, [None] * 8) is None  # CPU keeps no statistics


def test_out_of_memory_errors_and_hlo_shape_sizes():
    assert is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 1.00GiB"))
    assert not is_out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes differ"))
    # tensorstore (Orbax's writer) says RESOURCE_EXHAUSTED of a full disk too: a disk error.
    full = ValueError("RESOURCE_EXHAUSTED: Error writing \"params.wte/0.0\" in OCDBT database: "
                      "Failed to write 205453 bytes to file 6: No space left on device "
                      "[os_error_code='28']")
    assert not is_out_of_memory(full) and disk_error(full) == "no space left on device"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert disk_error(wrapped) == "input/output error"
    assert disk_error(RuntimeError("RESOURCE_EXHAUSTED: Out of memory")) is None
    assert shape_bytes("bf16[4,1024]{1,0}") == 8192
    assert shape_bytes("(f32[2,3]{1,0}, s32[])") == 28


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
