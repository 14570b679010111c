"""``python -m dxrun.report <sweep dir> [--wandb]``: write report.md, report.csv and the plots
of a multirun (also one copied back from a cluster) into its dir."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dxrun.config import ConfigError
from dxrun.report import tally, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dxrun.report", description=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir: multirun/<date>/<time>")
    parser.add_argument("--wandb", action="store_true",
                        help="also upload the plots and table to the jobs' W&B group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        jobs = write_report(args.sweep_dir, upload=args.wandb)
    except ConfigError as e:
        print(f"dxrun.report: error: {e}", file=sys.stderr)
        return 2
    print(f"{tally(jobs)}; wrote {args.sweep_dir / 'report.md'}, report.csv and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
