"""``python -m dxrun.launch --nproc N [--devices-per-proc K] -- <overrides>``: N local
processes of one run, joined through JAX's distributed runtime over loopback.

For development, tests and one node with several processes (one per GPU group). Each process
is ``python -m dxrun <overrides>`` with the coordinator variables ``distributed.mode=auto``
reads, its own GPUs (``gpu_slices``) or K simulated CPU devices, and its output prefixed with
its rank. Signals are passed on to every process; a stop that ends every rank cleanly exits with
the stop's code (``errors.EXIT_CODES``) and the resume command, otherwise with the first
non-zero code a process returned (killed by signal S: 128+S). One run lives and dies as one
(``stop_delay``), and its processes die with the launcher (``die_with_launcher``). On several
nodes use SLURM instead (docs/guide/multi-node.md, which tells the whole story).
"""

import signal

from dxrun.launch import EARLY

# Stop signals that come while the launcher imports (most of its first second): kept for its
# ranks, where they were Python's KeyboardInterrupt in the launcher.
if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, lambda signum, _frame: EARLY.append(signum))

from dxrun.launch.ranks import main

if __name__ == "__main__":
    main()
