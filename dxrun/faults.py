"""Test-only faults, set through the environment and read here alone, so that no key of the
user's config exists for the tests' sake: a test poisons a step, holds the loop at a known step
or makes it crash, on any host, by starting ``python -m dxrun`` with

    DXRUN_TEST_NAN_AT_STEP=k    step k's loss (so its gradients) is NaN: train.nan_policy's path
    DXRUN_TEST_HOLD_AT_STEP=k   from step k on, the loop waits before each step for a SIGUSR1
                                (which also asks for a save), so signals land at known steps
    DXRUN_TEST_ERROR_AT_STEP=k  after step k the loop raises an error that is not bad input

Unset or 0: off. Any other value than an integer in its range is refused in one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dxrun.config_key import INT32, NON_NEGATIVE, Range
from dxrun.errors import ConfigError

# Each fault's variable and the steps it accepts (the NaN step is compared with the int32 step
# counter inside the jitted step).
VARIABLES: dict[str, tuple[str, Range]] = {
    "nan_at_step": ("DXRUN_TEST_NAN_AT_STEP", Range(0, INT32)),
    "hold_at_step": ("DXRUN_TEST_HOLD_AT_STEP", NON_NEGATIVE),
    "error_at_step": ("DXRUN_TEST_ERROR_AT_STEP", NON_NEGATIVE),
}


@dataclass(frozen=True)
class Faults:
    nan_at_step: int = 0
    hold_at_step: int = 0
    error_at_step: int = 0

    def steps(self) -> tuple[int, int, int]:
        """The steps at which the loop does more than step (0: none)."""
        return self.nan_at_step, self.hold_at_step, self.error_at_step


def from_env(environ: Mapping[str, str] = os.environ) -> Faults:
    values = {}
    for name, (variable, accepted) in VARIABLES.items():
        text = environ.get(variable, "").strip() or "0"
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value not in accepted:
            raise ConfigError(f"{variable}={text} is outside its range {accepted}; "
                              f"{accepted.fix(variable)} (a test-only fault)")
        values[name] = value
    return Faults(**values)
