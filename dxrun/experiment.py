"""Assemble a run from a validated config: plan -> mesh -> sharded model -> optimizer -> step.

``Experiment`` is what the launcher trains and what tests drive directly (same code path). Its
parts, section by section: the optimizer and its learning-rate schedule (optax, or your own
factory through ``optimizer._target_``); the jitted train step (one ``jax.jit`` with explicit
shardings and the state donated: forward, loss, gradients, optax update, metrics reduced to
scalars; XLA reduces the gradients, no pmap, no hand-written all-reduce); and the experiment.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.config import ConfigError, checked_factory, hf_dir, read_config
from dxrun.data import EVAL, TRAIN, Data
from dxrun.hf import HFWeights, Weight, dims, dxrun_block, shape_of, weights
from dxrun.model.context_parallel import in_context_order
from dxrun.model.objectives import (
    MaskedDiffusion,
    chunked_cross_entropy,
    move_router_bias,
    objective_of,
    router_statistics,
    vmappable,
    with_router_losses,
)
from dxrun.model.sharding import (
    batch_sharding,
    check_process_rows,
    in_mesh_context,
    mesh_from_plan,
    optimizer_param_shardings,
    pad,
    param_axes,
    param_shardings,
    refit,
    replicated,
    spread_shardings,
    unpad,
    without_mesh_axis,
    zero_pads,
)
from dxrun.model.transformer import count_params, resize_vocab
from dxrun.model.user_model import build_model, logits_of
from dxrun.plan.cost import TARGETS
from dxrun.plan.run_plan import (
    AttentionTarget,
    MeshPlan,
    attention_target,
    compiled_kernel,
    kind_target,
    make_plan,
    scaled_lr,
    table_rows,
)
from dxrun.run import runtime
from dxrun.run.runtime import process_hosts

if TYPE_CHECKING:
    from dxrun.config import ModelConfig, OptimizerConfig, RunConfig


# ------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule from the ``optimizer`` section (optax); your own optax
# factory through ``optimizer._target_``.

def make_schedule(opt: OptimizerConfig, peak_lr: float, steps: int) -> optax.Schedule:
    warmup = min(opt.warmup_steps, steps)
    end_lr = peak_lr * opt.min_lr_ratio
    if opt.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(peak_lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak_lr, warmup), optax.constant_schedule(peak_lr)],
            [warmup])
    if opt.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(steps, warmup + 1),
                                                  end_value=end_lr)
    # wsd: warmup, stable at the peak, then a linear decay over the last decay_frac of training.
    decay = max(1, int(round(steps * opt.decay_frac)))
    stable = max(0, steps - warmup - decay)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, max(warmup, 1)),
         optax.constant_schedule(peak_lr),
         optax.linear_schedule(peak_lr, end_lr, decay)],
        [warmup, warmup + stable])


def decay_mask(params: dict, decay_all: bool) -> dict:
    """Weight decay on weight matrices only: not on norm scales, biases (named ``b*``, also the
    2-D per-head ones) or the embedding tables."""
    def keep(path: tuple, leaf: Any) -> bool:
        top, name = str(getattr(path[0], "key", "")), str(getattr(path[-1], "key", ""))
        is_bias_or_norm = name == "scale" or name.startswith("b")
        return decay_all or not (is_bias_or_norm or top in ("wte", "wpe"))
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(opt: OptimizerConfig, params: dict, batch_size: int, steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(opt, scaled_lr(opt, batch_size), steps)
    mask = decay_mask(params, opt.decay_all)
    if opt._target_:
        tx = custom_optimizer(opt._target_, schedule, dict(opt.kwargs))
    elif opt.name == "adamw":
        tx = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                         weight_decay=opt.weight_decay, mask=mask)
    elif opt.name == "lion":
        tx = optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=mask)
    else:
        tx = optax.chain(optax.add_decayed_weights(opt.weight_decay, mask),
                         optax.sgd(schedule, momentum=opt.momentum or None))
    if opt.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
    return tx, schedule


def custom_optimizer(target: str, schedule: optax.Schedule, kwargs: dict[str, Any]
                     ) -> optax.GradientTransformation:
    """``optimizer._target_``: ``target(learning_rate=schedule, **kwargs)``, which must be an
    optax ``GradientTransformation`` (Hydra's ``_target_`` convention: a dotted path)."""
    factory = checked_factory("optimizer", target, kwargs)
    tx = factory(learning_rate=schedule, **kwargs)
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"optimizer._target_={target} returned a {type(tx).__name__}, not an "
                          "optax GradientTransformation")
    return tx


# ------------------------------------------------------------------------------------------------
# The jitted train step: forward, loss, gradients, optax update, metrics reduced to scalars.
#
# One ``jax.jit`` with explicit input/output shardings and the state donated. Gradients of
# replicated (data-parallel) parameters are reduced by XLA; there is no pmap and no hand-written
# all-reduce.

MAX_IN_FLIGHT = 4  # CPU only; see InFlight
REPLICA_AXIS = "data"  # the mesh axis gradient accumulation reduces over once per step


