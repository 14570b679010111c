"""``parallelism=auto``: the fastest layout (mesh, remat, gradient accumulation) that fits.

Three stages, each a small function:

* **candidates** (pure): every ``dp x fsdp x tp`` factorisation of the devices in use that
  ``plan.make_plan`` accepts (its own checks: heads, kv heads, d_ff, d_model, batch, hosts);
* **model**: each mesh's step compiled from shapes (plan mode's machinery, nothing allocated),
  with the user's ``model.remat`` and ``train.grad_accum`` first and, only when that does not
  fit, ``remat=dots``, ``remat=full``, then 2/4/8 micro-batches; the fitting ones ranked by plan
  mode's estimate (``plan_mode.step_estimate``) for the visible hardware or ``plan.target``;
* **measure** (``parallelism.search=measure|fresh``): the top ``parallelism.search_top``, and
  any whose estimate ties with the best's and whose step is cheap, are timed for a few real
  steps in rounds that alternate their order, the clearly slower dropped after each round (the
  three fastest always go on, until one leads the rest by ``CLEAR``); the fastest wins. On
  simulated CPU devices the estimate is each device's share of the host (the eight "devices"
  share its cores and memory bus: ``plan_mode.cpu_target``), which ranks a step that moves
  gigabytes (``model=small``: its top three by the estimate held the fastest measured) but not
  one whose time is dispatch and per-op overhead (``model=tiny``, where the roofline's first choice was
  the slowest measured of nine: BENCHMARKS.md); so every layout that fits is timed when their
  estimated steps add up to under ``parallelism.search_turn_s``, the cost of one turn.

Before them, **is it worth it** (``parallelism.search_budget``): the starting layout (the
preset's own, all devices data-parallel) is compiled first, as the run would, and a search
predicted (``search_cost``: that compile and that estimated step standing for every layout's)
to cost more than that fraction of the run's steps is not made: the run keeps its start, and
the log says so and why (the default run, 600 steps of ``model=tiny``: nine compiles and 297
steps of turns against 600 steps that take 30 s). Deciding is the run's startup, the start's
compile its compile: a run that does not search books no search time. Plan mode says the same
of the run it plans, on its target's estimate. ``parallelism.search=fresh`` asks for a search:
it searches whatever the budget.

The global batch is the user's and never changes: with ``data.per_device_batch_size`` it is
resolved once on the layout the preset names (all devices data-parallel for ``auto``). The
decision is cached in the user's cache dir (``cache_key``) with its ranking, the mode that made
it and when, so a later run that takes it says so (and calls a toss-up one); every process
takes process 0's. An entry is checked before it is taken (``entry_doubt``, ``_cached_doubt``):
in doubt, one warning names it and the run decides as if there were none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dxrun import faults
from dxrun.errors import ConfigError

log = logging.getLogger("dxrun")

SEARCHES = ("none", "measure", "model", "fresh")
REMATS = ("none", "dots", "full")  # cheapest to most recomputation
ACCUMS = (1, 2, 4, 8)
MEASURE_STEPS, MEASURE_ROUNDS = 10, 3  # timed steps per turn (at most), rounds (a turn each)
# A turn stops timing once its timed steps add up to parallelism.search_turn_s (1 s): a model
# whose step takes seconds (model=small on a 2-core host: 3-50 s) is timed by one step a turn,
# whose noise is small against its length; a step of tens of milliseconds gets up to
# MEASURE_STEPS, whose median is what separates layouts 3% apart (model=tiny at batch 64: seven
# of nine within 9%; with 3 steps a turn auto's choice measured 0.94 of the best).
PRUNE = 1.25  # after a round, a layout slower than this x the best's median is timed no more
# ...except the KEEP fastest so far, which take every round: a single one-step turn on a loaded
# host can be 1.3x off (model=small's first bench case dropped the best layout after round 1
# and chose one at 0.90 of it), and the choice is made among these few.
KEEP = 3
TIE = 1.10  # estimates this close to the best's are within the roofline's error: measure them
# ...when a step of them is cheap (estimated under parallelism.search_turn_s): a turn of a step
# that takes seconds costs two of them (the untimed first, the timed), and there the estimate
# ranks (model=small: its top three held the fastest measured at both of the bench's batches;
# its ties added two turns, 20-25 s, to a 2-core search).
# After a round, a leader this much faster than every other layout has won: no more rounds.
# The layouts a search times differ by more than this (model=small: 1.18-1.27x from the best
# to the next) or tie within the 0.95 the choice must reach (model=tiny: seven of nine in 9%).
CLEAR = 1.10


@dataclass(frozen=True)
class Layout:
    dp: int
    fsdp: int
    tp: int
    remat: str = "none"
    grad_accum: int = 1

    @property
    def mesh(self) -> str:
        """The preset-style name: ``dp4_tp2``, ``fsdp8``, ``dp2_fsdp2_tp2``, ``dp1``."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp))
                 if v > 1]
        return "_".join(parts) or "dp1"

    @property
    def label(self) -> str:
        extra = [f"remat={self.remat}"] * (self.remat != "none") + [
            f"accum={self.grad_accum}"] * (self.grad_accum > 1)
        return " ".join([self.mesh, *extra])

    def overrides(self) -> dict[str, Any]:
        return {"parallelism": {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp},
                "model": {"remat": self.remat}, "train": {"grad_accum": self.grad_accum}}


