"""``python -m dxrun [group=option ...] [key=value ...]``: compose, validate, plan, train.

JAX is imported only after the config is composed and validated, so ``runtime.cpu_devices`` can
decide how many CPU devices to simulate.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dxrun.config import register, validate
from dxrun.errors import ConfigError
from dxrun.runtime import claim_run_dir, simulate_cpu_devices, write_hydra_files


def _conf_dir() -> str:
    here = Path(__file__).resolve().parent
    shipped = here / "conf"  # non-editable install: conf/ ships as dxrun/conf
    return str(shipped if shipped.is_dir() else here.parent / "conf")


log = logging.getLogger("dxrun")
register()


@hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")
def main(cfg: DictConfig) -> dict | None:
    try:
        validate(cfg)
        simulated = simulate_cpu_devices(cfg.runtime.cpu_devices)
        import jax  # noqa: PLC0415 - only now: XLA_FLAGS must be set first

        if jax.default_backend() == "cpu" and simulated:
            log.info("no accelerator found: simulating %d CPU devices (runtime.cpu_devices)",
                     jax.device_count())
        from dxrun.experiment import visible_devices  # noqa: PLC0415
        from dxrun.plan import make_plan  # noqa: PLC0415
        from dxrun.train import train  # noqa: PLC0415

        make_plan(cfg, *visible_devices())  # fail before anything is written
        hydra_cfg = HydraConfig.get()
        run_dir = claim_run_dir(Path(hydra_cfg.runtime.output_dir))
        write_hydra_files(run_dir, cfg, hydra_cfg)
        choices = {k: v for k, v in hydra_cfg.runtime.choices.items()
                   if not k.startswith("hydra/") and isinstance(v, str)}
        return train(cfg, run_dir, choices)
    except ConfigError as e:
        print(f"dxrun: error: {e}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
