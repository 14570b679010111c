"""``parallelism=auto``: the fastest layout (mesh, remat, gradient accumulation) that fits.

The candidates are the meshes the plan accepts (``cost.layouts.candidates``); the **model**
stage compiles each from shapes (nothing allocated) and ranks the variants that fit by the
estimate (``autotune.footprint.step_estimate``) for the visible hardware or ``plan.target``; the
**measure** stage (``parallelism.search=measure|fresh``) times the few the rules pick, in
rounds (``autotune.timing``), and the fastest wins. Before them the budget rule
(``worth_it``) keeps a run on its start when a search would not pay. The global batch
and sequence length are held fixed throughout (``cost.layouts.held_batch``). The decision is
cached (``autotune.cache``) and checked before it is taken; every process takes process 0's.
The config is read, never rewritten: each candidate is a mesh plan made for its layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jax

from dxrun.autotune.advice import ACCUMS
from dxrun.autotune.cache import cache_key, cache_path, read_cache, write_cache
from dxrun.autotune.footprint import step_estimate
from dxrun.autotune.timing import agreed, time_layouts
from dxrun.config import ConfigError
from dxrun.cost import (
    GiB,
    Row,
    Target,
    TooLarge,
    candidates,
    chosen_layout,
    gib_text,
    held_batch,
    measure_rule,
    measure_stage,
    model_choice,
    model_stage,
    ms_text,
    rows_of,
    s_text,
    search_cost,
    to_measure,
    train_through,
    usable_bytes,
)
from dxrun.experiment import (
    Experiment,
    analysis_is_full,
    step_bytes,
    visible_devices,
)
from dxrun.fit import (
    Handover,
    NoData,
    device_budget,
    is_out_of_memory,
    resolve_target,
    state_bytes,
    xla_need,
)
from dxrun.plan import (
    Layout,
    MeshPlan,
    make_plan,
)
from dxrun.run import (
    faults_from_env,
    is_main,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig

log = logging.getLogger("dxrun")


_SEARCHES = [0]  # searches made in this process: each agrees on its own keys
Timer = Callable[[Any, list[Layout]], dict[Layout, Any]]


# Is a search worth it (``parallelism.search_budget``)? The starting layout (the preset's own: all
# devices data-parallel) is compiled first, as the run would compile it, and a search predicted
# (``cost.layouts.search_cost``) to cost more than that fraction of the run's steps is not
# made: the run keeps its start, and the log says why.
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
             ms_text(None if est_s is None else 1e3 * est_s))


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
        try:
            need, est = kept_score = score(start, say=False)
        except TooLarge as e:  # the start does not fit the chip: a search it is
            need, est, kept_score = None, None, e
        compile_s = time.perf_counter() - t
        kept = {start: kept_score}
        score = (lambda layout, say=True, inner=score: _taken(kept.pop(layout)) if layout in kept
                 else inner(layout, say=say))
        if est is not None and (budget_gb is None or need <= budget_gb):
            row = Row(start, need, 1e3 * est, fits=True)
            cost, steps, run_s = search_cost(cfg, row, len(layouts), compile_s,
                                             devices[1] == "cpu", faults_from_env().steps())
            if cost > budget * run_s:
                turns = f", {steps} steps of turns" if steps else ""
                more = len(layouts) - 1
                verdict = (f"a search of {len(layouts)} layouts ({more} more "
                           f"compile{'s' * (more != 1)} of {compile_s:.1f} s{turns}) would take "
                           f"est. {s_text(cost)} s, more than parallelism.search_budget={budget:g} "
                           f"of the run's est. {s_text(run_s)} s ({cfg.train.steps} steps at "
                           f"{ms_text(1e3 * est)} ms on {target}); parallelism.search=fresh "
                           "searches anyway")
    verdict = agreed(f"{tag}/budget", verdict)
    if verdict is None:
        if len(layouts) > 1 and need is not None:
            say_score(start, need, est)  # the model stage's first
        return score, None, what
    return score, Row(start, need, 1e3 * est, chosen=True, fits=True, why=verdict), what


def _taken(score: tuple[float, float | None] | TooLarge) -> tuple[float, float | None]:
    """A kept score as the scorer gave it: its figures, or its refusal raised again."""
    if isinstance(score, TooLarge):
        raise score
    return score


@dataclass(frozen=True)
class Searched:
    """A layout search's outcome: the layout the run takes and the ranking's record (what
    plan.json and the log show)."""

    layout: Layout
    record: dict[str, Any]


@dataclass
class _Search:
    """What one search reads throughout: the config, the devices, the batch and sequence
    length held fixed, and the estimate's target and memory budget."""

    cfg: RunConfig
    devices: tuple
    held: tuple[int, int]
    plan_mode: bool
    mode: str  # plan mode: "model"
    fresh: bool  # a search asked for: no cached decision, whatever the budget
    tag: str  # this search's keys in the processes' agreement
    key: str
    target: Target
    peak: float | None
    budget_gb: float | None

    def plan(self, layout: Layout | None = None) -> MeshPlan:
        return make_plan(self.cfg, *self.devices, layout=layout, batch=self.held[0],
                         seq_len=self.held[1])


