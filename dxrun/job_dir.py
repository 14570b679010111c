"""The run dir a Hydra job trains in: claimed once for every process, released or tidied away.

A job that never starts leaves the dirs as they were: Hydra makes its dir before the config is
checked, so a refused or stopped job removes what was made for it (and nothing else).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.types import RunMode
from omegaconf import OmegaConf

from dxrun import run_dir as run_dirs
from dxrun.errors import ConfigError
from dxrun.multihost.distributed import agree, is_main, tell_launcher_startup
from dxrun.run_dir import Claim
from dxrun.runtime import claim_run_dir

if TYPE_CHECKING:
    from hydra.conf import HydraConf

    from dxrun.schema import CheckpointConfig, RunSection

log = logging.getLogger("dxrun")


def claim_new(asked: Path) -> Path:
    """Claim a new run's dir (plan mode); a used one gets a sibling, said at once rather than
    only in the last line."""
    run_dir = claim_run_dir(asked)
    if run_dir != asked:
        log.warning("%s already holds a run: this run writes to %s", asked, run_dir)
    return run_dir


def claim_to_train(run: RunSection, ckpt: CheckpointConfig, hydra_cfg: HydraConf,
                   asked: Path, held: list[Claim] | None = None) -> Claim:
    """The dir this training job writes to (``run_dir.claim``), held by process 0 for the
    job's life; every process gets process 0's decision, a refusal included. A move away from
    ``asked`` is said at once rather than only in the last line. ``held``: as ``run_dir.claim``
    (the caller's hold on the dir from the moment it is locked)."""
    from dxrun.checkpointing.store import checkpoint_dir, committed_steps  # JAX after device count

    wait_s = run_dirs.wait_seconds(run.wait_for_lock)
    claim, decision = None, {}
    if is_main():
        try:
            claim = run_dirs.claim(
                asked, named=names_its_dir(hydra_cfg),
                fresh=str(ckpt.resume) == "none", wait_s=wait_s, held=held,
                has_checkpoints=lambda d: bool(committed_steps(checkpoint_dir(ckpt, d))))
            decision = {"dir": str(claim.dir), "continues": claim.continues}
            checkpoints = checkpoint_dir(ckpt, claim.dir)
            _tell_launcher(claim, checkpoints, committed_steps(checkpoints))
        except ConfigError as e:
            decision = {"refusal": str(e)}
    # The others wait here while process 0 waits for the lock.
    decision = json.loads(agree(f"run_dir/{job_key(hydra_cfg)}", json.dumps(decision),
                                timeout_s=300 + int(min(wait_s, 7 * 24 * 3600))))
    if "refusal" in decision:
        raise ConfigError(decision["refusal"])
    if claim is None:  # another process: the dir, never the lock
        claim = Claim(Path(decision["dir"]), earlier={} if decision["continues"] else None)
    if claim.dir != asked:
        log.warning("%s already holds a run: this run %s %s", asked,
                    "continues it in" if claim.continues else "writes to", claim.dir)
    return claim


def _tell_launcher(claim: Claim, checkpoints: Path, steps: list[int]) -> None:
    """What process 0's status.json would say after a stop while starting (nothing is saved
    before the train loop; ``steps``: the committed ones), for ``dxrun.launch`` to write if
    process 0 cannot: stuck inside a startup collective, where the signal never reaches it."""
    tell_launcher_startup("claimed", {
        "run_dir": str(claim.dir), "step": steps[-1] if steps else 0,
        "checkpoint": str(checkpoints / str(steps[-1])) if steps else None,
        "attempt": claim.attempt, "lost_attempts": claim.lost_attempts})


def names_its_dir(hydra_cfg: HydraConf) -> bool:
    """Whether the run dir was named (``hydra.run.dir=<dir>``, a preset's, a fixed sweep dir)
    rather than generated from the clock (Hydra's default ``outputs/${now:...}``): only a named
    dir is continued by a relaunch; two launches in the same second share a generated name by
    chance and each takes its own dir."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    where = OmegaConf.to_container(hydra_cfg.sweep if multirun else hydra_cfg.run, resolve=False)
    return "${now:" not in str(where.get("dir", "")) + str(where.get("subdir", ""))


def give_up(claim: Claim | None, hydra_cfg: HydraConf) -> None:
    """A job that trains nothing leaves the dirs as they were: its lock goes, and a dir
    Hydra or the claim made for it goes too when nothing else is in it."""
    if claim is not None:
        claim.release()
        discard_empty_dir(claim.dir)
    discard_empty_dir(Path(hydra_cfg.runtime.output_dir))


def job_key(hydra_cfg: HydraConf) -> str:
    """Which job of this launch (a multirun's jobs run one after another in every process)."""
    return str(OmegaConf.select(hydra_cfg, "job.num", default=0))


def asked_dir(hydra_cfg: HydraConf) -> Path:
    """The run dir Hydra named on process 0. Other processes drop the one their own Hydra
    made when it differs (a launch across a second boundary names it differently)."""
    own = Path(hydra_cfg.runtime.output_dir)
    asked = Path(agree(f"asked/{job_key(hydra_cfg)}", str(own)))
    if asked != own:
        discard_empty_dir(own)
    return asked


# The working dir and what it held when this process started (``cli``): the top dir Hydra
# makes there for a run (``outputs/`` of a first run) is the run's to remove if it never starts.
_started_in: tuple[Path, frozenset[str]] | None = None


def remember_start() -> None:
    """Note the working dir and what it holds, before Hydra makes anything there."""
    global _started_in
    _started_in = (Path.cwd(), frozenset(os.listdir()))


def discard_empty_dir(run_dir: Path) -> None:
    """Hydra made the run dir before the config could be checked; a run that never started
    leaves nothing behind (and never touches a dir that holds anything or was there before)."""
    # The run dir and Hydra's <date>/ above it, never the working dir or a dir above it
    # (hydra.run.dir=run in an empty dir).
    cwd = Path.cwd().resolve()
    dirs = [d for d in (run_dir, run_dir.parent)
            if d.resolve() != cwd and d.resolve() not in cwd.parents]
    if _started_in is not None:
        cwd, had = _started_in
        top = run_dir.parent.parent
        if top.parent == cwd and top.name not in had:
            dirs.append(top)
    for d in dirs:
        try:
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        except OSError:  # removed (or filled) meanwhile by another process of the run
            return
