"""A layout: the mesh, the recomputation and the micro-batches a run is laid out with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dxrun.config.schema_parallel import AXES, axis_sizes


@dataclass(frozen=True)
class Layout:
    """How a run is laid out: the mesh, the recomputation (``model.remat``) and the
    micro-batches of one update (``train.grad_accum``)."""

    dp: int
    fsdp: int
    tp: int
    remat: str = "none"
    grad_accum: int = 1
    cp: int = 1  # the context axis (last: the positional dp, fsdp, tp, ... stay as they were)

    @property
    def mesh(self) -> str:
        """The preset-style name: ``dp4_tp2``, ``fsdp8``, ``dp2_fsdp2_tp2``, ``cp2_tp4``, ``dp1``."""
        parts = [f"{k}{v}" for k, v in axis_sizes(self).items() if v > 1]
        return "_".join(parts) or "dp1"

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Each axis's size by its JAX mesh axis name (``data``, ``fsdp``, ...)."""
        return {a.mesh: getattr(self, a.key) for a in AXES}

    @property
    def label(self) -> str:
        extra = [f"remat={self.remat}"] * (self.remat != "none") + [
            f"accum={self.grad_accum}"] * (self.grad_accum > 1)
        return " ".join([self.mesh, *extra])

    def overrides(self) -> dict[str, Any]:
        """The config keys that name this layout (what a run's saved record holds)."""
        return {"parallelism": axis_sizes(self), "model": {"remat": self.remat},
                "train": {"grad_accum": self.grad_accum}}


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout of a ranking row or record (``plan.json``'s), cp 1 where it was written
    before the context axis."""
    return Layout(**{a.key: row.get(a.key, 1) for a in AXES}, remat=row["remat"],
                  grad_accum=row["grad_accum"])
