"""How a mesh spreads over hosts and their processes (pure), axis by axis as ``AXES`` says
(``Axis.hosts``): tensor and context groups stay inside a host, fsdp takes what a host has left,
data spans the hosts. ``HostPlacement``: a mesh plan's host properties.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from dxrun.config import (
    AXES,
    FILLS,
    INSIDE,
    Axis,
    ConfigError,
)
from dxrun.plan.axes import Sizes, named


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
