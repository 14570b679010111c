"""Checkpoints: Orbax saves of the train state, and resuming from them.

A checkpoint is one Orbax step dir with two items: ``state`` (step, parameters, optimizer state,
NaN counters: the ``TrainState``, each process writing its own shards) and ``meta`` (JSON: the
data iterator's position, the resolved config, the mesh plan, the W&B run id). Dropout keys
derive from (seed, step), so this is everything an exact resume needs.

Saves are asynchronous: ``save`` waits for the state's device work (which also keeps the CPU
in-flight bound of ``TrainStep``), Orbax copies the shards to host memory, and the disk writes
run in a background thread while training goes on. Orbax writes each checkpoint into a tmp dir
and renames it when complete, so a crash mid-save never leaves a dir that looks finished, and it
deletes checkpoints beyond ``checkpoint.keep`` only after the new one is committed. A committed
checkpoint can still be damaged later (a truncated file); that shows only when it is read, so a
resume tries the newest first and falls back to the one before, naming the one it skipped.

Restoring reads straight into the target mesh's shardings (``Experiment.abstract_state``):
every process reads only its own shards, on any mesh, and nothing is gathered on one device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from dxrun.errors import ConfigError, NonFiniteError
from dxrun.preempt import Preemption, ProcessAgreement, Stopped
from dxrun.step import TrainState
from dxrun.vocab_padding import restore_args

log = logging.getLogger("dxrun")

STATE, META = "state", "meta"

# What a resumed run cannot change: the checkpoint's arrays would not fit, or its data position
# would mean other data. (data.batch_size is checked apart: checkpoint.allow_batch_change.)
MODEL_SHAPE = ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
               "model.d_ff", "model.max_seq_len", "model.bias", "model.norm", "model.mlp",
               "model.pos", "model.tie_embeddings")
VOCABULARY = ("model.vocab_size",)
DATA_SOURCE = ("data.name", "data.path", "data.tokenizer", "data.dtype", "data.seq_len",
               "data.seed", "data.order", "data.symbols", "data.branching")


def checkpoint_dir(cfg: Any, run_dir: Path) -> Path:
    # Absolute: Orbax refuses relative paths.
    return (Path(cfg.checkpoint.dir).expanduser().absolute() if cfg.checkpoint.dir
            else run_dir / "checkpoints")


def committed_steps(directory: Path) -> list[int]:
    """Steps Orbax finished writing (its tmp dirs of interrupted saves are not among them)."""
    return sorted(ocp.path.step.checkpoint_steps(directory)) if directory.is_dir() else []


def _manager(directory: Path, keep: int | None = None) -> ocp.CheckpointManager:
    if keep is None:  # only reading: creates nothing, deletes nothing, never saves
        options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    else:
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True,
            preservation_policy=ocp.checkpoint_managers.LatestN(keep))
    return ocp.CheckpointManager(directory, options=options, item_names=(STATE, META))


@dataclass
class Resume:
    """Where a run continues from: ``directory`` (a checkpoints dir) at its newest readable
    step, or at ``step``; ``in_place``: the run dir is the interrupted run's own."""

    directory: Path
    step: int | None
    in_place: bool
    meta: dict[str, Any] = field(default_factory=dict)  # the newest readable checkpoint's meta
    meta_step: int = 0


def find_resume(cfg: Any, run_dir: Path) -> Resume | None:
    """Apply ``checkpoint.resume`` (auto | none | <path>) for a launch into ``run_dir``; check
    the checkpoint fits the config. Raises ConfigError; writes nothing."""
    mode = str(cfg.checkpoint.resume)
    if mode == "none":
        return None
    if mode == "auto":
        directory = checkpoint_dir(cfg, run_dir)
        if not committed_steps(directory):
            return None
        resume = Resume(directory, None, in_place=True)
    else:
        resume = locate(Path(mode))
    resume.meta_step, resume.meta = newest_meta(resume)
    check_compatible(cfg, resume.meta["config"], resume.directory / str(resume.meta_step))
    return resume


def locate(path: Path, key: str = "checkpoint.resume") -> Resume:
    """``checkpoint.resume=<path>``: a checkpoints dir, one step dir in it, or a run dir
    (``key`` names what the user gave, for the refusal)."""
    path = path.expanduser().absolute()  # Orbax refuses relative paths
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name.isdigit() and path.parent.is_dir() and int(path.name) in committed_steps(
            path.parent):
        return Resume(path.parent, int(path.name), in_place=False)
    if committed_steps(path):
        return Resume(path, None, in_place=False)
    fix = ", or use checkpoint.resume=auto|none" if key == "checkpoint.resume" else ""
    raise ConfigError(f"{key}={path} holds no committed checkpoint; give a run dir, its "
                      f"checkpoints dir or one of its step dirs{fix}")


