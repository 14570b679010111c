"""The mesh plan: a pure function from (config, visible devices) to how the run is laid out.

Nothing here imports JAX, so the plan is checked (and can be printed) before anything compiles.
The mesh's axes are ``schema_parallel.AXES``' rows, outermost first: ``data`` (replicas), ``fsdp``
(replicas whose weights are sharded), ``context`` (each sequence split along its length:
dxrun/plan/context.py), ``tensor`` (Megatron tensor parallelism, innermost so it lands on the
closest devices); the plan holds their sizes as one ``Sizes`` mapping, and their parts across
hosts as another (``dcn``: dxrun/plan/hosts.py). The vocabulary's tables get the rows a multiple
of tp (the vocab axis is split over ``tensor``) and, on an accelerator, of an alignment that
tiles its matmul units evenly (``padded_vocab``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dxrun.config import (
    AXES,
    GLOBAL,
    PER_DEVICE,
    ConfigError,
    axis_sizes,
    expert_d_ff,
)
from dxrun.plan.axes import AxisAttrs, Layout, Sizes, named, replicas_of, resolve_axes, shrink
from dxrun.plan.batch import (
    batch_set_by,
    check_tokens_per_step,
    default_seq_len,
    global_batch,
    loss_chunk_for,
    scaled_lr,
)
from dxrun.plan.context import check_context, check_processes, check_sequence_parallel
from dxrun.plan.hosts import HostPlacement, group_by_host, split_over_hosts
from dxrun.plan.kernels import AttentionTarget, check_remat, plan_kernel

if TYPE_CHECKING:
    from dxrun.config import ParallelismConfig, RunConfig


MESH_AXES = tuple(a.mesh for a in AXES)  # ("data", "fsdp", "context", "tensor")
BATCH_AXES = tuple(a.mesh for a in AXES if a.batch)  # ("data", "fsdp", "expert")
# The one rules table: logical tensor axis -> mesh axis (None = replicated). Model code names
# logical axes only; changing the parallelism changes only the mesh sizes under this table.
# Megatron TP: heads/kv_heads/mlp are the column-parallel outputs of q/k/v/up/gate and the
# row-parallel inputs of the attention-out/down projections, so a block moves no weights.
# FSDP shards the remaining (embed) axis of each weight.
LOGICAL_RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "seq": "context",  # the sequence of every activation (attention gathers K/V over it)
    # the residual stream's and the norms' sequence: over tensor too with sequence_parallel
    "stream_seq": "context",
    "layers": None,  # the stacked layer axis of scanned blocks: every device has every layer
    "embed": "fsdp",
    "expert": "expert",  # an MoE layer's experts (the leading axis of their stacked weights)
    "act_embed": None,  # activations keep d_model whole; only weights shard it
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "norm": None,
    "pos": None,
}
# ZeRO-1 (parallelism.shard_optimizer): each optimizer-state tensor is split over `data` as
# well, along the first of its logical axes in this order whose per-shard size the data axis
# divides (appended to whatever the rules above shard it over). Weight axes first (the large
# ones), the stacked layer axis last. No divisible axis: the tensor is padded up to a
# multiple of the data axis along one axis and split there (dxrun/model/sharding.py).
OPTIMIZER_DATA_AXES = ("embed", "mlp", "vocab", "heads", "kv_heads", "head_dim", "norm", "pos",
                       "layers")


@dataclass(frozen=True)
class MeshPlan(AxisAttrs, HostPlacement):
    """The run's layout and its step's decisions. ``sizes``: each mesh axis's size by key
    (``plan.dp``, ``plan.tp``, ... read one); the host properties: ``HostPlacement``."""

    sizes: Sizes
    device_ids: tuple[int, ...]
    n_visible: int
    platform: str
    global_batch: int
    seq_len: int
    rules: dict[str, Any]
    warnings: tuple[str, ...] = ()
    # The model's vocabulary and the rows its wte / lm_head really have: a multiple of tp (the
    # vocab axis is split over `tensor`) and of VOCAB_ALIGN (or parallelism.vocab_align). 0 =
    # no model (a bare mesh).
    vocab_size: int = 0
    padded_vocab: int = 0
    vocab_align: int = 1  # the alignment padded_vocab has beside tp (VOCAB_ALIGN's or the key's)
    grad_accum: int = 1
    # JAX processes the mesh spans, the host of each (an index; () = each process its own
    # host), and the part of each mesh axis that runs across hosts (the rest of the axis is
    # inside one host): as each axis's ``Axis.hosts`` says (data spans hosts, tensor never
    # unless parallelism.allow_cross_host_tp). A host's processes together hold its part.
    processes: int = 1
    dcn: Sizes = Sizes()
    process_hosts: tuple[int, ...] = ()
    # Which key the global batch came from (data.batch_size or data.per_device_batch_size), and
    # the peak learning rate after optimizer.lr_scaling at that batch (0 = no optimizer given).
    batch_set_by: str = GLOBAL
    peak_lr: float = 0.0
    lr_scaling: str = "none"
    remat: str = "none"  # model.remat, or the layout search's choice
    sequence_parallel: bool = False  # parallelism.sequence_parallel, in effect (tp > 1)
    attention: str = "xla"  # the kernel (attention_kernel.choose) for attention_device's devices
    attention_device: AttentionTarget = AttentionTarget()
    # The step's other decisions, taken by ``make_plan`` alone from its final inputs: the
    # precision (train.precision) and its compute dtype's name, positions per loss chunk
    # (``loss_chunk.loss_chunk_for``; 0 = the whole sequence), ZeRO-1 on (``shard_optimizer``).
    precision: str = "fp32"
    precision_auto: bool = False  # decided by train.precision=auto (the platform's)
    grad_reduce_dtype: str = "fp32"  # train.grad_reduce_dtype, auto resolved
    compute_dtype: str = "float32"
    loss_chunk: int = 0
    shard_optimizer: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(self.sizes, self.remat, self.grad_accum)

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape over ``MESH_AXES``."""
        return tuple(self.sizes.values())

    @property
    def n_devices(self) -> int:
        return self.sizes.n

    @property
    def per_device_batch(self) -> int:
        """Examples each data replica (a group of cp x tp devices) computes per step."""
        return self.global_batch // self.replicas

    @property
    def per_device_batch_size(self) -> int:
        """Examples each data replica computes at once (one micro-batch): what
        ``data.per_device_batch_size`` sets; global = this x dp x fsdp x grad_accum."""
        return self.per_device_batch // self.grad_accum

    def _batch_row(self) -> str:
        accum = f" x {self.grad_accum} micro-batches (train.grad_accum)" if self.grad_accum > 1 else ""
        given = (f"{PER_DEVICE}={self.per_device_batch_size}" if self.batch_set_by == PER_DEVICE
                 else GLOBAL)
        return (f"{self.global_batch} global = {self.per_device_batch_size} per replica x "
                f"{self.replicas} replicas{accum}, seq_len {self.seq_len}; set by {given}")

    def to_json(self) -> dict[str, Any]:
        out = {**self.sizes, **asdict(self)}
        del out["remat"], out["sizes"]  # remat: the config's key (model.remat), not the mesh's
        out["dcn"] = dict(self.dcn)  # each axis's part across hosts
        out["dcn_shape"] = list(self.dcn_shape)
        out["attention_device"] = self.attention_device._asdict()
        out["mesh_axes"] = list(MESH_AXES)
        out["mesh_shape"] = list(self.shape)
        out["per_device_seq"] = self.seq_len // self.cp
        out["n_devices"] = self.n_devices
        out["per_device_batch"] = self.per_device_batch
        out["local_shape"] = list(self.local_shape)
        out["hosts"] = self.hosts
        out["per_device_batch_size"] = self.per_device_batch_size
        out["device_ids"] = list(self.device_ids)
        out["rules"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.rules.items()}
        out["warnings"] = list(self.warnings)
        return out

    def table(self) -> str:
        rows = [
            ("mesh", " x ".join(f"{a.mesh}={v}" for a, v in named(self.sizes))),
            ("devices", f"{self.n_devices} of {self.n_visible} {self.platform} "
                        f"(ids {_ids(self.device_ids)})"),
            ("batch", self._batch_row()),
            *([("lr", f"{self.peak_lr:.4g} peak (optimizer.lr_scaling={self.lr_scaling} at "
                      f"batch {self.global_batch})")] if self.peak_lr else []),
            *([("hosts", self._hosts_row())] if self.processes > 1 else []),
            ("compute", precision_row(self)),
            ("weights", "embed->fsdp, heads/mlp/vocab->tensor, norms+row biases replicated"),
            *([("sequence", f"{self.seq_len // self.cp} positions per device of {self.seq_len}: "
                            f"chunks i and {2 * self.cp - 1}-i of {2 * self.cp} on context "
                            "device i; K/V all-gathered over context per layer")]
              if self.cp > 1 else []),
            *([("seq-par", "norms and residual split along the sequence over tensor "
                           "(reduce-scatter + all-gather for each all-reduce)")]
              if self.sequence_parallel else []),
        ]
        if self.padded_vocab != self.vocab_size:
            rows.append(("vocab", f"{self.vocab_size} padded to {self.padded_vocab} for "
                                  f"tp={self.tp}{_align_note(self.vocab_align)} (padding rows "
                                  "masked out of the loss)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def precision_row(plan: MeshPlan) -> str:
    """The table's compute row: the precision, the gradients' sums, and what decided them."""
    if plan.precision != "bf16":
        what = plan.precision
    else:
        what = f"bf16, fp32 master weights, {plan.grad_reduce_dtype} gradient sums"
    why = (f"train.precision=auto on {plan.attention_device.platform}: bf16 on an accelerator, "
           "fp32 on CPU" if plan.precision_auto else f"train.precision={plan.precision}")
    return f"{what} ({why})"


def _align_note(align: int) -> str:
    return f" and {align}-alignment" if align > 1 else ""


def _ids(ids: tuple[int, ...]) -> str:
    if ids == tuple(range(ids[0], ids[0] + len(ids))) and len(ids) > 2:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def make_plan(cfg: RunConfig, n_visible: int, platform: str = "cpu", processes: int = 1,
              process_hosts: tuple[int, ...] | None = None,
              device: AttentionTarget | None = None, *, layout: Layout | None = None,
              batch: int | None = None, seq_len: int | None = None, vocab: int | None = None,
              zero: bool | None = None) -> MeshPlan:
    """Resolve ``cfg.parallelism`` against ``n_visible`` devices (of ``processes`` equal
    processes; ``process_hosts``: the host of each, None = each process its own host) and
    check the model and batch fit. Tensor and fsdp groups stay inside a host (whose processes
    may share them); data spans the hosts. ``layout``: the mesh, remat and accumulation to lay
    out instead of the config's (a layout search's); ``batch``, ``seq_len``: the global batch
    and sequence length held fixed instead of the config's (None: resolved from it).
    ``device``: the facts the attention kernel is chosen by (None: ``platform``'s, no cuDNN).
    ``vocab``: the padded vocabulary instead of ``platform``'s (a target's); ``zero``: ZeRO-1
    on or off instead of ``parallelism.shard_optimizer``'s (a candidate's). The one place
    every decision of the step (kernel, loss chunk, ZeRO-1, precision) is taken.

    Raises ConfigError (key, value, fix) on any mismatch, before anything compiles.
    """
    par, model, data = cfg.parallelism, cfg.model, cfg.data
    given = axis_sizes(par) if layout is None else dict(layout.sizes)
    sizes, warnings = _devices(par, given, n_visible, platform, processes)
    dp, fsdp, cp, tp = (sizes[k] for k in ("dp", "fsdp", "cp", "tp"))  # the formulas' own
    hosts_of = tuple(process_hosts) if process_hosts and processes > 1 else ()
    hosts = max(hosts_of) + 1 if hosts_of else processes
    crossing = {a.key for a in AXES if a.cross_host and par.get(a.cross_host)}
    dcn = split_over_hosts(sizes, hosts, crossing) if hosts > 1 else Sizes()
    if hosts_of and hosts < processes:
        group_by_host(hosts_of, tp, tp // dcn["tp"], sizes.n)
    replicas = replicas_of(sizes)
    if layout is not None:
        accum, remat = layout.grad_accum, layout.remat
    else:
        accum = cfg.train.grad_accum if "train" in cfg else 1
        remat = model.get("remat", "none")
    batch, set_by, given = _batch(par.name, data, batch, replicas, accum)
    if seq_len is None:
        seq_len = default_seq_len(data.seq_len, model.max_seq_len, platform)
    check_tokens_per_step(set_by, given, batch, seq_len)
    check_context(cp, seq_len, user_model=bool(model.get("_target_")),
                  objective=model.get("objective", "ar"))
    sp = bool(par.get("sequence_parallel")) and tp > 1
    check_sequence_parallel(sp, seq_len, cp, tp)
    check_model_divides(model, tp, fsdp)
    if not model.get("_target_"):
        check_experts_divide(model, sizes["ep"], tp)
    device = device or AttentionTarget(platform)
    asked = cfg.train.precision if "train" in cfg else "fp32"
    precision = precision_of(asked, device.platform)  # plan mode: its target's
    dtype = compute_dtype(precision)
    rows = (model.vocab_size if model.get("_target_") else  # a user's own table
            vocab or padded_vocab(table_rows(model), tp, platform, par.vocab_align))
    kernel = plan_kernel(cfg, seq_len, cp, device, dtype)
    check_remat(remat, kernel)
    return MeshPlan(
        sizes=sizes, attention=kernel,
        attention_device=device, precision=precision, compute_dtype=dtype,
        precision_auto=asked == "auto",
        grad_reduce_dtype=grad_reduce_of(cfg.train.grad_reduce_dtype if "train" in cfg
                                         else "fp32", precision, device.platform),
        shard_optimizer=shard_optimizer(par, dp) if zero is None else zero,
        device_ids=tuple(range(sizes.n)), n_visible=n_visible, platform=platform,
        global_batch=batch, grad_accum=accum, batch_set_by=set_by, remat=remat,
        peak_lr=scaled_lr(cfg.optimizer, batch) if "optimizer" in cfg else 0.0,
        lr_scaling=cfg.optimizer.lr_scaling if "optimizer" in cfg else "none",
        seq_len=seq_len,
        rules=dict(LOGICAL_RULES) | ({"stream_seq": ("context", "tensor")} if sp else {}),
        sequence_parallel=sp,
        warnings=tuple(warnings),
        vocab_size=model.vocab_size,
        padded_vocab=rows,
        loss_chunk=loss_chunk_for(model, batch // (replicas * accum), seq_len, rows // tp, cp),
        vocab_align=vocab_align(platform, par.vocab_align),
        processes=processes, dcn=dcn, process_hosts=hosts_of if hosts < processes else (),
    )


def _devices(par: ParallelismConfig, given: dict[str, int], n_visible: int, platform: str,
             processes: int) -> tuple[Sizes, list[str]]:
    """The axes' sizes on the devices the run uses (``parallelism.n_devices``, else all
    visible), shrunk to them with ``parallelism.on_mismatch=shrink`` (a warning); ConfigError
    where they do not fit."""
    if par.n_devices > n_visible:
        hint = f" or runtime.cpu_devices={par.n_devices}" if platform == "cpu" else ""
        raise ConfigError(
            f"parallelism.n_devices={par.n_devices} but only {n_visible} {platform} devices are "
            f"visible; set parallelism.n_devices<={n_visible}{hint}"
        )
    n = par.n_devices or n_visible
    sizes = Sizes(resolve_axes(given, n))
    check_processes(sizes["cp"], processes)
    warnings: list[str] = []
    # An axis that cannot be inferred (context) is named only where it is used.
    used = [(a.key, v) for a, v in named(sizes)]
    if processes > 1 and sizes.n != n_visible:
        raise ConfigError(
            f"parallelism={par.name} ({', '.join(f'{k}={v}' for k, v in used)}) uses "
            f"{sizes.n} devices but a {processes}-process run has {n_visible} ({processes} x "
            f"{n_visible // processes}) and must use them all; set parallelism.n_devices=0 and "
            f"sizes whose product is {n_visible}")
    if sizes.n != n:
        product, need = "*".join(k for k, _ in used), sizes.n
        if par.on_mismatch != "shrink":
            in_use = (f"parallelism.n_devices={n} uses {n}" if par.n_devices
                      else f"{n} {platform} devices are visible")
            given = ", ".join(f"{k}={v}" for k, v in used)
            raise ConfigError(
                f"parallelism={par.name} (parallelism.{given}) needs {product} = "
                f"{'*'.join(str(v) for _, v in used)} = {need} devices, but {in_use}; set "
                f"parallelism.n_devices={need} if that many are visible, pick another "
                f"preset, or set parallelism.on_mismatch=shrink"
            )
        sizes = Sizes(shrink(sizes, n))
        warnings.append(
            f"parallelism.on_mismatch=shrink: {product}={'*'.join(str(v) for _, v in used)} "
            f"does not fit {n} devices; using "
            + " ".join(f"{k}={sizes[k]}" for k, _ in used) + f" on {sizes.n} devices"
        )
    return sizes, warnings


def _batch(preset: str, data: Any, batch: int | None, replicas: int,
           accum: int) -> tuple[int, str, Any]:
    """(the global batch, the key that set it, the value given there): ``batch`` held, else
    resolved from the data section; ConfigError where the replicas or the accumulation do not
    divide it."""
    set_by = GLOBAL if batch is not None else batch_set_by(data)
    given = batch if batch is not None else data[set_by.partition(".")[2]]
    batch = global_batch(data, replicas, accum) if batch is None else batch
    if batch % replicas:
        good = replicas * max(1, round(batch / replicas))
        raise ConfigError(
            f"data.batch_size={given if set_by == GLOBAL else data.batch_size} is not "
            f"divisible by dp*fsdp={replicas} (the "
            f"data-parallel replicas of parallelism={preset}); "
            f"use a multiple of {replicas} (e.g. data.batch_size={good})"
        )
    if (batch // replicas) % accum:
        per = batch // replicas
        raise ConfigError(
            f"train.grad_accum={accum} does not divide the {per} examples per replica "
            f"(data.batch_size={given if set_by == GLOBAL else data.batch_size} over dp*fsdp="
            f"{replicas}); pick a "
            f"train.grad_accum that divides {per}, or data.batch_size="
            f"{replicas * accum * max(1, per // accum)}")
    return batch, set_by, given


def check_model_divides(model: Any, tp: int, fsdp: int) -> None:
    """The heads, the MLP and d_model split evenly over ``tensor`` and ``fsdp``."""
    for key, value in (("n_heads", model.n_heads), ("n_kv_heads", model.n_kv_heads),
                       ("d_ff", model.d_ff)):
        if value % tp:
            raise ConfigError(
                f"model.{key}={value} is not divisible by parallelism.tp={tp}; "
                f"pick a tp that divides {value} (tensor parallelism splits {key} across devices)"
            )
    if model.d_model % fsdp:
        raise ConfigError(
            f"model.d_model={model.d_model} is not divisible by parallelism.fsdp={fsdp}; "
            f"pick an fsdp size that divides {model.d_model}"
        )


def check_experts_divide(m: Any, ep: int, tp: int) -> None:
    """The experts split evenly over the ``expert`` mesh axis, their widths over ``tensor``."""
    moe = m.moe
    if ep > 1 and not moe.n_experts:
        raise ConfigError(f"parallelism.ep={ep} splits the experts, but model.moe.n_experts=0 "
                          "(a dense model); set parallelism.ep=1 or model.moe.n_experts")
    if moe.n_experts % ep:
        raise ConfigError(
            f"model.moe.n_experts={moe.n_experts} is not divisible by parallelism.ep={ep}; "
            f"pick an ep that divides {moe.n_experts} (each expert device holds "
            "n_experts / ep experts)")
    for name, width in (("d_ff", expert_d_ff(m) if moe.n_experts else 0),
                        ("shared_d_ff", moe.shared_d_ff)):
        if width % tp:
            raise ConfigError(f"model.moe.{name}={width} is not divisible by parallelism.tp="
                              f"{tp}; pick a tp that divides {width}")


def shard_optimizer(p: ParallelismConfig, dp: int) -> bool:
    """ZeRO-1 on? ``parallelism.shard_optimizer``; null = when there are data replicas."""
    value = p.get("shard_optimizer")
    return dp > 1 if value is None else bool(value)


def precision_of(asked: str, platform: str) -> str:
    """``train.precision`` on ``platform``: as given, or for ``auto`` bf16 compute over fp32
    master weights on an accelerator (what every tuned accelerator run sets, MaxText's and
    torchtitan's default) and fp32 on CPU, where XLA computes bf16 through converts (slower,
    and the suite's exact numbers are fp32's)."""
    if asked != "auto":
        return asked
    return "fp32" if platform == "cpu" else "bf16"


def grad_reduce_of(asked: str, precision: str, platform: str) -> str:
    """``train.grad_reduce_dtype`` on ``platform``: as given, or for ``auto`` bf16 where the
    step computes in bf16 on a TPU (faster a step, the same first loss: BENCHMARKS.md, the
    defaults on the chip) and fp32 elsewhere (under fp32 compute the two are one)."""
    if asked != "auto":
        return asked
    return "bf16" if precision == "bf16" and platform == "tpu" else "fp32"


def compute_dtype(precision: str) -> str:
    """The name of the dtype the step computes in for ``train.precision``."""
    return "bfloat16" if precision == "bf16" else "float32"


# Accelerators get the vocabulary padded to a multiple of 128 as well (nanoGPT's 50304, MaxText):
# the output matmul's vocab axis then tiles the tensor cores / MXU evenly. On CPU only tp matters,
# so CPU runs (and the tests) keep the smallest table.
VOCAB_ALIGN = {"gpu": 128, "cuda": 128, "rocm": 128, "tpu": 128}


def vocab_align(platform: str, given: int = 0) -> int:
    """``parallelism.vocab_align`` when set (> 0), else the platform's (VOCAB_ALIGN; 1 on CPU).
    Setting it makes another platform's layout here, e.g. a GPU run's 128-padding on CPU."""
    return given or VOCAB_ALIGN.get(platform, 1)


def padded_vocab(vocab_size: int, tp: int, platform: str, align: int = 0) -> int:
    """The smallest multiple of lcm(tp, alignment) that holds ``vocab_size`` rows (``align``:
    ``parallelism.vocab_align``, 0 = the platform's)."""
    multiple = math.lcm(tp, vocab_align(platform, align))
    return -(-vocab_size // multiple) * multiple


def table_rows(model: Any) -> int:
    """The vocabulary rows the model's tables must hold (the model section ``model``): the
    vocabulary, and for ``model.objective=mdlm`` its [MASK] token after it (``dxrun.model.objectives``),
    which then always sits in the first padding row."""
    return model.vocab_size + (getattr(model, "objective", "ar") == "mdlm")
