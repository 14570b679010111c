"""Test setup: 8 simulated CPU devices (set before JAX is imported), offline W&B, and config
composition through Hydra's compose API exactly as the launcher does."""

from __future__ import annotations

import os

from dxrun.runtime import simulate_cpu_devices

simulate_cpu_devices(8)  # must run before anything imports jax
os.environ.setdefault("WANDB_MODE", "offline")
os.environ["WANDB_ERROR_REPORTING"] = "false"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("HYDRA_FULL_ERROR", "0")

import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dxrun.config import register

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
register()


def make_cfg(*overrides: str):
    """The run config the launcher would build for ``python -m dxrun <overrides>``."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="dxrun"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def cfg_factory():
    return make_cfg


def run_cli(*args: str, cwd: Path, timeout: int = 600, env: dict | None = None):
    """``python -m dxrun <args>`` as a subprocess in ``cwd`` (its outputs/ land there)."""
    import subprocess

    full_env = {**os.environ, **(env or {})}
    full_env.pop("XLA_FLAGS", None)  # the launcher sets the device count itself
    return subprocess.run([sys.executable, "-m", "dxrun", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def tree_digest(tree: Path) -> dict[str, str]:
    """Every file under ``tree`` by its sha256: "untouched" means equal digests."""
    import hashlib

    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}
