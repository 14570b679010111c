"""``python -m dxrun.profile <run dir> [--top N]``: the table of a run's profiler trace (the
reading and the summary are the package's, dxrun/profile/__init__.py)."""

import sys

from dxrun.profile import main

if __name__ == "__main__":
    sys.exit(main())