class InFlight:
    """How far the host may dispatch ahead of the devices: every loop that dispatches device
    work (train steps, evaluation batches) passes each call's output through one of these.

    XLA:CPU runs every simulated device on one shared thread pool (8 threads for 8 devices).
    When the host dispatches more than ~32 programs ahead, those threads block waiting to
    launch later programs while the current one's all-reduce waits for a device that then
    never gets a thread: a real deadlock ("Expected 8 threads ... only 7 arrived"). So on a
    multi-device CPU mesh at most MAX_IN_FLIGHT outputs are queued; the host blocks only when
    it is that far ahead, which costs no throughput. Accelerators never wait here."""

    def __init__(self, mesh: jax.sharding.Mesh, limit: int = MAX_IN_FLIGHT):
        self.bounded = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1
        self.limit = limit
        self.queue: collections.deque = collections.deque()

    def __call__(self, out: Any) -> Any:
        """``out`` (a call's not-donated output) joins the queue; returns it unchanged."""
        if self.bounded:
            self.queue.append(out)
            if len(self.queue) > self.limit:
                jax.block_until_ready(self.queue.popleft())
        return out


class TrainState(NamedTuple):
    step: jax.Array
    params: dict  # fp32 master weights (pure dict, same structure as the model's nnx state)
    opt_state: Any
    skipped: jax.Array  # updates left out for a non-finite loss or gradient (nan_policy=skip)
    nonfinite_step: jax.Array  # the first step (1-based) whose loss/grads were not finite; 0 = none


def loss_and_metrics(graphdef: nnx.GraphDef, params: dict, tokens_BxT: jax.Array,
                     dtype: Any, dropout_key: jax.Array | None = None,
                     grad_reduce_dtype: str = "fp32", loss_chunk: int = 0,
                     objective: MaskedDiffusion | None = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``grad_reduce_dtype`` (``train.grad_reduce_dtype``): "fp32" hands the model the fp32
    master weights and it casts each at its use (``dxrun.model.transformer.dense``), so weight gradients
    are accumulated, all-reduced over data replicas and returned in fp32; "bf16" casts the
    whole tree to ``dtype`` first: the gradients' batch sums, and their all-reduce, are in
    ``dtype`` (half the traffic under bf16). Under fp32 compute the two are the same.
    ``loss_chunk`` > 0: the loss and accuracy over that many positions at a time, never the
    whole logits tensor (``dxrun.model.objectives``). ``objective``: masked diffusion
    (``dxrun.model.objectives``), whose ``tokens_BxT`` is its noised batch; None: the next token."""
    if grad_reduce_dtype == "fp32":
        model = nnx.merge(graphdef, params)
    else:
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
    if objective is not None and not loss_chunk:  # (under cp > 1 validation refuses mdlm)
        return objective.loss(lambda t: logits_of(model, t, dropout_key, dtype), tokens_BxT)
    if objective is not None:  # masked diffusion's bound: a weight per position
        inputs_BxL, targets_BxL = tokens_BxT.xt_BxL, tokens_BxT.x0_BxL
        weights_BxL = objective.position_weights(tokens_BxT)
    else:  # split over `context` (parallelism.cp), both in one order: the mean is over all tokens
        inputs_BxL, targets_BxL = (in_context_order(t)
                                   for t in (tokens_BxT[:, :-1], tokens_BxT[:, 1:]))
        weights_BxL = None
    if loss_chunk:
        x_BxLxD = model.final_norm(model.stream(inputs_BxL, dropout_key, dtype), dtype)
        loss, accuracy = chunked_cross_entropy(
            model.output_weight(gathered=True), x_BxLxD, targets_BxL, loss_chunk,
            vocab_size=model.vocab_size, vocab_axis=0 if model.lm_head is None else 1,
            weights_BxL=weights_BxL)
        return loss, {"train/loss": loss, "train/accuracy": accuracy}
    logits_BxLxV = logits_of(model, inputs_BxL, dropout_key, dtype)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL).mean()
    accuracy = (logits_BxLxV.argmax(-1) == targets_BxL).mean()
    return loss, {"train/loss": loss, "train/accuracy": accuracy}


def accumulated_grads(loss_fn: Callable, params: dict, tokens_BxT: jax.Array,
                      key: jax.Array | None, accum: int, batch_sharding: Any,
                      param_shardings: Any = None
                      ) -> tuple[jax.Array, dict[str, jax.Array], dict]:
    """Loss, metrics and mean gradient of the batch, in ``accum`` micro-batches under one
    ``lax.scan`` (``train.grad_accum``): the same update as the whole batch at once, with the
    activations of one micro-batch alive at a time. Micro-batch i is rows i, i+k, i+2k, ... so
    each device keeps computing on its own rows (no data moves). ``loss_fn(params, tokens,
    key) -> (loss, metrics)``; ``tokens_BxT`` may be a tree of arrays whose first axis is the
    batch's rows (an objective's noised batch, ``dxrun.model.objectives``): each is split alike.

    With ``param_shardings`` and more than one replica on the mesh's ``data`` axis, the
    gradients are reduced over ``data`` once per step, not once per micro-batch: each replica's
    gradient is computed apart (``jax.vmap`` over a leading replica axis, sharded over ``data``
    by ``spmd_axis_name``, so it needs no reduction), accumulated in the scan, and summed over
    the replica axis after it (one all-reduce). ``fsdp`` keeps its own per-micro-batch
    reduction (each fsdp device holds only its shard of the gradient)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum == 1:
        (loss, metrics), grads = grad_fn(params, tokens_BxT, key)
        return loss, metrics, grads
    B = jax.tree.leaves(tokens_BxT)[0].shape[0]
    micro_KxMxT = jax.tree.map(
        lambda a: a.reshape(B // accum, accum, *a.shape[1:]).swapaxes(0, 1), tokens_BxT)
    mesh = batch_sharding.mesh
    R = mesh.shape[REPLICA_AXIS] if param_shardings is not None else 1
    if R > 1:
        per_replica = jax.vmap(grad_fn, in_axes=(None, 0, 0), spmd_axis_name=REPLICA_AXIS)
        replica_shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, P(REPLICA_AXIS, *s.spec)), param_shardings)

    def one(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        tokens_MxT, i = xs
        tokens_MxT = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, P(*batch_sharding.spec[:a.ndim]))), tokens_MxT)
        mkey = None if key is None else jax.random.fold_in(key, i)
        if R == 1:
            (loss, m), g = grad_fn(params, tokens_MxT, mkey)
            return jax.tree.map(jnp.add, carry, (loss, m, g)), None
        # Replica r's rows of the micro-batch are the ones on data index r already.
        tokens_RxNxT = jax.tree.map(lambda a: a.reshape(R, -1, *a.shape[1:]), tokens_MxT)
        keys = None if mkey is None else jax.random.split(mkey, R)
        with without_mesh_axis(REPLICA_AXIS):  # the vmapped axis holds `data`
            (loss_R, m_R), g_R = per_replica(params, tokens_RxNxT, keys)
        g_R = jax.lax.with_sharding_constraint(g_R, replica_shardings)
        return jax.tree.map(jnp.add, carry, (loss_R, m_R, g_R)), None

    shape = () if R == 1 else (R,)
    zero = jnp.zeros(shape, jnp.float32)
    # The metrics' names are the loss function's (an MoE model's add moe/*)
    names = jax.eval_shape(loss_fn, params, jax.tree.map(lambda a: a[0], micro_KxMxT), key)[1]
    zeros = (zero, {k: jnp.zeros((*shape, *s.shape), s.dtype) for k, s in names.items()},
             jax.tree.map(lambda p: jnp.zeros((*shape, *p.shape), p.dtype), params))
    if R > 1:
        zeros = (*zeros[:2], jax.lax.with_sharding_constraint(zeros[2], replica_shardings))
    out, _ = jax.lax.scan(one, zeros, (micro_KxMxT, jnp.arange(accum)))
    if R > 1:  # the one reduction over the data replicas
        out = jax.tree.map(lambda x: x.sum(0), out)
    return jax.tree.map(lambda x: x / (accum * R), out)


