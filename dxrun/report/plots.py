"""The sweep's PNG plots (matplotlib, no display), each drawn only when the sweep varied what
it is plotted against: throughput by layout (mesh or devices varied), loss curves (one entry per
workload), final loss vs each scalar varied (lr...), MFU vs batch size, weak/strong scaling.
Each ``*_figure`` returns the matplotlib figure (or None), so a test reads its labels.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dxrun.report.collect import STRONG, WEAK, JobRecord, layout_run, scaling_groups, varying
from dxrun.report.ranking import rank_layouts


def _figure(panels: int = 1, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, height), dpi=100, squeeze=False)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, axes[0][0] if panels == 1 else list(axes[0])


def _save(fig: Any | None, path: Path) -> Path | None:
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _label(job: JobRecord, vary: set[str]) -> str:
    return " ".join(o for o in job.overrides if o in vary) or f"job {job.label_num}"


def _workload_label(job: JobRecord, vary: set[str]) -> str:
    """What a workload (a job's overrides but the mesh) varied: ``data.batch_size=64``."""
    return " ".join(o for o in job.workload if o in vary)


def varied_layouts(jobs: list[JobRecord]) -> bool:
    """The sweep ran finished jobs on more than one mesh or device count."""
    ok = [j for j in jobs if j.status == "ok" and j.mesh]
    return len({(j.mesh, j.n_devices) for j in ok}) > 1


def throughput_figure(jobs: list[JobRecord]) -> Any | None:
    """The layouts of each batch (and workload), fastest on top: a bar at the median tokens/s
    of the job's timing windows, its interquartile range as the error bar and every window a
    dot; each bar is labelled by its mesh on the y axis (one label a bar, so none overlap), and
    the legend names the batches. Drawn when the sweep varied the mesh or the devices."""
    if not varied_layouts(jobs):
        return None
    ok = [j for j in jobs if j.status == "ok" and j.mesh and j.windows()]
    if not ok:
        return None
    vary = varying(jobs)
    groups: dict[tuple, list[JobRecord]] = defaultdict(list)
    for j in ok:
        groups[(j.batch_size or 0, j.workload)].append(j)
    n_rows = len(ok) + len(groups) - 1  # a blank row between groups
    fig, ax = _figure(height=max(4.2, 0.28 * n_rows + 1.4))
    y, ticks, names = 0, [], []
    for i, (key, same) in enumerate(sorted(groups.items(), key=lambda kv: kv[0][0])):
        color = f"C{i % 10}"
        by_layout = {j.mesh: j for j in same}
        ranked = rank_layouts([layout_run(j) for j in same])
        rest = [o for o in key[1] if o in vary and not o.startswith("data.batch_size=")]
        label = " ".join([f"batch {key[0]}", *rest])
        for k, r in enumerate(ranked):
            ax.barh(y, r.median, xerr=[[r.median - r.q1], [r.q3 - r.median]], color=color,
                    alpha=0.75, capsize=3, label=label if k == 0 else None)
            ax.scatter(r.run.windows, [y] * len(r.run.windows), color="black", s=6, zorder=3)
            ticks.append(y)
            names.append(f"{r.layout} ({by_layout[r.layout].n_devices} dev)")
            y += 1
        y += 1
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()  # the first batch's fastest layout on top
    ax.set_xlabel("tokens/s (all devices): median of the timing windows, IQR bars, windows dots")
    ax.set_title("Throughput by layout, fastest first")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def loss_figure(jobs: list[JobRecord]) -> Any | None:
    """Train loss against tokens seen, one colour and one legend entry per workload: the jobs
    that differ only in their mesh draw the same curve (mesh equivalence), so the entry names
    their meshes instead of repeating the line."""
    curves = [(j, [r for r in j.metrics() if "train/loss" in r and "data/tokens_seen" in r])
              for j in jobs if j.status == "ok"]
    curves = [(j, rows) for j, rows in curves if rows]
    if not curves:
        return None
    fig, ax = _figure()
    vary = varying(jobs)
    groups: dict[tuple, list[tuple[JobRecord, list]]] = defaultdict(list)
    for j, rows in curves:
        groups[j.workload].append((j, rows))
    for i, (_, same) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0][0].batch_size
                                         or 0)):
        meshes = list(dict.fromkeys(j.mesh for j, _ in same if j.mesh))  # in job order
        label = _workload_label(same[0][0], vary) if len(same) > 1 or len(groups) > 1 else ""
        if len(same) > 1:
            shared = f"{len(same)} jobs" + (f": {', '.join(meshes)}" if meshes else "")
            label = f"{label} ({shared})" if label else shared
        label = label or _label(same[0][0], vary)
        for k, (_, rows) in enumerate(same):
            ax.plot([r["data/tokens_seen"] for r in rows], [r["train/loss"] for r in rows],
                    color=f"C{i % 10}", lw=1.2, label=label if k == 0 else None)
    floors = {r["data/entropy_floor"] for _, rows in curves for r in rows
              if "data/entropy_floor" in r}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="black", ls=":", lw=1, label="entropy floor")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7, ncol=2 if len(groups) > 8 else 1)
    return fig


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def scalar_keys(jobs: list[JobRecord]) -> list[str]:
    """The number-valued override keys the sweep varied (``optimizer.lr``), not the mesh or the
    devices, nor the batch size of a sweep that varied layouts (its question is throughput)."""
    ok = [j for j in jobs if j.status == "ok"]
    values: dict[str, set[float]] = defaultdict(set)
    for j in ok:
        for o in j.overrides:
            key, _, v = o.lstrip("+~").partition("=")
            if _number(v) is not None:
                values[key].add(_number(v))
    skip = {"runtime.cpu_devices"} | ({"data.batch_size", "data.per_device_batch_size"}
                                      if varied_layouts(jobs) else set())
    return [k for k in sorted(values) if len(values[k]) > 1 and k not in skip
            and k.split(".")[0] != "parallelism"]


