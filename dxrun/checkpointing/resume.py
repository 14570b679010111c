"""Resuming: which checkpoint a run continues from, whether it may, and restoring it.

``checkpoint.resume`` (auto | none | <path>) names where a launch continues; a run's own
checkpoints come first, and a resume only ever continues its own run's checkpoints. The newest
checkpoint is tried first and a damaged one (``is_damage``) falls back to the one
before, naming the one it skipped; in a multi-process run the processes agree on the step (the
newest every process can read) and only process 0 sets damaged ones aside. A checkpoint fits
the run when its model shape, vocabulary and data source are the config's (``check_compatible``).

Restoring reads straight into the target mesh's shardings (``Experiment.abstract_state``):
every process reads only its own shards, on any mesh, and nothing is gathered on one device.
Dropout keys derive from (seed, step), so state and meta are all an exact resume needs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from omegaconf import OmegaConf

from dxrun.checkpointing.damage import (
    is_damage,
    quiet_reads_that_finish_late,
    root_cause,
    set_aside_checkpoints,
)
from dxrun.checkpointing.store import (
    POINTER,
    STATE,
    checkpoint_dir,
    committed_steps,
    read,
    rotated_away,
)
from dxrun.checkpointing.vocab_padding import leaf_key, restore_args
from dxrun.config import (
    CheckpointGone,
    CheckpointReadError,
    ConfigError,
    NothingToTrain,
)
from dxrun.data import position
from dxrun.experiment import TrainState
from dxrun.plan import Resume
from dxrun.run import gather, is_main
from dxrun.tracking import stopped_early

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig, OptimizerConfig, RunConfig



log = logging.getLogger("dxrun")


# What a resumed run cannot change: the checkpoint's arrays would not fit, or its data position
# would mean other data. (data.batch_size is checked apart: checkpoint.allow_batch_change.)
MODEL_SHAPE = ("model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
               "model.d_ff", "model.max_seq_len", "model.bias", "model.norm", "model.mlp",
               "model.pos", "model.tie_embeddings", "model._target_", "model.kwargs")
# Keys newer than some checkpoints: one written before them had their default.
NEWER_KEYS: dict[str, Any] = {"model._target_": None, "model.kwargs": {}, "data._target_": None,
                              "data.kwargs": {}}
VOCABULARY = ("model.vocab_size",)
DATA_SOURCE = ("data.name", "data.path", "data.tokenizer", "data.dtype", "data.seq_len",
               "data.seed", "data.order", "data.symbols", "data.branching", "data._target_",
               "data.kwargs")


def find_resume(ckpt: CheckpointConfig, run_dir: Path, now: RunConfig | dict[str, Any]
                ) -> Resume | None:
    """Apply ``checkpoint.resume`` (auto | none | <path>) for a launch into ``run_dir``; check
    the checkpoint fits ``now``: the run's config, or that config as its files will record it
    (``run_plan.saved_config``, its global batch and sequence length resolved). The run's own
    checkpoints come first: a requeued warm start (``checkpoint.resume=<other run>``)
    continues its own. Raises ConfigError; writes nothing."""
    mode = str(ckpt.resume)
    if mode == "none":
        return None
    own = checkpoint_dir(ckpt, run_dir)
    if committed_steps(own):
        resume = Resume(own, None, in_place=True)
    elif mode == "auto":
        return None
    else:
        resume = locate(Path(mode))
    resume.meta_step, resume.meta = newest_meta(resume, check_state=True)
    if resume.in_place and ckpt.dir:
        _refuse_a_copy(run_dir, resume)
    check_compatible(now, resume.meta["config"], resume.directory / str(resume.meta_step))
    return resume


def _refuse_a_copy(run_dir: Path, resume: Resume) -> None:
    """A run dir whose checkpoints.txt names checkpoints that the run dir which wrote them, still
    there, names too is a copy: followed, the two would save into one dir and rotate each
    other's checkpoints away. Refused, naming the original (a moved run dir resumes)."""
    writer = resume.meta.get("run_dir")
    if not writer or Path(writer) == Path(run_dir).resolve():
        return
    try:
        theirs = Path((Path(writer) / POINTER).read_text().strip())
    except (OSError, ValueError):
        return
    if theirs.name == resume.directory.name:
        raise ConfigError(
            f"checkpoints {resume.directory} belong to run dir {writer}, which is still there; "
            f"{run_dir} is a copy of it: train on in {writer}, or start this copy from them "
            f"with checkpoint.resume={writer} after removing {Path(run_dir) / POINTER}")


