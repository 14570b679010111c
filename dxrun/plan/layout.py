"""A layout: the mesh, the recomputation and the micro-batches a run is laid out with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dxrun.config.schema_parallel import AXES
from dxrun.plan.axes import AxisAttrs, Sizes


@dataclass(frozen=True)
class Layout(AxisAttrs):
    """How a run is laid out: the mesh (``sizes``: each axis's size by key; ``.dp``, ``.tp``,
    ... read one), the recomputation (``model.remat``) and the micro-batches of one update
    (``train.grad_accum``)."""

    sizes: Sizes = Sizes()
    remat: str = "none"
    grad_accum: int = 1

    @classmethod
    def of(cls, remat: str = "none", grad_accum: int = 1, **sizes: int) -> Layout:
        """``Layout.of(dp=4, tp=2, remat="dots")``: the axes by key, those not given 1."""
        return cls(Sizes(sizes), remat, grad_accum)

    @property
    def mesh(self) -> str:
        """The preset-style name: ``dp4_tp2``, ``fsdp8``, ``dp2_fsdp2_tp2``, ``cp2_tp4``, ``dp1``."""
        parts = [f"{k}{v}" for k, v in self.sizes.items() if v > 1]
        return "_".join(parts) or "dp1"

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Each axis's size by its JAX mesh axis name (``data``, ``fsdp``, ...)."""
        return {a.mesh: self.sizes[a.key] for a in AXES}

    @property
    def label(self) -> str:
        extra = [f"remat={self.remat}"] * (self.remat != "none") + [
            f"accum={self.grad_accum}"] * (self.grad_accum > 1)
        return " ".join([self.mesh, *extra])

    def overrides(self) -> dict[str, Any]:
        """The config keys that name this layout (what a run's saved record holds)."""
        return {"parallelism": dict(self.sizes), "model": {"remat": self.remat},
                "train": {"grad_accum": self.grad_accum}}

    def to_json(self) -> dict[str, Any]:
        """The layout as a ranking row holds it: each axis's size by key, remat, grad_accum
        (what ``layout_of`` reads back)."""
        return {**self.sizes, "remat": self.remat, "grad_accum": self.grad_accum}


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout of a ranking row or record (``plan.json``'s), an axis it lacks 1 (cp, in
    one written before the context axis)."""
    return Layout(Sizes({a.key: row[a.key] for a in AXES if a.key in row}), row["remat"],
                  row["grad_accum"])
