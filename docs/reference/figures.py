"""The mesh figures of the Guide, drawn from the plan dxrun makes for a preset on 8 devices:
one SVG box per device, saying which part of the batch and of the weights it holds."""

from __future__ import annotations

from typing import Any

from dxrun.config import registry

FIGURE_LAYOUTS = ("dp4_tp2", "fsdp8", "dp2_fsdp2_tp2", "cp2_tp4")


def preset_plan(parallelism: str, n_devices: int = 8) -> Any:
    """The mesh plan ``python -m dxrun parallelism=NAME`` makes on ``n_devices`` CPU devices."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dxrun.plan import make_plan

    registry.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(registry.conf_dir()), version_base=None):
        cfg = compose("config", overrides=[f"parallelism={parallelism}"])
    GlobalHydra.instance().clear()
    return make_plan(cfg, n_devices, "cpu")


def mesh_svg(plan: Any, title: str) -> str:
    """One box per device, laid out as the mesh orders them (data, fsdp, context, tensor;
    row-major): a row per batch shard (data x fsdp), a column per (context, tensor) rank. Each
    box says which part of the batch, of each sequence and of the weights' sharded axes it
    holds, read from the plan's rules."""
    by_axis: dict[str, list[str]] = {}
    for logical, mesh_axis in plan.rules.items():
        for a in (mesh_axis if isinstance(mesh_axis, (tuple, list)) else [mesh_axis]):
            if a is not None and logical != "batch":
                by_axis.setdefault(a, []).append(logical)
    cp = getattr(plan, "cp", 1)
    rows, cols = plan.dp * plan.fsdp, cp * plan.tp
    w, h, gap, top = 300, 78, 10, 58
    width, height = max(cols * (w + gap) + gap, 620), top + rows * (h + gap) + gap
    colours = ["#e3f2fd", "#fff3e0", "#e8f5e9", "#fce4ec", "#ede7f6", "#e0f7fa", "#f9fbe7",
               "#efebe9"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<text x="{gap}" y="20" font-size="13" font-weight="bold">{title}: data={plan.dp} '
           f'x fsdp={plan.fsdp} x {f"context={cp} x " if cp > 1 else ""}tensor={plan.tp}</text>',
           f'<text x="{gap}" y="40">rows: batch shards (data x fsdp); columns: '
           f'{"(context, tensor)" if cp > 1 else "tensor"} ranks; colour: one data replica</text>']
    for i, device in enumerate(plan.device_ids):
        d, rest = divmod(i, plan.fsdp * cols)
        f, column = divmod(rest, cols)
        c, t = divmod(column, plan.tp)
        r = d * plan.fsdp + f
        x, y = gap + column * (w + gap), top + r * (h + gap)
        lines = [f"device {device}", f"batch rows {r + 1}/{rows}"]
        if cp > 1:  # the zig-zag split: chunks c and 2cp-1-c (dxrun/plan/context.py)
            lines.append(f"each sequence: chunks {c + 1} and {2 * cp - c} of {2 * cp}")
        if plan.tp > 1:
            lines.append(f"{', '.join(by_axis.get('tensor', []))}: part {t + 1}/{plan.tp}")
        if plan.fsdp > 1:
            lines.append(f"{', '.join(by_axis.get('fsdp', []))}: part {f + 1}/{plan.fsdp}")
        if plan.tp == plan.fsdp == 1:
            lines.append("every weight whole (replicated)")
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="6" '
                   f'fill="{colours[d % len(colours)]}" stroke="#555"/>')
        out += [f'<text x="{x + 8}" y="{y + 18 + 16 * k}"'
                f'{" font-weight=" + chr(34) + "bold" + chr(34) if k == 0 else ""}>{text}</text>'
                for k, text in enumerate(lines)]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def figures() -> dict[str, str]:
    return {f"figures/mesh_{name}.svg": mesh_svg(preset_plan(name), f"parallelism={name}")
            for name in FIGURE_LAYOUTS}
