"""A job launched, what the rest may use: ``python -m dxrun.launch`` (N local processes of one
run, joined through JAX's distributed runtime: ``ranks.py``, how it ended: ``ending.py``) and the
job's own part that every ``python -m dxrun`` plays (``job_status.py``: the run dir it claims, released
or tidied away, and how it ended, written there once: status.json).

Each name is imported from its module when first asked for: a single run loads ``job_status.py`` alone,
and the launcher's first second (before its ranks inherit its stop signals) imports nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# Stop signals that came while the launcher imported (its __main__ catches them): kept for its
# ranks (``ranks.Forwarder``), where they were Python's KeyboardInterrupt in the launcher.
EARLY: list[int] = []

_WHERE = {
    "job_status": ("JobStatus", "asked_dir", "claim_new", "claim_to_train", "give_up", "job_key",
            "names_its_dir", "remember_start"),
    "ending": ("STOP_LINE", "clean_stop", "first_failure", "settle_starting_stop",
               "stop_delay", "stopped_while_starting"),
    "ranks": ("child_env", "free_port", "gpu_slices", "launch", "main", "port_refusal",
              "without_device_count"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = ["EARLY", *sorted(_MODULE)]


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module 'dxrun.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dxrun.launch.{_MODULE[name]}"), name)
