"""What needs a compiled step, above the experiment: the run's decision (``decide``), the
layout search (``search``, with its budget rule, ``timing`` and the decision ``cache``), a
compiled step's footprint and estimate (``fit``, reading the HLO with ``hlo``), this host's
measured figures (``host``: its memory, matmul peak and bandwidth) and the memory preflight of
every real run (``preflight``, with ``memory_report``: where the memory goes), and plan mode
(``plan_mode``: ``run.mode=plan``, the plan, its estimates and advice without training). The
pure rules they apply live in ``dxrun.plan``."""
