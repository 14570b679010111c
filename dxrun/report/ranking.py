"""Layouts ranked by measured tokens/s, with their spread: the one ranking format of the sweep
report and of ``parallelism=auto`` (a sweep over every layout is the check of auto's choice).
Pure functions of numbers: no JAX, no files.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# A layout's speed is the median of its timing windows (tokens/s, all devices, one value per
# post-compile log window) and its spread the interquartile range of those windows. Two layouts
# are told apart only when the faster's lower quartile is above the slower's upper quartile; a
# layout with fewer than ``MIN_WINDOWS`` windows has no spread, so it is never told apart from
# another. From ``STEADY_WINDOWS`` windows on, the quartiles are robust to one window slowed by
# something else on the host.

# One window has no spread: a layout needs two to be told apart from another.
MIN_WINDOWS = 2
# The quartiles sit at positions 0.25 (n - 1) and 0.75 (n - 1) of the sorted windows; from
# five windows on they are inner windows, so one stray window (the slowest or the fastest)
# moves neither past its neighbour. With four or fewer it drags a quartile part of its way.
STEADY_WINDOWS = 5


@dataclass(frozen=True)
class LayoutRun:
    """One candidate layout and what was measured of it. A sweep fills ``layout``, ``windows``,
    ``devices`` and ``mem_bytes_per_device`` from a job; ``parallelism=auto`` can fill the same
    from its timed steps (``windows`` = tokens per step / each step's seconds) and add its
    roofline estimate (``estimated_ms``) and, for a candidate it did not time, why
    (``excluded``: "does not fit: <need> of <have> GiB")."""

    layout: str  # dp4_tp2, as the parallelism presets are named (plus remat/accum if they vary)
    windows: tuple[float, ...] = ()  # tokens/s of each post-compile window; () = not measured
    devices: int | None = None
    mem_bytes_per_device: float | None = None
    estimated_ms: float | None = None
    excluded: str = ""


@dataclass(frozen=True)
class Ranked:
    run: LayoutRun
    rank: int | None  # 1 = fastest; None = not measured (excluded)
    median: float | None
    q1: float | None
    q3: float | None
    vs_best: float | None  # best median / this median (1.0 for the fastest)
    why: str  # the fastest: "fastest"; the others: why they lost, or that they could not be told apart

    @property
    def layout(self) -> str:
        return self.run.layout


def quartiles(xs: list[float] | tuple[float, ...]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile), linear between the sorted values (numpy's
    default); one value is its own three quartiles."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0], s[0], s[0]

    def at(q: float) -> float:
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return at(0.25), statistics.median(s), at(0.75)


def beyond_spread(fast: Ranked, slow: Ranked) -> bool:
    """``fast`` is faster than ``slow`` beyond both spreads: its lower quartile is above the
    other's upper one, and each has more than one window (one window has no spread)."""
    return (len(fast.run.windows) >= MIN_WINDOWS and len(slow.run.windows) >= MIN_WINDOWS
            and fast.q1 > slow.q3)


def rank_layouts(runs: list[LayoutRun]) -> list[Ranked]:
    """The measured layouts fastest first (by median tokens/s), then the unmeasured ones by
    their estimate (those without one last, in the order given). Each row says how it compares
    with the fastest, or why it was not measured."""
    measured = [r for r in runs if r.windows]
    stats = {id(r): quartiles(r.windows) for r in measured}
    order = sorted(measured, key=lambda r: -stats[id(r)][1])
    out: list[Ranked] = []
    for i, r in enumerate(order):
        q1, med, q3 = stats[id(r)]
        out.append(Ranked(r, i + 1, med, q1, q3, None, ""))
    if out:
        best = out[0]
        rows = []
        for i, row in enumerate(out):
            ratio = best.median / row.median if row.median else None
            if i == 0:
                why = "fastest"
            elif beyond_spread(best, row):
                why = f"slower: {ratio:.2f}× behind {best.layout}, beyond the spread"
            else:
                why = f"within the spread of {best.layout} ({ratio:.2f}×)"
            rows.append(Ranked(row.run, row.rank, row.median, row.q1, row.q3, ratio, why))
        out = rows
    # Unmeasured: by their estimate where they have one (auto's model-only ranking), else as given.
    rest = sorted((r for r in runs if not r.windows),
                  key=lambda r: (r.estimated_ms is None, r.estimated_ms or 0.0))
    out += [Ranked(r, None, None, None, None, None, r.excluded or "not measured") for r in rest]
    return out


def verdict(ranked: list[Ranked], where: str) -> str:
    """One sentence on a ranking: ``fastest at batch 64: dp4_tp2, <ratio>× dp8, beyond the
    spread``, or ``at batch 64: not distinguishable: dp4_tp2 <ratio>× dp8, spreads overlap``
    (``where``: "at batch 64")."""
    measured = [r for r in ranked if r.rank is not None]
    if not measured:
        return f"{where}: no layout measured"
    best = measured[0]
    if len(measured) == 1:
        return f"{where}: only {best.layout} measured"
    second = measured[1]
    ratio = best.median / second.median
    if beyond_spread(best, second):
        return f"fastest {where}: {best.layout}, {ratio:.2f}× {second.layout}, beyond the spread"
    one = [r.layout for r in (best, second) if len(r.run.windows) < MIN_WINDOWS]
    cause = (f"{' and '.join(one)} timed in one window only" if one else "spreads overlap")
    return (f"{where}: not distinguishable: {best.layout} {ratio:.2f}× {second.layout}, "
            f"{cause}")


def _ms(tokens_per_step: float | None, tokens_per_s: float | None) -> str:
    if not (tokens_per_step and tokens_per_s):
        return "–"
    return f"{1e3 * tokens_per_step / tokens_per_s:,.1f}"


def ranking_table(ranked: list[Ranked], tokens_per_step: float | None = None) -> list[str]:
    """The ranking as Markdown table lines. Columns that no row fills (devices, memory,
    estimate, measured ms without ``tokens_per_step``) are left out."""
    runs = [r.run for r in ranked]
    cols: list[tuple[str, object]] = [("rank", lambda r: "–" if r.rank is None else str(r.rank)),
                                      ("layout", lambda r: f"`{r.layout}`")]
    if any(x.devices for x in runs):
        cols.append(("devices", lambda r: str(r.run.devices or "–")))
    if any(x.mem_bytes_per_device for x in runs):
        cols.append(("memory/device", lambda r: "–" if not r.run.mem_bytes_per_device
                     else f"{r.run.mem_bytes_per_device / 2**20:,.1f} MiB"))
    if any(x.estimated_ms for x in runs):
        cols.append(("estimated ms", lambda r: "–" if not r.run.estimated_ms
                     else f"{r.run.estimated_ms:,.1f}"))
    cols.append(("median tokens/s", lambda r: "–" if r.median is None else f"{r.median:,.0f}"))
    cols.append(("spread (IQR)", lambda r: "–" if r.median is None
                 else f"{r.q1:,.0f}–{r.q3:,.0f}"))
    cols.append(("windows", lambda r: str(len(r.run.windows))))
    if tokens_per_step:
        cols.append(("measured ms", lambda r: _ms(tokens_per_step, r.median)))
    cols.append(("× best", lambda r: "–" if r.vs_best is None else f"{r.vs_best:.2f}"))
    cols.append(("", lambda r: "✓" if r.rank == 1 else ""))
    cols.append(("why", lambda r: r.why))
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r).replace("|", "\\|") for _, f in cols) + " |"
              for r in ranked]
    return lines
