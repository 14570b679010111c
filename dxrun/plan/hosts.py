"""How a mesh spreads over hosts and their processes (pure): tensor groups stay inside a host,
fsdp takes what a host has left, data spans the hosts."""

from __future__ import annotations

import math

from dxrun.config.errors import ConfigError


def split_over_hosts(dp: int, fsdp: int, tp: int, hosts: int,
                     allow_cross_host_tp: bool = False) -> tuple[int, int, int]:
    """The part of (data, fsdp, tensor) that spans ``hosts`` equal hosts: tensor stays
    inside a host, fsdp takes what the host has left, data spans the hosts. Raises ConfigError
    for a layout whose tensor-parallel group would cross hosts (every layer's activation
    all-reduces over the network) unless allowed."""
    local = dp * fsdp * tp // hosts
    if local % tp:
        where = (f"parallelism.tp={tp} puts each tensor-parallel group across "
                 f"{-(-tp // local)} hosts ({hosts} hosts x {local} devices), so "
                 "every layer's all-reduces would cross the network")
        fits = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
        if not allow_cross_host_tp:
            raise ConfigError(f"{where}; use parallelism.tp from {fits} (the devices of one "
                              "host), or set parallelism.allow_cross_host_tp=true")
        if tp % local:
            raise ConfigError(f"{where}, and unevenly; use parallelism.tp from {fits} or a "
                              f"multiple of {local}")
        return dp, fsdp, tp // local
    inside = local // tp  # what the host has for data x fsdp
    fsdp_in = math.gcd(fsdp, inside)
    data_in = inside // fsdp_in
    dcn = (dp // data_in, fsdp // fsdp_in, 1)
    if data_in > 1 and dcn[1] > 1:
        # Each host would hold scattered rows of the batch; keep fsdp inside a host or
        # make it span whole hosts.
        raise ConfigError(
            f"parallelism.fsdp={fsdp} neither fits in one host's {inside} devices (after "
            f"tp={tp}) nor spans whole hosts; pick parallelism.fsdp dividing {inside} or "
            f"a multiple of {inside}")
    return dcn


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
