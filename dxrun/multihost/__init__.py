"""Multi-host runs: joining JAX's distributed runtime (``distributed.py``) and how a launch of N
local processes of one run ended, in the launcher's words (``ending.py``; the launcher itself is
``python -m dxrun.launch``, dxrun/launch.py)."""
