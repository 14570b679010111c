# ``python -m dxrun.dashboard`` keeps its name; the tool is dxrun/tracking/dashboard.py, whose
# docstring (the command line) is this module's too.

from dxrun.tracking.dashboard import *  # noqa: F403
from dxrun.tracking.dashboard import __doc__, main  # noqa: F401

if __name__ == "__main__":
    main()
