"""What a run measures and reports: where the wall time went, the log window's step time and
the profiler's trace of a few steps (``goodput``); the one metrics path to ``metrics.jsonl``,
W&B and the other backends, the progress on the terminal and the end's ``summary.json``
(``logger``); and the W&B workspace's panels (``dashboard.yaml``, which ``python -m
dxrun.dashboard`` creates). A logged row's numbers are the trainer's (``dxrun.train``)."""
