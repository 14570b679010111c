"""The house rules of issues 48, 64 and 80, measured over dxrun/ by reading its source (AST,
tokens, regex; nothing imported), and two by running it (what a one-step run loads): each bar is
a ceiling at today's value, so a change that makes the code worse fails here. When the code gets
better, lower the ceiling to the new value (the failure message of a ceiling that is too high
says so too); never raise one to make a change pass.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dxrun"

# Today's values: the ceilings. The goal for each is in the comment.
CFG_ANY = 7  # lines reading "cfg: Any" (grep -rn "cfg: Any" dxrun); goal <= 10, entry points
SEARCH_LINES = 50  # lines of dxrun/autotune/search.py's search() (the goal)
MAIN_LINES = 40  # lines of dxrun/__main__.py's main() (issue 64's goal)
LONGEST_DEF = 120  # lines of the longest class or function in TRAINER_MODULES (the goal)
LONGEST_HOOK = 60  # lines of the longest of the trainer's hooks, dxrun/train/hooks.py (the goal)
# The trainer and its hooks, the entry point and the job's status writer (issue 64).
TRAINER_MODULES = ("train/trainer.py", "train/hooks.py", "__main__.py")
# issue 64: no class or function over 120 lines anywhere in dxrun/, nested ones too (the goal)
LONGEST_ANYWHERE = 120
# No ceiling on a module's lines: issue 64 judges the house by how few modules a run passes
# through, and a 400-line cap (issue 48) split concepts into files to meet it. A module holds one
# concept, whole; its classes and functions stay short (LONGEST_ANYWHERE).
LARGEST_MODULE_DOCSTRING = 15  # source lines of the longest module docstring (the goal)
DOCSTRINGS_OVER_15: set[str] = set()  # modules whose docstring is longer than 15 lines
# function-local imports of dxrun modules; goal <= 30. Issue 80 added one: train.prepare imports
# the layout search for parallelism=auto alone, so that a fixed layout loads nothing of autotune/.
LOCAL_IMPORTS = 11
LOCAL_IMPORTS_WITHOUT_REASON = 0  # of those, without a trailing comment saying why
IMPORT_CIRCLES = 0  # sets of dxrun modules that reach each other through imports
MODULES_IN_CIRCLES = 0  # the modules in those sets
UPWARD_IMPORTS = 0  # imports of a module on a higher floor of LAYERS
# dxrun modules the widest module imports (function-local and type-only ones too; a package's
# face counts once): a module with many neighbours holds more than one responsibility (issue 64);
# goal <= 12 (issue 80)
MOST_IMPORTED = 11
# Issue 80: ceilings that neither concatenating modules nor splitting them can game.
# The largest module's lines; goal <= 500. The modules still over 500 lines, each to be split
# along its seams (a new module over 500 fails; one that drops under it leaves the set).
LARGEST_MODULE = 493
MODULES_OVER_500: set[str] = set()
# Lines of the dxrun modules outside model/ and config/ that the default run has loaded by its
# end (``sys.modules``, a one-step run: what its first step needed and little more); goal <= 8,000
ENTRY_LINES = 14544
# Lines of the dxrun modules the model package loads outside itself through its imports (a
# module loads its package's face first); goal <= 3,000
MODEL_CLOSURE = 2503
# Imports in dxrun of a module inside another package, past its face (``__init__``); goal 0
PAST_A_FACE = 35
PACKAGE_CIRCLES = 0  # sets of dxrun packages that reach each other through imports
PACKAGE_UPWARD = 0  # imports of a package on a higher floor of LAYERS (a package's own floor)
FIGURES = 0  # comment/docstring lines quoting a measured time or ratio
# Packages by concept (issue 64): the pipeline at the top, each family in its package.
TOP_MODULES = 11  # .py files directly in dxrun/, __init__ and __main__ included; goal <= 15
REPEATED_NAMES = 0  # module or package names used twice under dxrun/ (__init__, __main__ aside)
MODEL_IMPORTS_OUTSIDE = 0  # imports in dxrun/model/ of dxrun outside it, the config and the plan
# What the model package may import (type-only imports too): itself, the config, the plan.
MODEL_MAY_IMPORT = ("dxrun.model", "dxrun.config", "dxrun.plan")

# The floors, lowest first (STYLE.md, "As dxrun grows"; issue 48): a module may import modules
# on its own floor or below. A module's floor is the one of its longest prefix listed here, so a
# new package (dxrun/plan/, dxrun/autotune/) is placed by one entry; a module no prefix places
# fails ``test_every_module_has_a_floor``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the config family: the schema and its sections, keys, the Hydra registry, _target_ and the
    # run's outcomes (errors); the checks of a composed config sit higher (dxrun.checks)
    ("config", ("dxrun", "dxrun.config")),
    # the run and its directory (its job's status is written from the entry floor: job_dir)
    ("host", ("dxrun.run",)),
    # the plan, and the HF table with its readers and writer (numpy, no JAX)
    ("plan", ("dxrun.plan", "dxrun.cost", "dxrun.estimates", "dxrun.hf")),
    # the model family: the model, its attention and kernels, its losses and objectives, your
    # own model, and the logical-axis rules that place it (it imports the config and the plan)
    ("experiment", ("dxrun.model", "dxrun.metrics", "dxrun.data", "dxrun.checks",
                    "dxrun.experiment")),
    # a run fitted to its devices, on every run's path: its decision and the memory preflight
    ("fit", ("dxrun.fit",)),
    # the wing that needs a compiled step, entered for parallelism=auto and plan mode alone:
    # the layout search and plan mode
    ("autotune", ("dxrun.autotune",)),
    # the loop and what reads its outputs (the profile reads the trace tracking writes)
    ("loop", ("dxrun.train", "dxrun.checkpointing", "dxrun.tracking", "dxrun.report",
              "dxrun.tools", "dxrun.profile")),
    # the entry points: python -m dxrun and the commands (each command's code is its module)
    ("entry", ("dxrun.__main__", "dxrun.evaluate",
               "dxrun.sample", "dxrun.export", "dxrun.logits", "dxrun.launch", "dxrun.dashboard",
               "dxrun.report.__main__", "dxrun.data.prepare")),
)

# A measured time or ratio: "102 ms", "1.24x", "1.12×" (issue 48's grep). Formulas and shapes
# are not measurements: "3 x forward", "(2 x)", "16 x 1024" (a spaced x before a name, a closing
# bracket, a number or the line's end) are taken out before the grep.
FIGURE = re.compile(r"\d+(\.\d+)?\s?(ms|x|×)\b")
NOT_A_FIGURE = re.compile(r"\d+(\.\d+)? x(?=\s+[\w(]|\)|$)")


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _source(path: Path) -> str:
    return path.read_text()


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(_source(path))


@cache
def _comments(path: Path) -> list[tuple[int, str]]:
    return [(t.start[0], t.string) for t in
            tokenize.generate_tokens(io.StringIO(_source(path)).readline)
            if t.type == tokenize.COMMENT]


def _docstrings(path: Path) -> list[ast.Expr]:
    nodes = (n for n in ast.walk(_tree(path)) if isinstance(
        n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return [n.body[0] for n in nodes if n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant) and isinstance(n.body[0].value.value, str)]


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, type_only: bool = False) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import of a dxrun module in ``path`` and whether it sits inside a function; those
    under ``if TYPE_CHECKING:`` (annotations only, never run) are left out unless ``type_only``."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
                continue
            if isinstance(child, ast.ImportFrom) and child.level == 0 and (
                    child.module or "").split(".")[0] == "dxrun":
                out.append((child, in_function))
            elif isinstance(child, ast.Import) and any(
                    a.name.split(".")[0] == "dxrun" for a in child.names):
                out.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef, ast.Lambda)))

    visit(_tree(path), False)
    return out


@cache
def _face_names(package: str) -> frozenset[str]:
    """The names a package's ``__init__`` binds by importing them (its face); none for a module."""
    init = PACKAGE.parent / package.replace(".", "/") / "__init__.py"
    if not init.is_file():
        return frozenset()
    return frozenset(a.asname or a.name for node in _tree(init).body
                     if isinstance(node, ast.ImportFrom) for a in node.names)