def locate(path: Path, key: str = "checkpoint.resume") -> Resume:
    """``checkpoint.resume=<path>``: a checkpoints dir, one step dir in it, or a run dir (its
    ``checkpoints/`` or, under ``checkpoint.dir``, the dir its ``checkpoints.txt`` names).
    ``key`` names what the user gave, for the refusal."""
    path = path.expanduser().absolute()  # Orbax refuses relative paths
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    elif (path / POINTER).is_file():
        path = Path((path / POINTER).read_text().strip())
    if path.name.isdigit() and path.parent.is_dir() and int(path.name) in committed_steps(
            path.parent):
        return Resume(path.parent, int(path.name), in_place=False, key=key)
    if committed_steps(path):
        return Resume(path, None, in_place=False, key=key)
    fix = ", or use checkpoint.resume=auto|none" if key == "checkpoint.resume" else ""
    if (path / "plan.json").is_file():  # a run dir: its run wrote its plan first
        raise ConfigError(f"{key}={path} is a run dir whose run saved no checkpoint (it ran "
                          "with checkpoint.every=0, as debug=fast does, or stopped before its "
                          f"first save); train it with checkpoint.every=N to have one{fix}")
    raise ConfigError(f"{key}={path} holds no committed checkpoint; give a run dir, its "
                      f"checkpoints dir or one of its step dirs{fix}")


def _candidates(resume: Resume, upto: int | None = None) -> list[int]:
    """The steps to try, newest first (none newer than ``upto``)."""
    if resume.step is not None:
        return [resume.step]
    return [s for s in committed_steps(resume.directory)[::-1] if upto is None or s <= upto]


def _name(path: tuple) -> str:
    """A tree path as Orbax names a saved leaf: ``opt_state.1.0.mu.wte``."""
    return ".".join(leaf_key(path))


def _read_meta(directory: Path, step: int, check_state: bool
               ) -> tuple[dict[str, Any], set[str] | None]:
    meta, _ = read(directory / str(step))
    names = None
    if check_state:  # the state's tree and array metadata, without reading the arrays
        tree = ocp.StandardCheckpointHandler().metadata(directory / str(step) / STATE).tree
        names = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    return meta, names


def gone(resume: Resume, step: int) -> bool:
    """``rotated_away``: a run's own checkpoints no one else writes, so none goes while read."""
    return rotated_away(resume.directory, step, wait=not resume.in_place)


def _newest_readable(resume: Resume, check_state: bool
                     ) -> tuple[int, dict[str, Any], set[str] | None] | None:
    """The newest step this process can read: (step, meta, state leaf names), or None. A step
    rotated away while read gives way to the newest committed one then (a live run's); one
    asked for (``resume.step``) raises CheckpointGone."""
    quiet_reads_that_finish_late()
    tried: list[int] = []
    while (step := next((s for s in _candidates(resume) if s not in tried), None)) is not None:
        tried.append(step)
        try:
            meta, names = _read_meta(resume.directory, step, check_state)
        except Exception as e:  # noqa: BLE001 - damage: the one before; else: stop
            where = resume.directory / str(step)
            if gone(resume, step):
                if resume.step is not None:
                    raise CheckpointGone(where) from None
                log.info("checkpoint %s was rotated away while read; reading the newest one", where)
                continue
            if not is_damage(e):
                raise ConfigError(
                    f"checkpoint {where} could not be read ({root_cause(e)}); it is not damaged "
                    "as far as dxrun can tell and is left as it is: fix the cause and "
                    f"try again, or {resume.fix()}") from e
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before",
                        where, root_cause(e))
            continue
        return step, meta, names
    return None


def newest_meta(resume: Resume, check_state: bool = False) -> tuple[int, dict[str, Any]]:
    """The newest step whose meta (and with ``check_state`` its state's tree metadata) every
    process can read, and that meta. Damaged newer steps are named once and recorded in
    ``resume.damaged``; any other read failure stops with one line (ConfigError)."""
    found = _newest_readable(resume, check_state)
    # Several processes: each reads its own view; all continue from the oldest of theirs.
    agreed = min(int(v) for v in gather("resume_step", str(found[0] if found else -1)))
    if found is not None and agreed >= 0 and found[0] != agreed:
        log.warning("checkpoint %s cannot be read by every process; using step %d",
                    resume.directory / str(found[0]), agreed)
        found = _newest_readable(Resume(resume.directory, agreed, resume.in_place), check_state)
    if agreed < 0 or found is None:
        raise ConfigError(f"{resume.key}: no readable checkpoint in {resume.directory}; "
                          f"{resume.fix()}")
    step, meta, names = found
    resume.damaged = [s for s in _candidates(resume) if s > step]
    resume.state_names = names
    return step, meta


