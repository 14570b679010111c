"""One process of a real multi-process run over loopback (launched by test_multiprocess.py).

    python multiprocess_worker.py <port> <process_id> <num_processes> <out.json> [overrides...]

Each process simulates 8/num_processes CPU devices, joins the others through
``jax.distributed`` (gloo collectives on CPU), reads only its rows of each global batch, and
trains a few steps on the global mesh; process 0 writes the losses it saw.
"""

from __future__ import annotations

import json
import sys

from dxrun.runtime import simulate_cpu_devices

port, pid, nproc, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
simulate_cpu_devices(8 // nproc)

import jax  # noqa: E402

if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

from conftest import make_cfg  # noqa: E402

from dxrun.experiment import Experiment  # noqa: E402

cfg = make_cfg(*sys.argv[5:])
exp = Experiment.build(cfg)
assert jax.device_count() == 8 and jax.local_device_count() == 8 // nproc
state = exp.init_state()
it = exp.data.train_iterator()
losses, rows = [], []
for _ in range(4):
    local = next(it)
    rows.append(local.tolist())
    state, m = exp.step(state, exp.global_batch(local))
    losses.append(float(jax.device_get(m["train/loss"])))
with open(f"{out}.{pid}", "w") as f:
    json.dump({"losses": losses, "rows": rows, "process_count": jax.process_count()}, f)
