"""Before anything is written or allocated: the run's decision (``autotune.search``), the
checkpoint it resumes and the memory preflight (``prepare``); then the decision shown
(``show_plan``: the log, plan.json) and where training begins (``start_state``: the seeded
init, what the layout search trained, or the resumed checkpoint).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax

from dxrun.checkpointing import (
    Resume,
    data_position,
    find_resume,
    plan_resume,
    restore,
    tokens_seen,
)
from dxrun.config import ConfigError
from dxrun.cost import searches, table
from dxrun.experiment import Experiment, adopt, check_hf_weights
from dxrun.fit import Decided, Handover, compile_checked, decide, memory_preflight
from dxrun.plan import RunPlan
from dxrun.run import dir_refusal, write_json
from dxrun.tracking import goodput
from dxrun.train.rows import AllocatorPeak

log = logging.getLogger("dxrun")


def prepare(cfg: Any, run_dir: Path | None = None) -> Decided:
    """Everything that can refuse bad input, before anything is written or allocated: a
    ``checkpoint.dir`` that cannot be made, the run's decision (``decide``: the mesh plan,
    the layout, the data's files, tokenizer and vocabulary, the checkpoint to resume from for
    a launch into ``run_dir``) and the memory preflight (the step compiled from shapes alone
    must fit). A resume is decided here in full (``checkpointing.plan_resume``): its step, its
    data position, and its optimizer state, which is restored when its tree fits the
    optimizer now and otherwise starts fresh with one warning. Raises ConfigError, or
    NothingToTrain when the checkpoint has reached ``train.steps`` already (or its run stopped
    early: ``train.early_stop``). ``cfg`` is read, never rewritten, and is the config the run
    follows (``exp.cfg``); what is derived from it travels in ``Decided.plan``: ``decide``'s
    answer, the one carrier from here to the loop."""
    # Every run that trains into a run dir may save (a signal asks for a save at any cadence),
    # so its checkpoint.dir must take a dir before the search and the step compile.
    if run_dir is not None and cfg.checkpoint.dir and (why := dir_refusal(
            "checkpoint.dir", cfg.checkpoint.dir,
            "give a dir you can write to, or leave checkpoint.dir null (<run dir>/checkpoints)")):
        raise ConfigError(why)
    find = (None if run_dir is None
            else lambda saved: find_resume(cfg.checkpoint, run_dir, saved))
    search = None
    if searches(cfg.parallelism):  # parallelism=auto alone enters the autotune wing
        from dxrun.autotune import search  # a fixed layout loads none of it (issue 80)
    decided = decide(cfg, find_resume=find, search=search)
    exp, plan, resume = decided.exp, decided.plan, decided.resume
    if resume is not None:  # its data position, its optimizer state, whether it trains at all
        plan_resume(resume, exp.abstract_state(), cfg.train.steps, plan.global_batch,
                    cfg.optimizer, cfg.train.early_stop)
    elif cfg.model.init_from:  # the weights' files, read from their headers alone
        check_hf_weights(exp.cfg.model)
    elif (h := decided.handover) is None or (h.params is None and h.state is None):
        exp.seeded.compile()  # the seeded init the run starts from, beside the step's compile
    memory_preflight(cfg, exp, compile_checked(cfg, exp, plan), plan=plan)
    goodput.mark("decide")
    return decided


class Start(NamedTuple):
    """Where training begins."""

    state: Any  # the TrainState on this run's mesh
    step: int  # steps already done: 0, or the checkpoint's step
    # The resumed checkpoint's metadata (its config, W&B run id, data position, tokens seen);
    # {} on a fresh start.
    ckpt_meta: dict[str, Any]
    # This process's devices' allocator statistics before the state was placed: the run's
    # peak memory is measured from them (mem/peak_bytes_per_device).
    allocator: AllocatorPeak

    def place(self, batches: Any, global_batch: int, trained: int) -> None:
        """The training ``batches`` moved to where this attempt begins: the checkpoint's data
        position, or past the ``trained`` batches parallelism=auto's turns read."""
        if self.ckpt_meta:
            batches.set_state(data_position(self.ckpt_meta, global_batch))
        elif trained:
            (key,) = batches.get_state()  # the batches read: "step" or "next_index"
            batches.set_state({key: trained})

    def tokens_before(self, trained: int, tokens_per_step: int) -> int:
        """Tokens actually read before this attempt: the checkpoint's count (a resume may have
        changed the batch size), or the ``trained`` steps' batches."""
        if self.ckpt_meta:
            return tokens_seen(self.ckpt_meta, self.step)
        return trained * tokens_per_step


def start_state(exp: Experiment, resume: Resume | None,
                handover: Handover | None = None) -> Start:
    """The seeded init, or the resumed checkpoint placed on this run's mesh. ``handover``
    (parallelism=auto's search, ``Decided.handover``): the init it drew (``params``), or the
    state after the first steps it trained (``state``, ``step``): taken, so that their host or
    device copies are let go once on this mesh."""
    allocator = AllocatorPeak()  # before this run allocates anything
    if resume is None and exp.cfg.model.init_from:
        # A fine-tune starts from its checkpoint's weights: what a layout search drew or
        # trained from the seeded init is left behind.
        log.info("weights from %s", exp.cfg.model.init_from)
        return Start(exp.init_state(exp.hf_params()), 0, {}, allocator)
    if resume is None:
        handover = handover or Handover()
        if handover.state is not None:  # the search trained the run's first steps
            step, state, handover.state = handover.step, handover.state, None
            log.info("parallelism=auto: the layouts' turns trained steps 1-%d; the run goes on "
                     "from step %d", step, step + 1)
            return Start(adopt(exp, state), step, {}, allocator)
        params, handover.params = handover.params, None
        return Start(exp.init_state(params), 0, {}, allocator)
    state, ckpt_meta, step = restore(resume, exp.abstract_state())
    if state.opt_state is None:  # the optimizer changed its state's tree (plan_resume)
        state = fresh_optimizer(exp, state)
    log.info("resuming from step %d (checkpoint %s)", step, resume.directory / str(step))
    return Start(state, step, ckpt_meta, allocator)


def fresh_optimizer(exp: Experiment, state: Any) -> Any:
    """``state`` with a freshly initialised optimizer state whose step counts continue from
    ``state.step`` (so the lr schedule goes on where it was)."""
    fresh = exp.init_state(state.params).opt_state

    def count(path: tuple, x: jax.Array) -> jax.Array:
        if path and getattr(path[-1], "name", getattr(path[-1], "key", None)) == "count":
            # A copy: the step donates its input buffers, and one buffer must not appear twice.
            return jax.device_put(state.step.astype(x.dtype).copy(), x.sharding)
        return x

    return state._replace(opt_state=jax.tree_util.tree_map_with_path(count, fresh))


def show_plan(plan: RunPlan, run_dir: Path, main: bool) -> None:
    """The run plan: its warnings and table in the log, ``plan.json`` in the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for w in plan.mesh.warnings:
        log.warning(w)
    if main:
        write_json(run_dir / "plan.json", plan.to_json())
    log.info("mesh plan\n%s", plan.mesh.table())
    if plan.search:
        log.info("parallelism=auto\n%s", table(plan.search))
