"""The run's decision (``decide``), taken once for a run and for plan mode alike, and the layout
search it makes for ``parallelism=auto``: the fastest layout (mesh, remat, gradient
accumulation) that fits, ranked by the estimate and timed for real on the run's own data, with
its budget rule and the decision's cache. Each section's own account follows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from jax.experimental import multihost_utils
from omegaconf import OmegaConf

from dxrun.autotune.fit import NoData, device_budget, resolve_target, state_bytes, step_estimate
from dxrun.config import AXES, ConfigError
from dxrun.experiment import (
    Experiment,
    adopt,
    analysis_is_full,
    process_data,
    step_bytes,
    visible_devices,
)
from dxrun.plan.cost import GB, GiB, Target, plan_platform, save_cadence, usable_bytes
from dxrun.plan.run_plan import (
    MEASURE_ROUNDS,
    MEASURE_STEPS,
    PRUNE,
    REMATS,
    SEARCHES,
    Layout,
    MeshPlan,
    Row,
    RunPlan,
    _gib,
    _ms,
    _s,
    candidates,
    chosen_layout,
    default_seq_len,
    held_batch,
    layout_of,
    make_plan,
    measure_rule,
    measure_stage,
    model_choice,
    model_stage,
    named,
    recorded,
    resumed_layout,
    rows_of,
    saved_config,
    search_cost,
    searches,
    survivors,
    to_measure,
    train_through,
)
from dxrun.run.runtime import agree, is_main, release_freed_memory, user_cache_dir

if TYPE_CHECKING:
    from dxrun.config import RunConfig
    from dxrun.plan.run_plan import Resume


# ------------------------------------------------------------------------------------------------
# The decision cache: a layout search's record kept in the user's cache dir under what
# decides its answer, checked before it is taken.

def cache_key(cfg: RunConfig, held: tuple[int, int], n_devices: int, device_kind: str,
              jax_version: str, processes: int) -> str:
    """What decides the answer: the model's shape, the batch and sequence length held
    (``held``), precision, optimizer, devices and their kind, JAX's version, and whether it
    was measured."""
    key = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "batch": held[0], "seq_len": held[1],
           "precision": cfg.train.precision, "optimizer": cfg.optimizer.name,
           "devices": n_devices, "processes": processes, "device_kind": device_kind,
           "jax": jax_version, "measured": cfg.parallelism.search != "model",
           "top": cfg.parallelism.search_top, "target": cfg.plan.target,
           "memory_gb": cfg.runtime.memory_gb}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    return Path(user_cache_dir()) / "layouts"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


# The entries' layout: an entry written under another (by an older or newer dxrun) is decided
# again rather than read by guesswork. Raise it when a field's meaning changes.
CACHE_SCHEMA = 1


# Each axis's size: one that -1 could infer is in every row; one that cannot (context) came
# later and may be absent (1: ``layout_of``), and is checked where present.
_ROW_FIELDS = {**{a.key: int for a in AXES if a.inferable}, "remat": str, "grad_accum": int,
               "chosen": bool, "fits": bool, "why": str}


_ROW_NUMBERS = ("need_gb", "est_ms", "measured_ms")  # each a number or null


def read_cache(key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the decision cached under ``key``, None); (None, None) when there is none; (None, why)
    when the entry is in doubt (``entry_doubt``): the run decides again."""
    path = cache_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    try:
        record = json.loads(text)
    except ValueError:
        return None, "is not JSON"
    why = entry_doubt(record)
    return (None, why) if why else (record, None)


