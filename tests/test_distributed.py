"""Joining a multi-process run and laying the mesh over hosts: pure functions, no cluster."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from dxrun.config.errors import ConfigError
from dxrun.config.schema import DistributedConfig
from dxrun.plan import make_plan, split_over_hosts
from dxrun.run import (
    LOCAL_PROCESSES,
    Join,
    detect,
    host_indices,
    local_processes,
    slurm_device_ids,
    visible_gpus,
)


def _dist(**kw):
    return OmegaConf.merge(OmegaConf.structured(DistributedConfig), kw)


SLURM_2_NODES = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                 "SLURM_STEP_NUM_NODES": "2", "SLURM_LOCALID": "0",
                 "SLURM_STEP_NODELIST": "gpu[01-02]"}


@pytest.mark.parametrize(("dist", "env", "want"), [
    ({}, {}, None),  # a laptop: one process
    ({}, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # sbatch, 1 task
    ({}, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
          "JAX_PROCESS_ID": "3"}, Join("launch", 4, 3, "10.0.0.1:1234")),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1",
          "JAX_PROCESS_ID": "0"}, None),  # dxrun.launch --nproc 1
    # One task per node drives every GPU of its node (JAX alone would give it only GPU 0).
    ({}, SLURM_2_NODES, Join("slurm", 2, 1, None, ())),
    # Several tasks per node: JAX's default, one GPU per task (SLURM_LOCALID).
    ({}, {**SLURM_2_NODES, "SLURM_NTASKS": "16"}, Join("slurm", 16, 1, None, None)),
    # A site that binds one GPU per task: the task's only GPU, not ordinal SLURM_LOCALID=5.
    ({}, {**SLURM_2_NODES, "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
          "CUDA_VISIBLE_DEVICES": "5"}, Join("slurm", 16, 1, None, ())),
    ({"local_device_ids": [0, 1]}, SLURM_2_NODES, Join("slurm", 2, 1, None, (0, 1))),
    ({"mode": "off"}, SLURM_2_NODES, None),
    ({"mode": "manual", "coordinator": "h0:99", "num_processes": 2, "process_id": 0}, {},
     Join("manual", 2, 0, "h0:99")),
])
def test_detect(dist, env, want):
    assert detect(_dist(**dist), env) == want


@pytest.mark.parametrize(("dist", "env", "message"), [
    ({"mode": "manual", "coordinator": "h0:99"}, {},
     "distributed.mode=manual needs distributed.num_processes, distributed.process_id"),
    ({"mode": "manual", "coordinator": "h:1", "num_processes": 2, "process_id": 2}, {},
     "distributed.process_id=2 is not in [0, distributed.num_processes=2)"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"},
     "JAX_PROCESS_ID is not"),
    ({}, {**SLURM_2_NODES, "SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not an integer"),
    ({"mode": "manual", "coordinator": "h0", "num_processes": 2, "process_id": 1}, {},
     "distributed.coordinator=h0 is not host:port; give the address of process 0 with its "
     "port, e.g. host0:12345"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1", "JAX_NUM_PROCESSES": "2",
          "JAX_PROCESS_ID": "1"}, "environment variable JAX_COORDINATOR_ADDRESS=10.0.0.1 is "
     "not host:port"),
])
def test_detect_refuses_with_one_line(dist, env, message):
    with pytest.raises(ConfigError, match=None) as e:
        detect(_dist(**dist), env)
    assert message in str(e.value) and "\n" not in str(e.value)


def _split(dp, fsdp, tp, hosts, allow_cross_host_tp=False):
    """(data, fsdp, tensor)'s parts across ``hosts``, by the positions these tests were written in."""
    dcn = split_over_hosts({"dp": dp, "fsdp": fsdp, "cp": 1, "tp": tp}, hosts,
                           {"tp"} if allow_cross_host_tp else ())
    return dcn["dp"], dcn["fsdp"], dcn["tp"]


