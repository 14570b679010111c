"""When a run saves: the save cadence (``checkpoint.every``, ``checkpoint.every_minutes``, or
for null the platform's and the state's own) and what a save costs at that cadence (pure:
values in, values out; the run plan carries the cadence decided).
"""

from __future__ import annotations

import math
from typing import Any

from dxrun.cost.targets import GB, gb_text

MAX_CHECKPOINT_OVERHEAD = 0.02  # of the run's time: above it plan mode and the run warn


def checkpoint_interval_s(every_steps: int, every_minutes: float,
                          step_time_s: float | None) -> float | None:
    """Seconds between two saves: the step cadence at ``step_time_s`` or the wall-clock one,
    whichever comes first; None when neither is known (no cadence, or no step time)."""
    options = [60.0 * every_minutes] if every_minutes > 0 else []
    if every_steps > 0 and step_time_s:
        options.append(every_steps * step_time_s)
    return min(options) if options else None


def minutes_for_overhead(save_s: float, overhead: float = MAX_CHECKPOINT_OVERHEAD) -> int:
    """The shortest whole-minute wall-clock cadence at which a save of ``save_s`` seconds costs
    at most ``overhead`` of the run."""
    return max(1, math.ceil(save_s / overhead / 60))


CPU_EVERY_STEPS = 100  # checkpoint.every=null on CPU: a save every 100 steps
MIN_AUTO_MINUTES = 10  # the automatic wall-clock cadence is never shorter (work a crash loses)


def save_cadence(every: int | None, every_minutes: float, platform: str, state_bytes: float,
                 write_bytes_per_s: float) -> tuple[int, float]:
    """(steps, minutes) between saves, 0 = that cadence off. ``checkpoint.every`` as given,
    except null (the default): on CPU every 100 steps; on an accelerator no step cadence and a
    wall-clock one, ``checkpoint.every_minutes`` if set, else the shortest whole minute at which
    a save of the state (at ``plan.write_gb_per_s``) costs at most 2% of the run, and at least
    10 minutes. A step count cannot be right for every step time: a large state saved every
    hundred short steps makes a write-bound loop."""
    if every is not None:
        return every, every_minutes
    if platform == "cpu":
        return CPU_EVERY_STEPS, every_minutes
    if every_minutes > 0:
        return 0, every_minutes
    save_s = state_bytes / write_bytes_per_s
    return 0, float(max(MIN_AUTO_MINUTES, minutes_for_overhead(save_s)))


def cadence_text(every_steps: int, every_minutes: float) -> str:
    """``every 100 steps``, ``every 10 min``, both with ``and``, or ``never``."""
    parts = [f"every {every_steps} steps" if every_steps else "",
             f"every {every_minutes:g} min" if every_minutes else ""]
    return " and ".join(filter(None, parts)) or "never"


def checkpoint_cost(state_bytes: float, write_bytes_per_s: float, every_steps: int,
                    every_minutes: float, step_time_s: float | None) -> dict[str, Any]:
    """What a save of the whole train state costs at the assumed write bandwidth, and its
    share of the run at the configured cadence. Counted as if the whole write blocked the loop:
    Orbax's copy to host does, and the background write does too whenever the next save comes
    before it finished, so this errs high, like the roofline."""
    save_s = state_bytes / write_bytes_per_s
    interval = checkpoint_interval_s(every_steps, every_minutes, step_time_s)
    overhead = save_s / interval if interval else None
    return {
        "every_steps": every_steps, "every_minutes": every_minutes,
        "state_bytes": state_bytes, "write_bytes_per_s": write_bytes_per_s, "save_s": save_s,
        "interval_s": interval, "overhead": overhead,
        "too_costly": overhead is not None and overhead > MAX_CHECKPOINT_OVERHEAD,
        "suggest_every_minutes": minutes_for_overhead(save_s),
    }


def checkpoint_line(c: dict[str, Any]) -> str:
    """The plan table's checkpoint row: the save's cost and, when too costly, the fix."""
    every_steps, every_minutes = c["every_steps"], c["every_minutes"]
    head = (f"{gb_text(c['state_bytes'])} per save, ~{c['save_s']:.1f} s at "
            f"{c['write_bytes_per_s'] / GB:g} GB/s (plan.write_gb_per_s)")
    cadence = cadence_text(every_steps, every_minutes)
    if c["overhead"] is None:
        return f"{head}; {'no cadence (checkpoint.every=0)' if cadence == 'never' else cadence}"
    text = (f"{head}; {cadence} = a save every {c['interval_s']:.1f} s: "
            f"{100 * c['overhead']:.1f}% of the run")
    if c["too_costly"]:
        text += (f", above {100 * MAX_CHECKPOINT_OVERHEAD:.0f}%: set checkpoint.every=0 "
                 f"checkpoint.every_minutes={c['suggest_every_minutes']}")
    return text
