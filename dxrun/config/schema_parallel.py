"""The sections of a run over many devices: the mesh's axes (``AXES``, a table: each axis's key,
the JAX mesh axis it names and how it spreads over hosts), the ``parallelism`` section that
sizes them and the ``distributed`` section that joins a multi-process run through JAX's
distributed runtime (dxrun/run/distributed.py). Keys are written as in
``dxrun.config.schema`` (``key.key``), which places the sections in ``RunConfig``.

A new mesh axis is a row of ``AXES``, its key here, its logical rules
(``plan.run_plan.LOGICAL_RULES``), its presets (conf/parallelism/) and its tests: the plan
(``plan.run_plan.Sizes``), the layout search, the host split and the mesh iterate over ``AXES``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dxrun.config.key import NON_NEGATIVE, POSITIVE, key

# How an axis spreads over hosts (``plan.run_plan.split_over_hosts``, innermost axis first):
INSIDE = "inside"  # its groups stay inside a host (their collectives run every layer)
FILLS = "fills"  # it takes what a host has left, the rest across hosts
SPANS = "spans"  # it spans the hosts with whatever is left


@dataclass(frozen=True)
class Axis:
    """One mesh axis: ``key``, its size's name (``parallelism.<key>``, the layout's and the mesh
    plan's); ``mesh``, the JAX mesh axis it names (what the logical rules map onto); whether
    ``-1`` infers it from the device count; ``hosts``, how it spreads over hosts (``INSIDE``,
    ``FILLS``, ``SPANS``); ``cross_host``, the parallelism key that lets an ``INSIDE`` axis's
    groups span hosts anyway ("" = none); ``batch``, whether it splits the batch (its devices
    read different rows: ``plan.run_plan.BATCH_AXES``); ``only_with``, the config key a model
    needs non-zero for the axis to be of use (a layout search tries it only then; "" = any)."""

    key: str
    mesh: str
    inferable: bool = True
    hosts: str = INSIDE
    cross_host: str = ""
    batch: bool = False
    only_with: str = ""


# The mesh's axes in its order (the device grid's, major to minor): a mesh that does not fit
# its devices gives up sizes in this order too (``plan.run_plan.shrink``). The context axis stays
# inside a host as tensor does (its K/V all-gathers run every layer); a multi-process run
# refuses cp > 1 for now (``plan.run_plan.check_processes``).
# The expert axis splits the batch as data does (outside the MoE layers its devices are data
# replicas) and the experts of each MoE layer (dxrun/model/moe.py); its groups stay inside a
# host, whose links carry the tokens to their experts and back every MoE layer.
AXES: tuple[Axis, ...] = (Axis("dp", "data", hosts=SPANS, batch=True),
                          Axis("fsdp", "fsdp", hosts=FILLS, batch=True),
                          Axis("ep", "expert", batch=True, only_with="model.moe.n_experts"),
                          Axis("cp", "context", inferable=False),
                          Axis("tp", "tensor", cross_host="allow_cross_host_tp"))


def axis_sizes(section: object) -> dict[str, int]:
    """Each axis's size as ``section`` (the parallelism section, a layout or a mesh plan)
    holds it, in the mesh's order."""
    return {a.key: getattr(section, a.key) for a in AXES}


_AXIS = "-1 (inferred) or a size >= 1: plan.run_plan.resolve_axes"


@dataclass
class ParallelismConfig:
    name: str = key("auto", "the preset's name (run names and tags)")
    n_devices: int = key(0, "0 = all visible, k = the first k", range=NON_NEGATIVE)
    dp: int = key(-1, "data-parallel axis size (-1 = inferred; at most one axis)", unranged=_AXIS)
    fsdp: int = key(1, "fully-sharded data-parallel axis size (-1 = inferred)", unranged=_AXIS)
    tp: int = key(1, "tensor-parallel axis size (-1 = inferred)", unranged=_AXIS)
    ep: int = key(1, "expert-parallel axis size: each MoE layer's experts split over ep "
                  "devices, which split the batch as data replicas do (-1 = inferred)",
                  unranged=_AXIS)
    cp: int = key(1, "context-parallel axis size: each sequence split over cp devices", range=POSITIVE)
    sequence_parallel: bool = key(False, "under tp: norms and the residual split along the sequence")
    on_mismatch: str = key("error", "a mesh that does not match the devices: refuse, or shrink "
                           "it to fit", choices=("error", "shrink"))
    vocab_align: int = key(
        0, "The vocab axis (wte / lm_head rows) is padded to a multiple of tp and of this; 0 = "
        "the platform's (128 on GPU/TPU, 1 on CPU). E.g. 128 lays a GPU run's checkpoint out on "
        "CPU.", range=NON_NEGATIVE)
    allow_cross_host_tp: bool = key(
        False, "A multi-process run refuses a tensor-parallel group that spans processes "
        "(hosts): its per-layer all-reduces would cross the network. true = allow it anyway.")
    shard_optimizer: bool | None = key(
        None, "ZeRO-1: optimizer state (Adam/Lion moments, SGD momentum) also split over the "
        "`data` replicas; null = auto (on when dp > 1). Same losses either way; checkpoints "
        "restore across.")
    search: str = key(
        "none", "parallelism=auto's layout search (dxrun/autotune/search.py): none = "
        "dp/fsdp/tp as given | measure = rank by estimate, time the top search_top, the fastest "
        "wins | model = the estimate's first | fresh = measure, ignoring the cached decision and "
        "search_budget (a search asked for).",
        choices=("none", "measure", "model", "fresh"))
    search_top: int = key(3, "parallelism.search=measure times this many of the ranking's best "
                          "(and any estimated within 10% of the first at under search_turn_s "
                          "a step; on simulated CPU devices, when the steps are cheap, all that "
                          "fit)", range=POSITIVE)
    search_turn_s: float = key(
        1.0, "parallelism.search=measure: a layout's turn stops timing once its steps add up to "
        "this many seconds (up to 10 steps a turn, at least 1): longer = steadier medians, a "
        "slower search. Several processes stop on process 0's clock.", range=POSITIVE)
    search_budget: float | None = key(
        0.25, "parallelism=auto (a run, or the run plan mode plans): the starting layout (all "
        "devices data-parallel) is kept, unsearched, when a search is predicted to cost more "
        "than this fraction of the run's steps (from the starting layout's compile time and "
        "estimated step: plan.run_plan.search_cost); null = always search (a cached decision "
        "is still taken; search=fresh searches whatever this is)", range=POSITIVE)


@dataclass
class DistributedConfig:
    """Joining a multi-process run through JAX's distributed runtime (dxrun/run/distributed.py)."""

    mode: str = key(
        "auto", "auto: join when the environment says this process is one of several (srun "
        "with several tasks; JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, as "
        "python -m dxrun.launch sets them) | off | manual (the keys below)",
        choices=("auto", "off", "manual"))
    coordinator: str | None = key(None, "host:port of process 0")
    num_processes: int | None = key(None, "processes in the run (distributed.mode=manual)",
                                    range=POSITIVE)
    process_id: int | None = key(None, "this process's rank (distributed.mode=manual)",
                                 range=NON_NEGATIVE)
    local_device_ids: list[int] | None = key(
        None, "The accelerators this process drives: null = JAX's choice (under SLURM one per "
        "task when a node runs several tasks, all when it runs one).")
    init_timeout_s: int = key(300, "wait at most this long for every process to arrive",
                              range=POSITIVE)
    heartbeat_timeout_s: int = key(100, "a process silent this long is dead: the others exit",
                                   range=POSITIVE)