def applied_count(opt_state: Any, default: jax.Array) -> jax.Array:
    """The count optax's schedule is evaluated at for the next update (its
    ``ScaleByScheduleState``, else any ``count`` in the state: they advance together);
    ``default`` when the optimizer keeps none."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    scheduled = [v for path, v in found
                 if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"]
    return (scheduled or [v for _, v in found] or [default])[0]


def jax_dtype(name: str) -> Any:
    """The JAX dtype of the run plan's ``compute_dtype`` (its name: "float32", "bfloat16")."""
    return getattr(jnp, name)


@dataclass(frozen=True)
class StepSpec:
    """What a train or eval step is made of beside the model and the optimizer: the run plan
    (its rules, accumulation, loss chunk and compute dtype), the mesh and shardings, and the
    train section's settings. ``update_shardings`` (ZeRO-1, the plan's ``shard_optimizer``):
    per parameter, the sharding of its optimizer state, split over the data replicas as well;
    None: the update runs on the parameters' own layout (every data replica updates the whole
    of it). ``update_pads``: where no axis of a parameter divides, its gradient and value are
    padded with zeros into its optimizer state's layout (``dxrun.model.sharding``) and cut back
    after the update. ``objective``: masked diffusion (``model.objectives``), its noise drawn for the
    whole batch before any micro-batch; None: the next token."""

    plan: MeshPlan
    mesh: jax.sharding.Mesh
    state_shardings: TrainState
    batch_sharding: Any
    dropout_seed: int | None = None
    nan_policy: str = "halt"
    # test-only (dxrun/run/runtime.py, from the environment): the step whose loss is poisoned
    inject_nan_at_step: int = field(default_factory=lambda: runtime.faults_from_env().nan_at_step)
    grad_reduce_dtype: str = "fp32"
    update_shardings: Any = None
    update_pads: Any = None
    objective: MaskedDiffusion | None = None


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, spec: StepSpec) -> TrainStep:
    """The jitted step of ``spec``. Under ZeRO-1 the gradients and parameters are constrained
    to ``spec.update_shardings`` before the optimizer update, so each replica updates its shard
    only: XLA turns the gradient all-reduce into a reduce-scatter where it can, and the
    parameters' out-sharding all-gathers the updated shards."""
    dtype, plan, objective = jax_dtype(spec.plan.compute_dtype), spec.plan, spec.objective
    state_shardings, batch_sharding = spec.state_shardings, spec.batch_sharding
    update_shardings, update_pads = spec.update_shardings, spec.update_pads
    nan_policy, inject_nan_at_step = spec.nan_policy, spec.inject_nan_at_step

    def loss_fn(params: dict, tokens_BxT: jax.Array, key: Any, step: jax.Array):
        with router_statistics() as found:  # the MoE layers' statistics, if any
            loss, metrics = loss_and_metrics(graphdef, params, tokens_BxT, dtype, key,
                                             spec.grad_reduce_dtype, plan.loss_chunk, objective)
        if inject_nan_at_step:  # test-only (dxrun/run/runtime.py): poisons loss and grads
            loss = loss * jnp.where(step + 1 == inject_nan_at_step, jnp.nan, 1.0)
        # train/loss stays the objective's; the MoE penalties join the differentiated loss
        return with_router_losses(loss, {**metrics, "train/loss": loss}, found)

    def step(state: TrainState, tokens_BxT: jax.Array) -> tuple[TrainState, dict]:
        key = (None if spec.dropout_seed is None
               else jax.random.fold_in(jax.random.key(spec.dropout_seed), state.step))
        batch = tokens_BxT if objective is None else objective.train_batch(state.step, tokens_BxT)
        loss, metrics, grads = accumulated_grads(
            lambda p, t, k: loss_fn(p, t, k, state.step), state.params, batch, key,
            plan.grad_accum, batch_sharding,
            state_shardings.params if vmappable(state_shardings.params) else None)
        old_params = state.params
        if update_shardings is not None:  # ZeRO-1: the update on this replica's shards
            grads = jax.lax.with_sharding_constraint(pad(grads, update_pads), update_shardings)
            old_params = jax.lax.with_sharding_constraint(pad(old_params, update_pads),
                                                          update_shardings)
        updates, opt_state = tx.update(grads, state.opt_state, old_params)
        params = optax.apply_updates(old_params, updates)
        if update_shardings is not None:  # gathered back to the parameters' layout
            params = jax.lax.with_sharding_constraint(unpad(params, update_pads),
                                                      state_shardings.params)
        params, metrics = move_router_bias(params, metrics)  # model.moe.bias_rate's rule, if any
        grad_norm = optax.tree.norm(grads)  # the global norm, whatever the layout
        # A NaN/inf anywhere in the gradients makes their norm non-finite: one scalar test.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if nan_policy == "skip":  # leave the update out on device; the host never waits
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
        first_bad = jnp.where((state.nonfinite_step == 0) & ~finite, state.step + 1,
                              state.nonfinite_step)
        skipped = state.skipped + (~finite & (nan_policy == "skip")).astype(jnp.int32)
        metrics = dict(metrics)
        metrics["train/grad_norm"] = grad_norm
        metrics["train/param_norm"] = optax.tree.norm(params)
        # The lr this update used: the schedule at the optimizer's own count, which lags
        # state.step by the updates nan_policy=skip left out.
        metrics["train/lr"] = jnp.asarray(schedule(applied_count(state.opt_state, state.step)),
                                          jnp.float32)
        if nan_policy == "skip":
            metrics["train/skipped_steps"] = skipped
        if objective is not None:
            metrics["train/mask_rate"] = objective.masked_share(batch)
        return TrainState(state.step + 1, params, opt_state, skipped, first_bad), metrics

    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated(spec.mesh)), donate_argnums=0)
    return TrainStep(jitted, spec.mesh, plan.rules)


