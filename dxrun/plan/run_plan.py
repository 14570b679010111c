"""The run plan: every number a run derives from its validated config, decided once
(``dxrun.fit.decide``) and carried, never written back into the config the run follows.

It holds the mesh plan (the layout: dp/fsdp/tp, remat, accumulation; the global batch and
sequence length; the step's attention kernel, loss chunk, ZeRO-1 and precision), the save
cadence, and the layout search's record where one decided the layout. ``saved_config`` is
the one place the derived numbers, and the W&B job type and group the launch gave the run
(``run.Job``), are written, into the record a run's files keep (``config.yaml``, the W&B
config, each checkpoint's config).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dxrun.plan.axes import Layout
from dxrun.plan.mesh import MeshPlan


@dataclass(frozen=True)
class RunPlan:
    mesh: MeshPlan
    # (steps, minutes) between saves, 0 = that cadence off (``checkpointing.cadence``)
    cadence: tuple[int, float] = (0, 0.0)
    # parallelism=auto's ranking (``dxrun.autotune.search``) when the layout was searched for.
    search: dict[str, Any] | None = None

    @property
    def layout(self) -> Layout:
        return self.mesh.layout

    @property
    def global_batch(self) -> int:
        return self.mesh.global_batch

    @property
    def seq_len(self) -> int:
        return self.mesh.seq_len

    @property
    def search_s(self) -> float | None:
        """parallelism=auto's own seconds (``own_s``); None: no search."""
        return own_s(self.search) if self.search else None

    def to_json(self) -> dict[str, Any]:
        """``plan.json`` and the saved config's ``plan``: the mesh plan and the search."""
        return {**self.mesh.to_json(), "layout_search": self.search}


def resolved_config(cfg: DictConfig, plan: RunPlan, *, job_type: str | None = None,
                    group: str | None = None) -> DictConfig:
    """A copy of ``cfg`` holding the plan's global batch and sequence length in
    ``data.batch_size`` and ``data.seq_len`` and, where a search chose the layout, that layout
    as ordinary keys (W&B and sweeps group by them) with the global batch as the one given:
    what the run's files record, and the base of the settings a refusal tries. ``job_type``,
    ``group``: the run's W&B names (``run.Job``) in ``logger``, so that its W&B run, its
    files and the sweep report (which reads them) agree; None keeps the config's. ``cfg``
    itself is read, never rewritten."""
    out = recorded(cfg, plan.global_batch, plan.seq_len,
                   plan.layout if plan.search is not None else None)
    if job_type is not None:
        out.logger.job_type = job_type
    if group is not None:
        out.logger.group = group
    return out


def recorded(cfg: DictConfig, batch: int, seq_len: int, layout: Layout | None = None
             ) -> DictConfig:
    """``resolved_config`` before the layout is decided: the global batch and sequence length
    (and a searched ``layout``) as keys in a copy of ``cfg``; what a resume is checked
    against while a search is still to choose the layout."""
    out = copy.deepcopy(cfg)
    if layout is not None:
        out = OmegaConf.merge(out, layout.overrides())
        out.data.per_device_batch_size = None
    out.data.batch_size, out.data.seq_len = batch, seq_len
    return out


def saved_config(cfg: DictConfig, plan: RunPlan, *, job_type: str | None = None,
                 group: str | None = None) -> dict[str, Any]:
    """``resolved_config`` as the plain dict the run's files are written from."""
    return OmegaConf.to_container(
        resolved_config(cfg, plan, job_type=job_type, group=group), resolve=True)


def own_s(record: dict[str, Any]) -> float:
    """Seconds of a search that a run without one would not spend: less the seeded init, the
    chosen layout's compile and the steps it trained, all of which the run takes over (what
    goodput books as ``search``). 0 where the run did not search (too short for one to pay, a
    cached decision, a resumed layout): deciding that is the run's startup, and the compile
    of the layout it runs its compile."""
    if not record.get("searched", True):
        return 0.0
    return record["search_s"] - sum(record.get(k) or 0.0
                                    for k in ("init_s", "compile_s", "trained_s"))


# Where a run continues from: the checkpoint its decision takes (``decide``), found and read by
# ``dxrun.checkpointing.store``.
@dataclass
class Resume:
    """Where a run continues from: ``directory`` (a checkpoints dir) at its newest readable
    step, or at ``step``; ``in_place``: the checkpoints are this run's own."""

    directory: Path
    step: int | None
    in_place: bool
    meta: dict[str, Any] = field(default_factory=dict)  # the newest readable checkpoint's meta
    meta_step: int = 0
    damaged: list[int] = field(default_factory=list)  # newer steps found damaged, newest first
    # Why the optimizer state starts fresh (its tree does not fit the optimizer now); None: it
    # is restored with the rest.
    fresh_optimizer: str | None = None
    state_names: set[str] | None = None  # the leaves of the checkpoint's state tree
    key: str = "checkpoint.resume"  # what named the checkpoints: a tool's is its path argument

    def fix(self) -> str:
        """The way on when nothing here can be read: a launch starts fresh, a tool
        (``dxrun.export``, ...) is given other checkpoints: its own argument, not a run's key."""
        return ("start fresh with checkpoint.resume=none" if self.key == "checkpoint.resume" else
                f"give another {self.key}: a run dir, its checkpoints dir or one of its step dirs")
