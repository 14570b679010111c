# ``python -m dxrun.evaluate`` keeps its name; the tool is dxrun/tools/evaluate.py, whose docstring
# (the command line) is this module's too: its --help and the Reference read it.

from dxrun.tools.evaluate import *  # noqa: F403
from dxrun.tools.evaluate import __doc__, run  # noqa: F401
from dxrun.tools.load import main

if __name__ == "__main__":
    main("evaluate", run)