def final_loss_figure(jobs: list[JobRecord]) -> Any | None:
    """Final loss (held-out where every job has one, else train) against each scalar the sweep
    varied, one panel a key (at most 3), the lowest marked."""
    keys = scalar_keys(jobs)[:3]
    ok = [j for j in jobs if j.status == "ok"]
    if not keys or not ok:
        return None
    metric = "eval/loss" if all(j.summary.get("eval/loss") is not None for j in ok) else "train/loss"
    ok = [j for j in ok if j.summary.get(metric) is not None]
    if not ok:
        return None
    fig, axes = _figure(len(keys))
    axes = [axes] if len(keys) == 1 else axes
    best = min(ok, key=lambda j: j.summary[metric])
    for ax, key in zip(axes, keys, strict=True):
        pts = []
        for j in ok:
            v = next((_number(o.partition("=")[2]) for o in j.overrides
                      if o.lstrip("+~").partition("=")[0] == key), None)
            if v is not None:
                pts.append((v, j.summary[metric], j is best))
        xs = [p[0] for p in pts]
        ax.scatter(xs, [p[1] for p in pts], color="C0", s=24, zorder=3)
        ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], marker="*",
                   s=160, color="C3", zorder=4, label=f"lowest: {_label(best, varying(jobs))}")
        if min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(f"final {metric}")
        ax.set_title(f"Final {metric} vs {key}")
        ax.legend(fontsize=7)
    return fig


