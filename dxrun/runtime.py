"""Process setup that must happen before JAX is imported, and the run directory.

No JAX import at module level: ``simulate_cpu_devices`` has to set XLA_FLAGS first.
"""

from __future__ import annotations

import json
import math
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


def claim_run_dir(run_dir: Path) -> Path:
    """The run dir Hydra made, unless an earlier run already wrote there (two runs started in
    the same second): then a fresh sibling, so no earlier run's files are overwritten."""
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


def peak_bytes_since(start: dict | None, now: dict | None) -> float | None:
    """This run's allocator peak from ``Device.memory_stats()`` taken at its start and now.

    The allocator's ``peak_bytes_in_use`` is process-wide and JAX cannot reset it, so in a
    multirun it still holds the largest earlier job's peak. If it rose during this run, the new
    high-water mark was set by this run and is exact; if not, this run's peak is unknown (at most
    the old one) and None is returned, never an earlier job's number. None also where the
    backend keeps no statistics (CPU)."""
    if not now or "peak_bytes_in_use" not in now:
        return None
    before = (start or {}).get("peak_bytes_in_use", 0)
    return float(now["peak_bytes_in_use"]) if now["peak_bytes_in_use"] > before else None


class AllocatorPeak:
    """The allocator statistics of this process's devices at the start of a run, to report the
    peak reached during the run (``peak_bytes_since``), the largest over the devices."""

    def __init__(self) -> None:
        import jax

        self.devices = jax.local_devices()
        self.start = [d.memory_stats() for d in self.devices]

    def peak_since_start(self) -> float | None:
        peaks = [peak_bytes_since(s, d.memory_stats())
                 for s, d in zip(self.start, self.devices, strict=True)]
        return max((p for p in peaks if p is not None), default=None)


def finite_or_null(obj: Any, key: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every NaN/inf float replaced by None, and the keys where that happened.

    JSON has no NaN or Infinity: Python writes them anyway and most readers then refuse the
    whole file. A diverged run's numbers become ``null`` instead (W&B shows a gap)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [key or "value"]
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite_or_null(v, f"{key}.{k}" if key else str(k))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        pairs = [finite_or_null(v, f"{key}[{i}]") for i, v in enumerate(obj)]
        return [v for v, _ in pairs], [k for _, b in pairs for k in b]
    return obj, []


def write_json(path: Path, obj: Any) -> None:
    """Atomically; non-finite floats are written as null (see ``finite_or_null``)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(finite_or_null(obj)[0], indent=2, allow_nan=False) + "\n")
    tmp.replace(path)