@pytest.mark.parametrize(("mesh", "processes", "dcn"), [
    ((8, 1, 1), 2, (2, 1, 1)),   # dp8 on 2 x 4: data spans the hosts
    ((4, 1, 2), 2, (2, 1, 1)),   # dp4_tp2: tensor pairs inside a host
    ((1, 8, 1), 2, (1, 2, 1)),   # fsdp8: 4-way inside, 2-way across
    ((2, 2, 2), 2, (2, 1, 1)),   # dp2_fsdp2_tp2: fsdp stays inside
    ((2, 4, 1), 4, (2, 2, 1)),   # 4 hosts x 2: fsdp 2-way inside, both axes across
    ((16, 1, 8), 16, (16, 1, 1)),  # 16 nodes x 8 GPUs, tp8 per node
])
def test_split_over_hosts(mesh, processes, dcn):
    assert _split(*mesh, processes) == dcn


def test_split_refuses_cross_host_tp_unless_allowed():
    with pytest.raises(ConfigError) as e:
        _split(1, 1, 8, 2)
    msg = str(e.value)
    assert "parallelism.tp=8 puts each tensor-parallel group across 2 hosts" in msg
    assert "parallelism.tp from 1, 2, 4" in msg and "allow_cross_host_tp=true" in msg
    assert _split(1, 1, 8, 2, allow_cross_host_tp=True) == (1, 1, 2)
    with pytest.raises(ConfigError, match="fsdp=6 neither fits"):
        _split(2, 6, 1, 3)  # 3 hosts x 4: rows of a process would scatter


def test_plan_over_two_processes(cfg_factory):
    plan = make_plan(cfg_factory("parallelism=dp4_tp2", "data.batch_size=16"), 8, "cpu",
                     processes=2)
    assert plan.dcn_shape == (2, 1, 1, 1) and plan.local_shape == (2, 1, 1, 2)
    assert (plan.data_shards, plan.data_shard(0), plan.data_shard(1)) == (2, 0, 1)
    assert "hosts    2 processes x 4 devices; across processes: data=2 x fsdp=1 x tensor=1" \
        in plan.table()
    assert plan.to_json()["local_shape"] == [2, 1, 1, 2]
    # Processes of one cross-host tensor group read the same rows.
    cross = make_plan(cfg_factory("parallelism=dp2_tp4", "parallelism.allow_cross_host_tp=true"),
                      8, "cpu", processes=4)
    assert cross.dcn_shape == (2, 1, 1, 2)
    assert [cross.data_shard(p) for p in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallelism=tp8"], "parallelism.tp=8 puts each tensor-parallel group across 2"),
    (["parallelism=dp4", "parallelism.n_devices=4"],
     "a 2-process run has 8 (2 x 4) and must use them all"),
    (["parallelism=dp8", "data.batch_size=12"], "data.batch_size=12 is not divisible by"),
])
def test_plan_refuses_over_two_processes(cfg_factory, overrides, message):
    with pytest.raises(ConfigError) as e:
        make_plan(cfg_factory(*overrides), 8, "cpu", processes=2)
    assert message in str(e.value)


@pytest.mark.parametrize(("env", "num_processes", "want"), [
    ({}, 1, 1),
    ({LOCAL_PROCESSES: "2"}, 2, 2),  # python -m dxrun.launch --nproc 2: one host
    ({**SLURM_2_NODES, "SLURM_NTASKS": "16"}, 16, 8),  # 8 tasks on each of 2 nodes
    (SLURM_2_NODES, 2, 1),  # one task per node
    ({}, 4, 1),  # joined by hand: hosts dxrun cannot see
])
def test_processes_sharing_the_host(env, num_processes, want):
    assert local_processes(env, num_processes) == want


