"""The sweep's PNG plots (matplotlib, no display): throughput vs devices with the ideal line,
loss curves against tokens seen, and MFU (or tokens/s per device) vs batch size."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dxrun.report.collect import STRONG, WEAK, JobRecord, scaling_groups


def _figure(panels: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.2), dpi=100, squeeze=False)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return plt, fig, axes[0][0] if panels == 1 else list(axes[0])


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _varying(jobs: list[JobRecord]) -> set[str]:
    """The overrides that are not the same for every job: what a legend needs to show."""
    every = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    return {o for j in jobs for o in j.overrides} - every


def _label(job: JobRecord, varying: set[str]) -> str:
    return " ".join(o for o in job.overrides if o in varying) or f"job {job.label_num}"


def _workload_label(job: JobRecord, varying: set[str]) -> str:
    """A line's legend: batch size plus whatever else (not the mesh) varies in the sweep."""
    rest = [o for o in job.workload if o in varying and not o.startswith("data.batch_size=")]
    return " ".join([f"batch {job.batch_size}", *rest])


def throughput(path: Path, jobs: list[JobRecord]) -> Path | None:
    """Tokens/s against devices, one line per workload through its fastest mesh at each device
    count, every mesh a labelled point, and the ideal: the fewest-device speed times n/n0."""
    ok = [j for j in jobs if j.status == "ok" and j.summary.get("tokens_per_s") and j.n_devices]
    if not ok:
        return None
    plt, fig, ax = _figure()
    varying = _varying(jobs)
    lines: dict[tuple, list[JobRecord]] = defaultdict(list)
    for j in ok:
        lines[j.workload].append(j)
    for i, (_, same) in enumerate(sorted(lines.items(), key=lambda kv: kv[1][0].batch_size or 0)):
        color = f"C{i % 10}"
        best: dict[int, float] = {}
        for j in same:
            best[j.n_devices] = max(best.get(j.n_devices, 0.0), j.summary["tokens_per_s"])
            ax.scatter(j.n_devices, j.summary["tokens_per_s"], color=color, s=18, zorder=3)
            if "tp" in j.mesh or "fsdp" in j.mesh:  # pure dp is the line itself
                ax.annotate(j.mesh, (j.n_devices, j.summary["tokens_per_s"]), fontsize=7,
                            xytext=(4, -8), textcoords="offset points", color=color)
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], "-o", color=color, label=_workload_label(same[0], varying))
        n0 = xs[0]
        ax.plot(xs, [best[n0] * x / n0 for x in xs], "--", color=color, alpha=0.5, lw=1)
    ax.plot([], [], "--", color="gray", label="ideal (linear from fewest devices)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({j.n_devices for j in ok}), [str(n) for n in
                                                       sorted({j.n_devices for j in ok})])
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens/s (all devices)")
    ax.set_title("Throughput vs devices")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def loss_curves(path: Path, jobs: list[JobRecord]) -> Path | None:
    curves = [(j, [r for r in j.metrics() if "train/loss" in r and "data/tokens_seen" in r])
              for j in jobs if j.status == "ok"]
    curves = [(j, rows) for j, rows in curves if rows]
    if not curves:
        return None
    plt, fig, ax = _figure()
    varying = _varying(jobs)
    for j, rows in curves:
        ax.plot([r["data/tokens_seen"] for r in rows], [r["train/loss"] for r in rows],
                label=_label(j, varying), lw=1.2)
    floors = {r["data/entropy_floor"] for _, rows in curves for r in rows
              if "data/entropy_floor" in r}
    if len(floors) == 1:
        ax.axhline(floors.pop(), color="black", ls=":", lw=1, label="entropy floor")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("Loss curves")
    ax.legend(fontsize=6, ncol=2 if len(curves) > 8 else 1)
    return _save(plt, fig, path)


def efficiency(path: Path, jobs: list[JobRecord]) -> Path | None:
    """MFU against batch size, one line per mesh; tokens/s per device where a job has no MFU
    (no known peak, e.g. CPUs)."""
    ok = [j for j in jobs if j.status == "ok" and j.batch_size
          and j.summary.get("perf/tokens_per_s_per_device")]
    if not ok:
        return None
    use_mfu = all(j.summary.get("perf/mfu") is not None for j in ok)
    key = "perf/mfu" if use_mfu else "perf/tokens_per_s_per_device"
    plt, fig, ax = _figure()
    meshes: dict[str, list[JobRecord]] = defaultdict(list)
    for j in ok:
        meshes[f"{j.mesh} ({j.n_devices} dev)"].append(j)
    for label, same in sorted(meshes.items(), key=lambda kv: (kv[1][0].n_devices, kv[0])):
        same = sorted(same, key=lambda j: j.batch_size)
        ax.plot([j.batch_size for j in same], [j.summary[key] for j in same], "-o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({j.batch_size for j in ok})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("global batch size")
    ax.set_ylabel("MFU" if use_mfu else "tokens/s per device")
    ax.set_title("MFU vs batch size" if use_mfu else "Tokens/s per device vs batch size")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


# What each kind plots against devices, its ideal (from the fewest devices, n0) and its title.
_SCALING = {
    WEAK: ("tokens/s per device", lambda y0, n0, n: y0, "ideal: the same tokens/s per device",
           "Weak scaling (per-device batch fixed)"),
    STRONG: ("speed-up over the fewest devices", lambda y0, n0, n: n / n0,
             "ideal: speed-up = device ratio", "Strong scaling (global batch fixed)"),
}


def scaling(path: Path, jobs: list[JobRecord]) -> Path | None:
    """One panel per kind of scaling group in the sweep (weak, strong): each group's best mesh
    at each device count, and the dashed ideal of that kind from its fewest devices."""
    groups = scaling_groups(jobs)
    kinds = [k for k in (WEAK, STRONG) if any(kind == k for kind, _ in groups)]
    if not kinds:
        return None
    plt, fig, axes = _figure(len(kinds))
    axes = [axes] if len(kinds) == 1 else axes
    varying = _varying(jobs)
    for ax, kind in zip(axes, kinds, strict=True):
        ylabel, ideal, ideal_label, title = _SCALING[kind]
        mine = [same for k, same in groups if k == kind]
        for i, same in enumerate(mine):
            best: dict[int, float] = {}
            for j in same:
                best[j.n_devices] = max(best.get(j.n_devices, 0.0),
                                        j.summary["perf/tokens_per_s_per_device"])
            xs = sorted(best)
            n0 = xs[0]
            # tokens/s per device (weak); speed-up T_n / T_0 = (t_n * n) / (t_0 * n0) (strong)
            ys = [best[n] if kind == WEAK else best[n] * n / (best[n0] * n0) for n in xs]
            held = (f"per-device batch {same[0].per_device_batch}" if kind == WEAK
                    else f"global batch {same[0].batch_size}")
            rest = [o for o in same[0].workload if o in varying and "batch_size=" not in o]
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
    return _save(plt, fig, path)


def write_plots(sweep_dir: Path, jobs: list[JobRecord]) -> list[Path]:
    made = [throughput(sweep_dir / "throughput.png", jobs),
            loss_curves(sweep_dir / "loss.png", jobs),
            efficiency(sweep_dir / "efficiency.png", jobs),
            scaling(sweep_dir / "scaling.png", jobs)]
    return [p for p in made if p is not None]
