"""Where a run's wall time went (goodput); the step timer: the log window's step time and data
wait without the traced steps, and the loop's own time; and the profiler's trace of a few steps
(``train.profile``), which ``python -m dxrun.profile`` reads. Host-side accounting with the clock
as a parameter, so unit tests drive it by hand; each section's own account follows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

from dxrun.run import read_json, write_json

# ------------------------------------------------------------------------------------------------
# Where a run's wall time went, and the log window's step time without the traced steps.
#
# Host-side accounting: every second of the job's wall time is given to the part the host was in
# (startup, parallelism=auto's layout search, compile, data, productive steps, eval, checkpoint,
# logging, profile: the traced steps)
# and what no span covers is ``rest``, so the parts add up to the wall time by construction; a
# large ``rest`` means a span is missing. The device runs ahead of the host, so the productive
# steps are the time in the step call plus the waits for its results at log steps. The clock is a
# parameter so that unit tests drive it by hand.

PARTS = ("startup", "search", "compile", "data", "productive", "eval", "checkpoint", "logging",
         "profile")
SHOWN_IF_USED = ("search", "profile")  # parts most runs never have: on the console only if > 0
FILE = "goodput.json"  # the attempts of a run dir, kept over resumes
# The phases of a job's startup, in order, each ended by a ``mark``: the interpreter and
# dxrun.__main__'s imports (Hydra); Hydra composing the config; JAX's import and its devices
# (a TPU's runtime starts here), the compile cache, the train modules' imports (Flax, Orbax,
# Grain) and the run dir's claim; the run's decision (``prepare``: the plan, the model's
# shapes, the data, a resume's checkpoint, less the step's compile and a search); the run
# dir's files; the train state's init or restore (less its programs' compiles); the attempt's
# logger (the W&B run), data iterator, eval batches and checkpoint manager. ``other``: the
# startup no phase covers.
STARTUP_PHASES = ("launch", "compose", "jax", "decide", "files", "init", "open")
# The compile events JAX times (``jax._src.dispatch``): lowering to StableHLO and XLA's compile
# (a persistent-cache hit: its lookup). Tracing is left out: a nested jit traces inside its
# caller, so its events overlap.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

_first_job = [True]
_marks: list[tuple[str, float]] = []  # (startup phase, epoch seconds it ended) of this job


def mark(phase: str, at: float | None = None) -> None:
    """This job's startup ``phase`` (``STARTUP_PHASES``) ends now (or at ``at``)."""
    _marks.append((phase, time.time() if at is None else at))


@contextlib.contextmanager
def compiling() -> Iterator[list[float]]:
    """``with compiling() as seconds:`` the seconds JAX spent lowering and compiling programs
    inside the block, in ``seconds[0]`` (``COMPILE_EVENTS``): of a compile that began before
    it, on another thread (``SeededInit.compile``), its part inside the block."""
    import jax.monitoring

    seconds, start = [0.0], time.perf_counter()

    def listen(event: str, duration: float, **_: object) -> None:
        if event in COMPILE_EVENTS:
            seconds[0] += min(duration, time.perf_counter() - start)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def process_started_at() -> float | None:
    """Epoch seconds this process started (Linux /proc), so that startup includes the imports;
    None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: field 22, counted after the ")" of the name
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def job_started_at(now: float | None = None) -> float:
    """When this job began: the process's start for the first job of a process (its imports
    and device setup are this job's startup), the call's time for a multirun's later jobs."""
    now = time.time() if now is None else now
    first, _first_job[0] = _first_job[0], False
    if not first:  # a multirun's later job: an earlier job's marks are not its phases
        _marks.clear()
    started = process_started_at() if first else None
    return started if started is not None and started <= now else now


class _Span:
    """``with goodput.span(part):`` books the block's seconds to ``part``, raised or not (a
    plain class: a few clock reads per step is all that goodput costs)."""

    __slots__ = ("g", "part", "t0")

    def __init__(self, g: Goodput, part: str):
        self.g, self.part = g, part

    def __enter__(self) -> None:
        self.t0 = self.g.clock()

    def __exit__(self, *exc: object) -> None:
        self.g.spent[self.part] += self.g.clock() - self.t0


