"""The run plan: every decision a run takes from its validated config, made once before the model
is built and carried, never written back into the config the run follows (pure: no JAX).

Section by section: the context axis's zig-zag split; the mesh's axis sizes (``Sizes``) and
the ``Layout``; how a mesh spreads over hosts; the global batch, its learning rate and the
loss's chunk; the table of attention kernels and the rule that picks a run's; the mesh plan
(``make_plan``, ``LOGICAL_RULES``, the vocabulary's padded rows); ``parallelism=auto``'s
candidates and ranking rules and the search's record; and the ``RunPlan`` itself, which holds
the mesh plan, the save cadence and the search's record, with ``saved_config``, the record a
run's files keep. The model, the step, plan mode, the cost models and the logs read it here.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from omegaconf import DictConfig, OmegaConf

from dxrun.config import (
    AXES,
    FILLS,
    GLOBAL,
    INSIDE,
    INT32,
    PER_DEVICE,
    Axis,
    ConfigError,
    ModelConfig,
    axis_sizes,
    expert_d_ff,
    head_dim_of,
)
from dxrun.run import runtime

if TYPE_CHECKING:
    from dxrun.config import CheckpointConfig, ParallelismConfig, RunConfig, TrainConfig


# ------------------------------------------------------------------------------------------------
# Context parallelism (``parallelism.cp``, the ``context`` mesh axis), its pure part: which
# positions each device holds, the checks a config must pass, and the key/value traffic.
#
# Each sequence is cut into 2·cp equal chunks and device i of the axis holds chunks i and
# 2·cp-1-i (the zig-zag split): under a causal mask an early chunk attends to few keys and a late
# one to many, so pairing them gives every device the same work. The step permutes each
# sequence into that order once (``dxrun.model.context_parallel``); the model reads the true positions
# from ``zigzag_order``, and the loss, a mean over all tokens, does not depend on the order.

# parallelism=auto's layout search tries context-parallel layouts only from this sequence
# length on: below it a sequence's activations are small beside the weights and optimizer
# state, and the per-layer key/value gather costs more than the memory it frees.
LONG_SEQ = 8192
# Keys per block of the context axis's attention at most (dxrun.model.context_parallel.flash): one
# block's local-queries x BLOCK scores alive at a time.
BLOCK = 512


def zigzag_order(seq_len: int, cp: int) -> tuple[int, ...]:
    """The true position of each slot of the permuted sequence: device i's L/cp slots are
    chunk i then chunk 2·cp-1-i of 2·cp chunks. The identity when cp = 1."""
    if cp == 1:
        return tuple(range(seq_len))
    c = seq_len // (2 * cp)
    out: list[int] = []
    for i in range(cp):
        out += [*range(i * c, (i + 1) * c), *range((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
    return tuple(out)


def check_processes(cp: int, processes: int) -> None:
    """Raise ConfigError for a context axis in a multi-process run (not laid out over hosts)."""
    if cp > 1 and processes > 1:
        raise ConfigError(f"parallelism.cp={cp} runs in one process for now; set "
                          "parallelism.cp=1 for a multi-process run")


def check_context(cp: int, seq_len: int, *, user_model: bool = False,
                  objective: str = "ar") -> None:
    """Raise ConfigError (key, value, fix) for a context axis this model or sequence cannot
    take."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        good = 2 * cp * max(1, round(seq_len / (2 * cp)))
        raise ConfigError(
            f"parallelism.cp={cp} needs data.seq_len divisible by 2*cp={2 * cp} (the balanced "
            f"causal split cuts each sequence into 2*cp chunks), but data.seq_len={seq_len}; "
            f"use e.g. data.seq_len={good}")
    if user_model:
        raise ConfigError(f"parallelism.cp={cp} needs dxrun's own model (its attention gathers "
                          "keys/values over the context axis); set parallelism.cp=1 with "
                          "model._target_")
    if objective != "ar":  # the context kernel masks causally; the bound's mask is not ordered
        raise ConfigError(f"parallelism.cp={cp} trains model.objective=ar only (its attention "
                          f"is causal), not model.objective={objective}; set parallelism.cp=1")


def check_sequence_parallel(on: bool, seq_len: int, cp: int, tp: int) -> None:
    """Sequence parallelism splits a device's positions (seq_len / cp) over the tp devices."""
    if on and seq_len % (cp * tp):
        raise ConfigError(
            f"parallelism.sequence_parallel=true splits the sequence over cp*tp={cp * tp} "
            f"devices, but data.seq_len={seq_len} is not a multiple of it; use e.g. "
            f"data.seq_len={cp * tp * max(1, round(seq_len / (cp * tp)))}")