def efficiency_figure(jobs: list[JobRecord]) -> Any | None:
    """MFU against batch size, one line per mesh; tokens/s per device where a job has no MFU
    (no known peak, e.g. CPUs); both the jobs' throughput statistic. Drawn when the sweep ran
    more than one batch size."""
    ok = [j for j in jobs if j.status == "ok" and j.batch_size
          and j.throughput and j.throughput.per_device]
    if len({j.batch_size for j in ok}) < 2:
        return None
    use_mfu = all(j.throughput.mfu is not None for j in ok)

    def value(j: JobRecord) -> float:
        return j.throughput.mfu if use_mfu else j.throughput.per_device

    fig, ax = _figure()
    meshes: dict[str, list[JobRecord]] = defaultdict(list)
    for j in ok:
        meshes[f"{j.mesh} ({j.n_devices} dev)"].append(j)
    for label, same in sorted(meshes.items(), key=lambda kv: (kv[1][0].n_devices, kv[0])):
        same = sorted(same, key=lambda j: j.batch_size)
        ax.plot([j.batch_size for j in same], [value(j) for j in same], "-o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({j.batch_size for j in ok})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("global batch size")
    ax.set_ylabel("MFU" if use_mfu else "tokens/s per device")
    ax.set_title("MFU vs batch size" if use_mfu else "Tokens/s per device vs batch size")
    ax.legend(fontsize=8)
    return fig


# What each kind plots against devices, its ideal (from the fewest devices, n0) and its title.
_SCALING = {
    WEAK: ("tokens/s per device", lambda y0, n0, n: y0, "ideal: the same tokens/s per device",
           "Weak scaling (per-device batch fixed)"),
    STRONG: ("speed-up over the fewest devices", lambda y0, n0, n: n / n0,
             "ideal: speed-up = device ratio", "Strong scaling (global batch fixed)"),
}


def scaling_figure(jobs: list[JobRecord]) -> Any | None:
    """One panel per kind of scaling group in the sweep (weak, strong): each group's best mesh
    at each device count (the jobs' throughput statistic, as the efficiency columns), and the
    dashed ideal of that kind from its fewest devices."""
    groups = scaling_groups(jobs)
    kinds = [k for k in (WEAK, STRONG) if any(kind == k for kind, _ in groups)]
    if not kinds:
        return None
    fig, axes = _figure(len(kinds))
    axes = [axes] if len(kinds) == 1 else axes
    vary = varying(jobs)
    for ax, kind in zip(axes, kinds, strict=True):
        ylabel, ideal, ideal_label, title = _SCALING[kind]
        mine = [same for k, same in groups if k == kind]
        for i, same in enumerate(mine):
            best: dict[int, float] = {}
            for j in same:
                best[j.n_devices] = max(best.get(j.n_devices, 0.0), j.throughput.per_device)
            xs = sorted(best)
            n0 = xs[0]
            # tokens/s per device (weak); speed-up T_n / T_0 = (t_n * n) / (t_0 * n0) (strong)
            ys = [best[n] if kind == WEAK else best[n] * n / (best[n0] * n0) for n in xs]
            held = (f"per-device batch {same[0].per_device_batch}" if kind == WEAK
                    else f"global batch {same[0].batch_size}")
            rest = [o for o in same[0].workload if o in vary and "batch_size=" not in o]
            ax.plot(xs, ys, "-o", color=f"C{i % 10}", label=" ".join([held, *rest]))
            ax.plot(xs, [ideal(ys[0], n0, n) for n in xs], "--", color=f"C{i % 10}", alpha=0.5)
        ax.plot([], [], "--", color="gray", label=ideal_label)
        ax.set_xscale("log", base=2)
        ticks = sorted({j.n_devices for same in mine for j in same})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    return fig


# (file stem, figure function) in report order; each draws only when the sweep varied what
# it plots against.
FIGURES = [("throughput", throughput_figure), ("loss", loss_figure),
           ("final_loss", final_loss_figure), ("efficiency", efficiency_figure),
           ("scaling", scaling_figure)]


def write_plots(sweep_dir: Path, jobs: list[JobRecord]) -> list[Path]:
    made = [_save(draw(jobs), sweep_dir / f"{name}.png") for name, draw in FIGURES]
    return [p for p in made if p is not None]
