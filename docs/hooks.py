"""MkDocs hook: the Reference pages, generated from the code at build time (docs/reference/),
and BENCHMARKS.md, which lives at the top of the repository, as a page of the site."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def site_links(markdown: str) -> str:
    """BENCHMARKS.md links into the docs the way a reader of the repository follows them
    (``docs/guide/x.md``); on the site the page sits at the docs root, where the same page is
    ``guide/x.md``."""
    return re.sub(r"\]\(docs/", "](", markdown)


def on_files(files, config):
    if str(ROOT) not in sys.path:  # the generators are docs/reference/, in the checkout
        sys.path.insert(0, str(ROOT))
    from docs import reference

    pages = {**reference.pages(), **reference.figures(),
             "benchmarks-results.md": site_links((ROOT / "BENCHMARKS.md").read_text())}
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    """The tables a guide page asks for with a marker (docs/reference/hf_layout.py)."""
    from docs.reference import hf_layout

    return hf_layout.fill(markdown)