class Goodput:
    """Seconds per part since ``start``; ``span(part)`` times a block, ``add`` books a figure
    measured elsewhere (the preflight's compile), ``within`` the startup phase it took."""

    def __init__(self, start: float, clock: Callable[[], float] = time.time):
        self.clock, self.start = clock, start
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.in_startup = True  # until end_startup: the time no part took is startup's
        self.within: dict[str, float] = {}  # seconds booked to other parts inside a phase
        self.phases: dict[str, float] | None = None  # the startup's, fixed at end_startup

    def span(self, part: str) -> _Span:
        return _Span(self, part)

    def add(self, part: str, seconds: float, within: str | None = None) -> None:
        """Book ``seconds`` to ``part``; ``within``: the startup phase they were spent in (a
        compile inside ``decide``), which they leave."""
        self.spent[part] += seconds
        if within is not None:
            self.within[within] = self.within.get(within, 0.0) + seconds

    def end_startup(self) -> None:
        """Everything before now not booked elsewhere was startup (imports, devices, data,
        the W&B run, the state's init), split into its phases (``STARTUP_PHASES``)."""
        self.spent["startup"] = self._startup()
        self.phases = self._phases(self.spent["startup"])
        _marks.clear()  # taken: a later job's (or train()'s) phases are its own
        self.in_startup = False

    def _startup(self) -> float:
        return max(0.0, self.clock() - self.start - sum(
            v for k, v in self.spent.items() if k != "startup"))

    def _phases(self, startup: float) -> dict[str, float]:
        """The startup's seconds by phase: from one mark to the next since ``start`` (a
        phase not marked: 0), less what the phase booked to other parts; ``other``: the rest
        of ``startup`` (after the last mark)."""
        took = dict.fromkeys(STARTUP_PHASES, 0.0)
        last = self.start
        for phase, at in sorted(((p, t) for p, t in _marks if t >= self.start),
                                key=lambda m: m[1]):
            took[phase] = took.get(phase, 0.0) + at - last
            last = at
        out = {p: max(0.0, t - self.within.get(p, 0.0)) for p, t in took.items()}
        out["other"] = max(0.0, startup - sum(out.values()))
        return out

    def breakdown(self) -> dict[str, Any]:
        """``wall_s``, ``<part>_s`` for every part, ``rest_s`` (what no span covered),
        ``goodput`` (productive / wall) and ``startup_phases`` (the startup's seconds by
        phase, ``_phases``). Before ``end_startup`` (an attempt recorded as it starts, in
        case it is killed there) the startup so far."""
        wall = self.clock() - self.start
        spent = {**self.spent, "startup": self._startup()} if self.in_startup else self.spent
        out: dict[str, Any] = {"wall_s": wall, **{f"{k}_s": v for k, v in spent.items()}}
        out["rest_s"] = wall - sum(spent.values())
        out["goodput"] = spent["productive"] / wall if wall > 0 else 0.0
        out["startup_phases"] = (self._phases(spent["startup"]) if self.phases is None
                                 else self.phases)
        return out


def lost_seconds(attempt: dict[str, Any], resumed_at: int) -> float:
    """Productive seconds of ``attempt`` spent on steps after ``resumed_at`` (the checkpoint the
    next attempt restarted from): done again, so badput."""
    first, last = attempt.get("first_step", 0), attempt.get("last_step", 0)
    redone = max(0, last - max(resumed_at, first))
    return attempt.get("productive_s", 0.0) * redone / (last - first) if last > first else 0.0


def run_total(attempts: list[dict[str, Any]]) -> dict[str, float]:
    """Over a run's attempts (in order, each with ``first_step``): wall, productive less the
    steps a later attempt redid, and the run's goodput."""
    lost = sum(lost_seconds(a, b["first_step"]) for a, b in pairwise(attempts))
    wall = sum(a["wall_s"] for a in attempts)
    productive = sum(a["productive_s"] for a in attempts) - lost
    return {"attempts": len(attempts), "wall_s": wall, "productive_s": productive,
            "lost_s": lost, "goodput": productive / wall if wall > 0 else 0.0}