def test_launch_keeps_the_users_xla_flags_but_the_device_count():
    from dxrun.launch import child_env

    base = {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 "
                         "--xla_gpu_enable_latency_hiding_scheduler=true"}
    env = child_env(base, 1, 2, 1234, 4)
    assert env["XLA_FLAGS"] == ("--xla_dump_to=/tmp/d "
                                "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert env[LOCAL_PROCESSES] == "2"
    only_count = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 0, 2, 1,
                           None)
    assert "XLA_FLAGS" not in only_count


@pytest.mark.parametrize(("env", "tasks_per_node", "want"), [
    ({}, 1, ()),  # one task per node: all of the node's GPUs
    ({"SLURM_LOCALID": "3"}, 8, None),  # nothing said: JAX's default, ordinal SLURM_LOCALID
    ({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "3"}, 8, ()),  # bound: its one GPU
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, 4, ()),  # 2 bound, 4 tasks
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "4,5", "SLURM_GPUS_PER_TASK": "h100:2"},
     2, ()),  # --gpus-per-task=2 binds 2 to each of 2 tasks
    ({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8, (3,)),  # shared
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 2, (4, 5, 6, 7)),
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}, 2, None),  # uneven
])
def test_slurm_task_drives_devices_that_exist(env, tasks_per_node, want):
    assert slurm_device_ids(env, tasks_per_node) == want


def test_visible_gpus(tmp_path):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,GPU-x"}) == ["2", "3", "GPU-x"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at -1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cpu"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cuda,cpu"}) == ["0", "1"]
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, str(tmp_path)) == ["0", "1", "2"]  # device nodes, not ctl/uvm
    assert visible_gpus({}, str(tmp_path / "none")) == []


def test_gpus_are_divided_over_the_launched_processes():
    from dxrun.launch import child_env, gpu_slices

    eight = [str(i) for i in range(8)]
    assert gpu_slices(eight, 2, None) == [eight[:4], eight[4:]]
    assert gpu_slices(eight, 8, None) == [[g] for g in eight]
    assert gpu_slices(["4", "6"], 2, None) == [["4"], ["6"]]  # the user's CUDA_VISIBLE_DEVICES
    assert gpu_slices(eight, 2, 2) == [["0", "1"], ["2", "3"]]
    with pytest.raises(ValueError, match="--nproc=3 does not divide the 8 visible GPUs; pick "
                                         "--nproc from 1, 2, 4, 8"):
        gpu_slices(eight, 3, None)
    with pytest.raises(ValueError, match="--devices-per-proc=4 needs 12 GPUs but 8"):
        gpu_slices(eight, 3, 4)
    env = child_env({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "JAX_LOCAL_DEVICE_IDS": "0"}, 1, 2,
                    1234, None, ["2", "3"])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "JAX_LOCAL_DEVICE_IDS" not in env
    # --hosts 2: consecutive ranks declare one host (all 4 still share this machine's RAM).
    hosts = [child_env({}, r, 4, 1, 2, hosts=2) for r in range(4)]
    assert host_indices([e["DXRUN_HOSTNAME"] for e in hosts]) == (0, 0, 1, 1)
    assert [e[LOCAL_PROCESSES] for e in hosts] == ["4"] * 4
    assert "DXRUN_HOSTNAME" not in child_env({}, 0, 4, 1, 2)


