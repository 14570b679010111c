"""The reductions' first import path, kept for users' code: they live in ``dxrun.reductions``."""

from dxrun.reductions import *  # noqa: F403
from dxrun.reductions import __all__  # noqa: F401
