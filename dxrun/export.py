# ``python -m dxrun.export``: the tool is dxrun/tools/export.py, whose docstring (the command
# line) is this module's too: its --help and the Reference read it.

from dxrun.tools.export import *  # noqa: F403
from dxrun.tools.export import __doc__, run  # noqa: F401
from dxrun.tools.load import main

if __name__ == "__main__":
    main("export", run)