def make_eval_step(graphdef: nnx.GraphDef, spec: StepSpec) -> Callable:
    """Held-out loss and accuracy of a batch: forward only, jitted once, the train step's
    shardings (``spec``). ``run(params, tokens, index)``: ``index``, the batch's place in the
    held-out stream, seeds an objective's noise (``model.objectives``); the next token's loss has no
    argument for it."""
    dtype, objective = jax_dtype(spec.plan.compute_dtype), spec.objective
    mesh, rules, loss_chunk = spec.mesh, spec.plan.rules, spec.plan.loss_chunk

    def evaluate(params: dict, tokens_BxT: jax.Array, *index: jax.Array) -> dict[str, jax.Array]:
        if objective is not None:
            model = nnx.merge(graphdef, params)
            return objective.evaluate(lambda t: logits_of(model, t, None, dtype), tokens_BxT,
                                      *index)
        _, m = loss_and_metrics(graphdef, params, tokens_BxT, dtype, loss_chunk=loss_chunk)
        return {"eval/loss": m["train/loss"], "eval/accuracy": m["train/accuracy"]}

    seeded = () if objective is None else (replicated(mesh),)
    jitted = jax.jit(evaluate, in_shardings=(spec.state_shardings.params, spec.batch_sharding,
                                             *seeded),
                     out_shardings=replicated(mesh))
    in_flight = InFlight(mesh)  # however many batches a loop feeds it (eval.batches=all)

    def run(params: dict, tokens_BxT: jax.Array, index: int = 0) -> dict[str, jax.Array]:
        index_arg = () if objective is None else (np.int32(index),)
        with in_mesh_context(mesh, rules):
            return in_flight(jitted(params, tokens_BxT, *index_arg))

    return run


