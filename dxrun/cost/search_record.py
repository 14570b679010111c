"""A layout search's record as the log, plan.json and the docs read it (pure): the ranking,
the chosen layout first, a toss-up called one, and the search's own seconds.
"""

from __future__ import annotations

from typing import Any

from dxrun.cost.layouts import chosen_layout, gib_text, ms_text, overlaps
from dxrun.plan import Layout, layout_of, own_s


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
    names = ", ".join(layout_of(r).label
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
        layout = layout_of(r)
        lines.append((layout.label, gib_text(r["need_gb"]),
                      ms_text(r["est_ms"]), ms_text(r["measured_ms"]), "✓" if r["chosen"] else "",
                      r["why"]))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]


def markdown(record: dict[str, Any]) -> str:
    """The ranking as a Markdown table (the docs' auto section)."""
    out = ["| layout | per device | est ms | measured ms | chosen | why not |",
           "|---|---|---|---|---|---|"]
    for r in ranked(record["rows"]):
        layout = layout_of(r)
        need = gib_text(r["need_gb"])
        out.append(f"| {layout.label} | {need} | {ms_text(r['est_ms'])} | {ms_text(r['measured_ms'])} "
                   f"| {'✓' if r['chosen'] else ''} | {r['why']} |")
    return "\n".join(out)