def search(cfg: Any, plan_mode: bool = False, timer: Timer | None = None,
           resumed: Layout | None = None, handover: Handover | None = None,
           held: tuple[int, int] | None = None) -> Searched | None:
    """Choose the layout (``parallelism.search``; plan mode: from the estimate alone); None:
    no search. ``timer(cfg, layouts)``: seconds per step of each layout, or its turns'
    (default ``time_layouts``'s). ``resumed``: the layout of the checkpoint a run resumes, kept
    where the plan accepts it here. ``handover``: filled with what the run takes over.
    ``held``: the batch and sequence length (None: ``held_batch`` on these devices)."""
    if cfg.parallelism.search == "none":
        return None
    t0, devices = time.perf_counter(), visible_devices(cfg.plan.target if plan_mode else None)
    if resumed is not None and (kept := _resumed(cfg, resumed, devices, t0)) is not None:
        return kept
    s = _setup(cfg, devices, plan_mode, held or held_batch(cfg, *devices))
    if (cached := _from_cache(s, handover, t0)) is not None:
        return cached
    layouts, refused = candidates(cfg, *devices, batch=s.held[0], seq_len=s.held[1])
    if not layouts:  # the plan refuses every layout (more devices than there are...): its words
        s.plan()
    if not plan_mode:  # a state no mesh can hold: said before a compile is spent on it
        state_floor(s, layouts[0])
    # A search that measures keeps each candidate's full compile for its timing; so does a
    # run's on an accelerator, whose analysis compile is the full one: the chosen layout's is
    # then the run's step, not a second compile of the same program.
    keep = s.mode in ("measure", "fresh") or (not plan_mode and analysis_is_full(devices[1]))
    built: dict[Layout, Any] | None = {} if keep else None
    score = _scorer(s, built)
    budget = None if s.fresh else cfg.parallelism.get("search_budget")
    unsearched, start = None, ""
    if budget is not None:  # would the run's search pay? (plan mode: the planned run's)
        score, unsearched, start = worth_it(cfg, layouts, score, budget, s.budget_gb, devices,
                                            s.tag, s.target.name, s.held)
    if unsearched is not None:  # the start, chosen; the others never compiled
        verdict, unsearched.why, top = unsearched.why, "", 0
        rows = [unsearched] + [Row(x, why="not searched") for x in layouts
                               if x != unsearched.layout]
    else:
        verdict, top = None, cfg.parallelism.search_top
        rows = _ranked(s, layouts, score, built, handover, timer)
    chosen = next(r.layout for r in rows if r.chosen)
    if handover is not None and built and chosen in built:  # its compile: the run's step
        handover.exp = built.pop(chosen)
    if built:
        built.clear()
    rows += [Row(layout, why=why) for layout, why in refused]
    return Searched(chosen, _record(s, rows, top, verdict, start, handover, t0))