def step_bytes(compiled: Any) -> float | None:
    """Bytes per device a compiled step needs: arguments + outputs - the donated (aliased)
    state + temporaries. Per run, unlike the allocator's process-wide peak."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                 + m.temp_size_in_bytes)


def analysis_options(platform: str) -> dict[str, Any]:
    """XLA options for a compile whose executable never runs (plan mode's cost and candidate
    compiles, compile-only tests), which read only the optimised HLO, its buffer assignment and
    its cost analysis: all settled before code generation. On XLA:CPU, LLVM's optimisation is
    then about half the compile for nothing (text, memory and cost analyses come out identical:
    tests/test_plan_mode.py). Other platforms compile as ever."""
    if platform != "cpu":
        return {}
    return {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def analysis_is_full(platform: str) -> bool:
    """Whether an analysis compile on ``platform`` is the full one (no cheaper options there:
    a GPU or TPU), so that one of a step a run may take is kept for it, not thrown away and
    compiled again."""
    return not analysis_options(platform)


class TrainStep:
    """The jitted step, compiled ahead of its first call so that the same executable reports
    its FLOPs, memory and collectives and the compile time is measured exactly."""

    def __init__(self, jitted: Any, mesh: jax.sharding.Mesh, rules: dict):
        self.jitted, self.mesh, self.rules = jitted, mesh, rules
        self.compiled: Any = None
        self.compile_time_s = 0.0
        self.in_flight = InFlight(mesh)  # the CPU deadlock bound (see InFlight)

    def compile(self, state: TrainState, tokens_BxT: Any) -> Any:
        if self.compiled is None:
            t0 = time.perf_counter()
            with in_mesh_context(self.mesh, self.rules):  # the model pins activation layouts
                compiled = self.jitted.lower(state, tokens_BxT).compile()
            self.compiled = runtime.check_chip(compiled, step_bytes(compiled))
            self.compile_time_s = time.perf_counter() - t0
        return self.compiled

    def analyse(self, state: TrainState, tokens_BxT: Any) -> Any:
        """The step compiled for its analyses only (``analysis_options``): never kept, never
        run (the run's own compile is ``compile``)."""
        options = analysis_options(self.mesh.devices.flat[0].platform)
        with in_mesh_context(self.mesh, self.rules):
            compiled = self.jitted.lower(state, tokens_BxT).compile(options)
        return runtime.check_chip(compiled, step_bytes(compiled))

    def memory_bytes(self) -> float | None:
        return step_bytes(self.compiled) if self.compiled is not None else None

    def __call__(self, state: TrainState, tokens_BxT: jax.Array) -> tuple[TrainState, dict]:
        new_state, metrics = self.compile(state, tokens_BxT)(state, tokens_BxT)
        return new_state, self.in_flight(metrics)  # the metrics: not donated, unlike the state


# ------------------------------------------------------------------------------------------------
# Assemble a run from a validated config: plan -> mesh -> sharded model -> optimizer -> step.
#
# ``Experiment`` is what the launcher trains and what tests drive directly (same code path).

def visible_devices(target: str | None = None
                    ) -> tuple[int, str, int, tuple[int, ...] | None, AttentionTarget]:
    """What ``make_plan`` lays the mesh over: (devices of all processes, platform, processes,
    the host of each process, the facts the attention kernel is chosen by: those of plan
    mode's ``target`` (a ``plan.target`` name) where one is given, else of these devices)."""
    device = (kind_target(TARGETS[target].device_kind) if target is not None
              else attention_target(jax.devices()[0]))
    return jax.device_count(), jax.default_backend(), jax.process_count(), process_hosts(), device


def _placed(shapes: Any, shardings: Any) -> Any:
    """``shapes`` (arrays' shapes and dtypes) each with its sharding in ``shardings``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)


def process_data(cfg: RunConfig, plan: MeshPlan) -> Data:
    """This process's reader of the data: the row block of every batch its devices hold, of the
    plan's global batch and sequence length."""
    return Data(cfg, plan.data_shard(jax.process_index()), plan.data_shards, plan.global_batch,
                plan.seq_len)


def _state_layout(plan: MeshPlan, mesh: jax.sharding.Mesh, axes: dict, abstract_state: Any,
                  tx: optax.GradientTransformation) -> tuple[TrainState, TrainState, Any,
                                                             dict | None]:
    """(the train state's shardings, its shapes placed in them, the optimizer's per-parameter
    shardings, ZeRO-1's padding or None). Optimizer moments take their parameter's sharding,
    split over the data replicas as well under ZeRO-1 (the plan's shard_optimizer), padded where
    no axis divides; counters are replicated."""
    abstract_params = nnx.to_pure_dict(abstract_state)
    zero = plan.shard_optimizer
    pads = zero_pads(axes, abstract_params, mesh, plan.rules) if zero else None
    opt_params = jax.eval_shape(lambda p: pad(p, pads), abstract_params)
    u_shard = optimizer_param_shardings(axes, opt_params, mesh, plan.rules, zero)
    opt_shapes = jax.eval_shape(tx.init, opt_params)
    opt_shard = optax.tree_map_params(tx, lambda _, s: s, opt_shapes, u_shard,
                                      transform_non_params=lambda _: replicated(mesh))
    shardings = TrainState(replicated(mesh), param_shardings(axes, mesh, plan.rules), opt_shard,
                           replicated(mesh), replicated(mesh))
    counter = jax.ShapeDtypeStruct((), np.int32)
    shapes = _placed(TrainState(counter, abstract_params, opt_shapes, counter, counter), shardings)
    return shardings, shapes, u_shard, pads


def _abstract_model(cfg: RunConfig, plan: MeshPlan, mesh: jax.sharding.Mesh,
                    padded: int) -> tuple[nnx.GraphDef, Any]:
    """The model's graph and its parameters' shapes (nothing allocated), with the plan's
    attention kernel, or XLA's standing in where it does not run on these devices (plan mode
    compiles on CPU for an accelerator target)."""
    kernel = compiled_kernel(plan.attention, cfg.model.attention, mesh.devices.flat[0].platform)
    return nnx.split(nnx.eval_shape(lambda: build_model(cfg.model, nnx.Rngs(0), padded, kernel,
                                                        plan.remat)))


def _step_spec(cfg: RunConfig, plan: MeshPlan, mesh: jax.sharding.Mesh,
               state_shardings: TrainState, b_shard: Any, u_shard: Any,
               pads: dict | None) -> StepSpec:
    """What the train and eval steps are made from: the plan, its shardings, and the train
    section's choices."""
    return StepSpec(
        plan, mesh, state_shardings, b_shard,
        dropout_seed=cfg.train.seed + 1 if cfg.model.dropout > 0 else None,
        nan_policy=cfg.train.nan_policy,
        grad_reduce_dtype=plan.grad_reduce_dtype,
        update_shardings=u_shard if plan.shard_optimizer else None, update_pads=pads,
        # masked diffusion (model.objective=mdlm): its training masks seeded apart from dropout's
        objective=objective_of(cfg.model, cfg.train.seed + 2, cfg.eval.draws))


class SeededInit:
    """The parameters drawn from ``train.seed``: drawn spread over every device
    (``spread_shardings``), then laid out in the mesh's shards (``shardings``). Drawn in those
    shards directly, a layout that replicates the weights draws the whole init on each device,
    where drawn spread each device draws its share and the reshard is cheap. Threefry is
    partitionable (JAX's default), so the bits are the same whatever the sharding."""

    def __init__(self, model_cfg: ModelConfig, seed: int, padded_vocab: int, mesh: jax.sharding.Mesh,
                 shardings: dict, shapes: dict):
        self.model_cfg, self.seed, self.padded_vocab = model_cfg, seed, padded_vocab
        self.mesh, self.shardings, self.shapes = mesh, shardings, shapes
        self.compiling: Any = None  # (its compile under way, its spread shardings)

    def fn(self) -> Callable[[], dict]:
        """The seeded init as a function of nothing (what ``params`` jits)."""
        model_cfg, seed, padded = self.model_cfg, self.seed, self.padded_vocab

        def init() -> dict:
            model = build_model(model_cfg, nnx.Rngs(seed), padded)
            return nnx.to_pure_dict(nnx.state(model))
        return init

    def compile(self) -> None:
        """Start compiling the seeded init on a thread of its own, so that it compiles beside
        the step (XLA compiles outside Python's lock): a fresh run's ``params`` then runs that
        program."""
        spread = self._spread()
        lowered = jax.jit(self.fn(), out_shardings=spread).lower()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        self.compiling = (pool.submit(lowered.compile), spread)
        pool.shutdown(wait=False)  # its thread ends with the compile

    def params(self) -> dict:
        """The seeded parameters in the mesh's shards."""
        params, spread = self._drawn()
        if spread == self.shardings:
            return params
        return jax.jit(lambda p: p, out_shardings=self.shardings)(params)

    def spread_params(self) -> dict:
        """The seeded parameters as ``params`` draws them, spread over every device and left
        there: for a caller that fetches them whole to the host (the layout search), to which
        the mesh's layout would be a reshard for nothing."""
        return self._drawn()[0]

    def _spread(self) -> Any:  # every weight spread over every device, to be drawn there
        return spread_shardings(self.shapes, self.mesh, self.shardings)

    def _drawn(self) -> tuple[dict, Any]:
        if self.compiling is not None:
            (compiling, spread), self.compiling = self.compiling, None
            return compiling.result()(), spread
        spread = self._spread()
        return jax.jit(self.fn(), out_shardings=spread)(), spread


@dataclass
class Experiment:
    cfg: RunConfig
    plan: MeshPlan
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    axes: dict
    param_shardings: dict
    state_shardings: TrainState
    batch_sharding: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    data: Data | None
    step: Any
    eval_step: Any
    seeded: SeededInit
    state_shapes: TrainState  # ``abstract_state``: from the shapes ``build`` traces anyway
    zero_pads: dict | None = None  # ZeRO-1's padding of the optimizer state (zero_padding.py)

    @classmethod
    def build(cls, cfg: RunConfig, plan: MeshPlan | None = None, data: Data | None = None,
              with_data: bool = True) -> Experiment:
        """``with_data=False``: no data source (sampling from a checkpoint needs no corpus)."""
        if plan is None:
            plan = make_plan(cfg, *visible_devices())
        mesh = mesh_from_plan(plan)
        padded = plan.padded_vocab or cfg.model.vocab_size  # 0: a bare plan, no padding
        graphdef, abstract_state = _abstract_model(cfg, plan, mesh, padded)
        axes = param_axes(abstract_state)
        tx, schedule = make_optimizer(cfg.optimizer, nnx.to_pure_dict(abstract_state),
                                      plan.global_batch, cfg.train.steps)
        state_shardings, shapes, u_shard, pads = _state_layout(plan, mesh, axes, abstract_state,
                                                               tx)
        b_shard = batch_sharding(mesh)
        spec = _step_spec(cfg, plan, mesh, state_shardings, b_shard, u_shard, pads)
        step = make_train_step(graphdef, tx, schedule, spec)
        eval_step = make_eval_step(graphdef, spec)
        if data is None and with_data:
            data = process_data(cfg, plan)
        check_process_rows(b_shard, plan, plan.global_batch)
        seeded = SeededInit(cfg.model, cfg.train.seed, padded, mesh, state_shardings.params,
                            shapes.params)
        return cls(cfg, plan, mesh, graphdef, axes, state_shardings.params, state_shardings,
                   b_shard, tx, schedule, data, step, eval_step, seeded, shapes, pads)

    @property
    def attention_kernel(self) -> str:
        """What the step's attention runs (``run_plan.KERNELS``): the plan's choice."""
        return self.plan.attention

    def hf_params(self) -> dict:
        """``model.init_from``'s weights read into this mesh's shards (``dxrun.experiment``)."""
        return import_params(self)

    def init_state(self, params: dict | None = None) -> TrainState:
        """Fresh train state; ``params`` (host or device arrays) replaces the seeded init. They
        may come from a mesh with another vocab padding (another tp): they are re-padded."""
        if params is None:
            params = self.seeded.params()
        else:
            params = jax.device_put(resize_vocab(params, self.axes, table_rows(self.cfg.model),
                                                 self.padded_vocab), self.param_shardings)

        def _opt_init(params: dict) -> Any:  # the optimizer's, ZeRO-1's padding included
            return self.tx.init(pad(params, self.zero_pads))
        opt_state = jax.jit(_opt_init, out_shardings=self.state_shardings.opt_state)(params)
        step, skipped, bad = jax.device_put([np.zeros((), np.int32)] * 3, replicated(self.mesh))
        # Settle the one-off programs before the first step (see ``InFlight``).
        return jax.block_until_ready(TrainState(step, params, opt_state, skipped, bad))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and this mesh's shardings of the train state, allocating nothing: what
        plan mode and the memory preflight compile the step for, and the target a checkpoint
        restores into (each process reading only its own shards)."""
        return self.state_shapes

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.plan.global_batch, self.plan.seq_len + 1), np.int32,
                                    sharding=self.batch_sharding)

    def compile_step(self) -> Any:
        """The train step compiled for this mesh from shapes alone (no weights allocated)."""
        return self.step.compile(self.abstract_state(), self.abstract_batch())

    def analyse_step(self) -> Any:
        """As ``compile_step`` for a step that will never run: its HLO text, memory and cost
        analyses only, compiled cheaper (``analysis_options``) and not kept."""
        return self.step.analyse(self.abstract_state(), self.abstract_batch())

    def forward(self) -> Callable[[dict, Any], jax.Array]:
        """The model's logits (the padded vocabulary) for token ids ``[B, L]``: one jitted
        forward, traced on this mesh with its rules, compiled once per shape (dxrun.logits)."""
        jitted = jax.jit(lambda params, tokens: nnx.merge(self.graphdef, params)(tokens))

        def run(params: dict, tokens_BxL: Any) -> jax.Array:
            with in_mesh_context(self.mesh, self.plan.rules):
                return jitted(params, tokens_BxL)

        return run

    @property
    def padded_vocab(self) -> int:
        return self.plan.padded_vocab or self.cfg.model.vocab_size

    def count_params(self, params: Any) -> int:
        """Parameters of the real vocabulary (what FLOPs and the logs report)."""
        return count_params(params, self.axes, self.cfg.model.vocab_size)

    def global_batch(self, local_rows: np.ndarray) -> jax.Array:
        """One global array, sharded over (data, fsdp), from each process's rows."""
        shape = (self.plan.global_batch, self.plan.seq_len + 1)
        return jax.make_array_from_process_local_data(self.batch_sharding, local_rows, shape)

    def batch(self, step: int, stream: int = TRAIN) -> jax.Array:
        """Global batch ``step`` by random access (tests, evaluation)."""
        return self.global_batch(self.data.local_batch(step, stream))

    def held_out(self, n: int) -> list[jax.Array]:
        """The first ``n`` held-out global batches: what each evaluation in training reads."""
        return [self.batch(k, EVAL) for k in range(n)]


def adopt(exp: Experiment, state: TrainState) -> TrainState:
    """A train state of this run on another of its layouts (``parallelism=auto``'s turns) laid
    out in ``exp``'s shardings: a reshard, the bits unchanged. One process, one padding of the
    vocabulary (``autotune.search`` trains through only then); ZeRO-1's padding of the
    optimizer state may differ (another data size): it is refitted."""
    want = exp.abstract_state().opt_state
    if jax.tree.map(lambda x: x.shape, state.opt_state) != jax.tree.map(lambda x: x.shape, want):
        def refitted(opt_state: Any) -> Any:
            return jax.tree.map(lambda x, w: refit(x, w.shape), opt_state, want)
        state = state._replace(opt_state=jax.jit(
            refitted, out_shardings=exp.state_shardings.opt_state)(state.opt_state))
    return jax.block_until_ready(jax.device_put(state, exp.state_shardings))


# ------------------------------------------------------------------------------------------------
# A Hugging Face checkpoint read into a run's sharded parameters (``model.init_from=hf:<dir>``).
#
# Each dxrun parameter is made in the run's shardings one shard at a time: for each layer of a
# stacked weight in turn, a shard reads only its region of the HF tensor (safetensors' lazy
# slices; ``dxrun.hf.dxrun_block`` maps dxrun's index to the HF tensor's), in dxrun's layout, into
# the shard; rows past the real vocabulary are the mesh's padding, zeros. A shard is on its
# devices before the next is read, and replicas share one read. So the host holds one shard
# beyond the shards placed so far, never the whole model, and each process reads only the
# shards of its own devices.


def _table(exp: Experiment, d: Path) -> list[Weight]:
    m = exp.cfg.model
    return weights(read_config(d)["model_type"], m)


def check_hf_weights(exp: Experiment) -> None:
    """Refuse (ConfigError, one line) a directory whose tensors do not make this model:
    headers only, before anything is written."""
    d = hf_dir(exp.cfg.model.init_from)
    with HFWeights(d) as files:
        files.check(_table(exp, d), exp.cfg.model)


def _leaves(tree: dict) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))
    return {"/".join(str(getattr(k, "key", k)) for k in p): x for p, x in flat}


