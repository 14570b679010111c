"""Issue 64's bar for mesh axes as data: a new axis is a row of ``schema_parallel.AXES`` (its
rules and presets aside). A fake fifth axis, ``xp`` (mesh axis ``extra``, innermost, its groups
inside a host), is appended to the table, and the layout, the plan, the host split, the host
grid and the layout search carry it with no other change to dxrun's code."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dxrun.config import schema_parallel
from dxrun.config.schema_parallel import Axis


@pytest.fixture
def extra_axis(monkeypatch):
    """``AXES`` with ``xp`` appended, in every dxrun module that reads the table."""
    import dxrun.cost  # noqa: F401  (the plan too: the layouts read it)
    import dxrun.model.sharding  # noqa: F401  (its host_grid reads the table through the plan)

    table = schema_parallel.AXES
    axes = (*table, Axis("xp", "extra"))
    for name, module in list(sys.modules.items()):
        if name.startswith("dxrun") and getattr(module, "AXES", None) is table:
            monkeypatch.setattr(module, "AXES", axes)
    return axes


def test_a_new_axis_is_a_row_of_the_table(extra_axis, cfg_factory):
    from dxrun.cost import meshes
    from dxrun.model.sharding import host_grid
    from dxrun.plan import Layout, Sizes, layout_of, make_plan, resolve_axes, shrink, split_over_hosts

    assert list(Sizes(dp=2)) == ["dp", "fsdp", "ep", "cp", "tp", "xp"]
    layout = Layout.of(dp=4, xp=2)
    assert (layout.mesh, layout.xp, layout.mesh_sizes["extra"]) == ("dp4_xp2", 2, 2)
    assert layout.overrides()["parallelism"]["xp"] == 2
    assert layout_of(layout.to_json()) == layout
    # A record written before the axis reads it as 1.
    assert layout_of({"dp": 8, "fsdp": 1, "tp": 1, "remat": "none", "grad_accum": 1}).xp == 1
    assert resolve_axes({"dp": 2, "fsdp": 1, "cp": 1, "tp": 1, "xp": -1}, 8)["xp"] == 4
    assert shrink({"dp": 1, "fsdp": 1, "cp": 1, "tp": 1, "xp": 16}, 8)["xp"] == 8
    # Innermost and inside a host: what the host has left goes to the axes outside it.
    assert dict(split_over_hosts(Sizes(dp=4, xp=2), 2)) == {
        "dp": 2, "fsdp": 1, "ep": 1, "cp": 1, "tp": 1, "xp": 1}
    assert {m["xp"] for m in meshes(8, 0)} == {1, 2, 4, 8}

    cfg = cfg_factory("model.n_heads=4", "model.n_kv_heads=4", "data.batch_size=16")
    plan = make_plan(cfg, 8, "cpu", processes=2, layout=layout)
    assert (plan.shape, plan.n_devices, plan.xp) == ((4, 1, 1, 1, 1, 2), 8, 2)
    assert plan.dcn == Sizes(dp=2) and plan.local == Sizes(dp=2, xp=2)
    assert "data=4 x fsdp=1 x tensor=1 x extra=2" in plan.table()
    assert (plan.to_json()["xp"], plan.to_json()["dcn"]["xp"]) == (2, 1)
    # The host grid lays each process's devices in its host's part of every axis, xp included.
    grid = host_grid(plan, [i // 4 for i in range(8)])
    assert grid.shape == plan.shape and sorted(grid.ravel()) == list(range(8))
    assert np.all(grid[:2] < 4) and np.all(grid[2:] >= 4)
