# ``python -m dxrun.sample`` keeps its name; the tool is dxrun/tools/sample.py, whose docstring
# (the command line) is this module's too: its --help and the Reference read it.

from dxrun.tools.load import main
from dxrun.tools.sample import *  # noqa: F403
from dxrun.tools.sample import __doc__, run  # noqa: F401

if __name__ == "__main__":
    main("sample", run)