def _resumed(cfg: RunConfig, resumed: Layout, devices: tuple, t0: float) -> Searched | None:
    """The checkpoint's layout, kept where the plan accepts it on these devices; else None
    (chosen again as a new run would, the checkpoint resharded onto the choice)."""
    n, size = cfg.parallelism.n_devices or devices[0], resumed.sizes.n
    why = (f"its {size} devices are not this run's {n}" if size != n
           else _refused(lambda: make_plan(cfg, *devices, layout=resumed)))
    if why is None:
        row = Row(resumed, chosen=True, fits=True, why="")
        return Searched(resumed, {
            "search": "resume", "target": "the checkpoint's layout", "top": 0,
            "rows": [row.to_json()], "searched": False, "cached": False, "search_s": 0.0,
            "decide_s": time.perf_counter() - t0})
    log.info("parallelism=auto: the checkpoint's layout %s does not fit this run (%s); "
             "choosing again as a new run would, the checkpoint resharded onto the choice",
             resumed.label, why)
    return None


def _setup(cfg: RunConfig, devices: tuple, plan_mode: bool, held: tuple[int, int]) -> _Search:
    _SEARCHES[0] += 1
    n = cfg.parallelism.n_devices or devices[0]
    key = cache_key(cfg, held, n, jax.devices()[0].device_kind, jax.__version__, devices[2])
    target, peak = resolve_target(cfg, n)
    if plan_mode:  # the target's usable memory, as plan mode's fit
        budget_gb = usable_bytes(target) / GiB if target.memory_bytes else None
    elif devices[1] == "tpu" and cfg.runtime.memory_gb is None:
        budget_gb = None  # XLA's compile is the check (``compile_checked``): it fits or raises
    else:  # the memory preflight's budget
        budget_gb = device_budget(cfg.runtime)[0] / GiB
    mode = cfg.parallelism.search
    return _Search(cfg, devices, held, plan_mode, "model" if plan_mode else mode,
                   mode == "fresh", f"layout_search/{_SEARCHES[0]}", key, target, peak,
                   budget_gb)


def _from_cache(s: _Search, handover: Handover | None, t0: float) -> Searched | None:
    """An earlier run's decision, planned and (for a run) fitted before it is taken; None:
    none, or in doubt (one warning: deciding again as if there were none)."""
    cached, doubt = read_cache(s.key) if not s.fresh and is_main() else (None, None)
    checked: dict[Layout, Any] = {}  # the cached layout's compile, the run's step if taken
    if cached is not None:
        scorer = None if s.plan_mode else _scorer(s, checked)
        doubt = _cached_doubt(s, chosen_layout(cached), scorer)
    cached, doubt = agreed(f"{s.tag}/cache", [cached, doubt])
    if doubt:
        log.warning("parallelism=auto: the cached decision %s %s; deciding again as if there "
                    "were none (parallelism.search=fresh searches again and replaces it)",
                    cache_path(s.key), doubt)
        return None
    if cached is None:
        return None
    chosen = chosen_layout(cached)
    if handover is not None and chosen in checked:  # its compile: the run's step
        handover.exp = checked.pop(chosen)
    return Searched(chosen, {
        **cached, "search": s.mode, "decided_by": cached["search"], "cached": True,
        "searched": False, "search_s": 0.0, "decide_s": time.perf_counter() - t0,
        "init_s": None, "trained_steps": 0, "trained_s": 0.0, "compile_s": 0.0})


