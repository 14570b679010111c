"""Every Python snippet in the docs runs as written.

A snippet is a fenced ```python block or a `python -c '...'` command, in a fenced block (its
newlines are the program's) or in an inline code span (which Markdown renders on one line). The
snippets of the guide, the README and the tests page run in a subprocess from the checkout and
must exit 0; BENCHMARKS.md's are benchmark runs of minutes each, so for them every `dxrun` or
`benchmarks` name they import must exist (an import path that moved fails here, not in a reader's shell).
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
RUN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IMPORT_ONLY = [ROOT / "BENCHMARKS.md"]
FENCE = re.compile(r"^```(?P<lang>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)
SPAN = re.compile(r"(`+)(?P<code>.+?)\1", re.S)
OURS = ("dxrun", "benchmarks")  # the package and the checkout's benchmarks
COMMAND = re.compile(r"python3? -c (?P<q>['\"])(?P<code>.*?)(?P=q)", re.S)


def snippets(text: str) -> list[str]:
    """The Python programs a reader would copy out of one Markdown page."""
    found: list[str] = []
    prose = FENCE.sub(lambda m: "\n", text)
    for m in FENCE.finditer(text):
        if m["lang"].strip() in ("python", "py"):
            found.append(m["body"])
        else:
            found += [c["code"] for c in COMMAND.finditer(m["body"])]
    for span in SPAN.finditer(prose):
        one_line = re.sub(r"\s*\n\s*", " ", span["code"])
        found += [c["code"] for c in COMMAND.finditer(one_line)]
    return found


def cases(pages: list[Path]) -> list:
    return [pytest.param(code, id=f"{page.relative_to(ROOT)}:{i}")
            for page in pages for i, code in enumerate(snippets(page.read_text()))]


def test_snippets_are_found_in_fences_and_inline_spans():
    page = ("Run `python -c 'import a;\n  b()'` then\n\n```\n$ python -c \"x = 1\nprint(x)\"\n"
            "1\n```\n\n```python\ny = 2\n```\n")
    assert snippets(page) == ['x = 1\nprint(x)', "y = 2\n", "import a; b()"]


@pytest.mark.e2e
@pytest.mark.parametrize("code", cases(RUN))
def test_doc_snippet_runs(code):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("code", cases(IMPORT_ONLY))
def test_benchmark_snippet_imports_exist(code):
    if "…" in code:  # an elided call: only the text before the ellipsis is a program
        code = code.split("…")[0].rsplit(";", 1)[0]
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(OURS):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"), f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    importlib.import_module(alias.name)