def file_content(earlier: list[dict[str, Any]], attempt: dict[str, Any],
                 total: dict[str, float]) -> dict[str, Any]:
    """``goodput.json``: the run's totals and the list of its attempts (which a resume in place
    reads back with ``earlier_attempts``; the totals' own count must not replace it)."""
    return {**total, "attempts": [*earlier, attempt]}


def _holds_attempts(content: Any) -> bool:
    """``goodput.json`` as ``file_content`` writes it: what ``run_total`` reads of each
    attempt is there and a number."""
    attempts = content.get("attempts") if isinstance(content, dict) else None
    return isinstance(attempts, list) and all(
        isinstance(a, dict) and all(isinstance(a.get(k), (int, float)) for k in _NEEDED)
        for a in attempts)


_NEEDED = ("wall_s", "productive_s", "first_step", "last_step")


def earlier_attempts(run_dir: Path, resumed_in_place: bool) -> list[dict[str, Any]]:
    """The attempts a run dir holds (a resume in place continues them); [] for a new run, and
    for a damaged file (set aside as ``goodput.json.damaged``, with one warning)."""
    if not resumed_in_place:
        return []
    content = read_json(run_dir / FILE, _holds_attempts)
    return list(content["attempts"]) if content is not None else []


class RunRecord:
    """``goodput.json`` as an attempt goes: the run dir's earlier attempts (a resume in place
    continues them) and this one's record, written from the attempt's start on and again at
    every ``update``, because a process killed outright (kill -9, the OOM killer, a lost node)
    never reaches its end, and the next attempt must still find this one's time (its startup,
    when it was killed before its first step), its saves and the steps it will redo. Only
    ``write``, the process that writes the run's files, reads and writes the file (another
    process setting a damaged file aside too would race it)."""

    def __init__(self, run_dir: Path, clock: Goodput, resumed_in_place: bool, first_step: int,
                 write: bool):
        self.path, self.clock, self.write = run_dir / FILE, clock, write
        self.earlier = earlier_attempts(run_dir, resumed_in_place and write)
        self.first_step = first_step  # the step the attempt starts from: its resume's, or 0
        self.update(first_step)

    def update(self, last_step: int, checkpoint_saves: int = 0,
               checkpoint_block_s: float = 0.0) -> None:
        """This attempt up to ``last_step``, with the saves it made and how long they held its
        loop."""
        self.attempt: dict[str, Any] = {
            **self.clock.breakdown(), "first_step": self.first_step, "last_step": last_step,
            "checkpoint_saves": checkpoint_saves, "checkpoint_block_s": checkpoint_block_s}
        self.total = run_total([*self.earlier, self.attempt])
        if self.write:
            write_json(self.path, file_content(self.earlier, self.attempt, self.total))

    def over_attempts(self, key: str) -> float:
        """``key`` summed over the run's attempts (an attempt recorded before it was kept: 0)."""
        return sum(a.get(key, 0) for a in [*self.earlier, self.attempt])


def lines(attempt: dict[str, float], total: dict[str, float]) -> list[str]:
    """The console's goodput lines: the parts of this attempt, and the run's total over its
    attempts when it was resumed."""
    # Tracing (train.profile.start) and the layout search (parallelism=auto) are off unless
    # asked for: their parts show only when they ran.
    parts = ", ".join(f"{k} {attempt[f'{k}_s']:.1f}s" for k in PARTS
                      if k != "productive" and (k not in SHOWN_IF_USED or attempt[f"{k}_s"] > 0))
    out = [f"goodput {attempt['goodput']:.1%}: productive steps {attempt['productive_s']:.1f}s "
           f"of {attempt['wall_s']:.1f}s wall; {parts}, rest {attempt['rest_s']:.1f}s"]
    if total["attempts"] > 1:
        out.append(f"goodput over {total['attempts']} attempts: {total['goodput']:.1%} "
                   f"({total['lost_s']:.1f}s of steps redone after a resume)")
    return out


