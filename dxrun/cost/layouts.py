"""``parallelism=auto``'s layouts and the rules that rank them (pure: values in, values out).

A layout is a mesh (each axis of ``AXES`` sized), a ``model.remat`` and a ``train.grad_accum``.
The candidates are the factorisations of the devices over the axes that the mesh plan accepts (a
context axis only for long sequences: ``meshes``); the model stage ranks
the variants that fit by their estimated step; the measure stage times the few that the rules
here pick, in rounds, and chooses the fastest; ``search_cost`` predicts whether a search pays.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dxrun.config import (
    AXES,
    Axis,
    ConfigError,
    axis_sizes,
)
from dxrun.plan import LONG_SEQ, AttentionTarget, Layout, Sizes, default_seq_len, layout_of, make_plan

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig, ParallelismConfig, RunConfig, TrainConfig


SEARCHES = ("none", "measure", "model", "fresh")
# Cheapest to most recomputation; keep_attention only where the attention kernel names its
# residuals (splash: ``check_remat`` refuses it elsewhere, and the search moves on).
REMATS = ("none", "dots", "keep_attention", "full")
ACCUMS = (1, 2, 4, 8)
MEASURE_STEPS = 10  # timed steps per turn (at most): a median that separates close layouts
MEASURE_ROUNDS = 3  # rounds (a turn each)
# A turn stops timing once its timed steps add up to parallelism.search_turn_s: a slow step is
# timed once a turn (its noise is small against its length), a fast one up to MEASURE_STEPS.
PRUNE = 1.25  # after a round, a layout slower than this x the best's median is timed no more
# ...except the KEEP fastest so far, which take every round: one turn on a loaded host can be
# far off, and the choice is made among these few.
KEEP = 3
TIE = 1.10  # estimates this close to the best's are within the roofline's error: measure them
# ...when a step of them is cheap (estimated under parallelism.search_turn_s): a turn of a slow
# step costs two of them, and there the estimate ranks well enough.
# After a round, a leader this much faster than every other layout has won: no more rounds.
CLEAR = 1.10


def meshes(n: int, seq_len: int, unused: Collection[str] = ()) -> list[Sizes]:
    """Every mesh of ``n`` devices a search tries, each axis's size by key: an axis that is
    not inferable (context, chosen for the sequence) above 1 only for a sequence of
    ``LONG_SEQ`` or more that its 2 x size chunks divide; the axes keyed in ``unused`` (of no
    use to the model: ``Axis.only_with``) at 1. In the search's order: such axes outermost,
    then the others innermost first, the outermost (data) taking the rest."""
    def fits(a: Axis, v: int) -> bool:
        if a.key in unused:
            return v == 1
        return a.inferable or v == 1 or (seq_len >= LONG_SEQ and seq_len % (2 * v) == 0)

    *order, last = sorted(AXES, key=lambda a: (a.inferable, -AXES.index(a)))
    out: list[dict[str, int]] = [{}]
    for a in order:
        out = [m | {a.key: v} for m in out for v in _divisors(n // math.prod(m.values()))
               if fits(a, v)]
    return [Sizes(m | {last.key: n // math.prod(m.values())}) for m in out]


def unused_axes(cfg: RunConfig) -> list[str]:
    """The keys of the axes ``cfg``'s model has no use for (``Axis.only_with``)."""
    return [a.key for a in AXES if a.only_with and not OmegaConf.select(cfg, a.only_with)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: RunConfig, n_visible: int, platform: str, processes: int = 1,
               process_hosts: tuple[int, ...] | None = None, device: Any = None,
               batch: int | None = None, seq_len: int | None = None
               ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(meshes the plan accepts, [(mesh, why the plan refuses it)]), each with the user's remat
    and accumulation, at the ``batch`` and ``seq_len`` held fixed (None: the config's).
    ``make_plan`` is the one place the rules live."""
    n = cfg.parallelism.n_devices or n_visible
    ok, refused = [], []
    seq = seq_len or default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    for sizes in meshes(n, seq, unused_axes(cfg)):
        layout = Layout(sizes, cfg.model.remat, cfg.train.grad_accum)
        try:
            make_plan(cfg, n_visible, platform, processes, process_hosts, device, layout=layout,
                      batch=batch, seq_len=seq_len)
        except ConfigError as e:
            refused.append((layout, str(e).split(";")[0]))
            continue
        ok.append(layout)
    return ok, refused


def held_batch(cfg: RunConfig, n_visible: int, platform: str = "cpu", processes: int = 1,
               process_hosts: tuple[int, ...] | None = None,
               device: AttentionTarget | None = None, seq_len: int | None = None
               ) -> tuple[int, int]:
    """(global batch, sequence length) a layout search holds fixed while the layouts change
    (a search never changes the update): ``seq_len``, or ``data.seq_len`` (null: the
    platform's), and ``data.batch_size``, or with ``data.per_device_batch_size`` the global
    batch resolved once on the preset's own layout."""
    if seq_len is None:
        seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    if cfg.data.per_device_batch_size is None:
        return cfg.data.batch_size, seq_len
    plan = make_plan(cfg, n_visible, platform, processes, process_hosts, device, seq_len=seq_len)
    return plan.global_batch, seq_len


def fit_variants(layout: Layout) -> list[Layout]:
    """The mesh with the user's remat and accumulation, then more micro-batches (the same
    update), then more recomputation, each with as few micro-batches as fit: the order
    ``model_stage`` tries them in. Micro-batches before recomputation: a micro-batch only shrinks the
    matmuls' rows, a recomputation adds their FLOPs (on a v5e the faster of the two:
    BENCHMARKS.md, the defaults on the chip)."""
    return [replace(layout, remat=remat, grad_accum=accum)
            for remat in REMATS[REMATS.index(layout.remat):]
            for accum in ACCUMS if accum >= layout.grad_accum]


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
        return {**self.layout.to_json(), "mesh": self.layout.mesh, "need_gb": self.need_gb,
                "est_ms": self.est_ms, "measured_ms": self.measured_ms, "chosen": self.chosen,
                "fits": self.fits, "why": self.why, "spread_ms": self.spread_ms}


class TooLarge(Exception):
    """A candidate whose compile the accelerator refuses for memory (XLA's RESOURCE_EXHAUSTED
    on a chip): a row that does not fit, never the search's end. ``need_gb``: what XLA says the
    program needs (GiB per device; None where it names no figure)."""

    def __init__(self, need_gb: float | None) -> None:
        super().__init__(f"does not fit: XLA needs {gib_text(need_gb)}" if need_gb is not None
                         else "does not fit: XLA refuses its compile for memory")
        self.need_gb = need_gb


def model_stage(layouts: list[Layout], budget_gb: float | None,
                score: Callable[[Layout], tuple[float, float | None]]) -> list[Row]:
    """Each mesh at the variants that may fit fastest (``fit_variants``' order; past a fit, a
    heavier recomputation only with fewer micro-batches: BENCHMARKS.md, which variant fits
    fastest), ranked by estimate; a mesh that fits nowhere last, at its least need. ``score``:
    (GiB, est. s) or TooLarge (the chip refused); ``budget_gb`` None: a chip's compile is the
    check. Where every variant fails to build (ConfigError), that first error is the search's."""
    rows, errors = [], []
    for base in layouts:
        last, fitting = Row(base), []
        for layout in fit_variants(base):
            if fitting and layout.grad_accum >= fitting[-1].layout.grad_accum:
                continue  # as many micro-batches as a lighter recomputation's fit: slower
            try:
                need, est = score(layout)
            except ConfigError as e:  # e.g. accumulation not dividing the per-replica batch
                errors.append(e)
                last.why = last.why or str(e).split(";")[0]
                continue
            except TooLarge as e:
                last = Row(layout, e.need_gb, why=str(e))
                continue
            if budget_gb is not None and need > budget_gb:  # MiB if small
                last = Row(layout, need,
                           why=f"does not fit: {gib_text(need)} of {gib_text(budget_gb)}")
                continue
            fitting.append(Row(layout, need, None if est is None else 1e3 * est, fits=True))
        rows.extend(fitting or [last])
    if errors and not any(r.fits or r.need_gb is not None or r.why.startswith("does not fit")
                          for r in rows):
        raise errors[0]
    return sorted(rows, key=lambda r: (not r.fits, r.est_ms if r.est_ms is not None else 0.0))


def time_every(rows: list[Row], budget_s: float) -> bool:
    """On simulated CPU devices: time every layout that fits? When one step of each, by the
    estimates, adds up to less than ``budget_s`` (a turn's time): the steps are cheap, and
    their time is overhead the estimate does not rank."""
    est = [r.est_ms for r in rows if r.fits]
    return all(e is not None for e in est) and sum(est) < 1e3 * budget_s


def measure_rule(rows: list[Row], turn_s: float, simulated: bool) -> tuple[bool, float | None]:
    """(time every layout that fits?, ``prune`` between rounds). On simulated CPU devices whose
    steps are cheap (``time_every``) every layout takes every round: they lie close together
    and one turn on a shared host can be far off, so a prune after the first round could drop
    the best (BENCHMARKS.md, the auto bench); their rounds are cheap. Otherwise the top few
    by the estimate, the clearly slower dropped after each round."""
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


def train_budget(train: TrainConfig, checkpoint: CheckpointConfig,
                 faults: Collection[int] = ()) -> int:
    """Steps a search may train for the run: those before the first at which the run's loop
    does more than step (a log row, an evaluation, a save, a trace, a test's hook: ``faults``,
    the steps its caller read from the tests' faults), so that a run whose first steps the
    search trained writes what one that did not would."""
    t, every = train, checkpoint.every
    points = [t.steps, t.log_every, t.eval_every, 100 if every is None else every,
              t.profile.start, *faults]
    return min(p for p in points if p and p > 0) - 1


def train_through(cfg: RunConfig, timed: list[Row], budget_gb: float | None = None,
                  rounds: int = MEASURE_ROUNDS, faults: Collection[int] = ()) -> int:
    """Timed steps a turn may take when the search's turns train the run's first steps (0: they
    do not; ``time_layouts``'s ``train_cap``): when every turn, however the rounds go, fits in
    ``train_budget`` at up to ``MEASURE_STEPS`` timed steps, or at one when each step is
    estimated to take a turn's time (``parallelism.search_turn_s``: one timed step a turn
    anyway). A cheap step timed in turns of ten is timed on fresh states; so are layouts two
    of whose steps exceed ``budget_gb`` (GiB per device): a move between layouts holds the
    state twice. ``faults``: as ``train_budget``'s."""
    if budget_gb is not None and 2 * max((r.need_gb or 0.0 for r in timed),
                                         default=0.0) > budget_gb:
        return 0
    per_turn = train_budget(cfg.train, cfg.checkpoint, faults) // max(1, rounds * len(timed))
    if per_turn < 2:
        return 0
    slow = all(r.est_ms is not None and r.est_ms >= 1e3 * cfg.parallelism.search_turn_s
               for r in timed)
    return min(MEASURE_STEPS, per_turn - 1) if per_turn > MEASURE_STEPS or slow else 0


def search_cost(cfg: RunConfig, start: Row, n: int, compile_s: float, simulated: bool,
                faults: Collection[int] = ()) -> tuple[float, int, float]:
    """(seconds a search of ``n`` layouts is predicted to add to a run, the steps of its turns
    that do not train the run, the seconds of the run's ``train.steps``), the starting layout's
    figures standing for every layout's: its compile (``compile_s``, the run's own; each other
    layout one more) and its estimated step (``start.est_ms``), timed as ``measure_rule``,
    ``to_measure`` and ``train_through`` would time ``n`` layouts estimated alike, every round
    taken. An estimate below the measured step (simulated CPU devices) makes the run look
    shorter against the compiles: it errs to not searching. The memory a move between layouts
    holds is not counted: the start, every weight replicated over the data replicas,
    overstates the others'. ``faults``: as ``train_budget``'s."""
    step_s = start.est_ms / 1e3
    turn_s = cfg.parallelism.search_turn_s
    rows = [replace(start) for _ in range(n)]
    every, _ = measure_rule(rows, turn_s, simulated)
    timed = to_measure(rows, cfg.parallelism.search_top, every, turn_s)
    timed_steps = min(MEASURE_STEPS, max(1, math.ceil(turn_s / step_s)))  # a turn stops there
    steps = (0 if train_through(cfg, timed, faults=faults)
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
            r.why = f"slower: {ms_text(r.measured_ms)} ms measured"
            if overlaps(r.spread_ms, best.spread_ms):
                r.why += (f", not distinguishable (turns {ms_text(r.spread_ms[0])}-"
                          f"{ms_text(r.spread_ms[1])}, chosen {ms_text(best.spread_ms[0])}-"
                          f"{ms_text(best.spread_ms[1])})")
        elif r.est_ms is not None and best.est_ms is not None:
            r.why = (f"slower: {ms_text(r.est_ms)} ms estimated"
                     + (f" (not in the top {top} measured)" if top and best.measured_ms else ""))
        else:
            r.why = "not measured"
    return best


def overlaps(spread_ms: list[float] | None, chosen_ms: list[float] | None) -> bool:
    """Does a layout's spread of turns reach into the chosen one's? A turn of it was as fast as
    one of the chosen's: on this host the two are within each other's noise, and the choice
    between them is a toss-up."""
    return bool(spread_ms and chosen_ms and spread_ms[0] <= chosen_ms[1])


def gib_text(v: float | None) -> str:
    if v is None:
        return "-"
    # One unit below 1 GiB: a column read down compares like with like, never 0.01 GiB.
    return f"{v:.2f} GiB" if v >= 1 else f"{v * 1024:.1f} MiB"


def s_text(v: float) -> str:
    """Seconds in a sentence: whole above one, two significant digits below (a planned GPU
    run's step)."""
    return f"{v:.0f}" if v >= 1 else f"{v:.2g}"


def ms_text(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 1 else f"{v:.3f}"  # an accelerator's tiny step: sub-ms


def chosen_layout(record: dict[str, Any]) -> Layout:
    r = next(r for r in record["rows"] if r["chosen"])
    return layout_of(r)


def searches(p: ParallelismConfig) -> bool:
    """Does this run search? ``parallelism.search`` is not ``none`` and no axis was named: a run
    that sets ``parallelism.dp``, ``fsdp``, ``tp``, ... on ``auto`` (the default preset:
    ``python -m dxrun parallelism.tp=2``) takes that layout as given, as a named preset does:
    the first axis -1 (inferred), every other 1."""
    first, *rest = axis_sizes(p).values()
    return p.search != "none" and first == -1 and all(v == 1 for v in rest)


def rows_of(record: dict[str, Any]) -> list[Row]:
    """A record's ranking rows (as ``plan.json`` holds them), in the ranking's order."""
    out = []
    for r in record["rows"]:
        layout = layout_of(r)
        out.append(Row(layout, r["need_gb"], r["est_ms"], r["measured_ms"], r["chosen"],
                       r["fits"], r["why"], r.get("spread_ms")))
    return out


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


def resumed_layout(resume: Any) -> Layout | None:
    """The layout a checkpoint's run trained on (its saved config), None without a resume."""
    if resume is None:
        return None
    try:
        c = resume.meta["config"]
        p = c["plan"]
        # An axis that -1 could infer was saved from the start; the context axis came later.
        sizes = Sizes({a.key: p[a.key] if a.inferable else p.get(a.key, 1) for a in AXES})
        return Layout(sizes, c["model"]["remat"], c["train"]["grad_accum"])
    except (KeyError, TypeError):  # a checkpoint from before plans were saved with it
        return None