def entry_doubt(record: Any) -> str | None:
    """Why a cache entry cannot be taken as written (pure): another schema, a ranking row
    missing a field or holding the wrong type, a layout of no devices, or not exactly one
    chosen row that fits; None when every field the run and its ranking read is sound."""
    if not isinstance(record, dict):
        return "is not a decision"
    if record.get("schema") != CACHE_SCHEMA:
        return (f"was written under schema {record.get('schema')} (this dxrun reads "
                f"{CACHE_SCHEMA})")
    if record.get("search") not in SEARCHES or not isinstance(record.get("rows"), list):
        return "lacks its mode or its ranking"
    for r in record["rows"]:
        if not isinstance(r, dict):
            return "has a ranking row that is not one"
        for name, kind in {**{a.key: int for a in AXES if a.key in r}, **_ROW_FIELDS}.items():
            # bool is an int to isinstance: a size of true is as wrong as one of "2"
            if not isinstance(r.get(name), kind) or (kind is int and isinstance(r[name], bool)):
                return f"has a ranking row whose {name} is {r.get(name)!r}"
        sizes = layout_of(r).sizes
        if min(*sizes.values(), r["grad_accum"]) < 1 or r["remat"] not in REMATS:
            mesh = "x".join(str(v) for _, v in named(sizes))
            return (f"has a ranking row of no layout ({mesh}, "
                    f"remat={r['remat']}, grad_accum={r['grad_accum']})")
        for name in _ROW_NUMBERS:
            v = r.get(name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                return f"has a ranking row whose {name} is {v!r}"
        spread = r.get("spread_ms")
        if spread is not None and not (isinstance(spread, list) and len(spread) == 2 and all(
                isinstance(x, (int, float)) for x in spread)):
            return f"has a ranking row whose spread_ms is {spread!r}"
    chosen = [r for r in record["rows"] if r["chosen"]]
    if len(chosen) != 1 or not chosen[0]["fits"]:
        return f"has {len(chosen)} chosen layouts that fit, not one"
    return None


def write_cache(key: str, record: dict[str, Any]) -> None:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**record, "schema": CACHE_SCHEMA}, indent=1))
    tmp.replace(path)  # concurrent sweep jobs: the last writer wins, never a torn file


# ------------------------------------------------------------------------------------------------
# Timing layouts for real: each takes turns of a few steps on the run's own data, in rounds
# whose order alternates; every decision read off a clock is process 0's. What the turns make
# that the run can take over (the seeded init, or the state after the steps they trained) is
# left in a ``Handover``.

log = logging.getLogger("dxrun")


@dataclass
class Handover:
    """What a run's layout search made that the run takes over instead of making it again;
    each part is taken (set back to None) once the run has it, so its copy is freed."""

    exp: Experiment | None = None  # the chosen layout's compile: the run's step
    params: Any = None  # the seeded init the timing drew (host arrays, the same on any layout)
    init_s: float | None = None  # its seconds
    state: Any = None  # the run's state after the first ``step`` steps the turns trained
    step: int = 0
    trained_s: float = 0.0  # those steps' seconds


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
                     layout.label, _ms(1e3 * turns[layout][-1]), len(times), k + 1, rounds)
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


# ------------------------------------------------------------------------------------------------
# ``parallelism=auto``: the fastest layout (mesh, remat, gradient accumulation) that fits.
#
# The candidates are the meshes the plan accepts (``plan.run_plan.candidates``); the **model**
# stage compiles each from shapes (nothing allocated) and ranks the variants that fit by the
# estimate (``autotune.fit.step_estimate``) for the visible hardware or ``plan.target``; the
# **measure** stage (``parallelism.search=measure|fresh``) times the few the rules pick, in
# rounds (``autotune.search``), and the fastest wins. Before them the budget rule
# (``worth_it``) keeps a run on its start when a search would not pay. The global batch
# and sequence length are held fixed throughout (``plan.run_plan.held_batch``). The decision is
# cached (``autotune.search``) and checked before it is taken; every process takes process 0's.
# The config is read, never rewritten: each candidate is a mesh plan made for its layout.

_SEARCHES = [0]  # searches made in this process: each agrees on its own keys
Timer = Callable[[Any, list[Layout]], dict[Layout, Any]]


# Is a search worth it (``parallelism.search_budget``)? The starting layout (the preset's own: all
# devices data-parallel) is compiled first, as the run would compile it, and a search predicted
# (``plan.run_plan.search_cost``) to cost more than that fraction of the run's steps is not
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
            cap = train_through(cfg, timed, s.budget_gb)
    timer = timer or (lambda c, ls: time_layouts(c, ls, s.devices, built, prune=prune,
                                                 tag=s.tag, keep=handover, with_turns=True,
                                                 train_cap=cap, held=s.held))
    measure_stage(rows, top, lambda ls: timer(cfg, ls), every, turn_s)
    return _agreed_rows(f"{s.tag}/chosen", rows)


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
    if s.budget_gb is not None and need > s.budget_gb:
        return f"chose {layout.label}, which no longer fits: {_gib(need)} of {_gib(s.budget_gb)}"
    return None


