"""The run plan: every number a run derives from its validated config, decided once
(``dxrun.autotune.decide``) and carried, never written back into the config the run follows.

It holds the mesh plan (the layout: dp/fsdp/tp, remat, accumulation; the global batch and
sequence length; the step's attention kernel, loss chunk, ZeRO-1 and precision), the save
cadence, and the layout search's record where one decided the layout. ``saved_config`` is
the one place the derived numbers, and the W&B job type and group the launch gave the run
(``job.Job``), are written, into the record a run's files keep (``config.yaml``, the W&B
config, each checkpoint's config).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dxrun.plan.axes import Layout
from dxrun.plan.mesh import MeshPlan
from dxrun.plan.search_record import own_s


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
        """parallelism=auto's own seconds (``search_record.own_s``); None: no search."""
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
    ``group``: the run's W&B names (``job.Job``) in ``logger``, so that its W&B run, its
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
