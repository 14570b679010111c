"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train; and,
below ``main``, the job's own part: the run dir it claims (released or tidied away) and how it
ended, written there once (``JobStatus``: status.json).

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dxrun.checks import composition_refusal, config_warnings, validate
from dxrun.config import (
    ConfigError,
    Interrupted,
    check_targets,
    fail,
)
from dxrun.config.registry import check_composed, conf_dir, register
from dxrun.launch import JobStatus, asked_dir, claim_new, claim_to_train, remember_start
from dxrun.plan import resolved_config
from dxrun.run import (
    SIGNALS,
    SWEEP_EXITS,
    Job,
    accelerator_plan_note,
    collect_cycles_rarely,
    command_imports,
    cpu_fallback_refusal,
    enable_compile_cache,
    guard_signals,
    is_main,
    join,
    nvidia_device_node,
    reuse_pays,
    simulate_cpu_devices,
    simulated_count,
    store_refusal,
    sweep_group,
    thread_pool_note,
    write_hydra_files,
)
from dxrun.tracking import job_started_at, mark

if TYPE_CHECKING:
    from hydra.conf import HydraConf

    from dxrun.config import RunConfig


def _conf_dir() -> str:
    return str(conf_dir())  # non-editable install: conf/ ships as dxrun/conf


def _register_sweeper() -> None:
    """Make sure Hydra knows dxrun's Optuna sweeper (sweep=lr_optuna). Hydra instantiates only
    the plugins its scan of the hydra_plugins namespace found, and under setuptools' editable
    install that scan cannot list hydra_plugins/dxrun_sweeper (it sits behind an import hook),
    so the class is added by name when the scan missed it."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.dxrun_sweeper import OptunaSweeper

    name = f"{OptunaSweeper.__module__}.{OptunaSweeper.__name__}"
    Plugins.instance().class_name_to_class.setdefault(name, OptunaSweeper)


def multirun_only(target: str, mode: Any) -> str:
    """A ``hydra.callbacks`` entry's ``_target_`` (conf/config.yaml) for a callback of multiruns
    alone: ``target`` in a multirun, else Hydra's callback that does nothing, so that a single
    run imports nothing of ``target``'s package (the sweep report's)."""
    multirun = getattr(mode, "name", str(mode)) == RunMode.MULTIRUN.name
    return target if multirun else "hydra.experimental.callback.Callback"


log = logging.getLogger("dxrun")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" noise
logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines
logging.getLogger("jax._src.distributed").setLevel(logging.WARNING)  # dxrun says it in one line
register()
_register_sweeper()
OmegaConf.register_new_resolver("multirun_only", multirun_only, replace=True)


@hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")
def main(cfg: DictConfig) -> Any:
    """Compose (Hydra), check, start JAX, then plan or train: the job runs inside its
    ``JobStatus``, which writes how it ended (status.json, its line, its exit code)."""
    started = job_started_at()  # goodput's wall time counts from here (the process's start)
    mark("compose")
    SIGNALS.start_job()
    hydra_cfg = HydraConfig.get()
    with JobStatus(cfg, hydra_cfg) as status:
        _check(cfg, hydra_cfg)
        simulated = _start_jax(cfg, status)
        if cfg.run.mode == "plan":
            return _plan(cfg, hydra_cfg, status)
        summary = _train(cfg, hydra_cfg, status, started, simulated)
        # A sweeper (Optuna) minimises one number; None (a failed job) is a failed trial.
        return summary.get(cfg.train.objective) if cfg.train.objective else summary
    return None  # the job failed, and a multirun goes on: its status.json says how


def _check(cfg: RunConfig, hydra_cfg: HydraConf) -> None:
    """The config's keys and values, before JAX starts."""
    # model.init_from=hf:<dir>: the model section is the checkpoint's config.json
    check_composed(cfg, list(hydra_cfg.overrides.task))
    validate(cfg)
    if cfg.run.mode != "plan" and (why := store_refusal(cfg.logger)):
        raise ConfigError(why)  # a logger that cannot start: refused before the run


def _start_jax(cfg: RunConfig, status: JobStatus) -> bool:
    """The devices (simulated CPU ones where asked), joined to a multi-process run, checked
    against the run; the compile cache and the targets. Whether CPU devices are simulated."""
    # Plan mode simulates plan.devices (the planned run's device count), a run
    # runtime.cpu_devices: set before JAX starts.
    n_cpu, count_note = simulated_count(cfg.run.mode, cfg.plan.devices, cfg.runtime.cpu_devices)
    simulated = simulate_cpu_devices(n_cpu, reuse=reuse_pays(cfg, n_cpu))
    joined = join(cfg.distributed)  # before anything touches a JAX device
    import jax

    if joined is not None:
        status.run_log.for_process(joined.process_id, joined.num_processes)
        if not is_main():
            status.run_log.quiet_console()
    # Plan mode compiles on CPU for any target: only a training run needs the GPU.
    if cfg.run.mode != "plan" and (refusal := cpu_fallback_refusal(
            jax.default_backend(), nvidia_device_node(), os.environ.get("JAX_PLATFORMS"),
            cfg.runtime.allow_cpu)):
        raise ConfigError(refusal)
    count_key = "plan.devices" if cfg.run.mode == "plan" else "runtime.cpu_devices"
    if count_note is not None:
        log.info("%s", count_note)
    if cfg.run.mode == "plan" and (note := accelerator_plan_note(
            jax.default_backend(), jax.device_count(), n_cpu, cfg.plan.target)):
        log.warning("%s", note)
    if jax.default_backend() == "cpu" and simulated:
        log.info("no accelerator found: simulating %d CPU devices (%s)",
                 jax.local_device_count(), count_key)
    elif jax.default_backend() == "cpu" and jax.local_device_count() != n_cpu:
        # Multirun jobs share one process: JAX's device count is fixed by the first job.
        log.warning("%s=%d ignored: JAX already runs with %d CPU devices "
                    "in this process (set it once for the multirun, or run each job in "
                    "its own process: hydra/launcher=submitit_local)",
                    count_key, n_cpu, jax.device_count())
    enable_compile_cache(cfg.runtime.compile_cache)
    check_targets(cfg)  # your model, data and optimizer take what dxrun passes them
    for w in config_warnings(cfg):
        log.warning(w)
    return simulated