def _rows_held(plan, grid, process_of):
    """The row blocks (of plan.data_shards) each process's devices hold in the mesh grid."""
    per = plan.dp * plan.fsdp // plan.data_shards
    held: dict[int, set[int]] = {}
    for (d, f, *_), i in np.ndenumerate(grid):
        held.setdefault(process_of[i], set()).add((d * plan.fsdp + f) // per)
    return held


@pytest.mark.parametrize(("overrides", "procs_per_device", "hosts", "shape", "dcn", "shards"), [
    # 2 nodes x 8 GPUs, one SLURM task per GPU: tensor pairs inside a node.
    (["parallelism=dp4_tp2"], 1, host_indices(["a"] * 8 + ["b"] * 8), (8, 1, 1, 2), (2, 1, 1, 1),
     [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]),
    # The same with SLURM's cyclic distribution: the ranks alternate between the nodes.
    (["parallelism=dp4_tp2"], 1, host_indices(["a", "b"] * 8), (8, 1, 1, 2), (2, 1, 1, 1),
     [0, 4, 0, 4, 1, 5, 1, 5, 2, 6, 2, 6, 3, 7, 3, 7]),
    # One host, 4 processes x 2 devices: a 4-way tensor group over 2 processes.
    (["parallelism.tp=4"], 2, (0, 0, 0, 0), (2, 1, 1, 4), (1, 1, 1, 1), [0, 0, 1, 1]),
    # 2 hosts x 2 processes x 2 devices, fsdp8 = 4-way inside a host, 2-way across.
    (["parallelism=fsdp8", "parallelism.n_devices=8"], 2, (0, 0, 1, 1), (1, 8, 1, 1), (1, 2, 1, 1),
     [0, 1, 2, 3]),
])
def test_processes_grouped_by_host(cfg_factory, overrides, procs_per_device, hosts, shape, dcn,
                                   shards):
    from dxrun.model.sharding import host_grid

    cfg = cfg_factory(*overrides, "model.n_heads=8", "model.n_kv_heads=8", "data.batch_size=32")
    n = len(hosts) * procs_per_device
    plan = make_plan(cfg, n, "gpu", processes=len(hosts), process_hosts=hosts)
    assert (plan.host_shape, plan.dcn_shape, plan.hosts) == (shape, dcn, max(hosts) + 1)
    assert [plan.data_shard(p) for p in range(len(hosts))] == shards
    process_of = [i // procs_per_device for i in range(n)]
    grid = host_grid(plan, process_of)
    assert sorted(grid.ravel()) == list(range(n))
    # Every process holds exactly the row block it reads, and a host only its own part.
    assert _rows_held(plan, grid, process_of) == {p: {s} for p, s in enumerate(shards)}
    assert plan.to_json()["hosts"] == plan.hosts


def test_one_task_per_gpu_table_and_refusals(cfg_factory):
    cfg = cfg_factory("parallelism=dp4_tp2", "model=large", "data.batch_size=32")
    two_nodes = host_indices(["a"] * 8 + ["b"] * 8)
    plan = make_plan(cfg, 16, "gpu", processes=16, process_hosts=two_nodes)
    assert ("hosts    2 hosts x 8 processes x 1 devices; across hosts: data=2 x fsdp=1 x "
            "tensor=1") in plan.table()
    # The recipes' old layout: model=large's 20 heads do not split 8 ways.
    with pytest.raises(ConfigError, match="model.n_heads=20 is not divisible by parallelism.tp=8"):
        make_plan(cfg_factory("model=large", "parallelism.tp=8"), 16, "gpu", processes=2)
    # Counted as 16 hosts (what splitting over processes did), each tensor pair would cross.
    with pytest.raises(ConfigError, match="parallelism.tp=2 puts each tensor-parallel group "
                                          "across 2 hosts"):
        make_plan(cfg, 16, "gpu", processes=16)
    with pytest.raises(ConfigError, match=r"spread unevenly over 2 hosts \(\[3, 1\] processes\)"):
        make_plan(cfg_factory("parallelism=dp4_tp2"), 8, "cpu", processes=4,
                  process_hosts=(0, 0, 0, 1))
    with pytest.raises(ConfigError, match="parallelism.tp=6 neither fits in one process's 4 "
                                          "devices nor spans whole processes"):
        make_plan(cfg_factory("parallelism.tp=6", "model.n_heads=6", "model.n_kv_heads=6",
                              "model.d_ff=96", "data.batch_size=2"), 12, "cpu", processes=3,
                  process_hosts=(0, 0, 0))
