"""The run config checked, in one line a refusal: the command line before Hydra composes it
(``composition``: unknown keys and groups, a dir that cannot be written) and the composed
values after (``validation``: every key's range and choices, the data's, the batch's and the
plan's checks, the logger's keys, and the warnings a run still starts with). They read the
config's schema and the checks of the packages they ask (data, plan, cost, run), so they sit
above them, not in ``dxrun.config``.
"""

# ruff: noqa: I001 - the names wrapped as a list, not one a line
from __future__ import annotations

# The package's face: what the rest of dxrun imports, each name still in its module.
from dxrun.checks.composition import (
    composition_refusal)
from dxrun.checks.validation import (
    config_warnings, logged_metrics, validate)
