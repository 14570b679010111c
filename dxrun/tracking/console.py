"""What the user sees while a run trains: a rich progress bar on a terminal, plain log lines
otherwise. The log lines always also reach the run dir's log file (Hydra's file handler).

The bar advances per dispatched step on the host; loss, tokens/s and MFU change only at log
steps, when the host has the numbers anyway, so the bar adds no device sync.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("dxrun")


def format_line(step: int, total: int, m: dict[str, float], note: str = "") -> str:
    """A log step's line; an evaluation between log steps has only the eval numbers. ``note``
    (e.g. ``save_note``) goes after the tokens/s it explains."""
    parts = [f"step {step}/{total}"]
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.4f}")
    if "eval/loss" in m:
        parts.append(f"eval {m['eval/loss']:.4f}")
        if "train/loss" not in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
    if "perf/tokens_per_s" in m:
        parts.append(f"{m['perf/tokens_per_s']:,.0f} tok/s" + (f" {note}" if note else ""))
    if "perf/mfu" in m:
        parts.append(f"MFU {100 * m['perf/mfu']:.1f}%")
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    return "  ".join(parts)


class _RichHandler(logging.Handler):
    """Prints log records above the live bar instead of through it."""

    def __init__(self, console: Any, fmt: logging.Formatter | None):
        super().__init__()
        self.console = console
        self.setFormatter(fmt or logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(self.format(record), markup=False, highlight=False)


class Progress:
    def __init__(self, total: int, enabled: bool | None = None):
        self.total = total
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self._bar = None

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
        )
        self._task = self._bar.add_task("train", total=self.total, info="compiling…")
        self._bar.start()
        # Console handlers would write through the live display; route them above it.
        root = logging.getLogger()
        self._swapped = [h for h in root.handlers if type(h) is logging.StreamHandler]
        fmt = self._swapped[0].formatter if self._swapped else None
        self._handler = _RichHandler(self._bar.console, fmt)
        for h in self._swapped:
            root.removeHandler(h)
        root.addHandler(self._handler)
        return self

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def update(self, step: int, metrics: dict[str, float], note: str = "") -> None:
        line = format_line(step, self.total, metrics, note)
        if self._bar is not None and "train/loss" in metrics:
            info = line.split("  ", 1)[1]
            self._bar.update(self._task, completed=step, info=info)
            # The same line in the log file, not on the screen (the bar shows it).
            for h in logging.getLogger().handlers:
                if isinstance(h, logging.FileHandler):
                    h.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, None,
                                            None))
        else:
            log.info(line)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is None:
            return
        self._bar.stop()
        root = logging.getLogger()
        root.removeHandler(self._handler)
        for h in self._swapped:
            root.addHandler(h)
