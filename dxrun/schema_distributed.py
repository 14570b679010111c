"""The schema of the ``distributed`` section: joining a multi-process run through JAX's
distributed runtime (dxrun/multihost/distributed.py). Keys are written as in ``dxrun.schema``
(``config_key.key``), which places the section in ``RunConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dxrun.config_key import NON_NEGATIVE, POSITIVE, key


@dataclass
class DistributedConfig:
    """Joining a multi-process run through JAX's distributed runtime (dxrun/multihost/distributed.py)."""

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