def _ranked(s: _Search, layouts: list[Layout], score: Score, built: dict[Layout, Any] | None,
            handover: Handover | None, timer: Timer | None) -> list[Row]:
    """The model stage's ranking and, unless plan mode, the measure stage's choice: process
    0's rows on every process (memory readings differ per process), so that every process
    measures the same candidates in the same order."""
    cfg, top = s.cfg, s.cfg.parallelism.search_top
    rows = _agreed_rows(f"{s.tag}/rows", model_stage(layouts, s.budget_gb, score))
    if not s.plan_mode and not any(r.fits for r in rows):
        raise ConfigError(agreed(f"{s.tag}/none", nothing_fits(s, rows)))
    if s.mode == "model":
        model_choice(rows, top=0)
        return rows
    fitting = {r.layout for r in rows if r.fits}
    for layout in [x for x in built if x not in fitting]:  # their compiles freed before timing
        del built[layout]
    turn_s = cfg.parallelism.search_turn_s
    every, prune = measure_rule(rows, turn_s, s.devices[1] == "cpu")
    cap = 0
    if handover is not None and s.devices[2] == 1:  # the run's own search: train through?
        timed = to_measure(rows, top, every, turn_s)
        # One padding of the vocabulary: the state moves between layouts as it is.
        if len({built[r.layout].padded_vocab for r in timed if r.layout in built}) == 1:
            cap = train_through(cfg, timed, s.budget_gb, faults=faults_from_env().steps())
    timer = timer or (lambda c, ls: time_layouts(c, ls, s.devices, built, prune=prune,
                                                 tag=s.tag, keep=handover, with_turns=True,
                                                 train_cap=cap, held=s.held))
    measure_stage(rows, top, lambda ls: timer(cfg, ls), every, turn_s)
    return _agreed_rows(f"{s.tag}/chosen", rows)


def state_floor(s: _Search, layout: Layout) -> None:
    """Raise ConfigError when the weights and optimizer state alone, sharded over every device,
    exceed what the run's devices give one (the least any layout needs: shapes only, nothing
    compiled): a search would compile every variant of every mesh to learn that."""
    budget, _, source = device_budget(s.cfg.runtime)
    n = s.cfg.parallelism.n_devices or s.devices[0]
    floor = state_bytes(Experiment.build(s.cfg, s.plan(layout), data=NoData()).abstract_state()
                        ) / n
    if floor > budget:
        raise ConfigError(
            f"parallelism=auto: the weights and optimizer state alone need "
            f"{gib_text(floor / GiB)} per device sharded over all {n} {s.devices[1]} devices, more "
            f"than {source} gives one ({gib_text(budget / GiB)}); try a smaller model or more "
            "devices")


SMALLER = (2, 4)  # the global batch divided by these, tried when no layout fits