class StepWindow:
    """The log window: its seconds, steps and data wait, less the traced steps (tracing slows
    them). ``pause``/``resume`` bracket the trace; a log step inside it starts a paused window."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.reset(0)

    def reset(self, step: int) -> None:
        paused = getattr(self, "_paused", None) is not None
        self.t, self.step, self.waited = self.clock(), step, 0.0
        self.excluded_s, self.excluded_steps, self.profiled = 0.0, 0, paused
        self._paused = (self.t, step) if paused else None

    def wait(self, seconds: float) -> None:
        if self._paused is None:
            self.waited += seconds

    def pause(self, step: int) -> None:
        self._paused, self.profiled = (self.clock(), step), True

    def resume(self, step: int) -> None:
        if self._paused is not None:
            t, s = self._paused
            self.excluded_s += self.clock() - t
            self.excluded_steps += step - s
            self._paused = None

    def measure(self, done: int) -> tuple[float, int, float]:
        """(seconds, steps, data wait) of the window up to step ``done``, traced steps out."""
        now, seconds, steps = self.clock(), self.excluded_s, self.excluded_steps
        if self._paused is not None:
            seconds += now - self._paused[0]
            steps += done - self._paused[1]
        return now - self.t - seconds, done - self.step - steps, self.waited


# ------------------------------------------------------------------------------------------------
# The step timer: the log window's step time and data wait, and the loop's own time.
#
# Step time is measured from device-ready to device-ready over the window between two log
# points (the host waits on the device only there). An attempt's first step compiles: the windows
# and the loop's time start after it. Evaluation is not in a window (a log point starts the next
# one after it), a checkpoint save is (a save holds the loop, and the line says so: ``note``),
# and traced steps are left out (``pause``/``resume``: ``goodput.StepWindow``). No JAX here: the
# clock is a parameter, so tests drive it by hand.

NOTICEABLE_BLOCK_S = 0.5  # a save that holds the loop less is never warned or noted about


def save_note(held_s: float) -> str:
    """Why a window's tokens/s dropped: checkpoint saves held the loop ``held_s`` of it."""
    return f"(tok/s includes {held_s:.1f} s of checkpoint saving)"


class SaveTotals(NamedTuple):
    """The checkpoint saves of this attempt so far (``SaveCost.totals``)."""

    block_s: float  # seconds the saves held the loop
    saves: int


class Measured(NamedTuple):
    """A log window up to a step, traced steps left out."""

    seconds: float
    steps: int
    waited: float  # of ``seconds``, waiting for data
    profiled: bool  # traced steps were in the window (left out of perf/*)


class _Wait:
    """``with timer.data_wait():`` adds the block's seconds to the window's data wait (a plain
    class: it runs every step)."""

    __slots__ = ("t0", "timer")

    def __init__(self, timer: StepTimer):
        self.timer = timer

    def __enter__(self) -> None:
        self.t0 = self.timer.clock()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:  # a batch that never came is no wait of a step
            self.timer.window.wait(self.timer.clock() - self.t0)


