# ``python -m dxrun.launch`` keeps its name; the tool is dxrun/multihost/launch.py, whose docstring
# (the command line) is this module's too: its --help and the Reference read it.

from dxrun.multihost.launch import *  # noqa: F403
from dxrun.multihost.launch import __doc__, main  # noqa: F401

if __name__ == "__main__":
    main()
