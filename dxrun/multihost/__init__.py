"""Multi-host runs: joining JAX's distributed runtime (``distributed.py``) and starting N local
processes of one run (``launch.py``; the command stays ``python -m dxrun.launch``)."""
