"""One typed plan owns every run decision (issue 64): the attention kernel, the loss chunk,
ZeRO-1 and the precision are each computed in one function, which only ``make_plan`` calls, so
each is decided once, before the model is built, and read from the plan by everything else (the
model and step, plan mode, the memory and time models, the layout search, sampling). Found by
reading dxrun/'s source (AST): nothing imported."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dxrun"

# decision -> (the one function that computes it, the module that defines it)
DECISIONS = {
    "attention kernel": ("plan_kernel", "dxrun/plan/kernels.py"),
    "loss chunk": ("loss_chunk_for", "dxrun/plan/batch.py"),
    "ZeRO-1": ("shard_optimizer", "dxrun/plan/mesh.py"),
    "precision": ("compute_dtype", "dxrun/plan/mesh.py"),
}
PLAN_BUILDER = ("dxrun/plan/mesh.py", "make_plan")  # the one place that builds the plan
# Below a decision: the kernel table's rule, asked by ``plan_kernel`` alone; the loss chunk's
# rule, asked by ``loss_chunk_for`` and by the config check (which refuses a chunk that does not
# divide the sequence before JAX starts, and keeps no chunk).
HELPERS = {"choose": {("dxrun/plan/kernels.py", "plan_kernel")},
           "resolve_loss_chunk": {("dxrun/plan/batch.py", "loss_chunk_for"),
                                  ("dxrun/checks/validation.py", "check_data")}}
STEP_FACTORY_ARGS = 5


@cache
def _trees() -> dict[str, ast.Module]:
    return {p.relative_to(PACKAGE.parent).as_posix(): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def _enclosing(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node -> the name of the outermost function (or class) of the module holding it."""
    out: dict[ast.AST, str] = {}
    for top in tree.body:
        name = getattr(top, "name", "<module>")
        for node in ast.walk(top):
            out[node] = name
    return out


def _called(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def definitions(name: str) -> list[str]:
    return [path for path, tree in _trees().items() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name]


def call_sites(name: str) -> list[tuple[str, str]]:
    """(module, enclosing top-level function) of every call of ``name`` in dxrun/."""
    out = []
    for path, tree in _trees().items():
        where = _enclosing(tree)
        out += [(path, where[node]) for node in ast.walk(tree)
                if isinstance(node, ast.Call) and _called(node) == name]
    return out


def test_each_decision_is_computed_in_one_function_called_where_the_plan_is_built():
    for decision, (fn, module) in DECISIONS.items():
        assert definitions(fn) == [module], f"{decision}: {fn} defined in {definitions(fn)}"
        sites = call_sites(fn)
        assert sites, f"{decision}: {fn} is never called"
        assert set(sites) == {PLAN_BUILDER}, (
            f"{decision} is taken outside the plan: {fn} called from {sorted(set(sites))}; "
            f"read it from the plan (MeshPlan) instead")
    assert len(call_sites(PLAN_BUILDER[1])) > 1  # the run, plan mode, the search: one builder
    assert definitions(PLAN_BUILDER[1]) == [PLAN_BUILDER[0]]
    for fn, sites in HELPERS.items():
        assert set(call_sites(fn)) == sites, (fn, call_sites(fn))


def test_no_table_of_compute_dtypes_outside_the_plan():
    """The precision's dtype is looked up once (``compute_dtype``): no module keeps a table of
    its own from train.precision to a dtype."""
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                assert node.id != "COMPUTE_DTYPES", path


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    return (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
            + (a.kwarg is not None))


def test_the_step_factories_take_the_plan_not_its_pieces():
    step = _trees()["dxrun/experiment/step.py"]
    defs = {n.name: n for n in step.body if isinstance(n, ast.FunctionDef)}
    for name in ("make_train_step", "make_eval_step"):
        assert _params(defs[name]) <= STEP_FACTORY_ARGS, (name, _params(defs[name]))


def test_one_carrier_from_the_decision_to_the_loop():
    classes = [(path, n.name) for path, tree in _trees().items() for n in ast.walk(tree)
               if isinstance(n, ast.ClassDef) and n.name in ("Decided", "Prepared")]
    assert classes == [("dxrun/fit/decide.py", "Decided")]