def with_layout(cfg: Any, layout: Layout) -> Any:
    """A copy of ``cfg`` laid out as ``layout``: each candidate of the search, and the config a
    run follows once ``layout`` is chosen, which holds it as ordinary keys (W&B and sweeps
    group by them). ``cfg`` itself is never rewritten."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg, layout.overrides())


def factorisations(n: int) -> list[tuple[int, int, int]]:
    """Every (dp, fsdp, tp) with dp * fsdp * tp = n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [(n // (f * t), f, t) for t in divisors for f in divisors if (n // t) % f == 0]


def candidates(cfg: Any, n_visible: int, platform: str, processes: int = 1,
               process_hosts: tuple[int, ...] | None = None
               ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(meshes the plan accepts, [(mesh, why the plan refuses it)]), each with the user's remat
    and accumulation. Pure: ``plan.make_plan`` is the one place the rules live."""
    from dxrun.plan import make_plan

    n = cfg.parallelism.n_devices or n_visible
    ok, refused = [], []
    for dp, fsdp, tp in factorisations(n):
        layout = Layout(dp, fsdp, tp, cfg.model.remat, cfg.train.grad_accum)
        try:
            make_plan(with_layout(cfg, layout), n_visible, platform, processes, process_hosts)
        except ConfigError as e:
            refused.append((layout, str(e).split(";")[0]))
            continue
        ok.append(layout)
    return ok, refused


def fit_variants(layout: Layout) -> list[Layout]:
    """The mesh with the user's remat and accumulation, then more recomputation, then more
    micro-batches (the same update): tried in order until one fits."""
    out = [layout]
    for remat in REMATS[REMATS.index(layout.remat) + 1:]:
        out.append(replace(layout, remat=remat))
    last = out[-1]
    out += [replace(last, grad_accum=a) for a in ACCUMS if a > last.grad_accum]
    return out


@dataclass
class Row:
    """One line of the ranking."""

    layout: Layout
    need_gb: float | None = None  # GiB per device
    est_ms: float | None = None
    measured_ms: float | None = None
    chosen: bool = False
    fits: bool = False  # compiled and within the memory budget
    why: str = ""  # why it lost (or was never a candidate)
    spread_ms: list[float] | None = None  # [fastest, slowest] of its turns (two or more)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.layout), "mesh": self.layout.mesh, "need_gb": self.need_gb,
                "est_ms": self.est_ms, "measured_ms": self.measured_ms, "chosen": self.chosen,
                "fits": self.fits, "why": self.why, "spread_ms": self.spread_ms}


def model_stage(cfg: Any, layouts: list[Layout], budget_gb: float | None,
                score: Callable[[Any, Layout], tuple[float, float | None]]) -> list[Row]:
    """Each mesh at its first variant that fits, ranked by estimated step time (fastest
    first; those that fit nowhere last). ``score(trial_cfg, layout)``: (GB per device, est.
    seconds or None) of one candidate; ``budget_gb`` None: fit by the score's own verdict
    (a plan target's usable memory, passed as a negative need)."""
    rows = []
    for base in layouts:
        row = Row(base)
        for layout in fit_variants(base):
            try:
                need, est = score(with_layout(cfg, layout), layout)
            except ConfigError as e:  # e.g. accumulation not dividing the per-replica batch
                row.why = row.why or str(e).split(";")[0]
                continue
            if budget_gb is not None and need > budget_gb:
                if row.need_gb is None:
                    row.need_gb = need
                    row.why = f"does not fit: {_gib(need)} of {_gib(budget_gb)}"  # MiB if small
                continue
            row = Row(layout, need, None if est is None else 1e3 * est, fits=True)
            break
        rows.append(row)
    return sorted(rows, key=lambda r: (not r.fits, r.est_ms if r.est_ms is not None else 0.0))


def time_every(rows: list[Row], budget_s: float) -> bool:
    """On simulated CPU devices: time every layout that fits? When one step of each, by the
    estimates, adds up to less than ``budget_s`` (a turn's time): the steps are cheap, and
    their time is overhead the estimate does not rank."""
    est = [r.est_ms for r in rows if r.fits]
    return all(e is not None for e in est) and sum(est) < 1e3 * budget_s


def measure_rule(rows: list[Row], turn_s: float, simulated: bool) -> tuple[bool, float | None]:
    """(time every layout that fits?, ``prune`` between rounds). On simulated CPU devices whose
    steps are cheap (``time_every``) every layout takes every round: they lie within a few
    percent and one turn on a shared host can be 1.3x off, so a prune after round 1 dropped
    the best (model=tiny at batch 64: fsdp8's first turn 102 ms, its median over the bench's
    four rounds 79.7 ms, the best of nine); their rounds cost about a second a layout.
    Otherwise the top few by the estimate, the clearly slower dropped after each round."""
    every = simulated and time_every(rows, turn_s)
    return every, None if every else PRUNE


def to_measure(rows: list[Row], top: int, every: bool = False,
               turn_s: float = float("inf")) -> list[Row]:
    """The fitting rows the measure stage times: the first ``top`` and any whose estimate is
    within ``TIE`` of the best's and under ``turn_s`` seconds (``every``: all that fit)."""
    fitting = [r for r in rows if r.fits]
    if every or not fitting or fitting[0].est_ms is None:
        return fitting if every else fitting[:top]
    return [r for i, r in enumerate(fitting)
            if i < top or (r.est_ms is not None and r.est_ms <= TIE * fitting[0].est_ms
                           and r.est_ms < 1e3 * turn_s)]


def train_budget(cfg: Any) -> int:
    """Steps a search may train for the run: those before the first at which the run's loop
    does more than step (a log row, an evaluation, a save, a trace, a test's hook), so that a
    run whose first steps the search trained writes what one that did not would."""
    t, every = cfg.train, cfg.checkpoint.every
    points = [t.steps, t.log_every, t.eval_every, 100 if every is None else every,
              t.profile.start, *faults.from_env().steps()]
    return min(p for p in points if p and p > 0) - 1


def train_through(cfg: Any, timed: list[Row], budget_gb: float | None = None,
                  rounds: int = MEASURE_ROUNDS) -> int:
    """Timed steps a turn may take when the search's turns train the run's first steps (0: they
    do not; ``time_layouts``'s ``train_cap``): when every turn, however the rounds go, fits in
    ``train_budget`` at up to ``MEASURE_STEPS`` timed steps, or at one when each step is
    estimated to take a turn's time (``parallelism.search_turn_s``: one timed step a turn
    anyway). A cheap step timed in turns of ten (``model=tiny``: 27 turns of 11 steps) is
    timed on fresh states, as before; so are layouts two of whose steps exceed ``budget_gb``
    (GiB per device): a move between layouts holds the state twice (on an accelerator, a
    layout that fits at 60% of the memory does not move)."""
    if budget_gb is not None and 2 * max((r.need_gb or 0.0 for r in timed),
                                         default=0.0) > budget_gb:
        return 0
    per_turn = train_budget(cfg) // max(1, rounds * len(timed))
    if per_turn < 2:
        return 0
    slow = all(r.est_ms is not None and r.est_ms >= 1e3 * cfg.parallelism.search_turn_s
               for r in timed)
    return min(MEASURE_STEPS, per_turn - 1) if per_turn > MEASURE_STEPS or slow else 0


def search_cost(cfg: Any, start: Row, n: int, compile_s: float, simulated: bool
                ) -> tuple[float, int, float]:
    """(seconds a search of ``n`` layouts is predicted to add to a run, the steps of its turns
    that do not train the run, the seconds of the run's ``train.steps``), the starting layout's
    figures standing for every layout's: its compile (``compile_s``, the run's own; each other
    layout one more) and its estimated step (``start.est_ms``), timed as ``measure_rule``,
    ``to_measure`` and ``train_through`` would time ``n`` layouts estimated alike, every round
    taken. An estimate below the measured step (simulated CPU devices: ``model=tiny``'s 17 ms
    against 50 ms) makes the run look shorter against the compiles: it errs to not searching.
    The memory a move between layouts holds is not counted: the start, every weight replicated
    over the data replicas, overstates the others' (``model=small``: dp8 1.40 GiB a device,
    the layouts its search timed 0.92-1.05)."""
    step_s = start.est_ms / 1e3
    turn_s = cfg.parallelism.search_turn_s
    rows = [replace(start) for _ in range(n)]
    every, _ = measure_rule(rows, turn_s, simulated)
    timed = to_measure(rows, cfg.parallelism.search_top, every, turn_s)
    timed_steps = min(MEASURE_STEPS, max(1, math.ceil(turn_s / step_s)))  # a turn stops there
    steps = (0 if train_through(cfg, timed)
             else MEASURE_ROUNDS * len(timed) * (1 + timed_steps))
    return (n - 1) * compile_s + steps * step_s, steps, cfg.train.steps * step_s


def measure_stage(rows: list[Row], top: int, timer: Callable[[list[Layout]], dict[Layout, Any]],
                  every: bool = False, turn_s: float = float("inf")) -> Row:
    """Time the rows ``to_measure`` picks (``timer``: layout -> seconds per step, or the list
    of its turns' seconds, whose median ranks and whose range is its spread) and mark the
    fastest chosen; the others say why they lost."""
    timed = to_measure(rows, top, every, turn_s)
    if not timed:
        raise ConfigError("parallelism=auto: no layout fits the device memory; try a smaller "
                          "model or data.batch_size, or a larger runtime.memory_gb")
    times = timer([r.layout for r in timed]) if len(timed) > 1 else {}
    for r in timed:
        t = times.get(r.layout)
        turns = [1e3 * x for x in (t if isinstance(t, (list, tuple)) else [] if t is None
                                   else [t])]
        r.measured_ms = statistics.median(turns) if turns else None
        r.spread_ms = [min(turns), max(turns)] if len(turns) > 1 else None
    best = min(timed, key=lambda r: r.measured_ms if r.measured_ms is not None else 0.0)
    return _choose(rows, best, len(timed))


def model_choice(rows: list[Row], top: int = 0) -> Row:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise ConfigError("parallelism=auto: no layout fits the device memory; try a smaller "
                          "model or data.batch_size, or a larger runtime.memory_gb")
    return _choose(rows, fitting[0], top)


def _choose(rows: list[Row], best: Row, top: int) -> Row:
    best.chosen, best.why = True, ""
    for r in rows:
        if r is best or r.why:
            continue
        if r.measured_ms is not None and best.measured_ms is not None:
            r.why = f"slower: {_ms(r.measured_ms)} ms measured"
            if overlaps(r.spread_ms, best.spread_ms):
                r.why += (f", not distinguishable (turns {_ms(r.spread_ms[0])}-"
                          f"{_ms(r.spread_ms[1])}, chosen {_ms(best.spread_ms[0])}-"
                          f"{_ms(best.spread_ms[1])})")
        elif r.est_ms is not None and best.est_ms is not None:
            r.why = (f"slower: {_ms(r.est_ms)} ms estimated"
                     + (f" (not in the top {top} measured)" if top and best.measured_ms else ""))
        else:
            r.why = "not measured"
    return best


def overlaps(spread_ms: list[float] | None, chosen_ms: list[float] | None) -> bool:
    """Does a layout's spread of turns reach into the chosen one's? A turn of it was as fast as
    one of the chosen's: on this host the two are within each other's noise, and the choice
    between them is a toss-up."""
    return bool(spread_ms and chosen_ms and spread_ms[0] <= chosen_ms[1])


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record's rows in the order the ranking is read: the chosen layout first, then those
    timed by their measured median, then those that fit by their estimate, then the rest (do
    not fit, refused, not searched) as the record holds them. The record keeps the model
    stage's order (estimated fastest first), which the bench reads."""
    def place(r: dict[str, Any]) -> tuple[int, float]:
        if r["chosen"]:
            return 0, 0.0
        if r["measured_ms"] is not None:
            return 1, r["measured_ms"]
        if r["fits"] and r["est_ms"] is not None:
            return 2, r["est_ms"]
        return 3, 0.0

    return sorted(rows, key=place)


def toss_up(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed rows not distinguishable from the chosen one (``overlaps``): with any, the
    choice was a toss-up among them."""
    chosen = next(r for r in rows if r["chosen"])
    return [r for r in rows if not r["chosen"] and r["measured_ms"] is not None
            and overlaps(r.get("spread_ms"), chosen.get("spread_ms"))]


def table(record: dict[str, Any], run: bool = True) -> str:
    """The ranking as the log prints it after the mesh plan: first what happened (searched, or
    why not: a run too short for a search to pay, a decision cached by an earlier run, a
    resumed layout), a toss-up called one, then the layouts, the chosen first. ``run``: a run's
    (False: plan mode's, which books no time)."""
    chosen = chosen_layout(record)
    if record.get("search") == "resume":
        return f"  no layout search: {chosen.label}, the layout of the checkpoint the run resumes"
    if record.get("unsearched"):  # the others never compiled (plan.json lists them)
        who = "the run keeps" if run else "the planned run keeps"
        booked = " (goodput's startup)" if run else ""
        return (f"  no layout search: {who} its starting layout, {chosen.label} "
                f"({record['start']}); deciding took {record['decide_s']:.1f} s{booked}\n"
                f"  why: {record['unsearched']}")
    rows = ranked(record["rows"])
    cached = bool(record.get("cached"))
    if cached:
        when = f" on {record['decided_at']}" if record.get("decided_at") else ""
        first = (f"  no layout search: {chosen.label}, the decision a parallelism.search="
                 f"{record['decided_by']} run cached{when}, taken by this "
                 f"{'run' if run else 'plan'}'s parallelism.search={record['search']} "
                 "(parallelism.search=fresh searches again)")
    else:
        first = _searched_line(record)
    tossed = _toss_up_line(rows, chosen, cached)
    return "\n".join([first, *([tossed] if tossed else []), *_columns(rows)])


def _searched_line(record: dict[str, Any]) -> str:
    """The first line of a search's ranking: its mode, target and seconds, and what of them
    the run would have spent anyway."""
    parts = []
    if record.get("init_s"):
        parts.append(f"{record['init_s']:.1f} s of it the seeded init the run starts from")
    if record.get("compile_s"):
        parts.append(f"{record['compile_s']:.1f} s the compile of the layout it runs")
    if record.get("trained_steps"):
        parts.append(f"{record['trained_s']:.1f} s the run's steps 1-"
                     f"{record['trained_steps']} trained in the turns")
    source = f" ({', '.join(parts)}: {own_s(record):.1f} s the search's own)" if parts else ""
    return (f"  layout search: parallelism.search={record['search']}, estimate for "
            f"{record['target']}, {record['search_s']:.1f} s{source}")


def _toss_up_line(rows: list[dict[str, Any]], chosen: Layout, cached: bool) -> str | None:
    """One plain line when the choice was a toss-up (``toss_up``), else None; ``cached``: said
    of the search that cached it, which this run does not repeat."""
    tied = toss_up(rows)
    if not tied:
        return None
    n, others = len(tied), sum(r["measured_ms"] is not None for r in rows) - 1
    names = ", ".join(Layout(r["dp"], r["fsdp"], r["tp"], r["remat"], r["grad_accum"]).label
                      for r in tied)
    which = ("the other layout timed" if others == 1 else f"all {n} other layouts timed"
             if n == others else f"{n} of the {others} other layouts timed")
    verb = ("was" if n == 1 else "were") if cached else ("is" if n == 1 else "are")
    return (f"  a toss-up{' when it was timed' if cached else ''}: {which} ({names}) {verb} not "
            f"distinguishable from {chosen.label} on {'that' if cached else 'this'} host; it was "
            f"taken for its median{', and is not timed again' if cached else ''}")


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """The ranking's rows as aligned columns, under their header."""
    head = ("layout", "per device", "est ms", "measured ms", "", "why not")
    lines = [head]
    for r in rows:
        layout = Layout(r["dp"], r["fsdp"], r["tp"], r["remat"], r["grad_accum"])
        lines.append((layout.label, _gib(r["need_gb"]),
                      _ms(r["est_ms"]), _ms(r["measured_ms"]), "✓" if r["chosen"] else "",
                      r["why"]))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]


def own_s(record: dict[str, Any]) -> float:
    """Seconds of a search that a run without one would not spend: less the seeded init, the
    chosen layout's compile and the steps it trained, all of which the run takes over (what
    goodput books as ``search``). 0 where the run did not search (too short for one to pay, a
    cached decision, a resumed layout): deciding that is the run's startup, and the compile
    of the layout it runs its compile."""
    if not record.get("searched", True):
        return 0.0
    return record["search_s"] - sum(record.get(k) or 0.0
                                    for k in ("init_s", "compile_s", "trained_s"))


def _gib(v: float | None) -> str:
    if v is None:
        return "-"
    # One unit below 1 GiB (a column read down: 8.1 MiB above 11.3 MiB, never 0.01 GiB).
    return f"{v:.2f} GiB" if v >= 1 else f"{v * 1024:.1f} MiB"


def _s(v: float) -> str:
    """Seconds in a sentence: whole above one (41 s), two digits below (a planned GPU run's
    0.0048 s)."""
    return f"{v:.0f}" if v >= 1 else f"{v:.2g}"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 1 else f"{v:.3f}"  # an accelerator's tiny step: sub-ms


def markdown(record: dict[str, Any]) -> str:
    """The ranking as a Markdown table (the docs' auto section)."""
    out = ["| layout | per device | est ms | measured ms | chosen | why not |",
           "|---|---|---|---|---|---|"]
    for r in ranked(record["rows"]):
        layout = Layout(r["dp"], r["fsdp"], r["tp"], r["remat"], r["grad_accum"])
        need = _gib(r["need_gb"])
        out.append(f"| {layout.label} | {need} | {_ms(r['est_ms'])} | {_ms(r['measured_ms'])} "
                   f"| {'✓' if r['chosen'] else ''} | {r['why']} |")
    return "\n".join(out)


# --- the cache ---------------------------------------------------------------------------------

def cache_key(cfg: Any, n_devices: int, device_kind: str, jax_version: str,
              processes: int) -> str:
    """What decides the answer: the model's shape, batch, seq_len, precision, optimizer,
    devices and their kind, JAX's version, and whether it was measured."""
    from omegaconf import OmegaConf

    key = {"model": OmegaConf.to_container(cfg.model, resolve=True),
           "batch": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
           "precision": cfg.train.precision, "optimizer": cfg.optimizer.name,
           "devices": n_devices, "processes": processes, "device_kind": device_kind,
           "jax": jax_version, "measured": cfg.parallelism.search != "model",
           "top": cfg.parallelism.search_top, "target": cfg.plan.target,
           "memory_gb": cfg.runtime.memory_gb}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    from dxrun.runtime import user_cache_dir

    return Path(user_cache_dir()) / "layouts"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


# The entries' layout: an entry written under another (by an older or newer dxrun) is decided
# again rather than read by guesswork. Raise it when a field's meaning changes.
CACHE_SCHEMA = 1
_ROW_FIELDS = {"dp": int, "fsdp": int, "tp": int, "remat": str, "grad_accum": int,
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
        for name, kind in _ROW_FIELDS.items():
            # bool is an int to isinstance: a size of true is as wrong as one of "2"
            if not isinstance(r.get(name), kind) or (kind is int and isinstance(r[name], bool)):
                return f"has a ranking row whose {name} is {r.get(name)!r}"
        if min(r["dp"], r["fsdp"], r["tp"], r["grad_accum"]) < 1 or r["remat"] not in REMATS:
            return (f"has a ranking row of no layout ({r['dp']}x{r['fsdp']}x{r['tp']}, "
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


def chosen_layout(record: dict[str, Any]) -> Layout:
    r = next(r for r in record["rows"] if r["chosen"])
    return Layout(r["dp"], r["fsdp"], r["tp"], r["remat"], r["grad_accum"])


# --- the search in a run or in plan mode ---------------------------------------------------------

_SEARCHES = [0]  # searches made in this process: each agrees on its own keys


def search(cfg: Any, plan_mode: bool = False,
           timer: Callable[[Any, list[Layout]], dict[Layout, float]] | None = None,
           resumed: Layout | None = None,
           handover: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Choose the layout (``parallelism.search``; plan mode: from the estimate alone) and return
    the ranking's record (None: no search); ``cfg`` is read, never rewritten: the run follows
    ``with_layout(fixed_batch(cfg, devices), chosen_layout(record))``. ``timer(cfg, layouts)``:
    seconds per step of each layout, or its turns' (default ``time_layouts``'s turns).
    ``resumed``: the layout of the checkpoint a run resumes, kept (no search) where the plan
    accepts it on these devices, else chosen again as for a new run. ``handover``:
    filled with what the run takes over instead of making it again: ``params``, the seeded
    init the timing drew (host arrays; the same bits on every layout), and ``init_s``, its
    seconds; or, where the turns trained the run (``train_through``), ``state`` after its
    first ``step`` steps and ``trained_s``, their seconds. Every process takes process 0's."""
    import jax

    from dxrun.capacity import plan_mode as pm
    from dxrun.capacity.preflight import device_budget
    from dxrun.experiment import visible_devices
    from dxrun.multihost.distributed import is_main
    from dxrun.plan import make_plan

    mode = cfg.parallelism.search
    if mode == "none":
        return None
    t0 = time.perf_counter()
    devices = visible_devices()
    if resumed is not None:
        n, size = cfg.parallelism.n_devices or devices[0], resumed.dp * resumed.fsdp * resumed.tp
        why = (f"its {size} devices are not this run's {n}" if size != n
               else _refused(with_layout(cfg, resumed), devices))
        if why is None:
            row = Row(resumed, chosen=True, fits=True, why="")
            return {"search": "resume", "target": "the checkpoint's layout", "top": 0,
                    "rows": [row.to_json()], "searched": False, "cached": False,
                    "search_s": 0.0, "decide_s": time.perf_counter() - t0}
        # Resume on any mesh: Orbax reshards the checkpoint onto whatever is chosen here.
        log.info("parallelism=auto: the checkpoint's layout %s does not fit this run (%s); "
                 "choosing again as a new run would, the checkpoint resharded onto the choice",
                 resumed.label, why)
    cfg = fixed_batch(cfg, devices)  # the candidates' batch and sequence length
    _SEARCHES[0] += 1
    tag = f"layout_search/{_SEARCHES[0]}"  # this search's keys in the processes' agreement
    n = cfg.parallelism.n_devices or devices[0]
    key = cache_key(cfg, n, jax.devices()[0].device_kind, jax.__version__, devices[2])
    fresh = mode == "fresh"  # a search asked for: no cached decision, whatever the budget
    mode = "model" if plan_mode else mode
    target, peak = pm.resolve_target(cfg, n)
    if plan_mode:  # the target's usable memory, as plan mode's fit
        budget_gb = pm.usable_bytes(target) / pm.GiB if target.memory_bytes else None
    else:  # the memory preflight's budget
        budget_gb = device_budget(cfg)[0] / pm.GiB
    cached, doubt = read_cache(key) if not fresh and is_main() else (None, None)
    checked: dict[Layout, Any] = {}  # the cached layout's compile, the run's step if taken
    if cached is not None:  # planned and, for a run, fitted before it is taken
        doubt = _cached_doubt(cfg, chosen_layout(cached), devices,
                              None if plan_mode else _scorer(devices, target, peak, False,
                                                             checked), budget_gb)
    cached, doubt = _agreed(f"{tag}/cache", [cached, doubt])
    if doubt:
        log.warning("parallelism=auto: the cached decision %s %s; deciding again as if there "
                    "were none (parallelism.search=fresh searches again and replaces it)",
                    cache_path(key), doubt)
    elif cached is not None:  # an earlier run's decision: this run searches nothing
        chosen = chosen_layout(cached)
        if handover is not None and chosen in checked:  # its compile: the run's step
            handover["exp"] = checked.pop(chosen)
        return {**cached, "search": mode, "decided_by": cached["search"], "cached": True,
                "searched": False, "search_s": 0.0, "decide_s": time.perf_counter() - t0,
                "init_s": None, "trained_steps": 0, "trained_s": 0.0, "compile_s": 0.0}
    layouts, refused = candidates(cfg, *devices)
    if not layouts:  # the plan refuses every layout (more devices than there are...): its words
        make_plan(cfg, *devices)
    # A search that measures keeps each candidate's full compile for its timing: one compile
    # per candidate, whose memory and cost figures are the analysis compile's.
    built: dict[Layout, Any] | None = {} if mode in ("measure", "fresh") else None
    score = _scorer(devices, target, peak, plan_mode, built)
    budget = None if fresh else cfg.parallelism.get("search_budget")
    unsearched, verdict, start = None, None, ""
    if budget is not None:  # would the run's search pay? (plan mode: the planned run's)
        score, unsearched, start = _worth_it(cfg, layouts, score, budget, budget_gb, devices,
                                             tag, target.name)
    top = cfg.parallelism.search_top
    if unsearched is not None:  # the start, chosen; the others never compiled
        verdict, unsearched.why, top = unsearched.why, "", 0
        rows = [unsearched] + [Row(x, why="not searched") for x in layouts
                               if x != unsearched.layout]
    else:
        rows = model_stage(cfg, layouts, budget_gb, score)
        # Process 0's ranking (memory readings differ per process): every process measures
        # the same candidates in the same order.
        rows = _agreed_rows(f"{tag}/rows", rows)
    if unsearched is None and mode == "model":
        model_choice(rows, top=0)
    elif unsearched is None:
        built = {r.layout: built[r.layout] for r in rows if r.fits and r.layout in built}
        turn_s = cfg.parallelism.search_turn_s
        every, prune = measure_rule(rows, turn_s, devices[1] == "cpu")
        cap = 0
        if handover is not None and devices[2] == 1:  # the run's own search: train through?
            timed = to_measure(rows, top, every, turn_s)
            # One padding of the vocabulary: the state moves between layouts as it is.
            if len({built[r.layout].padded_vocab for r in timed if r.layout in built}) == 1:
                cap = train_through(cfg, timed, budget_gb)
        timer = timer or (lambda c, ls: time_layouts(c, ls, devices, built, prune=prune, tag=tag,
                                                     keep=handover, with_turns=True,
                                                     train_cap=cap))
        measure_stage(rows, top, lambda ls: timer(cfg, ls), every, turn_s)
        rows = _agreed_rows(f"{tag}/chosen", rows)
    chosen = next(r.layout for r in rows if r.chosen)
    if handover is not None and built and chosen in built:  # its compile: the run's step
        handover["exp"] = built.pop(chosen)
    if built:
        built.clear()
    rows += [Row(layout, why=why) for layout, why in refused]
    record = {"search": mode, "target": target.name, "key": key, "top": top,
              "rows": [r.to_json() for r in rows], "searched": verdict is None,
              "search_s": time.perf_counter() - t0, "decided_at": time.strftime("%Y-%m-%d %H:%M"),
              "init_s": (handover or {}).get("init_s"), "cached": False,
              "trained_steps": (handover or {}).get("step", 0),
              "trained_s": (handover or {}).get("trained_s", 0.0),
              "compile_s": _compile_s(handover)}
    if verdict is not None:  # no search: the time went to deciding (startup) and to the
        # starting layout's compile (the run's own: compile)
        record.update(unsearched=verdict, start=start, search_s=0.0,
                      decide_s=record["search_s"] - record["compile_s"])
    elif is_main() and not plan_mode:  # a run's length is not in the key: no verdict cached
        write_cache(key, record)
    return record


def searches(cfg: Any) -> bool:
    """Does this run search? ``parallelism.search`` is not ``none`` and no axis was named: a run
    that sets ``parallelism.dp``, ``fsdp`` or ``tp`` on ``auto`` (the default preset:
    ``python -m dxrun parallelism.tp=2``) takes that layout as given, as a named preset does."""
    p = cfg.parallelism
    return p.search != "none" and (p.dp, p.fsdp, p.tp) == (-1, 1, 1)


def start_layout(cfg: Any, devices: tuple) -> Layout | None:
    """The layout the run would take unsearched: the preset's own (``parallelism=auto``: every
    device data-parallel); None where the plan refuses it (the batch does not divide...)."""
    from dxrun.plan import make_plan

    try:
        plan = make_plan(cfg, *devices)
    except ConfigError:
        return None
    return Layout(plan.dp, plan.fsdp, plan.tp, cfg.model.remat, cfg.train.grad_accum)


def _refused(trial: Any, devices: tuple) -> str | None:
    """The plan's refusal of ``trial`` on ``devices``, its first clause; None: accepted."""
    from dxrun.plan import make_plan

    try:
        make_plan(trial, *devices)
    except ConfigError as e:
        return str(e).split(";")[0]
    return None


def _cached_doubt(cfg: Any, layout: Layout, devices: tuple, score: Callable | None,
                  budget_gb: float | None) -> str | None:
    """Why a cached layout cannot be this run's: the plan refuses it here (a model or a mesh
    rule changed since it was cached), or, with ``score`` (a run's: the step compiled as the
    run's own), its step no longer fits ``budget_gb`` (the memory preflight's). Plan mode
    passes no ``score``: it reports the fit itself. None: take it."""
    trial = with_layout(cfg, layout)
    if (why := _refused(trial, devices)) is not None:
        return f"chose {layout.label}, which this run's plan refuses: {why}"
    if score is None:
        return None
    try:
        need, _ = score(trial, layout, say=False)
    except ConfigError as e:
        return f"chose {layout.label}, which this run cannot build: {str(e).split(';')[0]}"
    if budget_gb is not None and need > budget_gb:
        return f"chose {layout.label}, which no longer fits: {_gib(need)} of {_gib(budget_gb)}"
    return None


def _worth_it(cfg: Any, layouts: list[Layout], score: Callable, budget: float,
              budget_gb: float | None, devices: tuple, tag: str, target: str
              ) -> tuple[Callable, Row | None, str]:
    """(the scorer, with the starting layout's score kept for the model stage; the starting
    layout's row, chosen, its ``why`` the reason, when a search would cost more than ``budget``
    of the run (``search_cost``), else None; what the start is: "all devices data-parallel").
    The start is scored first: its compile is the run's own either way, and its time is what
    each other layout's compile is predicted to take. ``target``: the estimate's, named in the
    reason. Process 0's verdict on every process."""
    start, verdict = start_layout(cfg, devices), None
    what = "all devices data-parallel"
    if start not in layouts and layouts:  # e.g. a batch the devices do not divide
        start, what = layouts[0], "the first layout the plan accepts"
    if len(layouts) > 1:
        t = time.perf_counter()
        need, est = score(with_layout(cfg, start), start, say=False)
        compile_s = time.perf_counter() - t
        kept = {start: (need, est)}
        score = (lambda trial, layout, inner=score: kept.pop(layout) if layout in kept
                 else inner(trial, layout))
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
    verdict = _agreed(f"{tag}/budget", verdict)
    if verdict is None:
        if len(layouts) > 1:
            _say(start, need, est)  # the model stage's first
        return score, None, what
    return score, Row(start, need, 1e3 * est, chosen=True, fits=True, why=verdict), what


def _compile_s(handover: dict[str, Any] | None) -> float:
    """Seconds of the search that were the compile of the layout the run takes over."""
    exp = (handover or {}).get("exp")
    return exp.step.compile_time_s if exp is not None else 0.0


def _agreed_rows(key: str, rows: list[Row]) -> list[Row]:
    """Process 0's rows on every process."""
    return rows_of({"rows": _agreed(key, [r.to_json() for r in rows])})


def rows_of(record: dict[str, Any]) -> list[Row]:
    """A record's ranking rows (as ``plan.json`` holds them), in the ranking's order."""
    out = []
    for r in record["rows"]:
        layout = Layout(r["dp"], r["fsdp"], r["tp"], r["remat"], r["grad_accum"])
        out.append(Row(layout, r["need_gb"], r["est_ms"], r["measured_ms"], r["chosen"],
                       r["fits"], r["why"], r.get("spread_ms")))
    return out


def fixed_batch(cfg: Any, devices: tuple) -> Any:
    """A copy of ``cfg`` with ``data.seq_len`` resolved (null: the platform's) and, with
    ``data.per_device_batch_size``, the global batch resolved once, on the preset's own layout:
    held fixed while the layouts change (a search never changes the update). Resolving a copy
    that is already fixed changes nothing."""
    import copy

    from dxrun.batch import default_seq_len
    from dxrun.plan import make_plan

    out = copy.deepcopy(cfg)
    out.data.seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, devices[1])
    if cfg.data.per_device_batch_size is None:
        return out
    batch = make_plan(out, *devices).global_batch
    out.data.per_device_batch_size = None
    out.data.batch_size = batch
    log.info("parallelism=auto: the global batch is held at %d (data.per_device_batch_size "
             "on the starting layout) while the layouts change", batch)
    return out


def _scorer(devices: tuple, target: Any, peak: float | None, plan_mode: bool,
            built: dict[Layout, Any] | None = None
            ) -> Callable[[Any, Layout], tuple[float, float | None]]:
    """``built`` None: the cheaper analysis compile, not kept; else the run's own compile,
    kept in ``built`` with its Experiment for the measure stage."""
    def score(trial: Any, layout: Layout, say: bool = True) -> tuple[float, float | None]:
        from dxrun.capacity import plan_mode as pm
        from dxrun.experiment import Experiment
        from dxrun.plan import make_plan
        from dxrun.step import step_bytes

        plan = make_plan(trial, *devices)
        if built is None:
            exp = Experiment.build(trial, plan, data=pm._NoData())
            compiled = exp.analyse_step()  # its memory and cost figures are the run compile's
        else:
            exp = Experiment.build(trial, plan)
            compiled = exp.compile_step()
            built[layout] = exp
        s = pm.step_estimate(trial, exp, compiled, target, peak, xla_cost=False)
        need = (s.mem.total_bytes if s.mem is not None and plan_mode
                else step_bytes(compiled) or s.fp.total_bytes)
        est = s.est.get("step_time_s")
        if say:
            _say(layout, need / pm.GiB, est)
        return need / pm.GiB, est

    return score


def _say(layout: Layout, need_gb: float, est_s: float | None) -> None:
    """A candidate's score in the log as the model stage takes it (a compile takes seconds)."""
    log.info("layout search: %s needs %.3f GiB per device, est. %s ms", layout.label, need_gb,
             _ms(None if est_s is None else 1e3 * est_s))


def time_layouts(cfg: Any, layouts: list[Layout], devices: tuple,
                 built: dict[Layout, Any] | None = None, rounds: int = MEASURE_ROUNDS,
                 prune: float | None = PRUNE, tag: str = "layout_search",
                 keep: dict[str, Any] | None = None, with_turns: bool = False,
                 train_cap: int = 0) -> dict[Layout, Any]:
    """Seconds per step of each layout (the median of its turns; ``with_turns``: the list of
    its turns' medians, for the ranking's spread): ``rounds`` rounds in which
    each layout takes a turn (``_turn``: up to ``MEASURE_STEPS`` timed steps) on the run's own
    data, the order reversed every other round so that drift on a shared host falls on all
    alike. With ``prune``, after each round only ``survivors`` go on (the ``KEEP`` fastest and
    any within ``prune`` x the best): the rounds go to the close ones. ``built``: Experiments
    already compiled (the model stage's).
    One seeded init is copied into each layout's shardings at its turn and freed after it:
    one init program, and only one layout's state alive at a time (each has to fit alone);
    ``keep["params"]`` gets it, for the run to start from (``model=small``: 7-10 s not drawn
    twice).
    ``train_cap`` (``train_through``; needs ``keep``): the turns train the run's first steps
    instead, each at most ``train_cap`` timed steps: one state carried from layout to layout
    on the run's batches in order, left in ``keep["state"]`` after ``keep["step"]`` steps of
    ``keep["trained_s"]`` seconds, from which the run goes on (the steps a search times are
    not thrown away: ``model=small``'s turns are steps of 10-19 s on a 2-core host).
    Several processes run every step together (each is one collective program), so every
    decision read off a clock (when a turn stops, who survives a round) is process 0's, agreed
    under keys beginning ``tag``: each process's own clock would stop its turn at another step
    and leave the others waiting in a collective for ever."""
    import jax
    from jax.experimental import multihost_utils

    from dxrun.experiment import Experiment
    from dxrun.plan import make_plan
    from dxrun.runtime import release_freed_memory

    exps = {}
    for layout in layouts:
        trial = with_layout(cfg, layout)
        exps[layout] = (built or {}).get(layout) or Experiment.build(trial,
                                                                      make_plan(trial, *devices))
    # Drawn spread over every device, then copied whole to every process's host: each layout
    # re-shards it at its turn. One process reads its own shards (process_allgather would
    # first replicate them over the 8 simulated devices: 9 GB of host memory for
    # model=small, against 0.5 GB).
    t0 = time.perf_counter()
    init = exps[layouts[0]].init_spread()
    params = (jax.device_get(init) if jax.process_count() == 1
              else multihost_utils.process_allgather(init, tiled=True))
    del init
    if keep is not None:  # the run's own init, drawn here: its time is the run's startup
        keep["init_s"] = time.perf_counter() - t0
        if not train_cap:
            keep["params"] = params
    turns: dict[Layout, list[float]] = {layout: [] for layout in layouts}
    live = list(layouts)
    turn_s = float(cfg.parallelism.search_turn_s)
    for k in range(rounds):
        for layout in live if k % 2 == 0 else live[::-1]:
            at = f"{tag}/{k}/{layouts.index(layout)}"
            times = _turn(exps[layout], params,
                          lambda t, at=at: _agreed(f"{at}/{len(t)}", sum(t) >= turn_s),
                          keep if train_cap else None, train_cap or MEASURE_STEPS)
            if train_cap:
                params = None  # in the run's state now
            turns[layout].append(statistics.median(times))
            release_freed_memory()  # the next layout's buffers have other shapes
            log.info("layout search: %s %s ms per step (%d timed, round %d of at most %d)",
                     layout.label, _ms(1e3 * turns[layout][-1]), len(times), k + 1, rounds)
        if prune:
            kept = survivors({x: statistics.median(turns[x]) for x in live}, prune)
            live = [layouts[i] for i in _agreed(f"{tag}/{k}/live",
                                                [layouts.index(x) for x in kept])]
        if len(live) == 1:
            break
    if with_turns:
        return {layout: list(t) for layout, t in turns.items()}
    return {layout: statistics.median(t) for layout, t in turns.items()}


def _agreed(key: str, value: Any) -> Any:
    """Process 0's ``value`` (JSON) on every process; one process: ``value``."""
    from dxrun.multihost.distributed import agree

    return json.loads(agree(key, json.dumps(value)))


def survivors(medians: dict[Layout, float], prune: float, keep: int = KEEP) -> list[Layout]:
    """The layouts timed in the next round, in their order in ``medians``: the ``keep``
    fastest so far, and any other within ``prune`` x the fastest; the fastest alone when it
    leads every other by ``CLEAR`` (it has won)."""
    ranked = sorted(medians, key=medians.__getitem__)
    best = medians[ranked[0]]
    if all(medians[x] >= CLEAR * best for x in ranked[1:]):
        return [ranked[0]]
    kept = set(ranked[:keep]) | {x for x in ranked if medians[x] <= prune * best}
    return [x for x in medians if x in kept]


def _turn(exp: Any, params: Any, done: Callable[[list[float]], bool],
          run: dict[str, Any] | None = None, cap: int = MEASURE_STEPS) -> list[float]:
    """One layout's turn: one untimed step (the first after a switch pays for it: page faults,
    after ``release_freed_memory``; the first of all, one-off costs), then up to ``cap``
    timed steps (their seconds, returned), stopping once ``done(times)``. Its state is made
    from ``params`` and dropped after it, its steps on the first two batches; or with ``run``
    (``train_cap``) the run's own: ``run["state"]`` moved onto this layout (the first turn
    makes it from ``params``), trained on the run's next batches and left in ``run`` with the
    steps done and their seconds."""
    import jax

    if run is None:
        state, first = exp.init_state(params=params), 0
    else:
        state = exp.init_state(params=params) if "state" not in run else exp.adopt(run["state"])
        run["state"], first = None, run.setdefault("step", 0)
    times: list[float] = []
    for i in range(1 + cap):
        # A fresh state's steps alternate the first two batches; the run's take its next ones.
        tokens = exp.global_batch(exp.data.local_batch(i % 2 if run is None else first + i))
        t0 = time.perf_counter()
        state, metrics = exp.step(state, tokens)
        jax.block_until_ready((state, metrics))
        took = time.perf_counter() - t0
        if run is not None:
            run["step"], run["trained_s"] = run["step"] + 1, run.get("trained_s", 0.0) + took
        if i > 0:
            times.append(took)
            if done(times):
                break
    if run is not None:
        run["state"] = state
    del state
    return times


def resumed_layout(resume: Any) -> Layout | None:
    """The layout a checkpoint's run trained on (its saved config), None without a resume."""
    if resume is None:
        return None
    try:
        c = resume.meta["config"]
        p = c["plan"]
        return Layout(p["dp"], p["fsdp"], p["tp"], c["model"]["remat"],
                      c["train"]["grad_accum"])
    except (KeyError, TypeError):  # a checkpoint from before plans were saved with it
        return None