def nothing_fits(s: _Search, rows: list[Row]) -> str:
    """The search's refusal when no layout fits, in one line: the nearest row (the least
    memory, at its most recomputation and micro-batches), and the largest smaller batch at
    which that mesh fits so (compiled: a chip's compile is the check), which a run given it
    searches again from."""
    near = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb,
               default=rows[0] if rows else None)
    batch, seq_len = s.held
    budget, _, source = device_budget(s.cfg.runtime)
    what = f"; the nearest, {near.layout.label}, {near.why}" if near and near.why else ""
    fix = "a smaller model or more devices"
    if near is not None:
        fix = next((f"data.batch_size={b}" for b in (batch // k for k in SMALLER)
                    if _fits_at(s, near.layout, b)), fix)
    n = s.cfg.parallelism.n_devices or s.devices[0]
    return (f"parallelism=auto: none of the {len(rows)} layouts of {n} {s.devices[1]} "
            f"devices fits at data.batch_size={batch}, data.seq_len={seq_len} "
            f"({source}: {gib_text(budget / GiB)} per device{what}); try {fix}")


def _fits_at(s: _Search, layout: Layout, batch: int) -> bool:
    """Does ``layout``'s mesh fit at the global ``batch``, with its recomputation and as many
    micro-batches as divide the batch (the most memory a search could save there)?"""
    for accum in sorted(ACCUMS, reverse=True):
        try:
            plan = make_plan(s.cfg, *s.devices, layout=replace(layout, grad_accum=accum),
                             batch=batch, seq_len=s.held[1])
        except ConfigError:  # the accumulation does not divide the batch
            continue
        try:
            need = step_bytes(Experiment.build(s.cfg, plan, data=NoData()).analyse_step())
        except Exception as e:  # a chip's compile refuses what does not fit it
            if not is_out_of_memory(e):
                raise
            return False
        return s.budget_gb is None or need is None or need <= s.budget_gb * GiB
    return False


def _record(s: _Search, rows: list[Row], top: int, verdict: str | None, start: str,
            handover: Handover | None, t0: float) -> dict[str, Any]:
    """The ranking's record, cached for later runs when a run searched."""
    h = handover or Handover()
    record = {"search": s.mode, "target": s.target.name, "key": s.key, "top": top,
              "rows": [r.to_json() for r in rows], "searched": verdict is None,
              "search_s": time.perf_counter() - t0, "decided_at": time.strftime("%Y-%m-%d %H:%M"),
              "init_s": h.init_s, "cached": False, "trained_steps": h.step,
              "trained_s": h.trained_s,
              "compile_s": h.exp.step.compile_time_s if h.exp is not None else 0.0}
    if verdict is not None:  # no search: the time went to deciding (startup) and to the
        # starting layout's compile (the run's own: compile)
        record.update(unsearched=verdict, start=start, search_s=0.0,
                      decide_s=record["search_s"] - record["compile_s"])
    elif is_main() and not s.plan_mode:  # a run's length is not in the key: no verdict cached
        write_cache(s.key, record)
    return record


def _refused(make: Callable[[], Any]) -> str | None:
    """The plan's refusal (``make()`` raising ConfigError), its first clause; None: accepted."""
    try:
        make()
    except ConfigError as e:
        return str(e).split(";")[0]
    return None


def _cached_doubt(s: _Search, layout: Layout, score: Score | None) -> str | None:
    """Why a cached layout cannot be this run's: the plan refuses it here (a model or a mesh
    rule changed since it was cached), or, with ``score`` (a run's: the step compiled as the
    run's own), its step no longer fits the memory preflight's budget. Plan mode passes no
    ``score``: it reports the fit itself. None: take it."""
    if (why := _refused(lambda: s.plan(layout))) is not None:
        return f"chose {layout.label}, which this run's plan refuses: {why}"
    if score is None:
        return None
    try:
        need, _ = score(layout, say=False)
    except ConfigError as e:
        return f"chose {layout.label}, which this run cannot build: {str(e).split(';')[0]}"
    except TooLarge as e:
        return f"chose {layout.label}, which no longer fits: {str(e).removeprefix('does not fit: ')}"
    if s.budget_gb is not None and need > s.budget_gb:
        return f"chose {layout.label}, which no longer fits: {gib_text(need)} of {gib_text(s.budget_gb)}"
    return None


def _scorer(s: _Search, built: dict[Layout, Any] | None = None) -> Score:
    """``score(layout)``: (GiB per device, est. seconds or None). ``built`` None: the cheaper
    analysis compile, not kept; else the run's own compile, kept in ``built`` with its
    Experiment for the measure stage or, chosen, the run."""
    def score(layout: Layout, say: bool = True) -> tuple[float, float | None]:
        plan = s.plan(layout)
        try:
            if built is None:
                exp = Experiment.build(s.cfg, plan, data=NoData())
                compiled = exp.analyse_step()  # its memory and cost figures are the run's
            else:
                exp = Experiment.build(s.cfg, plan)
                compiled = exp.compile_step()
                built[layout] = exp
        except Exception as e:  # a chip's compile refuses a program over its memory: a row
            if not is_out_of_memory(e):
                raise
            if say:
                log.info("layout search: %s does not fit: XLA refuses it (needs %s)",
                         layout.label, gib_text(xla_need(e)))
            raise TooLarge(xla_need(e)) from None
        est = step_estimate(s.cfg, exp, compiled, s.target, s.peak, xla_cost=False)
        need = (est.mem.total_bytes if est.mem is not None and s.plan_mode
                else step_bytes(compiled) or est.fp.total_bytes)
        step_s = est.est.get("step_time_s")
        if say:
            say_score(layout, need / GiB, step_s)
        return need / GiB, step_s

    return score


def _agreed_rows(key: str, rows: list[Row]) -> list[Row]:
    """Process 0's rows on every process."""
    return rows_of({"rows": agreed(key, [r.to_json() for r in rows])})
