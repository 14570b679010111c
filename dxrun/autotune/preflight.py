"""The memory preflight of every real run: before any weight is allocated, the train step
compiled from shapes alone must fit what this host or device gives one device; a refusal names
the nearest setting that fits (plan mode's suggestion search) and writes where the memory goes.

"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from dxrun.autotune import memory_report
from dxrun.autotune.fit import first_that_fits, state_bytes
from dxrun.autotune.host import host_memory_bytes
from dxrun.config.errors import ConfigError
from dxrun.multihost.distributed import gather, local_processes
from dxrun.plan.run_plan import RunPlan, resolved_config
from dxrun.plan.targets import USABLE_CPU, GiB
from dxrun.step import step_bytes

if TYPE_CHECKING:
    from dxrun.config.schema import RunConfig, RuntimeConfig
    from dxrun.experiment import Experiment


def cpu_device_budget(available: float, local_devices: int, processes: int) -> float:
    """Bytes one simulated CPU device may use: the host's usable RAM split over every device
    of every process on the host (each process sees the whole host's MemAvailable)."""
    return available * USABLE_CPU / (local_devices * processes)


def device_budget(runtime: RuntimeConfig) -> tuple[float, int, str]:
    """(bytes one device may use, devices sharing that memory, where the figure comes from)."""
    local = jax.local_device_count()
    procs = local_processes(os.environ, jax.process_count())
    per = f" / {procs} processes on this host" if procs > 1 else ""
    if runtime.memory_gb is not None:
        if jax.default_backend() != "cpu":
            return runtime.memory_gb * GiB, 1, f"runtime.memory_gb={runtime.memory_gb}"
        return (runtime.memory_gb * GiB / (local * procs), local,
                f"runtime.memory_gb={runtime.memory_gb}{per}")
    if jax.default_backend() == "cpu":  # simulated devices share the host's RAM
        return (cpu_device_budget(host_memory_bytes(), local, procs), local,
                f"this host's available RAM{per}")
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return float("inf"), 1, "unknown"
    return float(limit), 1, f"{jax.devices()[0].device_kind} memory (bytes_limit)"


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
        if exp.plan.platform != "tpu" or not memory_report.is_out_of_memory(e):
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
    under the system's temp dir (``memory_report.refusal_dir``).

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
        path = str(memory_report.write(out or memory_report.refusal_dir(), compiled,
                                       exp.abstract_state(), exp.plan.platform))
    path = gather("memory_preflight/report", path)[first]
    raise ConfigError(f"{lines[first]}; where the memory goes: {path}")
