"""``parallelism=auto`` against the best layout measured: for each case, the search runs as a
run would (``parallelism.search=fresh``), then every layout that fits is timed again, afresh
(its own compile), in rounds that alternate their order and drop none (one layout's state alive
at a time, so the larger models fit the host); the choice's step time is compared with the
fastest's.

Two figures per section: each case's tokens/s of auto's choice / the best measured (goal
>= 0.95), and how often the roofline's first choice alone was the measured best (what the
measured stage buys)."""

from __future__ import annotations

import os
import sys
import tempfile
import time

from benchmarks.report import Figure, figure

SECTION = "parallelism=auto vs the best layout measured (8 simulated CPU devices)"
# (name, overrides, global batches): tiny and small at a short sequence (tiny at the vocabulary
# BENCHMARKS.md's figures were taken at).
CASES = [("tiny", ["model=tiny", "data.seq_len=64", "data.vocab_size=64"], (16, 64)),
         ("small", ["model=small", "data.seq_len=64"], (8, 16))]
QUICK_CASES = [("tiny", ["model=tiny", "model.n_layers=1", "data.seq_len=16"], (16,))]


def case(name: str, shape: list[str], batch: int, rounds: int, command: str
         ) -> tuple[Figure, bool]:
    """(the choice / best figure, whether the roofline's first choice was the measured best)."""
    from benchmarks.speed import compose_cfg
    from dxrun.autotune import search, time_layouts
    from dxrun.cost import chosen_layout, held_batch, rows_of
    from dxrun.experiment import visible_devices
    from dxrun.fit import Handover

    devices = visible_devices()
    # The search reads the config and never rewrites it: the timing below uses the same
    # resolved batch and sequence length as the search did.
    # search_budget=null: the search itself is what is measured, whatever the run's length.
    cfg = compose_cfg(*shape, f"data.batch_size={batch}", "parallelism=auto",
                      "parallelism.search=fresh", "parallelism.search_budget=null")
    held = held_batch(cfg, *devices)
    t0 = time.perf_counter()
    _progress(f"{name} batch {batch}: searching (parallelism=auto, search=fresh)")
    # As a run's: the search says what of its time was the run's init.
    record = search(cfg, handover=Handover(), held=held).record
    chosen = chosen_layout(record)
    fitting = [r for r in rows_of(record) if r.fits]
    layouts = [r.layout for r in fitting]
    first_by_model = layouts[0]  # the model stage's order: estimated fastest first
    _progress(f"{name} batch {batch}: auto chose {chosen.label} in {record['search_s']:.0f} s; "
              f"timing {len(layouts)} layouts x {rounds} rounds")
    # Every layout in every round (no pruning), the order alternating: drift falls on all alike.
    step_s = time_layouts(cfg, layouts, devices, rounds=rounds, prune=None, held=held)
    best = min(layouts, key=step_s.__getitem__)
    raw = {lay.label: f"{1e3 * s:.1f} ms" for lay, s in sorted(step_s.items(),
                                                                  key=lambda kv: kv[1])}
    # Every time on the progress line: a bench stopped before the end still leaves them.
    _progress(f"{name} batch {batch}: best measured {best.label}, "
              f"choice/best {step_s[best] / step_s[chosen]:.3f} ({time.perf_counter() - t0:.0f} s); "
              + "; ".join(f"{k} {v}" for k, v in raw.items()))
    raw |= {"auto chose": chosen.label, "roofline's first": first_by_model.label,
            "search_s": round(record["search_s"], 1),
            "init_s": round(record["init_s"] or 0.0, 1),
            "trained_s": round(record.get("trained_s") or 0.0, 1)}
    fig = figure(SECTION, f"{name} batch {batch}: tokens/s of auto's choice ({chosen.label}) "
                 f"/ the best measured ({best.label})", step_s[best] / step_s[chosen], raw,
                 ">= 0.95", command=command)
    return fig, first_by_model == best


def _progress(line: str) -> None:
    """A case takes minutes: say where the bench is (stderr; the report is stdout)."""
    print(f"bench --auto: {line}", file=sys.stderr, flush=True)


def figures(quick: bool, command: str, rounds: int = 4, only: str | None = None
            ) -> list[Figure]:
    """Every case (``only``: those whose model name contains it)."""
    # The decision cache in a scratch dir: every case searches afresh and the user's is untouched.
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="dxrun-bench-auto-")
    figs, hits = [], []
    for name, shape, batches in QUICK_CASES if quick else CASES:
        if only and only not in name:
            continue
        for batch in batches:
            fig, hit = case(name, shape, batch, 1 if quick else rounds, command)
            figs.append(fig)
            hits.append(hit)
    figs.append(figure(SECTION, "cases where the roofline's first choice was the measured best",
                       sum(hits) / len(hits), {"cases": len(hits), "hits": sum(hits)},
                       command=command))
    return figs
