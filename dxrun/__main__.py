"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train.

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dxrun.config import check_keys, composition_error, register, validate
from dxrun.errors import ConfigError, NonFiniteError
from dxrun.runtime import claim_run_dir, simulate_cpu_devices, write_hydra_files


def _conf_dir() -> str:
    here = Path(__file__).resolve().parent
    shipped = here / "conf"  # non-editable install: conf/ ships as dxrun/conf
    return str(shipped if shipped.is_dir() else here.parent / "conf")


log = logging.getLogger("dxrun")
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" noise
register()


@hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")
def main(cfg: DictConfig) -> dict | None:
    log_sizes = _log_sizes()
    try:
        check_keys(cfg)
        validate(cfg)
        simulated = simulate_cpu_devices(cfg.runtime.cpu_devices)
        import jax

        if jax.default_backend() == "cpu" and simulated:
            log.info("no accelerator found: simulating %d CPU devices (runtime.cpu_devices)",
                     jax.device_count())
        elif jax.default_backend() == "cpu" and jax.device_count() != cfg.runtime.cpu_devices:
            # Multirun jobs share one process: JAX's device count is fixed by the first job.
            log.warning("runtime.cpu_devices=%d ignored: JAX already runs with %d CPU devices "
                        "in this process (set it once, for the whole multirun)",
                        cfg.runtime.cpu_devices, jax.device_count())
        from dxrun.preempt import Stopped
        from dxrun.train import Job, prepare, train

        hydra_cfg = HydraConfig.get()
        # The plan, the data and the checkpoint to resume: fail before anything is written.
        prepared = prepare(cfg, Path(hydra_cfg.runtime.output_dir))
        resume = prepared[2]
        # Relaunched into a dir holding its checkpoints (a requeued job): continue in place.
        run_dir = claim_run_dir(Path(hydra_cfg.runtime.output_dir),
                                reuse=resume is not None and resume.in_place)
        write_hydra_files(run_dir, cfg, hydra_cfg)
        choices = {k: v for k, v in hydra_cfg.runtime.choices.items()
                   if not k.startswith("hydra/") and isinstance(v, str)}
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        # Jobs of one multirun land together in W&B: grouped by their sweep dir.
        group = "sweep-" + "_".join(Path(hydra_cfg.sweep.dir).parts[-2:]) if multirun else None
        job = Job(choices=choices, overrides=list(hydra_cfg.overrides.task), group=group)
        try:
            return train(cfg, run_dir, job, prepared)
        except Stopped as e:  # preempted: the checkpoint is committed; a requeue resumes it
            sys.exit(e.code)
    except NonFiniteError as e:
        print(f"dxrun: error: {e}", file=sys.stderr)
        sys.exit(1)
    except ConfigError as e:
        _discard_empty_run_dir(log_sizes)
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            _fail(str(e))
        # One bad combination must not cost the rest of a sweep: report it, run the others,
        # and exit non-zero at the end (cli()).
        print(f"dxrun: error: job #{hydra_cfg.job.num}: {e}", file=sys.stderr)
        _FAILED_JOBS.append(f"#{hydra_cfg.job.num} ({' '.join(hydra_cfg.overrides.task)})")
        return None


_FAILED_JOBS: list[str] = []


def _log_sizes() -> dict[str, int]:
    """The sizes of the log files Hydra opened (appending), before this job wrote to them."""
    return {h.baseFilename: os.path.getsize(h.baseFilename)
            for h in logging.getLogger().handlers
            if isinstance(h, logging.FileHandler) and os.path.exists(h.baseFilename)}


def _discard_empty_run_dir(log_sizes: dict[str, int]) -> None:
    """Hydra made the run dir (and its log file) before the plan could be checked; a run that
    never started leaves nothing behind. A dir holding an earlier run (plan.json; e.g. a
    refused resume into it) is kept byte for byte: its log loses this job's lines."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not run_dir.is_dir():
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.close()
    if (run_dir / "plan.json").exists():
        for name, size in log_sizes.items():
            os.truncate(name, size)
        return
    for f in run_dir.glob("*.log"):
        f.unlink()
    if not any(run_dir.iterdir()):
        run_dir.rmdir()
        if not any(run_dir.parent.iterdir()):
            run_dir.parent.rmdir()


def preflight(argv: list[str]) -> None:
    """Compose the config the way Hydra will and turn a composition error (unknown option, unknown
    key, wrong type) into one line naming the key and the fix. Hydra's own flags (-m, --cfg, ...)
    and hydra.* overrides are left to Hydra, which reports its errors itself."""
    if any(a.startswith("-") or a.lstrip("+~").startswith("hydra") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=_conf_dir(), version_base="1.3", job_name="dxrun"):
            cfg = compose(config_name="config", overrides=argv)
        check_keys(cfg)
    except ConfigError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - anything we cannot phrase better goes to Hydra
        msg = composition_error(e)
        if msg:
            _fail(msg)


def _fail(msg: str) -> None:
    print(f"dxrun: error: {msg}", file=sys.stderr)
    sys.exit(2)


def cli() -> None:
    preflight(sys.argv[1:])
    main()
    if _FAILED_JOBS:
        _fail(f"{len(_FAILED_JOBS)} sweep job(s) refused their config: {'; '.join(_FAILED_JOBS)}")


if __name__ == "__main__":
    cli()
