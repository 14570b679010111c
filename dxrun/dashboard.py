"""``python -m dxrun.dashboard --entity E --project P``: create the dxrun W&B workspace.

The panels are described in ``dxrun/tracking/dashboard.yaml``. Creating a workspace needs the
W&B server (online) and the ``wandb-workspaces`` package; without the package, or with
``--print``, this prints the panels so they can be added by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

SPEC = Path(__file__).parent / "tracking" / "dashboard.yaml"  # shipped as package data there


def load_spec(path: Path = SPEC) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def metrics_in(spec: dict[str, Any]) -> set[str]:
    return {y for s in spec["sections"] for p in s["panels"] for y in p["y"]}


def panel_lines(spec: dict[str, Any]) -> list[str]:
    """One line per panel: ``  [section] title: metric, metric``."""
    return [f"  [{section['name']}] {panel['title']}: {', '.join(panel['y'])}"
            for section in spec["sections"] for panel in section["panels"]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entity", required=True)
    parser.add_argument("--project", default="dxrun")
    parser.add_argument("--print", action="store_true", dest="print_only",
                        help="print the panels to add by hand; create nothing")
    args = parser.parse_args(argv)
    spec = load_spec()
    if args.print_only:
        print("add these line plots (x axis: step) by hand:", *panel_lines(spec), sep="\n")
        return
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        print("wandb-workspaces is not installed (pip install wandb-workspaces); add these "
              "line plots (x axis: step) by hand:", *panel_lines(spec), sep="\n")
        return
    workspace = ws.Workspace(
        name=spec["name"], entity=args.entity, project=args.project,
        sections=[ws.Section(name=s["name"], is_open=True, panels=[
            wr.LinePlot(title=p["title"], x="step", y=p["y"]) for p in s["panels"]])
            for s in spec["sections"]],
    )
    workspace.save()
    print(f"saved workspace {spec['name']!r} in {args.entity}/{args.project}")


if __name__ == "__main__":
    main()
