"""The run's decision, taken once by one function for a run and for plan mode alike: the layout
(searched for ``parallelism=auto`` by the search its caller hands it, so that a fixed layout loads
nothing of ``dxrun.autotune``), the global batch and sequence length, the save cadence, and the
checkpoint a run resumes. The validated config is read, never rewritten: what is derived travels in
the ``RunPlan``, and what the search made that the run takes over in a ``Handover``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from dxrun.cost import (
    GB,
    held_batch,
    plan_platform,
    resumed_layout,
    save_cadence,
    searches,
)
from dxrun.experiment import (
    Experiment,
    process_data,
    visible_devices,
)
from dxrun.fit.preflight import NoData, state_bytes
from dxrun.plan import (
    RunPlan,
    default_seq_len,
    make_plan,
    recorded,
    saved_config,
)

if TYPE_CHECKING:
    from dxrun.plan import Resume

log = logging.getLogger("dxrun")


# A resume's finder: the run's config as its files will record it -> the checkpoint or None.
FindResume = Callable[[dict[str, Any]], "Resume | None"]
# The layout search (``dxrun.autotune.search``), handed in by the caller of a parallelism=auto
# run or of plan mode: the one door into the autotune wing.
Search = Callable[..., Any]


@dataclass
class Handover:
    """What a run's layout search made that the run takes over instead of making it again;
    each part is taken (set back to None) once the run has it, so its copy is freed."""

    exp: Experiment | None = None  # the chosen layout's compile: the run's step
    params: Any = None  # the seeded init the timing drew (host arrays, the same on any layout)
    init_s: float | None = None  # its seconds
    state: Any = None  # the run's state after the first ``step`` steps the turns trained
    step: int = 0
    trained_s: float = 0.0  # those steps' seconds


@dataclass
class Decided:
    """``decide``'s answer, the one carrier from the decision to the loop (``prepare`` returns
    it once the resume is planned and the memory preflight passed): the plan, the experiment
    built for it (the search's compile where it made the run's), what else the search made
    that the run takes over, and the resume."""

    plan: RunPlan  # every number derived from the config: layout, batch, cadence, search
    exp: Experiment  # the built experiment, its mesh plan and data inside; exp.cfg is cfg
    # What parallelism=auto's search made that the run takes over (the seeded init its timing
    # drew, or the state after the first steps its turns trained), each part taken once.
    handover: Handover | None = None
    resume: Resume | None = None  # the checkpoint a run resumes; None: a fresh start


def decide(cfg: Any, *, plan_mode: bool = False, find_resume: FindResume | None = None,
           search: Search | None = None) -> Decided:
    """Decide the run of ``cfg`` on the devices it sees (``experiment.visible_devices``). Plan
    mode plans for ``plan.target``'s platform (``data.seq_len=null`` as a run there resolves
    it; its devices' attention kernel) and compiles nothing it would train. ``find_resume``: a
    run's resume finder, asked before a search (the checkpoint's layout is kept where it fits).
    ``search``: the layout search, which ``parallelism=auto`` needs and a fixed layout never
    asks for."""
    devices = visible_devices(cfg.plan.target if plan_mode else None)
    platform = plan_platform(cfg.plan.target, devices[1]) if plan_mode else devices[1]
    seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    handover, searched, resume = (None if plan_mode else Handover()), None, None
    if not searches(cfg.parallelism):
        mesh = make_plan(cfg, *devices, seq_len=seq_len)  # the batch, whichever key gave it
        if find_resume is not None:
            resume = find_resume(saved_config(cfg, RunPlan(mesh)))
    else:  # parallelism=auto: the batch held fixed; a resume keeps its own layout
        if search is None:
            raise TypeError("parallelism=auto: decide() needs the layout search "
                            "(search=dxrun.autotune.search)")
        held = held_batch(cfg, *devices, seq_len=seq_len)
        if cfg.data.per_device_batch_size is not None:
            log.info("parallelism=auto: the global batch is held at %d (data.per_device_"
                     "batch_size on the starting layout) while the layouts change", held[0])
        if find_resume is not None:
            resume = find_resume(OmegaConf.to_container(recorded(cfg, *held), resolve=True))
        searched = search(cfg, plan_mode=plan_mode, resumed=resumed_layout(resume),
                          handover=handover, held=held)
        mesh = make_plan(cfg, *devices, layout=searched.layout, batch=held[0],
                         seq_len=held[1])
    if handover is not None and handover.exp is not None:  # the search compiled the run's step
        exp, handover.exp = replace(handover.exp, plan=mesh), None
    else:
        exp = Experiment.build(cfg, mesh, NoData() if plan_mode else process_data(cfg, mesh))
    ck = cfg.checkpoint  # checkpoint.every=null: by platform, on an accelerator by the state
    cadence = save_cadence(ck.every, ck.every_minutes, platform,
                           state_bytes(exp.abstract_state()), cfg.plan.write_gb_per_s * GB)
    plan = RunPlan(mesh, cadence, searched.record if searched is not None else None)
    return Decided(plan, exp, handover, resume)