class StepTimer:
    """The timing of an attempt that runs steps ``start+1 .. steps``."""

    def __init__(self, start: int, steps: int, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.start = clock, start
        self.window = StepWindow(clock)
        self.saves0 = SaveTotals(0.0, 0)  # the saves before this window
        self.loop_t, self.loop_step = 0.0, steps  # from the compiling step's end
        self.loop_s: float | None = None

    def data_wait(self) -> _Wait:
        return _Wait(self)

    def pause(self, step: int) -> None:
        """Tracing starts after step ``step``."""
        self.window.pause(step)

    def resume(self, step: int) -> None:
        """Tracing stopped after step ``step``."""
        self.window.resume(step)

    def stepped(self, done: int, saves: SaveTotals) -> None:
        """Step ``done`` ran; after the compiling one the first window and the loop start."""
        if done == self.start + 1:
            self.reset(done, saves)
            self.loop_t, self.loop_step = self.window.t, done

    def reset(self, done: int, saves: SaveTotals) -> None:
        """A new window after the log point of step ``done`` (its evaluation not in it)."""
        self.window.reset(done)
        self.saves0 = saves

    def measure(self, done: int) -> Measured:
        seconds, steps, waited = self.window.measure(done)
        return Measured(seconds, steps, waited, self.window.profiled)

    def note(self, saves: SaveTotals, has_rate: bool) -> str:
        """Why this window's tokens/s dropped, when saves held it noticeably; else ''."""
        held = saves.block_s - self.saves0.block_s
        return save_note(held) if has_rate and held >= NOTICEABLE_BLOCK_S else ""

    def end_loop(self) -> None:
        """The last step was logged: it is done."""
        self.loop_s = self.clock() - self.loop_t

    def loop_tokens_per_s(self, tokens_per_step: int, steps: int) -> float | None:
        """Tokens/s of the whole loop after the compiling step: data, the step, logging,
        evaluation, saves and the progress bar (None: no step after it)."""
        if steps <= self.loop_step or self.loop_s is None:
            return None
        return tokens_per_step * (steps - self.loop_step) / self.loop_s


# ------------------------------------------------------------------------------------------------
# ``train.profile``: a ``jax.profiler`` trace of a few steps after the compile.
#
# The trace (XSpace ``*.xplane.pb``, which XProf / TensorBoard's profile plugin open, and JAX's
# ``perfetto_trace.json.gz``) goes to ``<run dir>/profile/``, or ``profile/<rank>/`` per process
# of a multi-process run: each process traces its own host and devices. The compiled step's HLO
# is saved beside it (``step.hlo.txt``) so that ``python -m dxrun.profile`` can tell a matmul
# fusion from an elementwise one by what it computes rather than by its name.

log = logging.getLogger("dxrun")

HLO_FILE = "step.hlo.txt"


def profile_dir(run_dir: Path, rank: int, processes: int) -> Path:
    """Where this process writes its trace."""
    return run_dir / "profile" / str(rank) if processes > 1 else run_dir / "profile"


def traced_steps(start: int, steps: int, done_before: int, last: int) -> range:
    """The step numbers (as logged: 1-based) to trace for ``train.profile.start/steps`` in an
    attempt that starts after step ``done_before`` (a resume's checkpoint; 0) and ends at
    ``last``. The attempt's first step compiles, so a start on or before it moves to the step
    after. Empty when off (start 0) or past the end."""
    if start <= 0:
        return range(0)
    begin = max(start, done_before + 2)
    return range(begin, min(begin + steps, last + 1))


def open_command(where: Path) -> str:
    return f"xprof --logdir={where} --port=8791"


class Tracer:
    """Starts the trace before the first traced step and stops it after the last, each time
    with the device drained, so that the trace holds exactly those steps."""

    def __init__(self, steps: range, where: Path, run_dir: Path, hlo_text: str | None):
        self.steps, self.where, self.run_dir, self.hlo_text = steps, where, run_dir, hlo_text
        self.active = False

    def before(self, step: int, pending: object) -> bool:
        """Called before running ``step``; True when it starts the trace."""
        if not self.steps or step != self.steps.start:
            return False
        import jax  # here: dxrun.profile (and the reference) read HLO_FILE without JAX

        jax.block_until_ready(pending)  # the earlier steps stay out of the trace
        self.where.mkdir(parents=True, exist_ok=True)
        if self.hlo_text:
            (self.where / HLO_FILE).write_text(self.hlo_text)
        jax.profiler.start_trace(str(self.where), create_perfetto_trace=True)
        self.active = True
        return True

    def after(self, step: int, pending: object) -> bool:
        """Called after ``step`` ran; True when it stopped the trace."""
        if not self.active or step != self.steps[-1]:
            return False
        import jax

        jax.block_until_ready(pending)
        self.stop()
        log.info("profiler trace of steps %d-%d in %s; open it with: %s (pip install xprof), "
                 "or perfetto_trace.json.gz on ui.perfetto.dev; table: python -m dxrun.profile "
                 "%s", self.steps.start, self.steps[-1], self.where, open_command(self.where),
                 self.run_dir)
        return True

    def stop(self) -> None:
        if self.active:
            import jax

            jax.profiler.stop_trace()
            self.active = False
