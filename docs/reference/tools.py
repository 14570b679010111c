"""The Command-line tools page: each tool's usage as the code defines it (its argument parser,
Hydra's flags, or the module docstring of a ``key=value`` tool)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import sys
from typing import Any

from docs.reference.markdown import PACKAGE

# Every ``python -m`` entry point of dxrun a user runs, with how its usage is read; a new one not
# listed here fails the tests. (The benchmarks, run from the checkout: docs/guide/benchmarks.md.)
TOOLS: dict[str, str] = {
    "dxrun": "hydra",
    "dxrun.evaluate": "docstring",
    "dxrun.sample": "docstring",
    "dxrun.export": "docstring",
    "dxrun.logits": "docstring",
    "dxrun.launch": "argparse",
    "dxrun.report": "argparse",
    "dxrun.data.prepare": "argparse",
    "dxrun.dashboard": "argparse",
    "dxrun.profile": "argparse",
}

_MAIN_GUARDS = ("__name__ == '__main__'", "'__main__' == __name__")


def entry_points() -> set[str]:
    """Modules of dxrun/ runnable with ``python -m``: a ``__main__.py`` or a ``__main__`` guard."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        mod = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if path.name == "__main__.py":
            out.add(mod.removesuffix(".__main__"))
        elif any(isinstance(n, ast.If) and ast.unparse(n.test) in _MAIN_GUARDS
                 for n in ast.parse(path.read_text()).body):
            out.add(mod)
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _argparse_help(module: str) -> str:
    """The tool's own ``--help``: its main() is run until it parses, and the parser kept."""
    spec = importlib.util.find_spec(module)
    is_package = spec is not None and spec.submodule_search_locations is not None
    mod = importlib.import_module(module + ".__main__" if is_package else module)

    def capture(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self)

    saved = {n: getattr(argparse.ArgumentParser, n) for n in ("parse_args", "parse_known_args")}
    old_columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        for n in saved:
            setattr(argparse.ArgumentParser, n, capture)
        try:
            mod.main([])
        except _Captured as c:
            parser = c.parser
        else:
            raise LookupError(f"{module}.main() parsed no arguments")
    finally:
        for n, f in saved.items():
            setattr(argparse.ArgumentParser, n, f)
    try:
        parser.prog = f"python -m {module}"
        text = parser.format_help()
    finally:
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns
    return text.replace(str(PACKAGE.parent) + os.sep, "")


def _hydra_help() -> str:
    from hydra._internal.utils import get_args_parser

    argv0, sys.argv[0] = sys.argv[0], "python -m dxrun"  # the shell-completion help names it
    try:
        parser = get_args_parser()
        for action in parser._actions:  # Hydra's completion help is a lazy object, not a str
            action.help = None if action.help is None else str(action.help)
    finally:
        sys.argv[0] = argv0
    parser.prog = "python -m dxrun"
    with contextlib.redirect_stdout(io.StringIO()):
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"
        try:
            return parser.format_help()
        finally:
            os.environ.pop("COLUMNS", None) if old is None else os.environ.__setitem__("COLUMNS", old)


def tool_usage(module: str) -> str:
    how = TOOLS[module]
    if how == "argparse":
        return _argparse_help(module)
    if how == "hydra":
        return _hydra_help()
    doc = inspect.getdoc(importlib.import_module(module)) or ""
    text = doc.replace("``", "`")
    opts = getattr(importlib.import_module(module), "OPTIONS", None)
    if opts:
        text += "\n\nOptions (key=value, defaults): " + " ".join(f"{k}={v!r}" for k, v in opts.items())
    return text


def tools_markdown() -> str:
    out = ["# Command-line tools", "",
           "Each tool's usage as the code defines it: the argument parser of the argparse "
           "tools, Hydra's flags for `python -m dxrun`, the module docstring of the tools that "
           "take `key=value` arguments.", ""]
    for module in TOOLS:
        out += [f"## `python -m {module}`", ""]
        if module == "dxrun":
            out += ["Composes the run config from the config groups and `key=value` overrides "
                    "(every key: [Config keys](config.md); every option: [Presets](presets.md)), "
                    "then plans, trains and logs. `-m` runs a sweep (multirun). Also installed "
                    "as the `dxrun` command. Hydra's flags:", ""]
        if TOOLS[module] == "docstring":
            out += [tool_usage(module), ""]
        else:
            out += ["```text", tool_usage(module).rstrip(), "```", ""]
    out += ["The benchmarks are not installed with dxrun: they run from the checkout as "
            "`python -m benchmarks` (see [Benchmarks](../guide/benchmarks.md)).", ""]
    return "\n".join(out)
