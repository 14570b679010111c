"""The Presets page: every preset file shipped (``dxrun.config.registry.preset_files``), its leading
comment and the keys it sets, read from the files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from docs.reference.markdown import PACKAGE
from dxrun.config.registry import preset_files


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _flatten(v, f"{prefix}{k}.")
        return out or [f"{prefix[:-1]}={{}}"]
    if isinstance(node, list) and prefix == "defaults.":
        return [f"{_defaults_entry(e)}" for e in node]
    text = yaml.safe_dump(node, default_flow_style=True, width=10**6).strip()
    return [f"{prefix[:-1]}={text.removesuffix(chr(10) + '...')}"]


def _defaults_entry(e: Any) -> str:
    if isinstance(e, dict):
        ((k, v),) = e.items()
        return f"{k.replace('override /', '')}={v}"
    return f"defaults: {e}"


def _header(path: Path) -> str:
    """The file's leading comment, without the ``@package`` line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(("#!", "# @package")):
            continue
        lines.append(line.lstrip("#")[1:] if line.startswith("# ") else line.lstrip("#"))
    return "\n".join(lines).strip()


def presets_markdown() -> str:
    out = ["# Presets", "",
           "Every preset file shipped with dxrun (inside the package as `dxrun.conf`, "
           "`dxrun.experiments`, `dxrun.sweeps`) and the keys it sets, read from the files. "
           "`group=option` lines are the file's defaults list (the presets it brings).", ""]
    for choose, paths in preset_files().items():
        if not paths:
            continue
        where = os.path.relpath(paths[0].parent, PACKAGE.parent)
        out += [f"## `{choose}` ({where}/)", ""]
        for p in paths:
            out += [f"### `{p.name}`", ""]
            head = _header(p)
            if head:
                out += ["```text", head, "```", ""]
            if p.suffix == ".yaml":
                sets = _flatten(yaml.safe_load(p.read_text()) or {})
                out += ["Sets: " + ", ".join(f"`{s}`" for s in sets), ""]
    return "\n".join(out)
