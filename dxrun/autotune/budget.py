"""Is a layout search worth it (``parallelism.search_budget``)? The starting layout (the
preset's own: all devices data-parallel) is compiled first, as the run would compile it, and
a search predicted (``plan.layouts.search_cost``) to cost more than that fraction of the run's
steps is not made: the run keeps its start, and the log says why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dxrun.autotune.timing import agreed
from dxrun.config.errors import ConfigError
from dxrun.plan.axes import Layout
from dxrun.plan.layouts import Row, _ms, _s, search_cost
from dxrun.plan.mesh import make_plan

if TYPE_CHECKING:
    from dxrun.config.schema import RunConfig

log = logging.getLogger("dxrun")

Score = Callable[..., tuple[float, float | None]]  # (layout, say=True) -> (GiB, est. s or None)


def start_layout(cfg: RunConfig, devices: tuple, held: tuple[int, int]) -> Layout | None:
    """The layout the run would take unsearched: the preset's own (``parallelism=auto``: every
    device data-parallel) at the ``held`` batch and sequence length; None where the plan
    refuses it (the batch does not divide...)."""
    try:
        plan = make_plan(cfg, *devices, batch=held[0], seq_len=held[1])
    except ConfigError:
        return None
    return Layout(plan.sizes, cfg.model.remat, cfg.train.grad_accum)


def say_score(layout: Layout, need_gb: float, est_s: float | None) -> None:
    """A candidate's score in the log as the model stage takes it (a compile takes seconds)."""
    log.info("layout search: %s needs %.3f GiB per device, est. %s ms", layout.label, need_gb,
             _ms(None if est_s is None else 1e3 * est_s))


def worth_it(cfg: RunConfig, layouts: list[Layout], score: Score, budget: float,
             budget_gb: float | None, devices: tuple, tag: str, target: str,
             held: tuple[int, int]) -> tuple[Score, Row | None, str]:
    """(the scorer, with the starting layout's score kept for the model stage; the starting
    layout's row, chosen, its ``why`` the reason, when a search would cost more than ``budget``
    of the run (``search_cost``), else None; what the start is: "all devices data-parallel").
    The start is scored first: its compile is the run's own either way, and its time is what
    each other layout's compile is predicted to take. ``target``: the estimate's, named in the
    reason. Process 0's verdict on every process."""
    start, verdict = start_layout(cfg, devices, held), None
    what = "all devices data-parallel"
    if start not in layouts and layouts:  # e.g. a batch the devices do not divide
        start, what = layouts[0], "the first layout the plan accepts"
    if len(layouts) > 1:
        t = time.perf_counter()
        need, est = score(start, say=False)
        compile_s = time.perf_counter() - t
        kept = {start: (need, est)}
        score = (lambda layout, say=True, inner=score: kept.pop(layout) if layout in kept
                 else inner(layout, say=say))
        if est is not None and (budget_gb is None or need <= budget_gb):
            row = Row(start, need, 1e3 * est, fits=True)
            cost, steps, run_s = search_cost(cfg, row, len(layouts), compile_s,
                                             devices[1] == "cpu")
            if cost > budget * run_s:
                turns = f", {steps} steps of turns" if steps else ""
                more = len(layouts) - 1
                verdict = (f"a search of {len(layouts)} layouts ({more} more "
                           f"compile{'s' * (more != 1)} of {compile_s:.1f} s{turns}) would take "
                           f"est. {_s(cost)} s, more than parallelism.search_budget={budget:g} "
                           f"of the run's est. {_s(run_s)} s ({cfg.train.steps} steps at "
                           f"{_ms(1e3 * est)} ms on {target}); parallelism.search=fresh "
                           "searches anyway")
    verdict = agreed(f"{tag}/budget", verdict)
    if verdict is None:
        if len(layouts) > 1:
            say_score(start, need, est)  # the model stage's first
        return score, None, what
    return score, Row(start, need, 1e3 * est, chosen=True, fits=True, why=verdict), what
