"""What a run measures and reports: where the wall time went and the log window's step time
(``goodput``), the one metrics path to ``metrics.jsonl``, W&B and the other backends, the
progress on the terminal and the end's ``summary.json`` (``logger``), a profiler trace of a few
steps (``trace``; ``python -m dxrun.profile`` reads it) and the W&B workspace's panels
(``dashboard.yaml``, which ``python -m dxrun.dashboard`` creates). A logged row's numbers are
the trainer's (``dxrun.train``)."""
