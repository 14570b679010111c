"""The jitted train step: forward, loss, gradients, optax update, metrics reduced to scalars.

One ``jax.jit`` with explicit input/output shardings and the state donated. Gradients of
replicated (data-parallel) parameters are reduced by XLA; there is no pmap and no hand-written
all-reduce.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dxrun.model import (
    PENALTY,
    MaskedDiffusion,
    chunked_cross_entropy,
    in_context_order,
    in_mesh_context,
    logits_of,
    move_router_bias,
    objective_of,
    pad,
    replicated,
    router_statistics,
    unpad,
    vmappable,
    with_router_losses,
    without_mesh_axis,
)
from dxrun.plan import MeshPlan
from dxrun.run import check_chip, faults_from_env

if TYPE_CHECKING:
    from dxrun.config import RunConfig


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
    master weights and it casts each at its use (``dxrun.model.layers.dense``), so weight gradients
    are accumulated, all-reduced over data replicas and returned in fp32; "bf16" casts the
    whole tree to ``dtype`` first: the gradients' batch sums, and their all-reduce, are in
    ``dtype`` (half the traffic under bf16). Under fp32 compute the two are the same.
    ``loss_chunk`` > 0: the loss and accuracy over that many positions at a time, never the
    whole logits tensor (``dxrun.model.losses``). ``objective``: masked diffusion
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
            weights_BxL=weights_BxL, softcap=model.logit_softcap)
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
    # test-only (dxrun/run/faults.py, from the environment): the step whose loss is poisoned
    inject_nan_at_step: int = field(default_factory=lambda: faults_from_env().nan_at_step)
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
        if inject_nan_at_step:  # test-only (dxrun/run/faults.py): poisons loss and grads
            loss = loss * jnp.where(step + 1 == inject_nan_at_step, jnp.nan, 1.0)
        # The MoE penalties join the differentiated loss; train/loss (the objective's) is set
        # after the micro-batches from their sum less the penalty, so a dense model's loss is
        # reduced once, not twice (tests/test_gradient_reduction.py)
        metrics = {k: v for k, v in metrics.items() if k != "train/loss"}
        return with_router_losses(loss, metrics, found)

    def step(state: TrainState, tokens_BxT: jax.Array) -> tuple[TrainState, dict]:
        key = (None if spec.dropout_seed is None
               else jax.random.fold_in(jax.random.key(spec.dropout_seed), state.step))
        batch = tokens_BxT if objective is None else objective.train_batch(state.step, tokens_BxT)
        loss, metrics, grads = accumulated_grads(
            lambda p, t, k: loss_fn(p, t, k, state.step), state.params, batch, key,
            plan.grad_accum, batch_sharding,
            state_shardings.params if vmappable(state_shardings.params) else None)
        metrics = {**metrics, "train/loss": loss - metrics.pop(PENALTY, 0.0)}
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
            self.compiled = check_chip(compiled, step_bytes(compiled))
            self.compile_time_s = time.perf_counter() - t0
        return self.compiled

    def analyse(self, state: TrainState, tokens_BxT: Any) -> Any:
        """The step compiled for its analyses only (``analysis_options``): never kept, never
        run (the run's own compile is ``compile``)."""
        options = analysis_options(self.mesh.devices.flat[0].platform)
        with in_mesh_context(self.mesh, self.rules):
            compiled = self.jitted.lower(state, tokens_BxT).compile(options)
        return check_chip(compiled, step_bytes(compiled))

    def memory_bytes(self) -> float | None:
        return step_bytes(self.compiled) if self.compiled is not None else None

    def __call__(self, state: TrainState, tokens_BxT: jax.Array) -> tuple[TrainState, dict]:
        new_state, metrics = self.compile(state, tokens_BxT)(state, tokens_BxT)
        return new_state, self.in_flight(metrics)  # the metrics: not donated, unlike the state


def step_spec(cfg: RunConfig, plan: MeshPlan, mesh: jax.sharding.Mesh,
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
