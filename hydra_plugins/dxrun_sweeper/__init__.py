"""dxrun's Optuna sweeper (``sweep=lr_optuna``): hydra-optuna-sweeper's, except that a study in
which no trial finished ends like any failed sweep — one line, the sweep report, the exit code
naming the failed jobs — rather than with Optuna's "No trials are completed yet" traceback.

Hydra instantiates sweepers only from the ``hydra_plugins`` namespace, hence this package."""

from __future__ import annotations

import logging
from typing import Any

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper as _OptunaSweeper

log = logging.getLogger("dxrun")


class OptunaSweeper(_OptunaSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        try:
            return super().sweep(arguments)
        except ValueError as e:
            if "No trials are completed yet" not in str(e):
                raise
            log.error("Optuna: no trial finished, so there is no best value; the failed jobs "
                      "follow (and are in the sweep report)")
            return None