def kv_gather_bytes(*, batch_per_replica: int, seq_len: int, n_kv_heads: int, head_dim: int,
                    n_layers: int, cp: int, tp: int, dtype_bytes: int) -> float:
    """Bytes each device sends per step for the key/value all-gathers over ``context``: per
    layer, K and V of its replica's rows and its kv heads (over tp), gathered forward, and
    their gradients reduce-scattered backward (a ring: (cp-1)/cp of the gathered buffer
    each way)."""
    if cp == 1:
        return 0.0
    gathered = 2 * batch_per_replica * seq_len * (n_kv_heads // tp) * head_dim * dtype_bytes
    return 2 * n_layers * gathered * (cp - 1) / cp


# ------------------------------------------------------------------------------------------------
# The mesh's axis sizes (pure), axis by axis over ``schema_parallel.AXES``: ``Sizes``, the
# ordered mapping of axis key to size a layout and a mesh plan hold; from the config's, one size
# inferred from the device count, or the mesh shrunk to fit (``parallelism.on_mismatch=shrink``).
# An axis that ``AXES`` marks not inferable (the ``context`` axis: chosen for the sequence, not
# for the device count) is never inferred. A ``Layout`` is the sizes with the recomputation and
# the micro-batches a run is laid out with.

class Sizes(Mapping[str, int]):
    """Each mesh axis's size by its key, in ``AXES``' order: read-only and hashable (a layout
    holding it is a dict key); an axis not given is 1 (a record written before that axis)."""

    __slots__ = ("_d",)

    def __init__(self, sizes: Mapping[str, int] | None = None, /, **more: int) -> None:
        given = {**(sizes or {}), **more}
        if unknown := sorted(set(given) - {a.key for a in AXES}):
            raise TypeError(f"no mesh axis {', '.join(unknown)} (the axes: schema_parallel.AXES)")
        self._d = {a.key: given.get(a.key, 1) for a in AXES}

    def __getitem__(self, key: str) -> int:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(self._d.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other.items())

    def __reduce__(self) -> tuple[Any, ...]:
        return Sizes, (self._d,)

    def __repr__(self) -> str:
        return f"Sizes({', '.join(f'{k}={v}' for k, v in self._d.items())})"

    @property
    def n(self) -> int:
        """The devices they multiply to."""
        return math.prod(self._d.values())


class AxisAttrs:
    """``.dp``, ``.fsdp``, ``.cp``, ``.tp`` (any key of ``AXES``): its size in ``self.sizes``;
    ``.replicas``, the devices that split the batch."""

    sizes: Sizes

    @property
    def replicas(self) -> int:
        return replicas_of(self.sizes)

    def __getattr__(self, name: str) -> int:
        if name != "sizes" and any(a.key == name for a in AXES):
            return self.sizes[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def replicas_of(sizes: Mapping[str, int]) -> int:
    """The product of the batch axes' sizes (``Axis.batch``): data replicas, each a group of
    the other axes' devices computing the same rows."""
    return math.prod(sizes[a.key] for a in AXES if a.batch)


def named(sizes: Mapping[str, int]) -> list[tuple[Axis, int]]:
    """The axes a message or table names, with their sizes: every inferable axis, and one that
    is not (the context axis) or serves some models only (the expert axis: ``only_with``)
    only where it is used (size > 1)."""
    return [(a, sizes[a.key]) for a in AXES
            if (a.inferable and not a.only_with) or sizes[a.key] > 1]


def resolve_axes(sizes: dict[str, int], n: int) -> dict[str, int]:
    """``sizes`` (each axis's, by key, in ``AXES``' order) with the one -1 among them inferred
    so that their product is ``n``."""
    sizes = {a.key: sizes.get(a.key, 1) for a in AXES}  # an axis not given: 1
    inferred = [k for k, v in sizes.items() if v == -1]
    for a in AXES:
        v = sizes[a.key]
        if v == 0 or v < -1 or (not a.inferable and v < 1):
            raise ConfigError(f"parallelism.{a.key}={v} must be a positive size"
                              + (" or -1 (inferred)" if a.inferable else ""))
    if len(inferred) > 1:
        raise ConfigError(
            f"parallelism: {' and '.join('parallelism.' + k for k in inferred)} are both -1; "
            "at most one axis can be inferred, set the others to sizes"
        )
    if inferred:
        known = math.prod(v for v in sizes.values() if v != -1)
        if n % known:
            # Name what the user set (the sized axes), not the axis dxrun was asked to infer.
            typed = [k for k, v in sizes.items() if v > 1] or [k for k, v in sizes.items() if v != -1]
            set_ = " x ".join(f"parallelism.{k}={sizes[k]}" for k in typed)
            fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            fix = (f"pick parallelism.{typed[0]} from {fits}" if len(typed) == 1
                   else f"make their product divide {n}")
            raise ConfigError(
                f"{set_} does not divide the {n} devices in use, so parallelism.{inferred[0]} "
                f"cannot be inferred; {fix}, or set parallelism.n_devices to a multiple of {known}"
            )
        sizes[inferred[0]] = n // known
    return sizes


def shrink(sizes: dict[str, int], n: int) -> dict[str, int]:
    """Largest mesh that fits n devices: the axes give up sizes in ``AXES``' order (data
    replicas first, then fsdp, then context, then tensor)."""
    sizes = {a.key: sizes.get(a.key, 1) for a in AXES}  # an axis not given: 1
    while math.prod(sizes.values()) > n:
        k = next(k for k, v in sizes.items() if v > 1)
        sizes[k] //= min(p for p in range(2, sizes[k] + 1) if sizes[k] % p == 0)
    return sizes


@dataclass(frozen=True)
class Layout(AxisAttrs):
    """How a run is laid out: the mesh (``sizes``: each axis's size by key; ``.dp``, ``.tp``,
    ... read one), the recomputation (``model.remat``) and the micro-batches of one update
    (``train.grad_accum``)."""

    sizes: Sizes = Sizes()
    remat: str = "none"
    grad_accum: int = 1

    @classmethod
    def of(cls, remat: str = "none", grad_accum: int = 1, **sizes: int) -> Layout:
        """``Layout.of(dp=4, tp=2, remat="dots")``: the axes by key, those not given 1."""
        return cls(Sizes(sizes), remat, grad_accum)

    @property
    def mesh(self) -> str:
        """The preset-style name: ``dp4_tp2``, ``fsdp8``, ``dp2_fsdp2_tp2``, ``cp2_tp4``, ``dp1``."""
        parts = [f"{k}{v}" for k, v in self.sizes.items() if v > 1]
        return "_".join(parts) or "dp1"

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """Each axis's size by its JAX mesh axis name (``data``, ``fsdp``, ...)."""
        return {a.mesh: self.sizes[a.key] for a in AXES}

    @property
    def label(self) -> str:
        extra = [f"remat={self.remat}"] * (self.remat != "none") + [
            f"accum={self.grad_accum}"] * (self.grad_accum > 1)
        return " ".join([self.mesh, *extra])

    def overrides(self) -> dict[str, Any]:
        """The config keys that name this layout (what a run's saved record holds)."""
        return {"parallelism": dict(self.sizes), "model": {"remat": self.remat},
                "train": {"grad_accum": self.grad_accum}}

    def to_json(self) -> dict[str, Any]:
        """The layout as a ranking row holds it: each axis's size by key, remat, grad_accum
        (what ``layout_of`` reads back)."""
        return {**self.sizes, "remat": self.remat, "grad_accum": self.grad_accum}


def layout_of(row: dict[str, Any]) -> Layout:
    """The layout of a ranking row or record (``plan.json``'s), an axis it lacks 1 (cp, in
    one written before the context axis)."""
    return Layout(Sizes({a.key: row[a.key] for a in AXES if a.key in row}), row["remat"],
                  row["grad_accum"])


# ------------------------------------------------------------------------------------------------
# How a mesh spreads over hosts and their processes (pure), axis by axis as ``AXES`` says
# (``Axis.hosts``): tensor and context groups stay inside a host, fsdp takes what a host has left,
# data spans the hosts. ``HostPlacement``: a mesh plan's host properties.

def split_over_hosts(sizes: Mapping[str, int], hosts: int,
                     allow_cross: Collection[str] = ()) -> Sizes:
    """The part of each axis (``sizes``, by key) that spans ``hosts`` equal hosts, innermost
    axis first: an ``INSIDE`` axis stays inside a host, a ``FILLS`` axis takes what the host
    has left, a ``SPANS`` axis spans the hosts. Raises ConfigError for a layout whose inside
    group would cross hosts (every layer's collectives over the network) unless its key is in
    ``allow_cross`` (its ``Axis.cross_host`` key set), or whose hosts would hold scattered rows."""
    sizes = Sizes(sizes)  # an axis not given: 1
    local = math.prod(sizes.values()) // hosts
    left, dcn = local, {}
    for a in reversed(AXES):
        size = sizes[a.key]
        if a.hosts == INSIDE:
            dcn[a.key] = 1 if left % size == 0 else _crossing(a, size, left, hosts, local,
                                                               a.key in allow_cross)
            left = left // size if dcn[a.key] == 1 else 1
        elif a.hosts == FILLS:
            inside = left
            left //= math.gcd(size, inside)
            dcn[a.key] = size // (inside // left)
            if left > 1 and dcn[a.key] > 1:
                # Each host would hold scattered rows of the batch; keep the axis inside a
                # host or make it span whole hosts.
                after = " x ".join(f"{b.key}={v}" for b, v in named(sizes)
                                   if b.hosts == INSIDE)
                raise ConfigError(
                    f"parallelism.{a.key}={size} neither fits in one host's {inside} devices "
                    f"(after {after}) nor spans whole hosts; pick parallelism.{a.key} dividing "
                    f"{inside} or a multiple of {inside}")
        else:
            dcn[a.key], left = size // left, 1
    return Sizes(dcn)


def _crossing(a: Axis, size: int, left: int, hosts: int, local: int, allowed: bool) -> int:
    """The part of inside axis ``a`` that crosses hosts when a host's ``left`` devices do not
    hold its groups: refused unless ``allowed``, and unless whole hosts hold its parts."""
    where = (f"parallelism.{a.key}={size} puts each {a.mesh}-parallel group across "
             f"{-(-size // left)} hosts ({hosts} hosts x {local} devices), so "
             "every layer's all-reduces would cross the network")
    fits = ", ".join(str(d) for d in range(1, left + 1) if left % d == 0)
    if not allowed:
        allow = f", or set parallelism.{a.cross_host}=true" if a.cross_host else ""
        raise ConfigError(f"{where}; use parallelism.{a.key} from {fits} (the devices of one "
                          f"host){allow}")
    if size % left:
        raise ConfigError(f"{where}, and unevenly; use parallelism.{a.key} from {fits} or a "
                          f"multiple of {left}")
    return size // left


def group_by_host(process_hosts: tuple[int, ...], tp: int, host_tp: int, n: int) -> None:
    """Check that the processes of each host (``process_hosts``: each process's host) can
    share its part of the mesh: the same number on every host, and each holding whole tensor
    groups (``host_tp`` wide inside a host) or an equal part of one. Raises ConfigError."""
    processes, hosts = len(process_hosts), max(process_hosts) + 1
    counts = [process_hosts.count(h) for h in range(hosts)]
    if len(set(counts)) > 1:
        raise ConfigError(
            f"the {processes} processes are spread unevenly over {hosts} hosts ({counts} "
            "processes); start the same number of processes on every host (DXRUN_HOSTNAME "
            "names the host a process declares)")
    mine = n // processes
    if mine % host_tp and host_tp % mine:
        raise ConfigError(
            f"parallelism.tp={tp} neither fits in one process's {mine} devices nor spans whole "
            f"processes ({counts[0]} per host x {mine} devices); pick parallelism.tp dividing "
            f"{mine} or a multiple of it")


class HostPlacement:
    """A mesh plan's placement over hosts and processes: ``sizes`` (each axis's), ``dcn``
    (each axis's part across hosts), the plan's ``rules`` (the rows of the batch split over
    the mesh axes ``rules["batch"]`` names; the other axes' devices read the same rows)."""

    sizes: Sizes
    dcn: Sizes
    rules: dict
    processes: int
    process_hosts: tuple[int, ...]

    @property
    def local(self) -> Sizes:
        """Each axis's part inside one host."""
        return Sizes({k: v // self.dcn[k] for k, v in self.sizes.items()})

    def _rows_view(self, sizes: Sizes) -> tuple[int, ...]:
        """``sizes`` as the rows are read: each batch axis's, then the other axes' as one group."""
        batch = {a.key for a in AXES if a.mesh in self.rules.get("batch", ())}
        return (*(v for k, v in sizes.items() if k in batch),
                math.prod(v for k, v in sizes.items() if k not in batch))

    @property
    def host_shape(self) -> tuple[int, ...]:
        """(data, fsdp, context x tensor): the mesh as its rows are read (``dcn_shape`` and
        ``local_shape`` are its parts across hosts and inside one)."""
        return self._rows_view(self.sizes)

    @property
    def dcn_shape(self) -> tuple[int, ...]:
        return self._rows_view(self.dcn)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The mesh within one host (what ``create_hybrid_device_mesh`` calls mesh_shape)."""
        return self._rows_view(self.local)

    @property
    def hosts(self) -> int:
        return max(self.process_hosts) + 1 if self.process_hosts else self.processes

    def host_of(self, process: int) -> int:
        return self.process_hosts[process] if self.process_hosts else process

    def _in_host(self) -> tuple[int, int]:
        """(processes that share one row block, row blocks per host). Inside a host a process
        holds whole row groups (it alone reads their rows) or an equal part of one (the
        group's processes read the same rows)."""
        per_host = self.processes // self.hosts
        mine, group = self.sizes.n // self.processes, self.local_shape[-1]
        share = max(1, group // mine)
        return share, per_host // share

    @property
    def data_shards(self) -> int:
        """How many distinct row blocks the processes read: processes of one row group (inside
        a host or across hosts) read the same rows."""
        return self.hosts // self.dcn_shape[-1] * self._in_host()[1]

    def data_shard(self, process: int) -> int:
        """The row block of the global batch ``process`` reads. The mesh puts hosts in
        row-major order over the axes and, inside a host, its processes in process order
        row-major over the host's part: so the block is the host's position over the batch
        axes, then the process's place among the host's row blocks."""
        host = self.host_of(process)
        place = sum(1 for p in range(process) if self.host_of(p) == host)
        share, blocks = self._in_host()
        return host // self.dcn_shape[-1] * blocks + place // share

    def _hosts_row(self) -> str:
        across = " x ".join(f"{a.mesh}={v}" for a, v in named(self.dcn))
        mine = self.sizes.n // self.processes
        if self.hosts == self.processes:
            return f"{self.processes} processes x {mine} devices; across processes: {across}"
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        return (f"{hosts} x {self.processes // self.hosts} processes x {mine} devices; across "
                f"hosts: {across}")


# ------------------------------------------------------------------------------------------------
# The global batch and the learning rate that goes with it: pure, no JAX.
#
# A run gives its batch one of two ways. ``data.batch_size`` is the global batch of one optimizer
# update (all devices together). ``data.per_device_batch_size=B`` is what one data replica
# computes at once, so the global batch grows with the mesh: ``B x dp x fsdp x
# train.grad_accum``. Hydra cannot tell a default from a value the user typed, so
# ``data.batch_size`` defaults to ``${default_batch:${data.per_device_batch_size}}``: 32 when no
# per-device batch is given, null when one is; a ``data.batch_size`` beside a per-device batch
# was set on purpose and is refused (``check_batch_keys``).
#
# ``data.seq_len: null`` (the real-data presets' default) is the model's context on an
# accelerator and 64 on CPU (``default_seq_len``), where short windows keep the run quick. The
# chunked loss's positions a chunk (``model.loss_chunk``): checked before JAX starts, decided by
# ``make_plan`` (``loss_chunk_for``) for the models and the step (``model.objectives``).

CPU_SEQ_LEN = 64  # data.seq_len=null on CPU (capped by model.max_seq_len)


def check_batch_keys(data: Any) -> None:
    """Exactly one of the global and the per-device batch: each decides the other."""
    if data.batch_size is None and data.per_device_batch_size is None:
        raise ConfigError("data.batch_size=null but data.per_device_batch_size is not set either;"
                          " give one, e.g. data.batch_size=32 or data.per_device_batch_size=4")
    if data.batch_size is not None and data.per_device_batch_size is not None:
        raise ConfigError(
            f"data.batch_size={data.batch_size} and data.per_device_batch_size="
            f"{data.per_device_batch_size} are both set, but each decides the other; give one "
            f"(drop data.batch_size, or set data.batch_size=null, to keep the per-device batch "
            "and let the global batch grow with the devices)")


def batch_set_by(data: Any) -> str:
    """The key the global batch comes from. The per-device batch wins: a run's saved config
    records the resolved global batch in ``data.batch_size`` (``resolved_config``), and
    planning that config again must follow the per-device batch on whatever mesh it is planned
    for."""
    return PER_DEVICE if data.per_device_batch_size is not None else GLOBAL


def global_batch(data: Any, replicas: int, grad_accum: int) -> int:
    """Examples of one optimizer update across all devices."""
    if batch_set_by(data) == PER_DEVICE:
        return data.per_device_batch_size * replicas * grad_accum
    return data.batch_size


def default_seq_len(seq_len: int | None, max_seq_len: int, platform: str) -> int:
    """``data.seq_len``, or for null the platform's default: the model's whole context
    (``model.max_seq_len``) on an accelerator, ``CPU_SEQ_LEN`` (at most the context) on CPU."""
    if seq_len is not None:
        return int(seq_len)
    return min(CPU_SEQ_LEN, max_seq_len) if platform == "cpu" else int(max_seq_len)


def scaled_lr(opt: Any, batch_size: int) -> float:
    """Peak lr after the batch-size scaling rule, relative to ``optimizer.base_batch_size``."""
    ratio = batch_size / opt.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[opt.lr_scaling]
    return opt.lr * factor


def check_tokens_per_step(key: str, value: int, batch: int, seq_len: int) -> None:
    """The loss divides by a step's tokens (global batch x seq_len), a Python int that JAX
    makes an int32: from 2^31 the jitted step fails to trace with an OverflowError. ``key``,
    ``value``: where the batch came from."""
    if batch * seq_len < INT32:
        return
    given = f"{key}={value}"
    if key == PER_DEVICE:
        given += f" (a global batch of {batch})"
    raise ConfigError(f"{given} with data.seq_len={seq_len} makes {batch * seq_len:,} tokens a "
                      f"step, beyond the int32 the loss divides by (at most {INT32 - 1:,}); "
                      f"lower {key} or data.seq_len")


AUTO_ON_BYTES = 512 * 2**20  # null: chunk when one micro-batch's fp32 logits exceed this


CHUNK_BYTES = 256 * 2**20  # null: the largest chunk whose fp32 logits fit in this


def resolve_loss_chunk(value: int | None, rows: int, seq_len: int, vocab: int) -> int:
    """Positions per chunk (0 = unchunked) for ``model.loss_chunk=value`` when each device
    computes ``rows`` sequences of ``seq_len`` over ``vocab`` (padded, per device) logits.
    null: unchunked while the fp32 logits fit in ``AUTO_ON_BYTES``, else the largest divisor
    of ``seq_len`` whose chunk fits in ``CHUNK_BYTES``. A chunk of the whole sequence or more
    is the unchunked loss."""
    if value == 0:
        return 0
    if value is not None:
        if value >= seq_len:
            return 0
        if seq_len % value:
            divisors = [d for d in range(1, seq_len) if seq_len % d == 0]
            near = min(divisors, key=lambda d: abs(d - value))
            raise ConfigError(f"model.loss_chunk={value} does not divide data.seq_len={seq_len}; "
                              f"pick a divisor (e.g. {near}), 0 (off) or null (auto)")
        return value
    per_position = rows * vocab * 4
    if per_position * seq_len <= AUTO_ON_BYTES:
        return 0
    fits = [d for d in range(1, seq_len) if seq_len % d == 0 and d * per_position <= CHUNK_BYTES]
    return max(fits, default=1)


def loss_chunk_for(m: ModelConfig, rows: int, seq_len: int, vocab: int, cp: int = 1) -> int:
    """``resolve_loss_chunk`` for the model ``m`` when each device computes ``rows`` sequences
    (one micro-batch's) of ``seq_len`` over ``vocab`` (padded, per tensor-parallel device)
    logits: the run plan's, taken once by ``make_plan``. A user model (``model._target_``) has
    no output layer of dxrun's to chunk: 0. With a context axis (cp > 1) the logits are split
    over it already: 0, and a chunk asked for is refused."""
    if m.get("_target_"):
        return 0
    chunk = m.get("loss_chunk")
    if cp > 1:  # the chunks would run along the sequence the context axis splits
        if chunk:
            raise ConfigError(f"model.loss_chunk={chunk} does not run with "
                              f"parallelism.cp={cp} (the chunks run along the sequence that "
                              "the context axis splits); set model.loss_chunk=0 or null")
        return 0
    return resolve_loss_chunk(chunk, max(1, rows), seq_len, vocab)


# ------------------------------------------------------------------------------------------------
# The attention kernels as one table, and the one rule that picks a run's (``model.attention``).
#
# An entry: the kernel's name, its platforms, whether it keeps the ``L x L`` scores (the memory
# model's count; a kernel that does not is fused: the causal half, the scores recomputed in its
# backward, as the FLOP count and the time model count it), the inputs it accepts (else why not)
# and the module that applies it. ``choose`` decides once, when the mesh plan is made, into
# ``MeshPlan.attention``: the model applies it, the memory and time models and the logs read it
# there. ``dot_product`` (the default) takes the first of ``AUTO`` that accepts the devices and
# shapes: splash on a TPU, cuDNN's on an NVIDIA GPU, XLA's elsewhere; a name forces a kernel or
# is refused in one line. A new kernel is one entry here and one module. Pure (no JAX): the
# device facts come in as ``AttentionTarget`` (``attention_target``, ``kind_target``).

class AttentionTarget(NamedTuple):
    """What the choice needs to know of the devices the model runs on (hashable)."""

    platform: str = "cpu"  # jax Device.platform: "cpu", "gpu" (CUDA), "rocm", "tpu"
    compute_capability: str | None = None  # "9.0" on an H100/H200; NVIDIA GPUs only
    cudnn_version: int | None = None  # e.g. 91000 for 9.10; None: JAX found no cuDNN


CPU_TARGET = AttentionTarget()


class Inputs(NamedTuple):
    """The attention a run computes, as a kernel's ``accepts`` reads it."""

    device: AttentionTarget
    dtype: str  # the compute dtype's name: "bfloat16" | "float32" | "float16"
    head_dim: int
    seq_len: int  # per device (a context axis splits it; the blockwise kernel takes those)
    causal: bool  # model.objective=ar; masked diffusion (mdlm) attends both ways
    window: int | None = None  # model.sliding_window: keys a query sees (None: all before it)


@dataclass(frozen=True)
class Kernel:
    name: str
    native: tuple[str, ...]  # platforms it runs on as compiled code ("*": any)
    keeps_scores: bool  # materialises the L x L scores and keeps the probabilities for backward
    accepts: Callable[[Inputs], str | None]  # None, or why these inputs are refused
    module: str  # the module whose ``attend(q, k, v, causal, interpret)`` applies it
    interpretable: bool = False  # runs on CPU, interpreted (Pallas), when forced by name
    # its forward's residuals (output, softmax statistics) carry the checkpoint name RESIDUALS,
    # so model.remat=keep_attention can keep them
    names_residuals: bool = False
    doc: str = ""

    @property
    def fused(self) -> bool:
        """Never materialises the scores: the causal half only, the scores recomputed in the
        backward (the FLOP count's and the time model's fused attention)."""
        return not self.keeps_scores


_HALF = ("float16", "bfloat16")
# cuDNN's fused flash attention is documented for Ampere (8.0) and later; earlier GPUs get XLA.
_MIN_CAPABILITY = (8, 0)
# Splash attention's blocks: a multiple of the TPU's 128 lanes, at most SPLASH_BLOCK long.
SPLASH_LANES = 128
# The checkpoint name of what a kernel's backward reads of its forward (``names_residuals``).
RESIDUALS = "attention_residuals"


def _capability(cc: str | None) -> tuple[int, int]:
    if not cc:
        return (0, 0)
    major, _, minor = cc.partition(".")
    return int(major), int(minor or 0)


def _cudnn(x: Inputs) -> str | None:
    """JAX's own limits (``jax/_src/cudnn/fused_attention_stablehlo.py``: ``check_layout``,
    ``check_is_flash_attention``): an NVIDIA GPU of compute capability >= 8.0 with cuDNN
    loaded, fp16/bf16, a head dim that is a multiple of 8 and at most 256 on Hopper (9.0) and
    later, 128 before; 10.3 needs cuDNN 9.11. JAX raises rather than falls back outside them."""
    d = x.device
    if d.platform not in ("gpu", "cuda") or d.cudnn_version is None:
        return "needs an NVIDIA GPU with cuDNN"
    if x.dtype not in _HALF:
        return "needs bf16 or fp16 compute (train.precision=bf16)"
    cc = _capability(d.compute_capability)
    if cc < _MIN_CAPABILITY or (cc == (10, 3) and d.cudnn_version < 91100):
        return f"needs compute capability >= 8.0 (this GPU: {d.compute_capability})"
    limit = 256 if cc >= (9, 0) else 128
    if x.head_dim % 8 or x.head_dim > limit:
        return f"needs a head dim that is a multiple of 8 and at most {limit}, not {x.head_dim}"
    return None


def _splash(x: Inputs) -> str | None:
    """Pallas' splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``): its
    blocks tile the sequence in multiples of the TPU's 128 lanes."""
    if x.seq_len % SPLASH_LANES:
        return f"needs a sequence length that is a multiple of {SPLASH_LANES}, not {x.seq_len}"
    if x.dtype not in ("bfloat16", "float32"):
        return f"needs bf16 or fp32 compute, not {x.dtype}"
    return _no_window(x)


def _no_window(x: Inputs) -> str | None:
    """The kernels without a sliding window here (splash's local masks, the context axis's
    blockwise kernel): refused, so ``dot_product`` takes XLA's (or cuDNN's), which have one."""
    return (f"has no sliding window in dxrun (model.sliding_window={x.window})"
            if x.window is not None else None)


def _any(x: Inputs) -> str | None:
    return None


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("splash", ("tpu",), False, _splash, "dxrun.model.splash_attention", interpretable=True,
           names_residuals=True,
           doc="Pallas' splash attention (TPU): flash attention in blocks, causal blocks "
               "skipped, grouped-query heads native; interpreted on CPU when forced"),
    Kernel("cudnn", ("gpu", "cuda"), False, _cudnn, "dxrun.model.transformer",
           doc="cuDNN's fused flash attention through jax.nn.dot_product_attention (NVIDIA)"),
    Kernel("xla", ("*",), True, _any, "dxrun.model.transformer",
           doc="jax.nn.dot_product_attention's XLA kernel: the scores built in full"),
    Kernel("reference", ("*",), True, _any, "dxrun.model.transformer",
           doc="the plain einsum and softmax (what every kernel is tested against)"),
    # A context axis's own: keys and values gathered, one block of keys at a time
    # (dxrun.model.context_parallel.flash); chosen whenever parallelism.cp > 1.
    Kernel("blockwise", ("*",), False, _no_window, "dxrun.model.context_parallel"),
)}
AUTO = ("splash", "cudnn", "xla")  # model.attention=dot_product: the first that accepts


def choose(setting: str, x: Inputs, cp: int = 1) -> str:
    """The kernel a run of ``model.attention=setting`` runs on ``x.device``: with a context axis
    (cp > 1) its blockwise kernel; ``dot_product``, the first of ``AUTO`` that accepts ``x``;
    a kernel's name, that kernel, or a ConfigError in one line where it cannot run."""
    if cp > 1:
        why = KERNELS["blockwise"].accepts(x)
        if why is not None:
            raise ConfigError(f"parallelism.cp={cp} attends with its blockwise kernel, which {why}; "
                              "set parallelism.cp=1 or model.sliding_window=null")
        return "blockwise"
    if setting == "dot_product":
        return next(k for k in AUTO if KERNELS[k].accepts(x) is None
                    and _runs_on(KERNELS[k], x.device.platform))
    kernel = KERNELS[setting]
    interpreted = kernel.interpretable and x.device.platform == "cpu"
    why = kernel.accepts(x) or (None if _runs_on(kernel, x.device.platform) or interpreted
                                else f"runs on {'/'.join(kernel.native)} only")
    if why is not None:
        raise ConfigError(
            f"model.attention={setting} cannot run here: it {why} ({x.device.platform}, "
            f"{x.dtype}, head dim {x.head_dim}, seq_len {x.seq_len}); use "
            f"model.attention=dot_product (the fastest kernel that runs here)")
    return setting


def check_remat(remat: str, kernel: str) -> None:
    """``model.remat=keep_attention`` keeps what the attention kernel names as its residuals: a
    ConfigError in one line where the run's kernel names none."""
    if remat == "keep_attention" and not KERNELS[kernel].names_residuals:
        names = ", ".join(k.name for k in KERNELS.values() if k.names_residuals)
        raise ConfigError(
            f"model.remat=keep_attention keeps what the attention kernel saves for its backward, "
            f"and this run's kernel ({kernel}) names none; use model.remat=full, or a kernel "
            f"that does ({names}: model.attention=dot_product on a TPU)")


def _runs_on(kernel: Kernel, platform: str) -> bool:
    return "*" in kernel.native or platform in kernel.native


def compiled_kernel(chosen: str, setting: str, platform: str) -> tuple[str, bool]:
    """(the kernel a step compiled on ``platform`` devices applies, whether interpreted). The
    plan's choice where it runs there; forced by name off its platform, interpreted where it
    can be (Pallas on CPU: the suite's check); else XLA's stands in (plan mode compiles on CPU
    for an accelerator target, whose kernel does not lower here)."""
    kernel = KERNELS[chosen]
    if _runs_on(kernel, platform):
        return chosen, False
    if setting == chosen and kernel.interpretable and platform == "cpu":
        return chosen, True
    return "xla", False


def attention_target(device: Any) -> AttentionTarget:
    """The facts of ``device`` (one of the mesh's): its platform, and on an NVIDIA GPU its
    compute capability and the cuDNN version JAX loaded."""
    platform = device.platform
    if platform not in ("gpu", "cuda"):
        return AttentionTarget(platform)
    # JAX's own record of the loaded cuDNN, as its fused-attention checks read it.
    from jax._src.lib import cuda_versions

    version = cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    return AttentionTarget(platform, getattr(device, "compute_capability", None), version)


# The compute capability of each NVIDIA plan target (plan.cost.TARGETS' device kinds).
CAPABILITY = {"NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H100 96GB HBM2e": "9.0",
              "NVIDIA H200": "9.0", "NVIDIA A100-SXM4-80GB": "8.0", "NVIDIA L40S": "8.9"}
ASSUMED_CUDNN = 91000  # a CUDA 12 jaxlib's cuDNN 9 (JAX's own wheels ship one)


def kind_target(device_kind: str) -> AttentionTarget:
    """The facts of a plan target's device kind (no device at hand): its platform, and for a
    named NVIDIA GPU its compute capability and the cuDNN JAX's CUDA wheels ship."""
    if device_kind.startswith("NVIDIA"):
        return AttentionTarget("gpu", CAPABILITY.get(device_kind), ASSUMED_CUDNN)
    return AttentionTarget("tpu" if device_kind.startswith("TPU") else "cpu")


def run_inputs(model: ModelConfig, dtype: str, seq_len: int, cp: int,
               device: AttentionTarget) -> Inputs:
    """``Inputs`` of a run of ``model`` (its config) computing in ``dtype`` (its name) on
    ``device``."""
    return Inputs(device, dtype, head_dim_of(model), seq_len // cp,
                  model.get("objective", "ar") != "mdlm", model.get("sliding_window"))


def plan_kernel(cfg: RunConfig, seq_len: int, cp: int, device: AttentionTarget,
                dtype: str) -> str:
    """``choose`` for a run of ``cfg`` computing in ``dtype``: ``make_plan``'s, the one place
    a kernel is chosen (another target's too: ``autotune.fit.kernel_on``); a user's model
    (``model._target_``) attends its own way: recorded as XLA's."""
    if cfg.model.get("_target_"):
        return "xla"
    return choose(cfg.model.attention, run_inputs(cfg.model, dtype, seq_len, cp, device), cp)


# ------------------------------------------------------------------------------------------------
# The mesh plan: a pure function from (config, visible devices) to how the run is laid out.
#
# Nothing here imports JAX, so the plan is checked (and can be printed) before anything compiles.
# The mesh's axes are ``schema_parallel.AXES``' rows, outermost first: ``data`` (replicas), ``fsdp``
# (replicas whose weights are sharded), ``context`` (each sequence split along its length:
# dxrun/plan/run_plan.py), ``tensor`` (Megatron tensor parallelism, innermost so it lands on the
# closest devices); the plan holds their sizes as one ``Sizes`` mapping, and their parts across
# hosts as another (``dcn``: dxrun/plan/run_plan.py). The vocabulary's tables get the rows a multiple
# of tp (the vocab axis is split over ``tensor``) and, on an accelerator, of an alignment that
# tiles its matmul units evenly (``padded_vocab``).

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


# ------------------------------------------------------------------------------------------------
# ``parallelism=auto``'s layouts and the rules that rank them (pure: values in, values out).
#
# A layout is a mesh (each axis of ``AXES`` sized), a ``model.remat`` and a ``train.grad_accum``.
# The candidates are the factorisations of the devices over the axes that the mesh plan accepts (a
# context axis only for long sequences: ``meshes``); the model stage ranks
# the variants that fit by their estimated step; the measure stage times the few that the rules
# here pick, in rounds, and chooses the fastest; ``search_cost`` predicts whether a search pays.

SEARCHES = ("none", "measure", "model", "fresh")
# Cheapest to most recomputation; keep_attention only where the attention kernel names its
# residuals (splash: ``check_remat`` refuses it elsewhere, and the search moves on).
REMATS = ("none", "dots", "keep_attention", "full")
ACCUMS = (1, 2, 4, 8)
MEASURE_STEPS = 10  # timed steps per turn (at most): a median that separates close layouts
MEASURE_ROUNDS = 3  # rounds (a turn each)
# A turn stops timing once its timed steps add up to parallelism.search_turn_s: a slow step is
# timed once a turn (its noise is small against its length), a fast one up to MEASURE_STEPS.
PRUNE = 1.25  # after a round, a layout slower than this x the best's median is timed no more
# ...except the KEEP fastest so far, which take every round: one turn on a loaded host can be
# far off, and the choice is made among these few.
KEEP = 3
TIE = 1.10  # estimates this close to the best's are within the roofline's error: measure them
# ...when a step of them is cheap (estimated under parallelism.search_turn_s): a turn of a slow
# step costs two of them, and there the estimate ranks well enough.
# After a round, a leader this much faster than every other layout has won: no more rounds.
CLEAR = 1.10


def meshes(n: int, seq_len: int, unused: Collection[str] = ()) -> list[Sizes]:
    """Every mesh of ``n`` devices a search tries, each axis's size by key: an axis that is
    not inferable (context, chosen for the sequence) above 1 only for a sequence of
    ``LONG_SEQ`` or more that its 2 x size chunks divide; the axes keyed in ``unused`` (of no
    use to the model: ``Axis.only_with``) at 1. In the search's order: such axes outermost,
    then the others innermost first, the outermost (data) taking the rest."""
    def fits(a: Axis, v: int) -> bool:
        if a.key in unused:
            return v == 1
        return a.inferable or v == 1 or (seq_len >= LONG_SEQ and seq_len % (2 * v) == 0)

    *order, last = sorted(AXES, key=lambda a: (a.inferable, -AXES.index(a)))
    out: list[dict[str, int]] = [{}]
    for a in order:
        out = [m | {a.key: v} for m in out for v in _divisors(n // math.prod(m.values()))
               if fits(a, v)]
    return [Sizes(m | {last.key: n // math.prod(m.values())}) for m in out]


def unused_axes(cfg: RunConfig) -> list[str]:
    """The keys of the axes ``cfg``'s model has no use for (``Axis.only_with``)."""
    return [a.key for a in AXES if a.only_with and not OmegaConf.select(cfg, a.only_with)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: RunConfig, n_visible: int, platform: str, processes: int = 1,
               process_hosts: tuple[int, ...] | None = None, device: Any = None,
               batch: int | None = None, seq_len: int | None = None
               ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(meshes the plan accepts, [(mesh, why the plan refuses it)]), each with the user's remat
    and accumulation, at the ``batch`` and ``seq_len`` held fixed (None: the config's).
    ``make_plan`` is the one place the rules live."""
    n = cfg.parallelism.n_devices or n_visible
    ok, refused = [], []
    seq = seq_len or default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    for sizes in meshes(n, seq, unused_axes(cfg)):
        layout = Layout(sizes, cfg.model.remat, cfg.train.grad_accum)
        try:
            make_plan(cfg, n_visible, platform, processes, process_hosts, device, layout=layout,
                      batch=batch, seq_len=seq_len)
        except ConfigError as e:
            refused.append((layout, str(e).split(";")[0]))
            continue
        ok.append(layout)
    return ok, refused


def held_batch(cfg: RunConfig, n_visible: int, platform: str = "cpu", processes: int = 1,
               process_hosts: tuple[int, ...] | None = None,
               device: AttentionTarget | None = None, seq_len: int | None = None
               ) -> tuple[int, int]:
    """(global batch, sequence length) a layout search holds fixed while the layouts change
    (a search never changes the update): ``seq_len``, or ``data.seq_len`` (null: the
    platform's), and ``data.batch_size``, or with ``data.per_device_batch_size`` the global
    batch resolved once on the preset's own layout."""
    if seq_len is None:
        seq_len = default_seq_len(cfg.data.seq_len, cfg.model.max_seq_len, platform)
    if cfg.data.per_device_batch_size is None:
        return cfg.data.batch_size, seq_len
    plan = make_plan(cfg, n_visible, platform, processes, process_hosts, device, seq_len=seq_len)
    return plan.global_batch, seq_len


def fit_variants(layout: Layout) -> list[Layout]:
    """The mesh with the user's remat and accumulation, then more micro-batches (the same
    update), then more recomputation, each with as few micro-batches as fit: tried in order
    until one fits. Micro-batches before recomputation: a micro-batch only shrinks the
    matmuls' rows, a recomputation adds their FLOPs (on a v5e the faster of the two:
    BENCHMARKS.md, the defaults on the chip)."""
    return [replace(layout, remat=remat, grad_accum=accum)
            for remat in REMATS[REMATS.index(layout.remat):]
            for accum in ACCUMS if accum >= layout.grad_accum]


@dataclass
class Row:
    """One line of the ranking."""

    layout: Layout
    need_gb: float | None = None  # GiB per device
    est_ms: float | None = None
    measured_ms: float | None = None
    chosen: bool = False
    fits: bool = False  # compiled and within the memory budget
    why: str = ""  # why it lost (or was never a candidate)
    spread_ms: list[float] | None = None  # [fastest, slowest] of its turns (two or more)

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.to_json(), "mesh": self.layout.mesh, "need_gb": self.need_gb,
                "est_ms": self.est_ms, "measured_ms": self.measured_ms, "chosen": self.chosen,
                "fits": self.fits, "why": self.why, "spread_ms": self.spread_ms}


class TooLarge(Exception):
    """A candidate whose compile the accelerator refuses for memory (XLA's RESOURCE_EXHAUSTED
    on a chip): a row that does not fit, never the search's end. ``need_gb``: what XLA says the
    program needs (GiB per device; None where it names no figure)."""

    def __init__(self, need_gb: float | None) -> None:
        super().__init__(f"does not fit: XLA needs {_gib(need_gb)}" if need_gb is not None
                         else "does not fit: XLA refuses its compile for memory")
        self.need_gb = need_gb


def model_stage(layouts: list[Layout], budget_gb: float | None,
                score: Callable[[Layout], tuple[float, float | None]]) -> list[Row]:
    """Each mesh at its first variant that fits, ranked by estimated step time (fastest
    first; those that fit nowhere last, at their last variant: the least they need).
    ``score(layout)``: (GiB per device, est. seconds or None) of one candidate, or TooLarge
    where the chip refuses its compile; ``budget_gb`` None: what compiles fits (a chip's
    compile is its check). Where no variant of any mesh could be built at all (a ConfigError
    each: token ids beyond the vocabulary...), that first error is the search's, as a fixed
    layout's run would say it: memory was never the question."""
    rows, errors = [], []
    for base in layouts:
        row = Row(base)
        for layout in fit_variants(base):
            try:
                need, est = score(layout)
            except ConfigError as e:  # e.g. accumulation not dividing the per-replica batch
                errors.append(e)
                row.why = row.why or str(e).split(";")[0]
                continue
            # A mesh that fits nowhere keeps its last variant's row: the least it needs.
            except TooLarge as e:
                row = Row(layout, e.need_gb, why=str(e))
                continue
            if budget_gb is not None and need > budget_gb:  # MiB if small
                row = Row(layout, need, why=f"does not fit: {_gib(need)} of {_gib(budget_gb)}")
                continue
            row = Row(layout, need, None if est is None else 1e3 * est, fits=True)
            break
        rows.append(row)
    if errors and not any(r.fits or r.need_gb is not None or r.why.startswith("does not fit")
                          for r in rows):
        raise errors[0]
    return sorted(rows, key=lambda r: (not r.fits, r.est_ms if r.est_ms is not None else 0.0))


def time_every(rows: list[Row], budget_s: float) -> bool:
    """On simulated CPU devices: time every layout that fits? When one step of each, by the
    estimates, adds up to less than ``budget_s`` (a turn's time): the steps are cheap, and
    their time is overhead the estimate does not rank."""
    est = [r.est_ms for r in rows if r.fits]
    return all(e is not None for e in est) and sum(est) < 1e3 * budget_s


def measure_rule(rows: list[Row], turn_s: float, simulated: bool) -> tuple[bool, float | None]:
    """(time every layout that fits?, ``prune`` between rounds). On simulated CPU devices whose
    steps are cheap (``time_every``) every layout takes every round: they lie close together
    and one turn on a shared host can be far off, so a prune after the first round could drop
    the best (BENCHMARKS.md, the auto bench); their rounds are cheap. Otherwise the top few
    by the estimate, the clearly slower dropped after each round."""
    every = simulated and time_every(rows, turn_s)
    return every, None if every else PRUNE


def to_measure(rows: list[Row], top: int, every: bool = False,
               turn_s: float = float("inf")) -> list[Row]:
    """The fitting rows the measure stage times: the first ``top`` and any whose estimate is
    within ``TIE`` of the best's and under ``turn_s`` seconds (``every``: all that fit)."""
    fitting = [r for r in rows if r.fits]
    if every or not fitting or fitting[0].est_ms is None:
        return fitting if every else fitting[:top]
    return [r for i, r in enumerate(fitting)
            if i < top or (r.est_ms is not None and r.est_ms <= TIE * fitting[0].est_ms
                           and r.est_ms < 1e3 * turn_s)]


def train_budget(train: TrainConfig, checkpoint: CheckpointConfig) -> int:
    """Steps a search may train for the run: those before the first at which the run's loop
    does more than step (a log row, an evaluation, a save, a trace, a test's hook), so that a
    run whose first steps the search trained writes what one that did not would."""
    t, every = train, checkpoint.every
    points = [t.steps, t.log_every, t.eval_every, 100 if every is None else every,
              t.profile.start, *runtime.faults_from_env().steps()]
    return min(p for p in points if p and p > 0) - 1


def train_through(cfg: RunConfig, timed: list[Row], budget_gb: float | None = None,
                  rounds: int = MEASURE_ROUNDS) -> int:
    """Timed steps a turn may take when the search's turns train the run's first steps (0: they
    do not; ``time_layouts``'s ``train_cap``): when every turn, however the rounds go, fits in
    ``train_budget`` at up to ``MEASURE_STEPS`` timed steps, or at one when each step is
    estimated to take a turn's time (``parallelism.search_turn_s``: one timed step a turn
    anyway). A cheap step timed in turns of ten is timed on fresh states; so are layouts two
    of whose steps exceed ``budget_gb`` (GiB per device): a move between layouts holds the
    state twice."""
    if budget_gb is not None and 2 * max((r.need_gb or 0.0 for r in timed),
                                         default=0.0) > budget_gb:
        return 0
    per_turn = train_budget(cfg.train, cfg.checkpoint) // max(1, rounds * len(timed))
    if per_turn < 2:
        return 0
    slow = all(r.est_ms is not None and r.est_ms >= 1e3 * cfg.parallelism.search_turn_s
               for r in timed)
    return min(MEASURE_STEPS, per_turn - 1) if per_turn > MEASURE_STEPS or slow else 0


def search_cost(cfg: RunConfig, start: Row, n: int, compile_s: float, simulated: bool
                ) -> tuple[float, int, float]:
    """(seconds a search of ``n`` layouts is predicted to add to a run, the steps of its turns
    that do not train the run, the seconds of the run's ``train.steps``), the starting layout's
    figures standing for every layout's: its compile (``compile_s``, the run's own; each other
    layout one more) and its estimated step (``start.est_ms``), timed as ``measure_rule``,
    ``to_measure`` and ``train_through`` would time ``n`` layouts estimated alike, every round
    taken. An estimate below the measured step (simulated CPU devices) makes the run look
    shorter against the compiles: it errs to not searching. The memory a move between layouts
    holds is not counted: the start, every weight replicated over the data replicas,
    overstates the others'."""
    step_s = start.est_ms / 1e3
    turn_s = cfg.parallelism.search_turn_s
    rows = [replace(start) for _ in range(n)]
    every, _ = measure_rule(rows, turn_s, simulated)
    timed = to_measure(rows, cfg.parallelism.search_top, every, turn_s)
    timed_steps = min(MEASURE_STEPS, max(1, math.ceil(turn_s / step_s)))  # a turn stops there
    steps = (0 if train_through(cfg, timed)
             else MEASURE_ROUNDS * len(timed) * (1 + timed_steps))
    return (n - 1) * compile_s + steps * step_s, steps, cfg.train.steps * step_s


def measure_stage(rows: list[Row], top: int, timer: Callable[[list[Layout]], dict[Layout, Any]],
                  every: bool = False, turn_s: float = float("inf")) -> Row:
    """Time the rows ``to_measure`` picks (``timer``: layout -> seconds per step, or the list
    of its turns' seconds, whose median ranks and whose range is its spread) and mark the
    fastest chosen; the others say why they lost."""
    timed = to_measure(rows, top, every, turn_s)
    if not timed:
        raise ConfigError("parallelism=auto: no layout fits the device memory; try a smaller "
                          "model or data.batch_size, or a larger runtime.memory_gb")
    times = timer([r.layout for r in timed]) if len(timed) > 1 else {}
    for r in timed:
        t = times.get(r.layout)
        turns = [1e3 * x for x in (t if isinstance(t, (list, tuple)) else [] if t is None
                                   else [t])]
        r.measured_ms = statistics.median(turns) if turns else None
        r.spread_ms = [min(turns), max(turns)] if len(turns) > 1 else None
    best = min(timed, key=lambda r: r.measured_ms if r.measured_ms is not None else 0.0)
    return _choose(rows, best, len(timed))


def model_choice(rows: list[Row], top: int = 0) -> Row:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise ConfigError("parallelism=auto: no layout fits the device memory; try a smaller "
                          "model or data.batch_size, or a larger runtime.memory_gb")
    return _choose(rows, fitting[0], top)


def _choose(rows: list[Row], best: Row, top: int) -> Row:
    best.chosen, best.why = True, ""
    for r in rows:
        if r is best or r.why:
            continue
        if r.measured_ms is not None and best.measured_ms is not None:
            r.why = f"slower: {_ms(r.measured_ms)} ms measured"
            if overlaps(r.spread_ms, best.spread_ms):
                r.why += (f", not distinguishable (turns {_ms(r.spread_ms[0])}-"
                          f"{_ms(r.spread_ms[1])}, chosen {_ms(best.spread_ms[0])}-"
                          f"{_ms(best.spread_ms[1])})")
        elif r.est_ms is not None and best.est_ms is not None:
            r.why = (f"slower: {_ms(r.est_ms)} ms estimated"
                     + (f" (not in the top {top} measured)" if top and best.measured_ms else ""))
        else:
            r.why = "not measured"
    return best


def overlaps(spread_ms: list[float] | None, chosen_ms: list[float] | None) -> bool:
    """Does a layout's spread of turns reach into the chosen one's? A turn of it was as fast as
    one of the chosen's: on this host the two are within each other's noise, and the choice
    between them is a toss-up."""
    return bool(spread_ms and chosen_ms and spread_ms[0] <= chosen_ms[1])


def _gib(v: float | None) -> str:
    if v is None:
        return "-"
    # One unit below 1 GiB: a column read down compares like with like, never 0.01 GiB.
    return f"{v:.2f} GiB" if v >= 1 else f"{v * 1024:.1f} MiB"


def _s(v: float) -> str:
    """Seconds in a sentence: whole above one, two significant digits below (a planned GPU
    run's step)."""
    return f"{v:.0f}" if v >= 1 else f"{v:.2g}"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 1 else f"{v:.3f}"  # an accelerator's tiny step: sub-ms


def chosen_layout(record: dict[str, Any]) -> Layout:
    r = next(r for r in record["rows"] if r["chosen"])
    return layout_of(r)


def searches(p: ParallelismConfig) -> bool:
    """Does this run search? ``parallelism.search`` is not ``none`` and no axis was named: a run
    that sets ``parallelism.dp``, ``fsdp``, ``tp``, ... on ``auto`` (the default preset:
    ``python -m dxrun parallelism.tp=2``) takes that layout as given, as a named preset does:
    the first axis -1 (inferred), every other 1."""
    first, *rest = axis_sizes(p).values()
    return p.search != "none" and first == -1 and all(v == 1 for v in rest)


def rows_of(record: dict[str, Any]) -> list[Row]:
    """A record's ranking rows (as ``plan.json`` holds them), in the ranking's order."""
    out = []
    for r in record["rows"]:
        layout = layout_of(r)
        out.append(Row(layout, r["need_gb"], r["est_ms"], r["measured_ms"], r["chosen"],
                       r["fits"], r["why"], r.get("spread_ms")))
    return out


def survivors(medians: dict[Layout, float], prune: float, keep: int = KEEP) -> list[Layout]:
    """The layouts timed in the next round, in their order in ``medians``: the ``keep``
    fastest so far, and any other within ``prune`` x the fastest; the fastest alone when it
    leads every other by ``CLEAR`` (it has won)."""
    ranked = sorted(medians, key=medians.__getitem__)
    best = medians[ranked[0]]
    if all(medians[x] >= CLEAR * best for x in ranked[1:]):
        return [ranked[0]]
    kept = set(ranked[:keep]) | {x for x in ranked if medians[x] <= prune * best}
    return [x for x in medians if x in kept]


def resumed_layout(resume: Any) -> Layout | None:
    """The layout a checkpoint's run trained on (its saved config), None without a resume."""
    if resume is None:
        return None
    try:
        c = resume.meta["config"]
        p = c["plan"]
        # An axis that -1 could infer was saved from the start; the context axis came later.
        sizes = Sizes({a.key: p[a.key] if a.inferable else p.get(a.key, 1) for a in AXES})
        return Layout(sizes, c["model"]["remat"], c["train"]["grad_accum"])
    except (KeyError, TypeError):  # a checkpoint from before plans were saved with it
        return None


# ------------------------------------------------------------------------------------------------
# A layout search's record as the log, plan.json and the docs read it (pure): the ranking,
# the chosen layout first, a toss-up called one, and the search's own seconds.

def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record's rows in the order the ranking is read: the chosen layout first, then those
    timed by their measured median, then those that fit by their estimate, then the rest (do
    not fit, refused, not searched) as the record holds them. The record keeps the model
    stage's order (estimated fastest first), which the bench reads."""
    def place(r: dict[str, Any]) -> tuple[int, float]:
        if r["chosen"]:
            return 0, 0.0
        if r["measured_ms"] is not None:
            return 1, r["measured_ms"]
        if r["fits"] and r["est_ms"] is not None:
            return 2, r["est_ms"]
        return 3, 0.0

    return sorted(rows, key=place)


def toss_up(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed rows not distinguishable from the chosen one (``overlaps``): with any, the
    choice was a toss-up among them."""
    chosen = next(r for r in rows if r["chosen"])
    return [r for r in rows if not r["chosen"] and r["measured_ms"] is not None
            and overlaps(r.get("spread_ms"), chosen.get("spread_ms"))]


def table(record: dict[str, Any], run: bool = True) -> str:
    """The ranking as the log prints it after the mesh plan: first what happened (searched, or
    why not: a run too short for a search to pay, a decision cached by an earlier run, a
    resumed layout), a toss-up called one, then the layouts, the chosen first. ``run``: a run's
    (False: plan mode's, which books no time)."""
    chosen = chosen_layout(record)
    if record.get("search") == "resume":
        return f"  no layout search: {chosen.label}, the layout of the checkpoint the run resumes"
    if record.get("unsearched"):  # the others never compiled (plan.json lists them)
        who = "the run keeps" if run else "the planned run keeps"
        booked = " (goodput's startup)" if run else ""
        return (f"  no layout search: {who} its starting layout, {chosen.label} "
                f"({record['start']}); deciding took {record['decide_s']:.1f} s{booked}\n"
                f"  why: {record['unsearched']}")
    rows = ranked(record["rows"])
    cached = bool(record.get("cached"))
    if cached:
        when = f" on {record['decided_at']}" if record.get("decided_at") else ""
        first = (f"  no layout search: {chosen.label}, the decision a parallelism.search="
                 f"{record['decided_by']} run cached{when}, taken by this "
                 f"{'run' if run else 'plan'}'s parallelism.search={record['search']} "
                 "(parallelism.search=fresh searches again)")
    else:
        first = _searched_line(record)
    tossed = _toss_up_line(rows, chosen, cached)
    return "\n".join([first, *([tossed] if tossed else []), *_columns(rows)])


def _searched_line(record: dict[str, Any]) -> str:
    """The first line of a search's ranking: its mode, target and seconds, and what of them
    the run would have spent anyway."""
    parts = []
    if record.get("init_s"):
        parts.append(f"{record['init_s']:.1f} s of it the seeded init the run starts from")
    if record.get("compile_s"):
        parts.append(f"{record['compile_s']:.1f} s the compile of the layout it runs")
    if record.get("trained_steps"):
        parts.append(f"{record['trained_s']:.1f} s the run's steps 1-"
                     f"{record['trained_steps']} trained in the turns")
    source = f" ({', '.join(parts)}: {own_s(record):.1f} s the search's own)" if parts else ""
    return (f"  layout search: parallelism.search={record['search']}, estimate for "
            f"{record['target']}, {record['search_s']:.1f} s{source}")


def _toss_up_line(rows: list[dict[str, Any]], chosen: Layout, cached: bool) -> str | None:
    """One plain line when the choice was a toss-up (``toss_up``), else None; ``cached``: said
    of the search that cached it, which this run does not repeat."""
    tied = toss_up(rows)
    if not tied:
        return None
    n, others = len(tied), sum(r["measured_ms"] is not None for r in rows) - 1
    names = ", ".join(layout_of(r).label
                      for r in tied)
    which = ("the other layout timed" if others == 1 else f"all {n} other layouts timed"
             if n == others else f"{n} of the {others} other layouts timed")
    verb = ("was" if n == 1 else "were") if cached else ("is" if n == 1 else "are")
    return (f"  a toss-up{' when it was timed' if cached else ''}: {which} ({names}) {verb} not "
            f"distinguishable from {chosen.label} on {'that' if cached else 'this'} host; it was "
            f"taken for its median{', and is not timed again' if cached else ''}")


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """The ranking's rows as aligned columns, under their header."""
    head = ("layout", "per device", "est ms", "measured ms", "", "why not")
    lines = [head]
    for r in rows:
        layout = layout_of(r)
        lines.append((layout.label, _gib(r["need_gb"]),
                      _ms(r["est_ms"]), _ms(r["measured_ms"]), "✓" if r["chosen"] else "",
                      r["why"]))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return ["  " + "  ".join(f"{c:<{w}}" for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]


def own_s(record: dict[str, Any]) -> float:
    """Seconds of a search that a run without one would not spend: less the seeded init, the
    chosen layout's compile and the steps it trained, all of which the run takes over (what
    goodput books as ``search``). 0 where the run did not search (too short for one to pay, a
    cached decision, a resumed layout): deciding that is the run's startup, and the compile
    of the layout it runs its compile."""
    if not record.get("searched", True):
        return 0.0
    return record["search_s"] - sum(record.get(k) or 0.0
                                    for k in ("init_s", "compile_s", "trained_s"))


def markdown(record: dict[str, Any]) -> str:
    """The ranking as a Markdown table (the docs' auto section)."""
    out = ["| layout | per device | est ms | measured ms | chosen | why not |",
           "|---|---|---|---|---|---|"]
    for r in ranked(record["rows"]):
        layout = layout_of(r)
        need = _gib(r["need_gb"])
        out.append(f"| {layout.label} | {need} | {_ms(r['est_ms'])} | {_ms(r['measured_ms'])} "
                   f"| {'✓' if r['chosen'] else ''} | {r['why']} |")
    return "\n".join(out)


# Where a run continues from: the checkpoint its decision takes (``decide``), found and read by
# ``dxrun.checkpointing.store``.
@dataclass
class Resume:
    """Where a run continues from: ``directory`` (a checkpoints dir) at its newest readable
    step, or at ``step``; ``in_place``: the checkpoints are this run's own."""

    directory: Path
    step: int | None
    in_place: bool
    meta: dict[str, Any] = field(default_factory=dict)  # the newest readable checkpoint's meta
    meta_step: int = 0
    damaged: list[int] = field(default_factory=list)  # newer steps found damaged, newest first
    # Why the optimizer state starts fresh (its tree does not fit the optimizer now); None: it
    # is restored with the rest.
    fresh_optimizer: str | None = None
    state_names: set[str] | None = None  # the leaves of the checkpoint's state tree
    key: str = "checkpoint.resume"  # what named the checkpoints: a tool's is its path argument

    def fix(self) -> str:
        """The way on when nothing here can be read: a launch starts fresh, a tool
        (``dxrun.export``, ...) is given other checkpoints: its own argument, not a run's key."""
        return ("start fresh with checkpoint.resume=none" if self.key == "checkpoint.resume" else
                f"give another {self.key}: a run dir, its checkpoints dir or one of its step dirs")


# ------------------------------------------------------------------------------------------------
# The run plan: every number a run derives from its validated config, decided once
# (``dxrun.autotune.fit``) and carried, never written back into the config the run follows.
#
# It holds the mesh plan (the layout: dp/fsdp/tp, remat, accumulation; the global batch and
# sequence length; the step's attention kernel, loss chunk, ZeRO-1 and precision), the save
# cadence, and the layout search's record where one decided the layout. ``saved_config`` is
# the one place the derived numbers, and the W&B job type and group the launch gave the run
# (``runtime.Job``), are written, into the record a run's files keep (``config.yaml``, the W&B
# config, each checkpoint's config).

@dataclass(frozen=True)
class RunPlan:
    mesh: MeshPlan
    # (steps, minutes) between saves, 0 = that cadence off (``checkpointing.cadence``)
    cadence: tuple[int, float] = (0, 0.0)
    # parallelism=auto's ranking (``dxrun.autotune.fit``) when the layout was searched for.
    search: dict[str, Any] | None = None

    @property
    def layout(self) -> Layout:
        return self.mesh.layout

    @property
    def global_batch(self) -> int:
        return self.mesh.global_batch

    @property
    def seq_len(self) -> int:
        return self.mesh.seq_len

    @property
    def search_s(self) -> float | None:
        """parallelism=auto's own seconds (``own_s``); None: no search."""
        return own_s(self.search) if self.search else None

    def to_json(self) -> dict[str, Any]:
        """``plan.json`` and the saved config's ``plan``: the mesh plan and the search."""
        return {**self.mesh.to_json(), "layout_search": self.search}


def resolved_config(cfg: DictConfig, plan: RunPlan, *, job_type: str | None = None,
                    group: str | None = None) -> DictConfig:
    """A copy of ``cfg`` holding the plan's global batch and sequence length in
    ``data.batch_size`` and ``data.seq_len`` and, where a search chose the layout, that layout
    as ordinary keys (W&B and sweeps group by them) with the global batch as the one given:
    what the run's files record, and the base of the settings a refusal tries. ``job_type``,
    ``group``: the run's W&B names (``runtime.Job``) in ``logger``, so that its W&B run, its
    files and the sweep report (which reads them) agree; None keeps the config's. ``cfg``
    itself is read, never rewritten."""
    out = recorded(cfg, plan.global_batch, plan.seq_len,
                   plan.layout if plan.search is not None else None)
    if job_type is not None:
        out.logger.job_type = job_type
    if group is not None:
        out.logger.group = group
    return out


def recorded(cfg: DictConfig, batch: int, seq_len: int, layout: Layout | None = None
             ) -> DictConfig:
    """``resolved_config`` before the layout is decided: the global batch and sequence length
    (and a searched ``layout``) as keys in a copy of ``cfg``; what a resume is checked
    against while a search is still to choose the layout."""
    out = copy.deepcopy(cfg)
    if layout is not None:
        out = OmegaConf.merge(out, layout.overrides())
        out.data.per_device_batch_size = None
    out.data.batch_size, out.data.seq_len = batch, seq_len
    return out


def saved_config(cfg: DictConfig, plan: RunPlan, *, job_type: str | None = None,
                 group: str | None = None) -> dict[str, Any]:
    """``resolved_config`` as the plain dict the run's files are written from."""
    return OmegaConf.to_container(
        resolved_config(cfg, plan, job_type=job_type, group=group), resolve=True)
