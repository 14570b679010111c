"""The reductions' first import path, kept for users' code: they live in ``dxrun.model.reductions``."""

from dxrun.model.reductions import *  # noqa: F403
from dxrun.model.reductions import __all__  # noqa: F401
