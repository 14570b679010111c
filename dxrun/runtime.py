"""Process setup that must happen before JAX is imported, and the run directory.

No JAX import at module level: ``simulate_cpu_devices`` has to set XLA_FLAGS first.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

_COUNT_FLAG = "--xla_force_host_platform_device_count"
def simulate_cpu_devices(n: int) -> bool:
    """Make the CPU platform expose ``n`` devices. Returns False if JAX already started (the
    device count is then fixed, e.g. in later jobs of a multirun) or the user set it."""
    if "jax" in sys.modules and "jax._src.xla_bridge" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge._backends:  # backends initialised: too late to change anything
            return False
    flags = os.environ.get("XLA_FLAGS", "")
    if _COUNT_FLAG not in flags:
        flags = f"{flags} {_COUNT_FLAG}={n}"
    os.environ["XLA_FLAGS"] = flags.strip()
    return True


def claim_run_dir(run_dir: Path, reuse: bool = False) -> Path:
    """The run dir Hydra made, unless an earlier run already wrote there (two runs started in
    the same second): then a fresh sibling, so no earlier run's files are overwritten.
    ``reuse``: take the dir as it is (a run resuming in place from its own checkpoints)."""
    if reuse:
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    candidate, i = run_dir, 0
    while (candidate / "plan.json").exists():
        i += 1
        candidate = run_dir.with_name(f"{run_dir.name}_{i}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def write_hydra_files(run_dir: Path, cfg: Any, hydra_cfg: Any | None) -> None:
    """What Hydra's .hydra/ holds, written only once the config is known to be valid."""
    out = run_dir / ".hydra"
    out.mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    if hydra_cfg is not None:
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), out / "hydra.yaml")
        OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), out / "overrides.yaml")


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
