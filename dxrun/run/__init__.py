"""The run's process and its directory, below the plan (no JAX at module level): the process set
up before JAX starts (``process``), joined to the run's other processes (``distributed``), its
signals turned into flags the loop reads (``signals``), where the run sits among others and its
logger's section checked (``job``), the run dir claimed, continued, held or refused
(``run_dir``), the files that record the run (``files``) and the tests' faults, read from the
environment (``faults``).
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.run.distributed import (
    COORDINATOR, CUDA_VISIBLE, HOSTNAME, LAUNCH_RUN_DIR, LAUNCH_STARTUP, LOCAL_PROCESSES,
    NUM_PROCESSES, PROCESS_ID, Join, agree, detect, gather, host_indices, is_main, join,
    local_processes, process_hosts, slurm_device_ids, tell_launcher, tell_launcher_startup,
    visible_gpus)
from dxrun.run.faults import (
    Faults, check_chip, faults_from_env)
from dxrun.run.files import (
    STATUS, RunLog, finite_or_null, read_json, write_hydra_files, write_json, write_status)
from dxrun.run.job import (
    SWEEP_EXITS, Job, describe_model, mlflow_store_uri, run_name, store_refusal, sweep_group,
    unread_logger_keys)
from dxrun.run.process import (
    DEVICE_COUNT_FLAG, accelerator_plan_note, collect_cycles_rarely, command_imports,
    cpu_fallback_refusal, enable_compile_cache, freeze_imported, nvidia_device_node,
    release_freed_memory, reuse_freed_memory, reuse_pays, simulate_cpu_devices, simulated_count,
    thread_pool_note, user_cache_dir)
from dxrun.run.run_dir import (
    LAUNCHED_BY, LOCK, Claim, RunLock, claim, claim_run_dir, dir_refusal, holder, pick,
    read_status, relaunch_command, run_dir_of, stopped_words, wait_seconds)
from dxrun.run.signals import (
    SIGNALS, Preemption, ProcessAgreement, Signals, guard_signals)
