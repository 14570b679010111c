"""The docs' Reference pages, generated from the code at every ``mkdocs build`` (docs/hooks.py),
so they cannot drift from it: every config key (``keys``), every preset (``presets``), every
file a run writes with its keys and every metric (``outputs``), every command-line tool
(``tools``), and the Guide's mesh figures (``figures``).

Generated at build time rather than committed: a committed page would need a test to say it is
stale and a person to paste it; a generated one is never stale, and ``mkdocs build --strict`` in
CI fails on a page that does not render. ``tests/test_reference.py`` fails when something exists
in the code without its entry here (a key without a meaning, a metric the train loop logs
without its entry in ``dxrun.config.metric_names``, a tool without its usage).

Outside the package (nothing in dxrun imports it) and pure: reads the schema dataclasses and
their fields' metadata, the YAML presets and the tools' argument parsers; never imports JAX (a
docs build needs no accelerator stack). Run from the checkout: ``from docs import reference``.
"""

from __future__ import annotations

from docs.reference.figures import figures
from docs.reference.keys import config_markdown
from docs.reference.outputs import outputs_markdown
from docs.reference.presets import presets_markdown
from docs.reference.tools import tools_markdown

__all__ = ["figures", "pages"]


def pages() -> dict[str, str]:
    """The generated pages: path under docs/ -> markdown."""
    return {"reference/config.md": config_markdown(),
            "reference/presets.md": presets_markdown(),
            "reference/outputs.md": outputs_markdown(),
            "reference/tools.md": tools_markdown()}
