"""What a run measures and reports: the log window's timing (``step_timer``) and where the wall
time went (``goodput``), a logged row's numbers (``metrics_row``), every metric's name, unit
and meaning (``metric_names``), the one metrics path to ``metrics.jsonl`` and W&B
(``logger``), the progress on the terminal (``console``), the end's ``summary.json``
(``run_summary``), a profiler trace of a few steps (``trace``; ``python -m dxrun.profile``
reads it), an offline W&B run read back (``wandb_file``) and the W&B workspace's panels
(``dashboard.yaml``, which ``python -m dxrun.dashboard`` creates)."""
