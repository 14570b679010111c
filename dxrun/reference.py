"""The preset files dxrun ships, by where each is chosen: what the docs' Presets page lists and
what the wheel check compares between the wheel and the checkout (.ci/wheel_check). The pages
themselves are rendered outside the package, by docs/reference/."""

from __future__ import annotations

from pathlib import Path

from dxrun import config


def preset_files() -> dict[str, list[Path]]:
    """Every preset file by where it is chosen: ``conf/<group>/``, ``experiments/``, ``sweeps/``,
    ``sweeps/wandb/`` and the SLURM batch script."""
    conf = config.conf_dir()
    out = {f"{g.name}=": sorted(g.glob("*.yaml")) for g in sorted(conf.iterdir()) if g.is_dir()
           and g.name != "hydra"}
    out["hydra/launcher="] = sorted((conf / "hydra" / "launcher").glob("*.yaml"))
    out["experiment="] = sorted(config.preset_dir("experiment").glob("*.yaml"))
    out["sweep="] = sorted(config.preset_dir("sweep").glob("*.yaml"))
    out["wandb sweep"] = sorted((config.preset_dir("sweep") / "wandb").glob("*.yaml"))
    out["sbatch"] = sorted(config.preset_dir("experiment").glob("*.sbatch"))
    return out
