"""Assemble a run from a validated config: plan -> mesh -> sharded model -> optimizer -> step.

``Experiment`` is what the launcher trains and what tests drive directly (same code path).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from flax import nnx

from dxrun.cost import TARGETS
from dxrun.data import EVAL, TRAIN, Data
from dxrun.experiment.hf_weights import import_params
from dxrun.experiment.optimizer import make_optimizer
from dxrun.experiment.step import TrainState, make_eval_step, make_train_step, step_spec
from dxrun.model import (
    batch_sharding,
    build_model,
    check_process_rows,
    count_params,
    in_mesh_context,
    mesh_from_plan,
    optimizer_param_shardings,
    pad,
    param_axes,
    param_shardings,
    refit,
    replicated,
    resize_vocab,
    spread_shardings,
    zero_pads,
)
from dxrun.plan import (
    AttentionTarget,
    MeshPlan,
    attention_target,
    compiled_kernel,
    kind_target,
    make_plan,
    table_rows,
)
from dxrun.run import process_hosts

if TYPE_CHECKING:
    from dxrun.config import ModelConfig, RunConfig


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
        spec = step_spec(cfg, plan, mesh, state_shardings, b_shard, u_shard, pads)
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

    def hf_params(self, spec: dict | None = None) -> dict:
        """``model.init_from``'s weights read into this mesh's shards (``hf_weights``);
        ``spec``: ``abstract_state().params`` when the caller has it."""
        return import_params(self.cfg.model, spec or self.abstract_state().params, self.axes)

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
