"""Timing layouts for real: each takes turns of a few steps on the run's own data, in rounds
whose order alternates; every decision read off a clock is process 0's. What the turns make
that the run can take over (the seeded init, or the state after the steps they trained) is
left in a ``Handover``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jax.experimental import multihost_utils

from dxrun.cost import (
    MEASURE_ROUNDS,
    MEASURE_STEPS,
    PRUNE,
    held_batch,
    ms_text,
    survivors,
)
from dxrun.experiment import (
    Experiment,
    adopt,
)
from dxrun.fit import Handover
from dxrun.plan import (
    Layout,
    make_plan,
)
from dxrun.run import (
    agree,
    release_freed_memory,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig

log = logging.getLogger("dxrun")


def time_layouts(cfg: RunConfig, layouts: list[Layout], devices: tuple,
                 built: dict[Layout, Any] | None = None, rounds: int = MEASURE_ROUNDS,
                 prune: float | None = PRUNE, tag: str = "layout_search",
                 keep: Handover | None = None, with_turns: bool = False,
                 train_cap: int = 0, held: tuple[int, int] | None = None) -> dict[Layout, Any]:
    """Seconds per step of each layout (the median of its turns; ``with_turns``: the list of
    its turns' medians, for the ranking's spread): ``rounds`` rounds in which each layout takes
    a turn (``_turn``: up to ``MEASURE_STEPS`` timed steps) on the run's own data at the
    ``held`` batch and sequence length (None: ``held_batch``), the order reversed every other
    round so that drift on a shared host falls on all alike. With ``prune``, after each round
    only ``survivors`` go on. ``built``: Experiments already compiled (the model stage's).
    One seeded init is copied into each layout's shardings at its turn and freed after it (one
    layout's state alive at a time); ``keep.params`` gets it, for the run to start from.
    ``train_cap`` (``train_through``; needs ``keep``): the turns train the run's first steps
    instead, each at most ``train_cap`` timed steps: one state carried from layout to layout
    on the run's batches in order, left in ``keep.state`` after ``keep.step`` steps. Every
    decision read off a clock (when a turn stops, who survives a round) is process 0's, agreed
    under keys beginning ``tag``: each process's own clock would stop its turn at another step
    and leave the others waiting in a collective for ever."""
    held = held or held_batch(cfg, *devices)
    exps = {}
    for layout in layouts:
        exps[layout] = (built or {}).get(layout) or Experiment.build(cfg, make_plan(
            cfg, *devices, layout=layout, batch=held[0], seq_len=held[1]))
    # Drawn spread over every device, then copied whole to every process's host: each layout
    # re-shards it at its turn. One process reads its own shards (process_allgather would
    # first replicate them over every simulated device in host memory).
    t0 = time.perf_counter()
    init = exps[layouts[0]].seeded.spread_params()
    params = (jax.device_get(init) if jax.process_count() == 1
              else multihost_utils.process_allgather(init, tiled=True))
    del init
    if keep is not None:  # the run's own init, drawn here: its time is the run's startup
        keep.init_s = time.perf_counter() - t0
        if not train_cap:
            keep.params = params
    turns: dict[Layout, list[float]] = {layout: [] for layout in layouts}
    live = list(layouts)
    turn_s = float(cfg.parallelism.search_turn_s)
    for k in range(rounds):
        for layout in live if k % 2 == 0 else live[::-1]:
            at = f"{tag}/{k}/{layouts.index(layout)}"
            times = _turn(exps[layout], params,
                          lambda t, at=at: agreed(f"{at}/{len(t)}", sum(t) >= turn_s),
                          keep if train_cap else None, train_cap or MEASURE_STEPS)
            if train_cap:
                params = None  # in the run's state now
            turns[layout].append(statistics.median(times))
            release_freed_memory()  # the next layout's buffers have other shapes
            log.info("layout search: %s %s ms per step (%d timed, round %d of at most %d)",
                     layout.label, ms_text(1e3 * turns[layout][-1]), len(times), k + 1, rounds)
        if prune:
            kept = survivors({x: statistics.median(turns[x]) for x in live}, prune)
            live = [layouts[i] for i in agreed(f"{tag}/{k}/live",
                                               [layouts.index(x) for x in kept])]
        if len(live) == 1:
            break
    if with_turns:
        return {layout: list(t) for layout, t in turns.items()}
    return {layout: statistics.median(t) for layout, t in turns.items()}


def agreed(key: str, value: Any) -> Any:
    """Process 0's ``value`` (JSON) on every process; one process: ``value``."""
    return json.loads(agree(key, json.dumps(value)))


def _turn(exp: Any, params: Any, done: Callable[[list[float]], bool],
          run: Handover | None = None, cap: int = MEASURE_STEPS) -> list[float]:
    """One layout's turn: one untimed step (the first after a switch pays for it: page faults,
    after ``release_freed_memory``; the first of all, one-off costs), then up to ``cap``
    timed steps (their seconds, returned), stopping once ``done(times)``. Its state is made
    from ``params`` and dropped after it, its steps on the first two batches; or with ``run``
    (``train_cap``) the run's own: ``run.state`` moved onto this layout (the first turn makes
    it from ``params``), trained on the run's next batches and left in ``run`` with the steps
    done and their seconds."""
    if run is None:
        state, first = exp.init_state(params=params), 0
    else:
        state = exp.init_state(params=params) if run.state is None else adopt(exp, run.state)
        run.state, first = None, run.step
    times: list[float] = []
    for i in range(1 + cap):
        # A fresh state's steps alternate the first two batches; the run's take its next ones.
        tokens = exp.global_batch(exp.data.local_batch(i % 2 if run is None else first + i))
        t0 = time.perf_counter()
        state, metrics = exp.step(state, tokens)
        jax.block_until_ready((state, metrics))
        took = time.perf_counter() - t0
        if run is not None:
            run.step, run.trained_s = run.step + 1, run.trained_s + took
        if i > 0:
            times.append(took)
            if done(times):
                break
    if run is not None:
        run.state = state
    del state
    return times
