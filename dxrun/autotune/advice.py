"""Plan mode's advice for a plan that does not fit: the fastest setting that fits, by the estimate.

The candidates are the ways to lay the same update out on the same devices: every mesh
(dp x fsdp x tp) the mesh plan accepts, each ``model.remat``, ``train.grad_accum`` and ZeRO-1
(``parallelism.shard_optimizer``). Each is first priced from the shapes alone (values in,
values out): the memory model's need, with the state's shards counted from the parameters'
logical axes, and the time model's step without its collectives, which the step can only
exceed. Those that may fit are then built and compiled from shapes (plan mode's own need and
estimate) in the order of that bound, until the bound of the next cannot beat the runners-up
found, or the compile budget ends. When none fits, the same pricing finds the smallest multiple
of the devices on which a layout would (an accelerator target: each device brings its memory).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import jax
from omegaconf import OmegaConf

from dxrun.autotune.footprint import accelerator_memory, kernel_on, step_estimate, target_vocab
from dxrun.config import AXES, ConfigError
from dxrun.cost import (
    GB,
    REMATS,
    TARGETS,
    Target,
    gb_text,
    meshes,
    step_flops,
    target_key,
    unused_axes,
    usable_bytes,
)
from dxrun.estimates import COST, estimate_memory, shapes, step_time, workload
from dxrun.experiment import (
    Experiment,
)
from dxrun.fit import NoData
from dxrun.plan import (
    LOGICAL_RULES,
    Layout,
    MeshPlan,
    make_plan,
)

if TYPE_CHECKING:
    from dxrun.config import RunConfig


ACCUMS = (1, 2, 4, 8, 16)
RUNNERS_UP = 3  # settings listed after the suggestion
GROWTH = (2, 4, 8, 16, 32, 64)  # the device counts (x the plan's) tried when none fits
MAX_COMPILES = 10
# On a CPU target the bound (FLOPs at the peak) leaves out the memory traffic a CPU step is
# bound by, so it rarely stops the compiles early: fewer of them, nearest first among equals.
MAX_COMPILES_CPU = 3
TIME_BUDGET_S = 120.0  # the compile stage stops here, keeping what it found
SLACK = 1.02  # a pure need this close over the budget is still compiled (rounding, padding)
CPU_SLACK = 1.25


@dataclass(frozen=True)
class Setting:
    """One candidate: a layout (mesh, remat, accumulation) and whether ZeRO-1 is on.
    ``keyed``: ZeRO-1 set against what the config's ``parallelism.shard_optimizer`` gives on
    this layout (its plan's decision), so the key is one of the candidate's overrides."""

    layout: Layout
    zero: bool
    keyed: bool = field(default=False, compare=False)


@dataclass
class Priced:
    setting: Setting
    overrides: list[str]
    need_bytes: float | None  # the memory model's (pure) or plan mode's (built)
    step_s: float | None  # a lower bound (pure) or the estimate (compiled)
    changes: int = 0
    compiled: bool = False

    def to_json(self, asked_s: float | None) -> dict[str, Any]:
        return {"overrides": self.overrides, "step_time_s": self.step_s,
                "speed": asked_s / self.step_s if asked_s and self.step_s else None,
                "needs_gb": None if self.need_bytes is None else self.need_bytes / GB}


@dataclass(frozen=True)
class StateShapes:
    """What the state's shards are counted from: each parameter's shape, itemsize and
    logical axes, the optimizer's bytes per parameter byte, the global batch's bytes."""

    leaves: tuple[tuple[tuple[int, ...], int, tuple | None], ...]
    opt_per_param: float
    batch_bytes: float

    @classmethod
    def of(cls, exp: Any, state: Any) -> StateShapes:
        leaves: list[tuple[tuple[int, ...], int, tuple | None]] = []
        jax.tree.map(lambda names, x: leaves.append((tuple(x.shape), x.dtype.itemsize, names)),
                     exp.axes, state.params,
                     is_leaf=lambda x: isinstance(x, tuple) or x is None)
        params = sum(itemsize * math.prod(shape) for shape, itemsize, _ in leaves)
        opt = sum(x.dtype.itemsize * x.size for x in jax.tree.leaves(state.opt_state))
        batch = exp.abstract_batch()
        return cls(tuple(leaves), opt / params, batch.dtype.itemsize * math.prod(batch.shape))

    def per_device(self, s: Setting) -> tuple[float, float, float]:
        """(params, optimizer state, batch) bytes per device: a tensor axis split where its
        mesh axes divide it (the vocabulary always: it is padded to tp), the optimizer state as
        its parameter's, over the data replicas too under ZeRO-1."""
        sizes = s.layout.mesh_sizes
        params = 0.0
        for shape, itemsize, names in self.leaves:
            n = float(itemsize)
            for dim, name in zip(shape, names or (None,) * len(shape), strict=True):
                rule = LOGICAL_RULES.get(name) if name else None
                k = math.prod(sizes[a] for a in ((rule,) if isinstance(rule, str) else
                                                 rule or ()))
                n *= -(-dim // k) if dim % k == 0 or name == "vocab" else dim
            params += n
        opt = self.opt_per_param * params / (s.layout.dp if s.zero else 1)
        return params, opt, self.batch_bytes / s.layout.replicas


def settings(cfg: RunConfig, n: int, platform: str, batch: int, seq_len: int,
             processes: int = 1, hosts: tuple[int, ...] | None = None, device: Any = None
             ) -> list[tuple[Setting, MeshPlan]]:
    """Every (setting, its mesh plan) on ``n`` devices that the mesh plan accepts at the
    global ``batch`` and ``seq_len`` held fixed: ZeRO-1 off, and on too with data replicas."""
    out = []
    for sizes in meshes(n, seq_len, unused_axes(cfg)):
        for remat in REMATS:
            for accum in ACCUMS:
                layout = Layout(sizes, remat, accum)
                try:
                    own = make_plan(cfg, n, platform, processes, hosts, device, layout=layout,
                                    batch=batch, seq_len=seq_len)
                except ConfigError:
                    continue
                for z in (False, True) if sizes["dp"] > 1 else (False,):
                    plan = own if z == own.shard_optimizer else make_plan(
                        cfg, n, platform, processes, hosts, device, layout=layout,
                        batch=batch, seq_len=seq_len, zero=z)
                    out.append((Setting(layout, z, keyed=plan is not own), plan))
    return out


def overrides(cfg: RunConfig, s: Setting, asked: Setting, batch: int) -> list[str]:
    """The keys that turn the asked setting into ``s`` (the batch of one update kept)."""
    a, b = asked.layout, s.layout
    out = []
    if a.sizes != b.sizes:  # every axis -1 could infer, and one that cannot where it changes
        out += [f"parallelism.{x.key}={b.sizes[x.key]}" for x in sorted(
            AXES, key=lambda x: not x.inferable)
            if (x.inferable and not x.only_with) or a.sizes[x.key] != b.sizes[x.key]]
    if a.remat != b.remat:
        out.append(f"model.remat={b.remat}")
    if a.grad_accum != b.grad_accum:
        out.append(f"train.grad_accum={b.grad_accum}")
    if s.keyed:
        out.append(f"parallelism.shard_optimizer={str(s.zero).lower()}")
    per_device = batch // (b.replicas * b.grad_accum)
    if cfg.data.per_device_batch_size is not None and per_device != cfg.data.per_device_batch_size:
        out.append(f"data.per_device_batch_size={per_device}")
    return out


def _model_need(cfg: RunConfig, plan: MeshPlan, target: Target, state: tuple[float, float, float]
                ) -> float:
    """The memory model's need (``dxrun.cost``) of ``plan`` with the state's shards
    ``state``: what ``footprint.accelerator_memory`` counts, before anything is built (the logits
    of the target's vocabulary padding, as there)."""
    m = cfg.model
    kernel = kernel_on(cfg, plan, target.device_kind)
    vocab = target_vocab(cfg, plan, target)
    x = shapes(m, plan, kernel, vocab)
    return estimate_memory(x, *state, plan.fsdp).total_bytes


def _step_bound(cfg: RunConfig, plan: MeshPlan, target: Target, peak: float | None,
                n_params: int, params_bytes: float) -> float | None:
    """A lower bound of the estimated step: the accelerator time model's without collectives
    (they only add to it), or on a CPU target the recomputed FLOPs at the peak."""
    key = target_key(target)
    if not peak:
        return None
    if key in COST:
        w = workload(cfg, plan, n_params, params_bytes / 4,
                              kernel=kernel_on(cfg, plan, target.device_kind))
        t = TARGETS[key]
        return step_time(w, COST[key], peak, t.hbm_bytes_per_s,
                                  t.link_bytes_per_s, [])["step_time_s"]
    parts = step_flops(cfg.model, plan.global_batch * plan.seq_len, plan.seq_len,
                             plan.padded_vocab, plan.remat)
    return parts["hardware"] / plan.n_devices / (peak * 1e12)


def price(cfg: RunConfig, shapes: StateShapes, target: Target, peak: float | None, n_params: int,
          candidates: list[tuple[Setting, MeshPlan]], asked: Setting, batch: int
          ) -> list[Priced]:
    """Each candidate priced from the shapes: the memory model's need and the step's lower
    bound."""
    out = []
    for s, plan in candidates:
        state = shapes.per_device(s)
        need = _model_need(cfg, plan, target, state)
        o = overrides(cfg, s, asked, batch)
        out.append(Priced(s, o, need, _step_bound(cfg, plan, target, peak, n_params, state[0]),
                          changes=len(o)))
    return out


def _order(p: Priced) -> tuple[float, int, float]:
    return (p.step_s if p.step_s is not None else 0.0, p.changes, p.need_bytes or 0.0)


def _compile(cfg: RunConfig, p: Priced, asked_plan: MeshPlan, target: Target, peak: float | None,
             budget: float) -> Priced:
    """``p`` built and compiled from shapes as plan mode plans a run: its need and estimate
    (not compiled when the built state already does not fit an accelerator)."""
    lay = p.setting.layout
    keys = {"parallelism": {**lay.sizes, "shard_optimizer": p.setting.zero},
            "model": {"remat": lay.remat}, "train": {"grad_accum": lay.grad_accum}}
    trial = OmegaConf.merge(cfg, keys)
    plan = make_plan(trial, asked_plan.n_visible, asked_plan.platform, asked_plan.processes,
                     asked_plan.process_hosts or None, asked_plan.attention_device,
                     batch=asked_plan.global_batch, seq_len=asked_plan.seq_len)
    exp = Experiment.build(trial, plan, data=NoData())
    if target.device_kind != "cpu":
        need = accelerator_memory(exp, target).total_bytes
        if need > budget:
            return replace(p, need_bytes=need, step_s=None, compiled=True)
    s = step_estimate(trial, exp, exp.analyse_step(), target, peak, xla_cost=False)
    need = s.est["needs_per_device_gb"] * GB
    return replace(p, need_bytes=need, step_s=step_of(s.est, lay.grad_accum) if s.est["fits"]
                   else None, compiled=True)


def step_of(est: dict[str, Any], grad_accum: int) -> float | None:
    """The estimate's step, the same for every candidate. On a CPU target (the roofline of
    the compile's bytes) XLA counts a loop's body once, the micro-batch loop's too: its bytes
    are counted ``grad_accum`` times here, or accumulation would look free."""
    if "timing" in est or "memory_s" not in est:
        return est.get("step_time_s")
    return max(est["compute_s"], est["memory_s"] * grad_accum) + est["collective_s"]


def fastest_that_fits(cfg: RunConfig, exp: Any, state: Any, target: Target, peak: float | None,
                      asked: dict[str, Any], n_params: int, *, runners_up: int = RUNNERS_UP,
                      max_compiles: int | None = None, time_budget_s: float = TIME_BUDGET_S
                      ) -> dict[str, Any]:
    """Plan mode's advice for ``exp``'s plan (which does not fit ``target``): the fastest
    setting that fits, with its estimated step and speed against the asked one's (``asked``:
    its estimate, priced as the candidates are: ``step_estimate(..., xla_cost=False)``), and
    up to ``runners_up`` more; or, when none fits on these devices, how many would do.
    ``cfg``: the run's config as its files record it (``plan.resolved_config``)."""
    t0 = time.perf_counter()
    plan, budget = exp.plan, usable_bytes(target)
    asked_s = step_of(asked, plan.grad_accum)
    if max_compiles is None:
        max_compiles = MAX_COMPILES if target.device_kind != "cpu" else MAX_COMPILES_CPU
    start = Setting(plan.layout, plan.shard_optimizer)
    shapes = StateShapes.of(exp, state)
    batch, seq = plan.global_batch, plan.seq_len
    candidates = [c for c in settings(cfg, plan.n_devices, plan.platform, batch, seq,
                                      plan.processes, plan.process_hosts or None,
                                      plan.attention_device)
                  if c[0] != start]
    priced = price(cfg, shapes, target, peak, n_params, candidates, start, batch)
    # A CPU target's program is not the one the memory model counts (XLA:CPU keeps more): there
    # it only rules out what is far over, and the compile decides.
    slack = SLACK if target.device_kind != "cpu" else CPU_SLACK
    maybe = sorted((p for p in priced if p.need_bytes <= budget * slack), key=_order)
    fits: list[Priced] = []
    compiled = 0
    for p in maybe:
        keep = fits[:runners_up + 1]
        if (len(keep) > runners_up and p.step_s is not None and keep[-1].step_s is not None
                and p.step_s >= keep[-1].step_s):
            break  # no candidate left can beat the ones kept
        if compiled >= max_compiles or time.perf_counter() - t0 > time_budget_s:
            break
        done = _compile(cfg, p, plan, target, peak, budget)
        compiled += 1
        if done.need_bytes is not None and done.need_bytes <= budget:
            fits = sorted([*fits, done], key=_order)
    out: dict[str, Any] = {"candidates": len(priced), "fit_by_model": len(maybe),
                           "compiled": compiled, "asked_step_time_s": asked_s}
    if fits:
        best, *rest = _distinct(fits)
        out |= {"suggestion": best.to_json(asked_s),
                "runners_up": [r.to_json(asked_s) for r in rest[:runners_up]]}
    elif target.device_kind != "cpu":
        out["larger_mesh"] = larger_mesh(cfg, shapes, target, peak, n_params, start, plan)
    out["search_s"] = time.perf_counter() - t0
    return out


def _distinct(ranked: list[Priced]) -> list[Priced]:
    """``ranked`` less each setting estimated as fast as one before it on the same mesh (a
    remat or ZeRO-1 that only moves memory): the list names different choices."""
    out: list[Priced] = []
    for p in ranked:
        mesh = p.setting.layout.mesh
        if not any(q.setting.layout.mesh == mesh and q.step_s is not None and p.step_s is not None
                   and abs(p.step_s - q.step_s) <= 1e-3 * q.step_s for q in out):
            out.append(p)
    return out


def larger_mesh(cfg: RunConfig, shapes: StateShapes, target: Target, peak: float | None,
                n_params: int, asked: Setting, plan: MeshPlan) -> dict[str, Any] | None:
    """The smallest multiple of the plan's devices (``GROWTH``) on which a setting fits by the
    memory model, and its fastest setting there by the step's lower bound (nothing compiled:
    plan it with ``plan.devices``); None when none up to the last multiple does."""
    base = OmegaConf.merge(cfg, {"parallelism": {"n_devices": 0}})
    for k in GROWTH:
        n = plan.n_devices * k
        candidates = settings(base, n, plan.platform, plan.global_batch, plan.seq_len,
                              device=plan.attention_device)
        priced = price(base, shapes, target, peak, n_params, candidates, asked,
                       plan.global_batch)
        fits = sorted((p for p in priced if p.need_bytes <= usable_bytes(target)), key=_order)
        if fits:
            best = fits[0]
            extra = [f"parallelism.n_devices={n}"] if cfg.parallelism.n_devices else []
            return {"devices": n, "overrides": [f"plan.devices={n}", *extra, *best.overrides],
                    "needs_gb": best.need_bytes / GB, "step_time_bound_s": best.step_s}
    return None


def advice_text(advice: dict[str, Any], n_devices: int, short: bool = False) -> str:
    """The table's suggestion row (``short``: without the runners-up)."""
    s = advice.get("suggestion")
    if s is not None:
        text = f"fastest that fits: {' '.join(s['overrides'])} ({_setting_text(s)})"
        if short:
            return text
        rest = "; ".join(f"{' '.join(r['overrides'])} ({_setting_text(r)})"
                         for r in advice.get("runners_up", []))
        return (text + (f"; runners-up: {rest}" if rest else "") +
                f" [ranked by the estimate: {advice['compiled']} of {advice['candidates']} "
                f"settings compiled, {advice['fit_by_model']} fit by the memory model]")
    larger = advice.get("larger_mesh")
    if larger:
        return (f"no layout of {n_devices} devices fits; {larger['devices']} would: "
                f"{' '.join(larger['overrides'])} (memory model: "
                f"{gb_text(larger['needs_gb'] * GB)} per device; not compiled)")
    if advice.get("fit_by_model") == 0:
        return (f"no layout of {n_devices} to {n_devices * GROWTH[-1]} devices fits at this "
                "batch and sequence length")
    return (f"none of the {advice['compiled']} settings compiled fits "
            f"({advice['candidates']} candidates)")


def _setting_text(p: dict[str, Any]) -> str:
    need = f"needs {gb_text(p['needs_gb'] * GB)}"
    if p["step_time_s"] is None:
        return need
    speed = f", {p['speed']:.2f}x the asked speed" if p["speed"] else ""
    return f"est. {p['step_time_s'] * 1e3:.1f} ms a step{speed}, {need}"