def _flat(config: RunConfig | dict[str, Any]) -> dict[str, Any]:
    """``section.key`` -> value, over the sections of ``config`` (a config or its saved dict)."""
    container = (config if isinstance(config, dict)
                 else OmegaConf.to_container(config, resolve=True))
    out = {}
    for group, values in container.items():
        if isinstance(values, dict):
            out.update({f"{group}.{k}": v for k, v in values.items()})
    return out


def changed(config: RunConfig | dict[str, Any], saved_cfg: dict[str, Any],
            keys: tuple[str, ...]) -> tuple[str, Any, Any] | None:
    """The first of ``keys`` whose value differs from the checkpoint's: (key, now, then)."""
    now, then = _flat(config), _flat(saved_cfg)
    then = {k: then.get(k, NEWER_KEYS.get(k)) for k in keys}
    return next(((k, now.get(k), then[k]) for k in keys if now.get(k) != then[k]), None)


def check_compatible(config: RunConfig | dict[str, Any], saved_cfg: dict[str, Any],
                     where: Path) -> None:
    """Refuse a resume that cannot continue the checkpoint: one line naming both values.
    ``config``: the config now, or the dict the run saves of it."""
    for what, keys in (("model shape", MODEL_SHAPE), ("vocabulary", VOCABULARY),
                       ("data source", DATA_SOURCE)):
        if diff := changed(config, saved_cfg, keys):
            key, now, then = diff
            raise ConfigError(
                f"{key}={now} but checkpoint {where} was written with {key}={then} (the "
                f"{what} cannot change on resume); resume with {key}={then}, or start fresh "
                "with checkpoint.resume=none")
    now, then = _flat(config), _flat(saved_cfg)
    key = "data.batch_size"
    if now[key] != then[key] and not now["checkpoint.allow_batch_change"]:
        raise ConfigError(
            f"{key}={now[key]} but checkpoint {where} was written with {key}={then[key]}; "
            f"resume with {key}={then[key]}, or set checkpoint.allow_batch_change=true to "
            "continue from the same number of tokens seen")


