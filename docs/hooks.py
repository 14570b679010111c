"""MkDocs hook: the Reference pages, generated from the code at build time (dxrun/reference.py),
and BENCHMARKS.md, which lives at the top of the repository, as a page of the site."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    from dxrun import reference

    pages = {**reference.pages(), **reference.figures(),
             "benchmarks-results.md": (ROOT / "BENCHMARKS.md").read_text()}
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files