def _candidates(resume: Resume) -> list[int]:
    """The steps to try, newest first."""
    if resume.step is not None:
        return [resume.step]
    return committed_steps(resume.directory)[::-1]


def newest_meta(resume: Resume) -> tuple[int, dict[str, Any]]:
    mgr = _manager(resume.directory)
    try:
        for step in _candidates(resume):
            try:
                meta = mgr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
                return step, dict(meta[META])
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                log.warning("checkpoint %s is unreadable (%s); trying the one before",
                            resume.directory / str(step), _first_line(e))
    finally:
        mgr.close()
    raise ConfigError(f"checkpoint.resume: no readable checkpoint in {resume.directory}; "
                      "start fresh with checkpoint.resume=none")


def _flat(cfg: Any) -> dict[str, Any]:
    container = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    out = {}
    for group, values in container.items():
        if isinstance(values, dict):
            out.update({f"{group}.{k}": v for k, v in values.items()})
    return out


def changed(cfg: Any, saved_cfg: dict[str, Any], keys: tuple[str, ...]
            ) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` whose value differs from the checkpoint's: (key, now, then)."""
    now, then = _flat(cfg), _flat(saved_cfg)
    return next(((k, now.get(k), then.get(k)) for k in keys if now.get(k) != then.get(k)), None)


def check_compatible(cfg: Any, saved_cfg: dict[str, Any], where: Path) -> None:
    """Refuse a resume that cannot continue the checkpoint: one line naming both values."""
    for what, keys in (("model shape", MODEL_SHAPE), ("vocabulary", VOCABULARY),
                       ("data source", DATA_SOURCE)):
        if diff := changed(cfg, saved_cfg, keys):
            key, now, then = diff
            raise ConfigError(
                f"{key}={now} but checkpoint {where} was written with {key}={then} (the "
                f"{what} cannot change on resume); resume with {key}={then}, or start fresh "
                "with checkpoint.resume=none")
    now, then = _flat(cfg), _flat(saved_cfg)
    key = "data.batch_size"
    if now[key] != then[key] and not cfg.checkpoint.allow_batch_change:
        raise ConfigError(
            f"{key}={now[key]} but checkpoint {where} was written with {key}={then[key]}; "
            f"resume with {key}={then[key]}, or set checkpoint.allow_batch_change=true to "
            "continue from the same number of tokens seen")


def data_position(meta: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The data iterator state to continue with. Under a new global batch size (allowed by
    ``checkpoint.allow_batch_change``) the position is recomputed so that the same number of
    tokens has been read: batches seen x old batch / new batch, rounded down."""
    state = dict(meta["data"])
    old = meta["config"]["data"]["batch_size"]
    if old == batch_size:
        return state
    (key,) = [k for k in ("step", "next_index") if k in state] or [None]
    if key is None:
        raise ConfigError(f"checkpoint.allow_batch_change=true cannot map the data position "
                          f"{state} to another batch size; resume with data.batch_size={old}")
    state[key] = state[key] * old // batch_size
    log.info("data.batch_size %d -> %d: data position %d -> %d batches (same tokens seen)",
             old, batch_size, meta["data"][key], state[key])
    return state


def restore(resume: Resume, target: TrainState) -> tuple[TrainState, dict[str, Any], int]:
    """The newest readable checkpoint of ``resume``, its arrays placed per ``target``'s
    shardings (``Experiment.abstract_state``). Returns (state, meta, step)."""
    mgr = _manager(resume.directory)
    skipped: list[int] = []
    try:
        for step in _candidates(resume):
            try:
                out = mgr.restore(step, args=ocp.args.Composite(**{
                    # Another mesh may pad the vocabulary differently (vocab_padding.py).
                    STATE: restore_args(resume.directory / str(step) / STATE, target._asdict()),
                    META: ocp.args.JsonRestore()}))
            except Exception as e:  # noqa: BLE001 - a damaged checkpoint: use the one before
                log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before",
                            resume.directory / str(step), _first_line(e))
                skipped.append(step)
                continue
            if skipped and resume.in_place:
                _set_aside(resume.directory, skipped)
            return TrainState(**out[STATE]), dict(out[META]), step
    finally:
        mgr.close()
    raise ConfigError(f"checkpoint.resume: no readable checkpoint in {resume.directory}; "
                      "start fresh with checkpoint.resume=none")


def _set_aside(directory: Path, steps: list[int]) -> None:
    """Damaged checkpoints newer than the one resumed from would be overwritten by the run's
    next saves (same step numbers): rename them out of Orbax's sight, never delete them."""
    for step in steps:
        src = directory / str(step)
        dst = directory / f"{step}.corrupt"
        i = 0
        while dst.exists():
            i += 1
            dst = directory / f"{step}.corrupt{i}"
        src.rename(dst)
        log.warning("moved the damaged checkpoint %s to %s", src, dst)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


class Checkpointer:
    """Saves of one run into one checkpoints dir, every ``checkpoint.every`` steps."""

    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.manager = _manager(directory, keep)

    def save(self, step: int, state: TrainState, meta: dict[str, Any]) -> Path:
        """Start saving ``state`` after step ``step``; returns at once the disk writes begin."""
        path = self.directory / str(step)
        if step in self.manager.all_steps():
            return path  # already saved (e.g. the step this run resumed from)
        # Wait for the state's steps to finish: Orbax then copies settled shards, and the host
        # never runs more than MAX_IN_FLIGHT steps ahead of the device (see step.py).
        jax.block_until_ready(state)
        self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state._asdict()), META: ocp.args.JsonSave(meta)}))
        return path

    def wait(self) -> None:
        """Block until the last save is committed (renamed into place)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


class RunCheckpoints:
    """What the train loop does between two steps: save when due (``checkpoint.every``, the last
    step, SIGUSR1), stop after a committed save on SIGTERM/SIGINT, and halt on a non-finite
    step (``train.nan_policy=halt``). The finiteness flag is read only where the host waits
    anyway (log and save steps), so a halt reports the exact first bad step, at the next of
    those, without a save of the bad state."""

    def __init__(self, cfg: Any, run_dir: Path, start: int, meta: dict[str, Any],
                 iterator: Any, logger: Any, preemption: Preemption,
                 relaunch: str | None = None):
        self.start = start  # the step this attempt began at: saved already, or the init
        self.every, self.log_every = cfg.checkpoint.every, cfg.train.log_every
        self.halt = cfg.train.nan_policy == "halt"
        self.meta, self.iterator, self.logger, self.preemption = meta, iterator, logger, preemption
        self.saver = Checkpointer(checkpoint_dir(cfg, run_dir), cfg.checkpoint.keep)
        self.last_saved: Path | None = None
        self.relaunch = relaunch  # the command that resumes this run, for the stop line
        # Several processes act on a signal at one agreed step (a save is collective).
        self.agreement = ProcessAgreement() if jax.process_count() > 1 else None

    def between_steps(self, done: int, state: TrainState, last: bool = False) -> None:
        """After step ``done`` (the iterator has given exactly ``done`` batches)."""
        stop, asked = self.preemption.stop, self.preemption.take_save()
        if self.agreement is not None:
            stop, asked = self.agreement(done, stop, asked)
        ran = done > self.start
        due = ran and bool(self.every) and (done % self.every == 0 or last)
        if due or stop or asked:
            self._check_finite(done, state)
            meta = {**self.meta, "step": done, "data": self.iterator.get_state(),
                    "wandb_id": self.logger.run_id}
            self.last_saved = self.saver.save(done, state, meta)
            if asked and not stop:
                log.info("SIGUSR1: saving checkpoint %s; training goes on", self.last_saved)
        elif ran and (done % self.log_every == 0 or last):
            self._check_finite(done, state)
        if stop:
            self.saver.wait()
            log.info("%s: stopped at step %d; checkpoint %s committed. Resume with: %s", stop,
                     done, self.last_saved, self.relaunch or "the same command and run dir")
            raise Stopped(stop, done, self.last_saved, self.relaunch)

    def _check_finite(self, done: int, state: TrainState) -> None:
        if not self.halt:
            return
        bad = int(jax.device_get(state.nonfinite_step))
        if bad:
            self.saver.wait()
            good = committed_steps(self.saver.directory)
            where = (f"the last good checkpoint is {self.saver.directory / str(good[-1])}"
                     if good else "no checkpoint was saved before it")
            raise NonFiniteError(
                f"non-finite loss or gradients at step {bad} (stopped at step {done}, "
                f"train.nan_policy=halt); {where}; lower optimizer.lr or set "
                "train.nan_policy=skip to leave such steps out")

    def close(self) -> None:
        """Wait for the last save to be committed."""
        self.saver.close()