def data_position(meta: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """The data iterator state to continue with. Under a new global batch size (allowed by
    ``checkpoint.allow_batch_change``) the position is recomputed so that the same number of
    tokens has been read: batches seen x old batch / new batch, rounded down. Grain's nested
    state of a run with ``data.workers`` > 0 (older checkpoints) becomes the one position it
    stands for, so the worker count may change."""
    state = dict(meta["data"])
    if "step" not in state:  # a token corpus (Grain): one position, whatever the workers
        state = {"next_index": position(state)}
    old = meta["config"]["data"]["batch_size"]
    if old == batch_size:
        return state
    (key,) = [k for k in ("step", "next_index") if k in state]
    moved = state[key] * old // batch_size
    log.info("data.batch_size %d -> %d: data position %d -> %d batches (same tokens seen)",
             old, batch_size, state[key], moved)
    return {key: moved}


def tokens_seen(meta: dict[str, Any], step: int) -> int:
    """Tokens trained on up to checkpoint ``step``: carried in its meta, or for a checkpoint
    that predates it, its steps at its own batch size."""
    if "tokens_seen" in meta:
        return int(meta["tokens_seen"])
    data = meta["config"]["data"]
    return step * data["batch_size"] * data["seq_len"]


def plan_resume(resume: Resume, target: TrainState, steps: int, global_batch: int,
                optimizer: OptimizerConfig, early_stop: Any = None) -> None:
    """What a resume into ``target`` (the abstract state of this run, which trains to
    ``steps`` at ``global_batch`` with ``optimizer``, and ``early_stop``: its
    ``train.early_stop``) does, decided before anything is written: stop when there is
    nothing to train (NothingToTrain: the checkpoint is at ``train.steps``, or its run stopped
    early and would stop again before its first step), refuse a data position that cannot be
    continued (ConfigError), and restore the optimizer state only when its tree fits the
    optimizer now. A changed optimizer (``optimizer.name``, clipping on or off, SGD momentum)
    is not refused: the parameters and step are restored and the optimizer state starts fresh
    (its step count continues), with one warning naming why."""
    where = resume.directory / str(resume.meta_step)
    meta = {**resume.meta, "step": resume.meta_step}
    if steps <= resume.meta_step:
        raise NothingToTrain(
            f"nothing to train: train.steps={steps} and checkpoint {where} is at step "
            f"{resume.meta_step}; the run's files are left as they are (raise train.steps to "
            "train on)", where, meta)
    if why := stopped_early(resume.meta, early_stop):
        raise NothingToTrain(
            f"nothing to train: checkpoint {where} is where the run stopped early, "
            f"{why.removeprefix('early stop: ')}; the run's files are left as they are (raise "
            "train.early_stop.patience, or set train.early_stop.monitor=null, to train on)",
            where, meta)
    data_position(resume.meta, global_batch)
    if resume.state_names is None:
        return
    want = {_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    mine = {n.split(".", 1)[1] for n in want if n.startswith("opt_state.")}
    saved = {n.split(".", 1)[1] for n in resume.state_names if n.startswith("opt_state.")}
    if mine == saved:
        return
    diff = [f"{k}={now} (was {then})"
            for k, now, then in _optimizer_changes(optimizer, resume.meta["config"])]
    resume.fresh_optimizer = (", ".join(diff) or "the optimizer") + " changes its state's tree"
    log.warning("checkpoint %s: %s; restoring the parameters and step, with a fresh optimizer "
                "state (its moments start at zero)", where, resume.fresh_optimizer)


def _optimizer_changes(optimizer: OptimizerConfig, saved_cfg: dict[str, Any]
                       ) -> list[tuple[str, Any, Any]]:
    """The ``optimizer.*`` keys whose value differs from the checkpoint's: (key, now, then)."""
    now = _flat({"optimizer": OmegaConf.to_container(optimizer, resolve=True)})
    then = _flat({"optimizer": saved_cfg.get("optimizer")})
    return [(k, now.get(k), then.get(k)) for k in sorted(set(now) | set(then))
            if now.get(k) != then.get(k)]


def _restore_args(state_dir: Path, target: TrainState, with_optimizer: bool
                  ) -> ocp.args.CheckpointArgs:
    tree = target._asdict()
    if not with_optimizer:
        tree.pop("opt_state")
    # Another mesh or platform may pad the vocabulary differently (vocab_padding.py).
    return restore_args(state_dir, tree, partial=not with_optimizer)


def restore(resume: Resume, target: TrainState) -> tuple[TrainState, dict[str, Any], int]:
    """The newest readable checkpoint of ``resume`` (from ``resume.meta_step`` down, when
    ``newest_meta`` chose it), its arrays placed per ``target``'s shardings
    (``Experiment.abstract_state``). Returns (state, meta, step); the state's ``opt_state`` is
    None when ``resume.fresh_optimizer`` says it does not fit. A step any process finds damaged
    is skipped by all; one that cannot be read for another reason stops the run
    (CheckpointReadError) and is left as it is."""
    upto = resume.meta_step if resume.meta else None
    skipped = list(resume.damaged)
    quiet_reads_that_finish_late()
    for step in _candidates(resume, upto):
        try:
            step_dir = resume.directory / str(step)
            # A resume that newest_meta planned reads a run's checkpoints, whose meta must
            # hold what the run reads of it; a bare restore (a test's own save) may not.
            meta, state = read(step_dir, _restore_args(step_dir / STATE, target,
                                                       resume.fresh_optimizer is None),
                               resuming=bool(resume.meta))
            outcome, err = "ok", ""
        except Exception as e:  # noqa: BLE001 - sorted below: rotated away, damage or not
            outcome = ("gone" if gone(resume, step) else "damaged" if is_damage(e) else "error")
            err = root_cause(e)
        # Every process reads its own shards: all go on only from a step all of them read.
        outcomes = gather(f"restore/{step}", outcome)
        where = resume.directory / str(step)
        if "gone" in outcomes:
            raise CheckpointGone(where)
        if "error" in outcomes:
            raise CheckpointReadError(
                f"checkpoint {where} could not be read ({err or 'on another process'}); it is "
                "not damaged as far as dxrun can tell and is left as it is: fix the cause and "
                "try again")
        if "damaged" in outcomes:
            log.warning("checkpoint %s is incomplete or corrupt (%s); using the one before", where,
                        err or f"on process {outcomes.index('damaged')}")
            skipped.append(step)
            continue
        if skipped and resume.in_place and is_main():
            set_aside_checkpoints(resume.directory, skipped)
        state = dict(state)
        state.setdefault("opt_state", None)
        return TrainState(**state), meta, step
    raise ConfigError(f"{resume.key}: no readable checkpoint in {resume.directory}; "
                      f"{resume.fix()}")
