"""Reading a run's newest checkpoint while the run may still be training (``dxrun.export``,
``dxrun.evaluate``, ``dxrun.sample`` of a live run).

A live run rotates its checkpoints away (``checkpoint.keep``): the one a tool chose can go while
it is read. The tool then reads the newest committed one, on the mesh it built already where
that one's config is the same, up to ``READS`` times; a checkpoint asked for (a step dir,
``--step``) is that one or a refusal naming how to read the newest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dxrun import checkpointing as store  # load.py's too: one import of JAX
from dxrun.config import CheckpointGone, ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dxrun.experiment import Experiment

log = logging.getLogger("dxrun")

# Reads of a live run's newest checkpoint, each rotated away while read, before giving up.
READS = 20

Build = Callable[[dict[str, Any], Path], tuple["DictConfig", "Experiment"]]


def read_newest(resume: store.Resume, best: bool, by_step: bool, build: Build
                ) -> tuple[dict[str, Any], Path, DictConfig, Experiment, dict]:
    """(meta, step dir, config, experiment, parameters) of the newest committed checkpoint of
    ``resume`` (with ``best``: the one ``checkpoint.keep_best`` kept; ``resume.step``: that
    one); ``build`` makes the config and experiment of a checkpoint's meta. ``by_step``: the
    step was given as ``--step``, which a refusal names."""
    built: tuple[Any, DictConfig, Experiment] | None = None
    for attempt in range(1, READS + 1):
        this = dataclasses.replace(resume)
        try:
            step, meta = _chosen(this, best)
            where = this.directory / str(step)
            if built is None or built[0] != meta["config"]:
                built = (meta["config"], *build(meta, where))
            _, cfg, exp = built
            this.step = step  # exactly the step whose config this is
            # The parameters alone: the optimizer state is not needed, and its tree may not
            # match an optimizer given as an override.
            this.fresh_optimizer = "not needed after training"
            state, _, _ = store.restore(this, exp.abstract_state())
            return meta, where, cfg, exp, state.params
        except CheckpointGone as e:
            if resume.step is not None:
                fix = "drop --step" if by_step else "give the run dir"
                raise ConfigError(f"{e}; {fix} to read the newest one it keeps") from None
            if attempt == READS:
                raise ConfigError(f"{e}, the last of {READS} in a row: the run rotates them "
                                  "faster than they are read; try again") from None
            log.info("%s; reading the newest one", e)
    raise AssertionError("unreachable")


def _chosen(resume: store.Resume, best: bool) -> tuple[int, dict[str, Any]]:
    """(step, meta) of the checkpoint to read: the newest committed of ``resume``, or with
    ``best`` the one ``checkpoint.keep_best`` kept, which the newest one's meta names."""
    step, meta = store.newest_meta(resume)
    if not best:
        return step, meta
    kept = (meta.get("keep_best") or {}).get("step")
    there = kept in store.committed_steps(resume.directory)
    if kept is not None and not there and store.gone(resume, step):
        raise CheckpointGone(resume.directory / str(kept))  # the best moved on with the run
    if kept is None or not there:
        raise ConfigError(f"--best: {resume.directory} holds no best checkpoint (the run "
                          "was not trained with checkpoint.keep_best=<metric>); drop --best")
    resume.step = kept
    return store.newest_meta(resume)