def _scorer(s: _Search, built: dict[Layout, Any] | None = None) -> Score:
    """``score(layout)``: (GiB per device, est. seconds or None). ``built`` None: the cheaper
    analysis compile, not kept; else the run's own compile, kept in ``built`` with its
    Experiment for the measure stage or, chosen, the run."""
    def score(layout: Layout, say: bool = True) -> tuple[float, float | None]:
        plan = s.plan(layout)
        if built is None:
            exp = Experiment.build(s.cfg, plan, data=NoData())
            compiled = exp.analyse_step()  # its memory and cost figures are the run compile's
        else:
            exp = Experiment.build(s.cfg, plan)
            compiled = exp.compile_step()
            built[layout] = exp
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


# ------------------------------------------------------------------------------------------------
# The run's decision, taken once by one function for a run and for plan mode alike: the
# layout (searched for ``parallelism=auto``), the global batch and sequence length, the save
# cadence, and the checkpoint a run resumes. The validated config is read, never rewritten:
# what is derived travels in the ``RunPlan``.

# A resume's finder: the run's config as its files will record it -> the checkpoint or None.
FindResume = Callable[[dict[str, Any]], "Resume | None"]


@dataclass
class Decided:
    """``decide``'s answer, the one carrier from the decision to the loop (``prepare`` returns
    it once the resume is planned and the memory preflight passed): the plan, the experiment
    built for it (the search's compile where it made the run's), what else the search made
    that the run takes over, and the resume."""

    plan: RunPlan  # every number derived from the config: layout, batch, cadence, search
    exp: Experiment  # the built experiment, its mesh plan and data inside; exp.cfg is cfg
    # What parallelism=auto's search made that the run takes over (the seeded init its timing
    # drew, or the state after the first steps its turns trained), each part taken once.
    handover: Handover | None = None
    resume: Resume | None = None  # the checkpoint a run resumes; None: a fresh start


def decide(cfg: Any, *, plan_mode: bool = False, find_resume: FindResume | None = None
           ) -> Decided:
    """Decide the run of ``cfg`` on the devices it sees (``experiment.visible_devices``). Plan
    mode plans for ``plan.target``'s platform (``data.seq_len=null`` as a run there resolves
    it; its devices' attention kernel) and compiles nothing it would train. ``find_resume``: a
    run's resume finder, asked before a search (the checkpoint's layout is kept where it fits)."""
    devices = visible_devices(cfg.plan.target if plan_mode else None)
    platform = plan_platform(cfg.plan.target, devices[1]) if plan_mode else devices[1]
    seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    handover, searched, resume = (None if plan_mode else Handover()), None, None
    if not searches(cfg.parallelism):
        mesh = make_plan(cfg, *devices, seq_len=seq_len)  # the batch, whichever key gave it
        if find_resume is not None:
            resume = find_resume(saved_config(cfg, RunPlan(mesh)))
    else:  # parallelism=auto: the batch held fixed; a resume keeps its own layout
        held = held_batch(cfg, *devices, seq_len=seq_len)
        if cfg.data.per_device_batch_size is not None:
            log.info("parallelism=auto: the global batch is held at %d (data.per_device_"
                     "batch_size on the starting layout) while the layouts change", held[0])
        if find_resume is not None:
            resume = find_resume(OmegaConf.to_container(recorded(cfg, *held), resolve=True))
        searched = search(cfg, plan_mode=plan_mode, resumed=resumed_layout(resume),
                          handover=handover, held=held)
        mesh = make_plan(cfg, *devices, layout=searched.layout, batch=held[0],
                         seq_len=held[1])
    if handover is not None and handover.exp is not None:  # the search compiled the run's step
        exp, handover.exp = replace(handover.exp, plan=mesh), None
    else:
        exp = Experiment.build(cfg, mesh, NoData() if plan_mode else process_data(cfg, mesh))
    ck = cfg.checkpoint  # checkpoint.every=null: by platform, on an accelerator by the state
    cadence = save_cadence(ck.every, ck.every_minutes, platform,
                           state_bytes(exp.abstract_state()), cfg.plan.write_gb_per_s * GB)
    plan = RunPlan(mesh, cadence, searched.record if searched is not None else None)
    return Decided(plan, exp, handover, resume)