@cache
def _graph(type_only: bool = False) -> dict[str, set[str]]:
    """dxrun module -> the dxrun modules it imports (at module level or in a function; with
    ``type_only``, under ``if TYPE_CHECKING:`` too)."""
    modules = {_module(p) for p in _files()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for path in _files():
        me, targets = _module(path), set()
        for node, _ in _imports(path, type_only):
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            else:  # ``from dxrun import run_dir``: the module run_dir; else the module itself
                # (a name its package's face gives, ``from dxrun.fit import decide``, is the face's)
                targets |= {resolve(f"{node.module}.{a.name}") if f"{node.module}.{a.name}"
                            in modules and a.name not in _face_names(node.module)
                            else resolve(node.module) for a in node.names}
        graph[me] = {t for t in targets if t and t != me}
    return graph


def _floor(module: str) -> int | None:
    best, floor = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "dxrun" places the package's __init__ only, not every module under it
            under = module.startswith(prefix + ".") and prefix != "dxrun"
            if (module == prefix or under) and len(prefix) > best:
                best, floor = len(prefix), i
    return floor


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _at_most(name: str, value: int, ceiling: int, detail: object = "") -> None:
    assert value <= ceiling, f"{name}: {value}, above its ceiling {ceiling}. {detail}"
    if value < ceiling:
        print(f"{name}: {value}, below its ceiling {ceiling}: lower {name} in tests/test_house.py")


def _largest_and_those_over(name: str, values: dict[str, int], ceiling: int, bar: int,
                            listed: set[str], listed_name: str) -> None:
    """The largest of ``values`` at most ``ceiling``, and those over ``bar`` among ``listed``
    (a set that may only shrink)."""
    largest = max(values, key=values.get)
    _at_most(name, values[largest], ceiling, largest)
    over = {k for k, n in values.items() if n > bar}
    assert over <= listed, f"over {bar} lines: {sorted(over - listed)}"
    if over < listed:
        print(f"no longer over {bar} lines: {sorted(listed - over)}: drop them from {listed_name}")


def test_the_config_is_typed_below_the_entry_points():
    hits = [f"{_rel(p)}:{i}" for p in _files()
            for i, line in enumerate(_source(p).splitlines(), 1) if "cfg: Any" in line]
    _at_most("CFG_ANY", len(hits), CFG_ANY, hits)


def test_the_search_reads_in_one_screen():
    """``search()`` is the layout search's outline; its stages are functions beside it."""
    path = PACKAGE / "autotune" / "search.py"
    (fn,) = [n for n in _tree(path).body if isinstance(n, ast.FunctionDef) and n.name == "search"]
    _at_most("SEARCH_LINES", fn.end_lineno - fn.lineno + 1, SEARCH_LINES,
             "dxrun.autotune.search.search")


def _defs(path: Path) -> dict[str, int]:
    """Every class and function in ``path`` (nested ones too) and its lines."""
    return {f"{_rel(path)}:{n.lineno} {n.name}": n.end_lineno - n.lineno + 1
            for n in ast.walk(_tree(path))
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_entry_point_composes_builds_and_runs_in_one_screen():
    """``main()`` composes, builds the run and executes it; the stages are functions beside it
    and how the job ended is ``JobStatus``'s (dxrun/__main__.py), not an ``except`` arm each."""
    path = PACKAGE / "__main__.py"
    (fn,) = [n for n in _tree(path).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    _at_most("MAIN_LINES", fn.end_lineno - fn.lineno + 1, MAIN_LINES, "dxrun.__main__.main")
    arms = [n for n in ast.walk(fn) if isinstance(n, ast.ExceptHandler)]
    assert not arms, "main() ends the job through JobStatus, not its own except arms"


def test_the_trainer_and_its_hooks_stay_short():
    defs = {k: v for name in TRAINER_MODULES for k, v in _defs(PACKAGE / name).items()}
    longest = max(defs, key=defs.get)
    _at_most("LONGEST_DEF", defs[longest], LONGEST_DEF, longest)
    path = PACKAGE / "train" / "hooks.py"
    hooks = {f"{_rel(path)}:{n.lineno} {n.name}": n.end_lineno - n.lineno + 1
             for n in _tree(path).body if isinstance(n, ast.ClassDef)
             and any(ast.unparse(b) == "Hook" for b in n.bases)}
    assert len(hooks) >= 6, f"the hooks of dxrun/train/hooks.py: {sorted(hooks)}"
    longest = max(hooks, key=hooks.get)
    _at_most("LONGEST_HOOK", hooks[longest], LONGEST_HOOK, longest)


def test_no_class_or_function_is_long():
    defs = {k: v for p in _files() for k, v in _defs(p).items()}
    longest = max(defs, key=defs.get)
    _at_most("LONGEST_ANYWHERE", defs[longest], LONGEST_ANYWHERE,
             f"{longest}; over 120: {sorted(k for k, v in defs.items() if v > 120)}")


def test_module_docstrings_stay_short():
    lengths = {_rel(p): d[0].end_lineno - d[0].lineno + 1 for p in _files()
               if (d := _docstrings(p)) and isinstance(_tree(p).body[0], ast.Expr)
               and d[0] is _tree(p).body[0]}
    _largest_and_those_over("LARGEST_MODULE_DOCSTRING", lengths, LARGEST_MODULE_DOCSTRING,
                            15, DOCSTRINGS_OVER_15, "DOCSTRINGS_OVER_15")


def test_function_local_imports_are_few_and_say_why():
    local = [(p, node) for p in _files() for node, in_function in _imports(p) if in_function]
    silent = []
    for path, node in local:
        commented = {line for line, _ in _comments(path)}
        if not commented & set(range(node.lineno, node.end_lineno + 1)):
            silent.append(f"{_rel(path)}:{node.lineno}")
    _at_most("LOCAL_IMPORTS", len(local), LOCAL_IMPORTS)
    _at_most("LOCAL_IMPORTS_WITHOUT_REASON", len(silent), LOCAL_IMPORTS_WITHOUT_REASON,
             f"a function-local import needs a trailing comment saying why, e.g. "
             f"'# JAX after device count'; without one: {silent}")


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in _graph() if _floor(m) is None)
    assert not unplaced, f"add these modules to a floor of LAYERS in tests/test_house.py: {unplaced}"


def test_no_import_circles():
    """Type-only imports included (issue 64): a circle drawn by annotations alone is one a
    reader walks all the same."""
    circles = _circles(_graph(type_only=True))
    _at_most("IMPORT_CIRCLES", len(circles), IMPORT_CIRCLES, [sorted(c) for c in circles])
    _at_most("MODULES_IN_CIRCLES", sum(map(len, circles)), MODULES_IN_CIRCLES,
             [sorted(c) for c in circles])


def test_imports_point_down():
    graph = _graph(type_only=True)  # type-only imports included (issue 64)
    upward = sorted(f"{m} ({LAYERS[_floor(m)][0]}) -> {t} ({LAYERS[_floor(t)][0]})"
                    for m, targets in graph.items() for t in targets
                    if _floor(m) is not None and _floor(t) is not None and _floor(t) > _floor(m))
    _at_most("UPWARD_IMPORTS", len(upward), UPWARD_IMPORTS, upward)


def test_no_module_imports_many_others():
    """A module's fan-out: the other dxrun modules it imports, type-only and function-local
    imports included (``from dxrun.pkg import name`` counts the module ``name`` is, else pkg)."""
    graph = _graph(type_only=True)
    widest = max(graph, key=lambda m: len(graph[m]))
    _at_most("MOST_IMPORTED", len(graph[widest]), MOST_IMPORTED,
             f"{widest}: {sorted(graph[widest])}")


def _lines(module: str) -> int:
    path = PACKAGE.parent / module.replace(".", "/")
    return len(_source(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
               .splitlines())


def _package(module: str) -> str:
    """The package a module belongs to (``dxrun.plan.mesh`` -> ``dxrun.plan``); a module directly
    in dxrun/ is its own (``dxrun.train``), as is the package's ``__init__``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _package_graph() -> dict[str, set[str]]:
    """dxrun package -> the dxrun packages its modules import (type-only and function-local
    imports too): the hands between the house's rooms."""
    out: dict[str, set[str]] = {}
    for module, targets in _graph(type_only=True).items():
        me = _package(module)
        out.setdefault(me, set()).update(_package(t) for t in targets if _package(t) != me)
    return out


def test_the_packages_point_down_and_reach_no_circle():
    """Issue 80: at the package level, as at the file level, no circle and no upward arrow
    (a package's floor is its own entry's in LAYERS)."""
    graph = _package_graph()
    circles = _circles(graph)
    _at_most("PACKAGE_CIRCLES", len(circles), PACKAGE_CIRCLES, [sorted(c) for c in circles])
    upward = sorted(f"{p} ({LAYERS[_floor(p)][0]}) -> {q} ({LAYERS[_floor(q)][0]})"
                    for p, targets in graph.items() for q in targets
                    if _floor(p) is not None and _floor(q) is not None and _floor(q) > _floor(p))
    _at_most("PACKAGE_UPWARD", len(upward), PACKAGE_UPWARD, upward)


def test_packages_are_entered_through_their_faces():
    """Issue 80: a package's ``__init__`` names what the rest may use; another package imports
    those names from it, not from the module behind (tests may reach further)."""
    past = sorted(f"{m} -> {t}" for m, targets in _graph(type_only=True).items() for t in targets
                  if _package(t) != _package(m) and t != _package(t))
    _at_most("PAST_A_FACE", len(past), PAST_A_FACE, past)


def test_no_module_is_large():
    """Issue 80: one concept a file; a module over 500 lines is two (or a list of them waiting)."""
    lines = {_rel(p): len(_source(p).splitlines()) for p in _files()}
    _largest_and_those_over("LARGEST_MODULE", lines, LARGEST_MODULE, 500, MODULES_OVER_500,
                            "MODULES_OVER_500")


def test_the_model_pulls_in_little():
    """The lines the model package loads outside itself: its imports' closure, each module's
    package face loaded before it (what ``import`` does), type-only imports aside."""
    graph = _graph()
    reached, todo = set(), [m for m in graph if m.startswith("dxrun.model")]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo += graph.get(module, set())
        parent = module.rpartition(".")[0]
        if parent != "dxrun" and parent in graph:
            todo.append(parent)
    outside = sorted(m for m in reached if not m.startswith("dxrun.model"))
    _at_most("MODEL_CLOSURE", sum(map(_lines, outside)), MODEL_CLOSURE, outside)


# A one-step default run in a process of its own; at its exit, the dxrun modules it loaded.
LOADED = """
import atexit, json, os, runpy, sys
atexit.register(lambda: json.dump(sorted(m for m in sys.modules if m.split(".")[0] == "dxrun"),
                                  open(os.environ["DXRUN_LOADED"], "w")))
sys.argv = ["dxrun", *sys.argv[1:]]
runpy.run_module("dxrun", run_name="__main__", alter_sys=True)
"""
ONE_STEP = ("train.steps=1", "logger=none", "checkpoint.every=0", "train.eval_every=0")


def _loaded(tmp_path: Path, *overrides: str) -> list[str]:
    import subprocess
    import sys

    from conftest import subprocess_env

    out = tmp_path / "loaded.json"  # (the entry module runs as __main__: counted by its name)
    run = subprocess.run([sys.executable, "-c", LOADED, *ONE_STEP, *overrides], cwd=tmp_path,
                         env={**subprocess_env(), "DXRUN_LOADED": str(out)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return ["dxrun.__main__", *json.loads(out.read_text())]


def test_the_default_run_loads_few_lines(tmp_path):
    """Issue 80: measured at run time, what a newcomer's run walks through: the lines of the
    dxrun modules loaded outside model/ and config/ (the counts of modules and arrows that
    splitting or concatenating moves say less)."""
    outside = [m for m in _loaded(tmp_path) if not m.startswith(("dxrun.model", "dxrun.config"))]
    _at_most("ENTRY_LINES", sum(map(_lines, outside)), ENTRY_LINES, outside)


def test_a_fixed_layout_loads_nothing_of_the_autotune_wing(tmp_path):
    """Issue 80: the layout search and plan mode are entered for ``parallelism=auto`` and
    ``run.mode=plan`` alone; a run of a fixed layout decides and checks its memory without
    them (``dxrun.fit``)."""
    loaded = _loaded(tmp_path, "parallelism=dp8")
    assert "dxrun.fit" in loaded and "dxrun.train" in loaded
    assert [m for m in loaded if m.startswith("dxrun.autotune")] == []


def test_the_top_holds_the_pipeline_and_the_commands():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    _at_most("TOP_MODULES", len(top), TOP_MODULES, f"dxrun/: {top}; a module that belongs to a "
             "family goes into its package (dxrun/model/, dxrun/config/, dxrun/run/, ...)")


def test_no_two_modules_share_a_name():
    """A name says which module: ``load`` or ``config`` twice makes every mention ambiguous.
    Packages count by their dir's name; every package's ``__init__`` and ``__main__`` aside."""
    names: dict[str, list[str]] = {}
    for path in _files():
        if path.stem not in ("__init__", "__main__"):
            names.setdefault(path.stem, []).append(_rel(path))
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent != PACKAGE:
            names.setdefault(init.parent.name, []).append(_rel(init.parent) + "/")
    repeated = {name: where for name, where in names.items() if len(where) > 1}
    _at_most("REPEATED_NAMES", len(repeated), REPEATED_NAMES, repeated)


def test_the_model_imports_only_itself_the_config_and_the_plan():
    outside = []
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        for node in ast.walk(_tree(path)):  # type-only imports too
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = ([f"dxrun.{a.name}" for a in node.names] if node.module == "dxrun"
                           else [node.module])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            outside += [f"{_rel(path)}:{node.lineno} {t}" for t in targets
                        if t.split(".")[0] == "dxrun" and not any(
                            t == p or t.startswith(p + ".") for p in MODEL_MAY_IMPORT)]
    _at_most("MODEL_IMPORTS_OUTSIDE", len(outside), MODEL_IMPORTS_OUTSIDE, outside)


def test_no_measured_figures_in_comments():
    hits = []
    for path in _files():
        lines = list(_comments(path))
        for d in _docstrings(path):
            lines += [(d.lineno + i, text) for i, text in enumerate(d.value.value.splitlines())]
        hits += [f"{_rel(path)}:{n}: {text.strip()}" for n, text in lines
                 if FIGURE.search(NOT_A_FIGURE.sub("", text))]
    _at_most("FIGURES", len(hits), FIGURES,
             "a measured figure belongs in BENCHMARKS.md or docs/guide beside its command:\n"
             + "\n".join(hits))


def test_the_floors_and_the_circle_finder_work():
    """The measuring itself, on a made-up graph: a circle is found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []
    assert _floor("dxrun.cost.targets") < _floor("dxrun.fit.decide") < _floor("dxrun.autotune.search")
    assert _floor("dxrun.plan.run_plan") == _floor("dxrun.plan")  # a package placed by its prefix
    assert FIGURE.search(NOT_A_FIGURE.sub("", "ran 1.24x slower"))
    assert FIGURE.search(NOT_A_FIGURE.sub("", "its first turn 102 ms"))
    assert not FIGURE.search(NOT_A_FIGURE.sub("", "forward + backward = 3 x forward"))
    assert not FIGURE.search(NOT_A_FIGURE.sub("", "16 x 1024 tokens"))