def _plan(cfg: RunConfig, hydra_cfg: HydraConf, status: JobStatus) -> Any:
    """run.mode=plan: the decision reported for plan.target; nothing trained."""
    with command_imports():
        from dxrun.autotune import planned, run_plan  # imports JAX

    # data.seq_len=null resolved for the target; for parallelism=auto the layout
    # ranked first by the estimate alone, for plan.target: in the plan, cfg as it is.
    decided = planned(cfg)
    status.run_dir = run_dir = claim_new(Path(hydra_cfg.runtime.output_dir))
    status.run_log.attach(run_dir)
    # The saved config holds the derived numbers: the global batch, the layout.
    write_hydra_files(run_dir, resolved_config(cfg, decided.plan), hydra_cfg)
    return run_plan(cfg, run_dir, decided)


def _train(cfg: RunConfig, hydra_cfg: HydraConf, status: JobStatus, started: float,
           simulated: bool) -> dict[str, Any]:
    """Claim the run dir, prepare the run, train it; its summary."""
    import jax

    with command_imports():
        from dxrun.train import (
            prepare,  # imports JAX
            train,  # imports JAX
        )

    # Every process uses process 0's run dir (their clocks may name it differently).
    # Claimed and held before the plan and the compile, so that a second launch into a
    # held dir is refused at once (or waits) instead of compiling beside it.
    claim = claim_to_train(cfg.run, cfg.checkpoint, hydra_cfg, asked_dir(hydra_cfg),
                           status.held)
    run_dir = status.claimed(claim)
    # The plan, the data, the checkpoint to resume and the memory preflight: fail before
    # anything is written. The run follows cfg; what is derived from it (the layout...) is
    # in ``prepared.plan``, where the run sits (its W&B names) in ``job``.
    mark("jax")
    prepared = prepare(cfg, run_dir)
    resume = prepared.resume
    if simulated and not status.multirun and (note := thread_pool_note(
            len(prepared.exp.plan.device_ids), jax.local_device_count(), os.cpu_count())):
        log.info(note)
    status.run_log.attach(run_dir)
    if claim.continues and not (resume is not None and resume.in_place):
        last = {"running": "died (killed: its status still said running)",
                "stopped": "was stopped", "failed": "failed"}.get(
                    (claim.earlier or {}).get("status"), "ended")
        log.warning("%s: attempt %d of its run; the last one %s before its first "
                    "checkpoint, so this one starts again from %s", run_dir, claim.attempt,
                    last, resume.directory if resume is not None else "step 0")
    job = _job(cfg, hydra_cfg, started, claim.continues)
    if is_main():  # the plan's batch and sequence length, the W&B names: written once
        write_hydra_files(run_dir, resolved_config(
            cfg, prepared.plan, job_type=job.job_type, group=job.group), hydra_cfg)
    status.write("running")
    summary = train(cfg, run_dir, job, prepared)
    status.ended(summary)
    return summary


def _job(cfg: RunConfig, hydra_cfg: HydraConf, started: float, continues: bool) -> Job:
    """Where the run sits: Hydra's group choices and overrides, and its W&B job type and group,
    the config's or, where it left them unset, filled in: the jobs of one multirun share the
    group of their sweep dir and have job type "sweep". The run's W&B run and its saved config
    record them alike, so the sweep report (which reads the saved config) agrees with W&B."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    choices = {k: v for k, v in hydra_cfg.runtime.choices.items()
               if not k.startswith("hydra/") and isinstance(v, str)}
    group, job_type = cfg.logger.group, cfg.logger.job_type
    if multirun and group is None:
        group = sweep_group(Path(hydra_cfg.sweep.dir))
    if job_type is None:
        job_type = "sweep" if multirun else "train"
    return Job(choices=choices, overrides=list(hydra_cfg.overrides.task), started=started,
               continues=continues, group=group, job_type=job_type)


def cli() -> None:
    mark("launch")  # the interpreter and this module's imports (goodput's startup phases)
    guard_signals()  # before anything slow: a signal from here on ends the run in one line
    collect_cycles_rarely()
    remember_start()
    try:
        if refusal := composition_refusal(sys.argv[1:]):
            fail(refusal)
        main()
    except Interrupted as e:  # outside a job (composing the config), or while it was failing
        print(f"dxrun: {e.signal_name}: stopped {e.when}", file=sys.stderr)
        sys.exit(e.code)
    for sweep_exit in SWEEP_EXITS:  # a multirun's, from its jobs (report.SweepReport)
        sweep_exit()





if __name__ == "__main__":
    cli()
