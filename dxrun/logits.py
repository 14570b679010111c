# ``python -m dxrun.logits`` and ``from dxrun.logits import load_model``: the tool is
# dxrun/tools/logits.py, whose docstring (the command line) is this module's too.

from dxrun.tools.load import main
from dxrun.tools.logits import (
    Model,
    __doc__,  # noqa: F401
    load_model,
    run,
)

__all__ = ["Model", "load_model"]

if __name__ == "__main__":
    main("logits", run)
