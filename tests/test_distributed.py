"""Joining a multi-process run and laying the mesh over hosts: pure functions, no cluster."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dxrun.config import DistributedConfig
from dxrun.distributed import LOCAL_PROCESSES, Join, detect, local_processes
from dxrun.errors import ConfigError
from dxrun.plan import make_plan, split_over_processes


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


@pytest.mark.parametrize(("mesh", "processes", "dcn"), [
    ((8, 1, 1), 2, (2, 1, 1)),   # dp8 on 2 x 4: data spans the hosts
    ((4, 1, 2), 2, (2, 1, 1)),   # dp4_tp2: tensor pairs inside a host
    ((1, 8, 1), 2, (1, 2, 1)),   # fsdp8: 4-way inside, 2-way across
    ((2, 2, 2), 2, (2, 1, 1)),   # dp2_fsdp2_tp2: fsdp stays inside
    ((2, 4, 1), 4, (2, 2, 1)),   # 4 hosts x 2: fsdp 2-way inside, both axes across
    ((16, 1, 8), 16, (16, 1, 1)),  # 16 nodes x 8 GPUs, tp8 per node
])
def test_split_over_processes(mesh, processes, dcn):
    assert split_over_processes(*mesh, processes) == dcn


def test_split_refuses_cross_host_tp_unless_allowed():
    with pytest.raises(ConfigError) as e:
        split_over_processes(1, 1, 8, 2)
    msg = str(e.value)
    assert "parallelism.tp=8 puts each tensor-parallel group across 2 processes" in msg
    assert "parallelism.tp from 1, 2, 4" in msg and "allow_cross_host_tp=true" in msg
    assert split_over_processes(1, 1, 8, 2, allow_cross_host_tp=True) == (1, 1, 2)
    with pytest.raises(ConfigError, match="fsdp=6 neither fits"):
        split_over_processes(2, 6, 1, 3)  # 3 hosts x 4: rows of a process would scatter


def test_plan_over_two_processes(cfg_factory):
    plan = make_plan(cfg_factory("parallelism=dp4_tp2", "data.batch_size=16"), 8, "cpu",
                     processes=2)
    assert plan.dcn_shape == (2, 1, 1) and plan.local_shape == (2, 1, 2)
    assert (plan.data_shards, plan.data_shard(0), plan.data_shard(1)) == (2, 0, 1)
    assert "hosts    2 processes x 4 devices; across processes: data=2 x fsdp=1 x tensor=1" \
        in plan.table()
    assert plan.to_json()["local_shape"] == [2, 1, 2]
    # Processes of one cross-host tensor group read the same rows.
    cross = make_plan(cfg_factory("parallelism=dp2_tp4", "parallelism.allow_cross_host_tp=true"),
                      8, "cpu", processes=4)
    assert cross.dcn_shape == (2, 1, 2)
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
