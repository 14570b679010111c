"""What the generated pages share: where dxrun is, and a Markdown table's cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dxrun

PACKAGE = Path(dxrun.__file__).resolve().parent  # the dxrun/ the pages are generated from


def cell(v: Any) -> str:
    """A table cell: ``|`` escaped, and ``<name>`` outside code spans escaped so Markdown does
    not take it for an HTML tag (``dxrun.<rank>.log``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    parts = str(v).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;")
                    for i, p in enumerate(parts))


def table(head: str, rows: dict[str, str]) -> list[str]:
    """A two-column table: ``head`` and its meaning."""
    return [f"| {head} | meaning |", "|---|---|",
            *[f"| `{k}` | {cell(v)} |" for k, v in rows.items()], ""]
