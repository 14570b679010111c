"""The memory preflight of every real run: before any weight is allocated, the train step compiled
from shapes alone must fit what this host or device gives one device; a refusal names the nearest
setting that fits (the first of ``overrides_to_try`` whose compile fits) and writes where the
memory goes.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from omegaconf import OmegaConf

from dxrun.config import ConfigError
from dxrun.cost import (
    GiB,
)
from dxrun.experiment import (
    Experiment,
    step_bytes,
)
from dxrun.fit.host import device_budget
from dxrun.fit.memory_report import is_out_of_memory, refusal_dir, write_breakdown
from dxrun.plan import (
    MeshPlan,
    RunPlan,
    make_plan,
    resolved_config,
)
from dxrun.run import (
    gather,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig


def overrides_to_try(cfg: RunConfig) -> list[list[str]]:
    """Overrides to try, nearest first: recompute activations (same mesh, same batch), shard
    the weights and optimizer state over the data replicas (FSDP), accumulate gradients over
    micro-batches, then a smaller batch."""
    par = cfg.parallelism
    out: list[list[str]] = []
    remat = [] if cfg.model.remat == "full" else ["model.remat=full"]
    if remat:
        out.append(remat)
    if par.fsdp == 1 and par.dp != 1:
        fsdp = ["parallelism.dp=1", "parallelism.fsdp=-1", f"parallelism.tp={par.tp}"]
        out += [fsdp, fsdp + remat] if remat else [fsdp]
    # The same update in micro-batches (train.grad_accum), then a smaller update.
    a, per = cfg.train.grad_accum, cfg.data.per_device_batch_size
    if per is None:
        out += [[f"train.grad_accum={a * k}", *remat] for k in (2, 4, 8)]
        b = cfg.data.batch_size
        out += [[f"data.batch_size={b // k}", *remat] for k in (2, 4)]
        return out
    # The user gave the per-device batch (the global batch is refused beside it): the same
    # update is k times the micro-batches at 1/k of the per-device batch.
    out += [[f"train.grad_accum={a * k}", f"data.per_device_batch_size={per // k}", *remat]
            for k in (2, 4, 8) if per % k == 0]
    out += [[f"data.per_device_batch_size={per // k}", *remat] for k in (2, 4) if per // k]
    return out


def check_memory(cfg: RunConfig, exp: Any, compiled: Any, plan: RunPlan | None = None) -> str | None:
    """This process's refusal of a run whose compiled step will not fit what its host gives a
    device, in one line with the nearest setting that fits (tried from ``plan``'s layout,
    batch and sequence length; None: ``exp``'s config as it is); None when it fits."""
    if cfg.runtime.skip_memory_check or (exp.plan.platform == "tpu"
                                         and cfg.runtime.memory_gb is None):
        return None  # XLA's TPU compile is the check (``compile_checked``); it passed
    need = step_bytes(compiled)
    if need is None:
        return None
    budget, shared, source = device_budget(cfg.runtime)
    if need <= budget:
        return None
    # No suggestion changes the model: sharded over every visible device, its weights and
    # optimizer state alone are the least any of them needs. Below that, a search of compiles
    # would only make the refusal slow.
    floor = state_bytes(exp.abstract_state()) / exp.plan.n_visible
    if floor > budget:
        fix_text = (f"the weights and optimizer state alone need {floor / GiB:.4f} GiB per "
                    f"device on all {exp.plan.n_visible}: try a larger mesh or a smaller model")
    else:
        base = cfg if plan is None else resolved_config(cfg, plan)
        fix = first_that_fits(base, budget, exp.plan)
        fix_text = f"try {' '.join(fix)}" if fix else "try a larger mesh or a smaller model"
    # Three significant figures: a tiny budget reads "0.004 GiB", not "0.0 GiB".
    return (f"the train step needs {need / GiB:.3g} GiB per device x {shared} device(s) = "
            f"{need * shared / GiB:.3g} GiB, but {source} gives {budget * shared / GiB:.3g} GiB; "
            f"{fix_text} (or runtime.skip_memory_check=true to run anyway)")


def compile_checked(cfg: RunConfig, exp: Experiment, plan: RunPlan | None = None) -> Any:
    """The run's step compiled for the preflight (and the run). On a TPU, XLA's compile is the
    memory check: it assigns every buffer of the program, donated inputs reused, and refuses
    one that exceeds the chip (RESOURCE_EXHAUSTED) before anything runs, where arguments plus
    temporaries (``step_bytes``) count buffers that share memory. Its refusal becomes the
    preflight's one line, with the nearest setting that compiles."""
    try:
        return exp.compile_step()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        base = cfg if plan is None else resolved_config(cfg, plan)
        fix = first_that_fits(base, float("inf"), exp.plan)  # fits: its compile passes
        why = str(e).split(":", 1)[-1].strip().splitlines()[0]
        raise ConfigError(f"the train step does not fit one {jax.devices()[0].device_kind} "
                          f"chip: XLA says {why}; try "
                          f"{' '.join(fix) if fix else 'a larger mesh or a smaller model'}"
                          ) from None


def memory_preflight(cfg: RunConfig, exp: Experiment, compiled: Any, out: Path | None = None,
                     plan: RunPlan | None = None) -> None:
    """Raise ConfigError, before any weight is allocated, when the compiled step will not fit
    (``check_memory``); the refusal writes where the memory goes and its one line names the
    file. Bad input leaves no run dir behind, so the file goes to ``out``, by default a new dir
    under the system's temp dir (``refusal_dir``).

    The processes of a run decide together: each checks its own host, and one refusing alone
    would leave the others waiting for it in their first collective. The first process that
    refuses says why (its line, its file) and every process raises that one line. ``plan``:
    the run plan ``exp`` was built for (``check_memory``)."""
    lines = gather("memory_preflight", check_memory(cfg, exp, compiled, plan) or "")
    if not any(lines):
        return
    first = next(i for i, line in enumerate(lines) if line)
    path = ""
    if jax.process_index() == first:
        path = str(write_breakdown(out or refusal_dir(), compiled,
                                       exp.abstract_state(), exp.plan.platform))
    path = gather("memory_preflight/report", path)[first]
    raise ConfigError(f"{lines[first]}; where the memory goes: {path}")


def first_that_fits(base: Any, budget_bytes: float, plan: MeshPlan,
                    max_tries: int = 8, time_budget_s: float = 40.0,
                    need: Any = None) -> list[str] | None:
    """Compile the candidates (``overrides_to_try``) in order (shapes only), each
    merged into ``base`` (the run's config as its files record it, ``resolved_config``: its
    layout, batch and sequence length as keys) and laid out over ``plan``'s devices,
    processes and hosts, and return the first whose per-device need is within
    ``budget_bytes``; None if none does within ``time_budget_s`` (a refused run must answer
    within a minute, whatever the model). ``need(exp)``: the per-device bytes of a candidate
    when not its compiled step's (an accelerator target's memory model: nothing compiled)."""
    deadline = time.perf_counter() + time_budget_s
    cfg = base
    for overrides in overrides_to_try(cfg)[:max_tries]:
        if time.perf_counter() > deadline:
            return None
        trial = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        try:
            # Over the run's processes too: a trial planned for one process would put this
            # process's devices at other rows of the batch than its plan reads (refused).
            exp = Experiment.build(trial, make_plan(
                trial, plan.n_visible, plan.platform, plan.processes,
                plan.process_hosts or None, plan.attention_device), data=NoData())
        except ConfigError:
            continue
        try:
            needs = step_bytes(exp.analyse_step()) if need is None else need(exp)
        except Exception as e:  # a TPU's compile refuses what does not fit its chip
            if not is_out_of_memory(e):
                raise
            continue
        if needs is not None and needs <= budget_bytes:
            return overrides
    return None


class NoData:
    """Plan mode and suggestions compile the step only; they never read data."""


def state_bytes(state: Any) -> float:
    """Bytes of the whole train state (every array once, as a checkpoint holds it; its
    shapes alone do)."""
    return float(sum(x.dtype.itemsize * math.prod(x.shape) for x in jax.tree.leaves(state)))
