"""``python -m dxrun.launch``: the command keeps its name; the tool is
``dxrun/multihost/launch.py``."""

from dxrun.multihost.launch import *  # noqa: F403
from dxrun.multihost.launch import main

if __name__ == "__main__":
    main()