def import_params(exp: Experiment, spec: dict | None = None) -> dict:
    """The parameters of ``exp.cfg.model.init_from``'s directory, laid out in ``exp``'s
    shardings (``exp.param_shardings``), as a params tree ``exp.init_state`` takes. ``spec``:
    ``exp.abstract_state().params`` when the caller has it."""
    d = hf_dir(exp.cfg.model.init_from)
    m, table = exp.cfg.model, _table(exp, d)
    spec = spec or exp.abstract_state().params
    specs, axes = _leaves(spec), _leaves(exp.axes)
    if set(specs) != {w.dxrun for w in table}:
        raise AssertionError(f"dxrun.hf misses {set(specs) ^ {w.dxrun for w in table}}")
    dim = dims(m)
    real_v = dim["V"]
    built: dict[str, jax.Array] = {}
    with HFWeights(d) as files:
        files.check(table, m)
        for w in table:
            s, names = specs[w.dxrun], list(axes[w.dxrun])
            if w.per_layer:
                names = names[1:]
            vocab = names.index("vocab") if "vocab" in names else None
            one = s.shape[1:] if w.per_layer else s.shape
            real = tuple(real_v if i == vocab else n for i, n in enumerate(one))

            def shard(index: tuple, w: Weight = w, one: tuple = one, real: tuple = real,
                      dtype: Any = s.dtype) -> np.ndarray:
                # (start, stop) per axis of one layer, within the real vocabulary; the rows
                # past it are the mesh's padding, zeros
                wanted = [i.indices(n)[:2] for i, n in
                          zip(index[1:] if w.per_layer else index, one, strict=True)]
                within = tuple((min(a, r), min(b, r)) for (a, b), r in zip(wanted, real,
                                                                           strict=True))
                layers = range(m.n_layers)[index[0]] if w.per_layer else [None]
                out = np.zeros((len(layers), *(b - a for a, b in wanted)), dtype)
                fill = tuple(slice(0, b - a) for a, b in within)
                hf_shape = shape_of(w.hf_shape, dim)
                if any(a == b for a, b in within):  # all padding (or empty): zeros
                    return out if w.per_layer else out[0]
                for k, layer in enumerate(layers):  # one layer's block read at a time
                    name = files.name_for(w, layer)
                    out[(k, *fill)] = dxrun_block(w, real, within, hf_shape,
                                                  lambda sl, name=name: files.read(name, sl))
                return out if w.per_layer else out[0]

            built[w.dxrun] = _place(s.shape, s.sharding, shard)
    return _nest(built)


def _place(shape: tuple[int, ...], sharding: Any, shard: Any) -> jax.Array:
    """``jax.make_array_from_callback``, one shard at a time: each is read once (replicas of
    it on other devices share the read) and is on its devices before the next is read, so
    the host holds one shard at a time."""
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_index.setdefault(tuple((s.start, s.stop, s.step) for s in index), []).append(
            (device, index))
    placed = {}
    for group in by_index.values():
        # Ready before the next is read: an asynchronous copy keeps its host buffer alive, and
        # several in flight would hold several shards
        first = jax.block_until_ready(jax.device_put(shard(group[0][1]), group[0][0]))
        # replicas copied from device to device: no two share the host's buffer
        placed |= {device: jax.device_put(first, device) for device, _ in group[1:]}
        placed[group[0][0]] = first
    arrays = [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out
