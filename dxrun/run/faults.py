"""Test-only faults, set through the environment and read here alone, so that no key of the
user's config exists for the tests' sake: a test poisons a step, holds the loop at a known step
or makes it crash, on any host, by starting ``python -m dxrun`` with one of ``FAULT_VARIABLES``
set. Unset: off (a step fault at 0 too: steps count from 1). Any other value than an integer in its
range is refused in one line.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dxrun.config import (
    INT32,
    NON_NEGATIVE,
    ConfigError,
    Range,
)

# DXRUN_TEST_NAN_AT_STEP=k    step k's loss (so its gradients) is NaN: train.nan_policy's path
# DXRUN_TEST_HOLD_AT_STEP=k   from step k on, the loop waits before each step for a SIGUSR1
#                             (which also asks for a save), so signals land at known steps
# DXRUN_TEST_ERROR_AT_STEP=k  after step k the loop raises an error that is not bad input
# DXRUN_TEST_DEAF_RANK=k      rank k (0 too) of a launch does not act on SIGINT or SIGTERM
#                             while starting, and holds there until sent one (``deafen``)
# DXRUN_TEST_CHIP_MIB=k       a chip of k MiB: a step compile whose program needs more
#                             fails as XLA's TPU compile does (RESOURCE_EXHAUSTED), so a CPU
#                             test meets what only a real accelerator's compile refuses
#
# Each fault's variable and the steps it accepts (the NaN step is compared with the int32 step
# counter inside the jitted step).
FAULT_VARIABLES: dict[str, tuple[str, Range]] = {
    "nan_at_step": ("DXRUN_TEST_NAN_AT_STEP", Range(0, INT32)),
    "hold_at_step": ("DXRUN_TEST_HOLD_AT_STEP", NON_NEGATIVE),
    "error_at_step": ("DXRUN_TEST_ERROR_AT_STEP", NON_NEGATIVE),
    "deaf_rank": ("DXRUN_TEST_DEAF_RANK", NON_NEGATIVE),
    "chip_mib": ("DXRUN_TEST_CHIP_MIB", NON_NEGATIVE),
}


@dataclass(frozen=True)
class Faults:
    nan_at_step: int = 0
    hold_at_step: int = 0
    error_at_step: int = 0
    deaf_rank: int | None = None
    chip_mib: int = 0

    def steps(self) -> tuple[int, int, int]:
        """The steps at which the loop does more than step (0: none)."""
        return self.nan_at_step, self.hold_at_step, self.error_at_step

    def after_step(self, done: int, signalled: Callable[[], bool]) -> None:
        """Between steps, after step ``done``: from ``hold_at_step`` on, each step waits for a
        SIGUSR1 (``signalled``), so a test knows the step its signals are acted on at (a stop
        waits for one too); after ``error_at_step``, a failure."""
        while self.hold_at_step and done >= self.hold_at_step and not signalled():
            time.sleep(0.01)
        if self.error_at_step and done == self.error_at_step:
            raise RuntimeError(f"injected failure after step {done} "
                               "(DXRUN_TEST_ERROR_AT_STEP, a test-only fault)")


def xla_bytes(n: float) -> str:
    """Bytes as XLA's messages write them (binary units: 15.75G is 15.75 GiB)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}B"


def check_chip(compiled: Any, need: float | None) -> Any:
    """``compiled`` (a step's executable needing ``need`` bytes per device), or under
    ``DXRUN_TEST_CHIP_MIB`` the error XLA's TPU compile raises for a program over the chip's
    memory, in its own words (what ``fit.memory_report.is_out_of_memory`` and ``xla_need`` read)."""
    limit = faults_from_env().chip_mib * 2**20
    if not limit or need is None or need <= limit:
        return compiled
    from jax.errors import JaxRuntimeError

    raise JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        f"temporaries ({xla_bytes(need)}) exceeds available HBM ({xla_bytes(limit)}). "
        "(DXRUN_TEST_CHIP_MIB, a test-only fault)")


def faults_from_env(environ: Mapping[str, str] = os.environ) -> Faults:
    values = {}
    for name, (variable, accepted) in FAULT_VARIABLES.items():
        text = environ.get(variable, "").strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value not in accepted:
            raise ConfigError(f"{variable}={text} is outside its range {accepted}; "
                              f"{accepted.fix(variable)} (a test-only fault)")
        values[name] = value
    return Faults(**values)


_HEARD: list[int] = []  # the stops the deaf rank was sent


def deafen(rank: int) -> None:
    """Rank ``deaf_rank`` notes SIGINT and SIGTERM and does nothing else (``join`` calls this):
    a stop never reaches its startup, as for a rank inside a collective, where no Python
    handler runs. (Not a blocked signal mask: a thread started earlier would take the signal.)"""
    if rank == faults_from_env().deaf_rank:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: _HEARD.append(signum))


def hold_until_stopped(rank: int) -> None:
    """Rank ``deaf_rank`` waits here until it has been sent a stop: the others wait for it in
    their next collective, so the stop reaches them inside their startup, whenever it comes."""
    if rank == faults_from_env().deaf_rank:
        while not _HEARD:
            time.sleep(0.05)
